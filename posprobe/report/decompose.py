"""Figures and report page of the score decomposition, built from the `decompose` table and meta only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.compare import compare_caption, member_of, member_order, refused_text, spread, table, unit
from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, caption, reference_line, style


def summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Wide per-head table (one row per head, ranked) from a `head_summary` frame: var_share per term (terms in
    the order the decomposition lists them, "positional" last), pp rel_pos_fraction, rank."""
    shares = summary[summary.metric == "var_share"]
    share = shares.pivot(index="head", columns="term", values="value")
    terms = [t for t in dict.fromkeys(shares.term) if t != "positional"] + ["positional"]
    wide = share[[t for t in terms if t in share.columns]].add_prefix("share_")
    extra = summary[summary.metric.isin(["rel_pos_fraction", "rank"])].pivot(
        index="head", columns="metric", values="value"
    )
    wide = wide.join(extra.rename(columns={"rel_pos_fraction": "pp_rel_pos_fraction"}))
    return wide.sort_values("rank").reset_index().round(4)


_WHAT = {
    "exact-layer0": ("exact layer-0 split: w = token embedding, p = position embedding, bias = everything constant "
                     "across tokens (LN bias, b_Q/b_K, and the token-type embedding where the model has one)"),
    "data-driven": ("data-driven split of resid_pre: p = corpus positional mean minus global mean, c = the sentence's "
                    "mean offset (context), r = remainder; mean = terms with the global mean; bias = LN bias and "
                    "b_Q/b_K terms; alibi (ALiBi models) = the distance bias -slope·(i-j), slopes measured from the "
                    "model, with the model's constant per query row"),
}


def title(result: Any) -> str:
    """Report title."""
    return f"Score decomposition: {result.meta['model']['name']} layer {result.meta['layer']}"


def figures(result: Any) -> list:
    """Heatmaps of four terms of the chosen head, shares per head, the pp profile by relative position."""
    df, m = result.tables["decompose"], result.meta
    summary = df[df.metric != "score"].drop(columns=["query_pos", "key_pos", "rel_pos"])
    maps = df[df.metric == "score"]
    head = int(m["head"])
    return [heatmap_figure(maps, head, tuple(m["heatmap_terms"]), m), share_figure(summary, m),
            profile_figure(maps, head, m)]


def figure_caption(meta: dict | None) -> str:
    """Caption of a decomposition figure: model, data, layer, method, sentence length, identity error."""
    m = meta or {}
    opts = {"layer": m.get("layer"), "split": m.get("method"),
            "sentence of": f"{m['n_tokens']} tokens" if m.get("n_tokens") else None,
            "max |sum of terms − score|": f"{m['max_abs_error']:.1e}" if m.get("max_abs_error") is not None else None}
    return caption(m, opts)


def sections(result: Any) -> list[Section]:
    """What the split is, the identity's error, the sentence, per-head shares, and the figures."""
    df, m = result.tables["decompose"], result.meta
    summary = df[df.metric != "score"].drop(columns=["query_pos", "key_pos", "rel_pos"])
    words = m["sentence_tokens"]
    intro = (
        f"<p>{html.escape(_WHAT.get(m['method'], m['method']))}. Terms sum to the model's scores within "
        f"{m['max_abs_error']:.2e} (score units). Sentence ({len(words)} tokens): "
        f"<code>{html.escape(' | '.join(words))}</code>.</p>"
        "<p>share_* = cov(term, score)/var(score) over unmasked entries after removing each query row's mean "
        "(softmax ignores it); shares sum to 1. pp_rel_pos_fraction = fraction of the pp term's variance "
        "explained by its mean on each diagonal i-j. Heads ranked by the share of all terms with a position part.</p>"
    )
    return [Section("Summary", html=intro + table_html(summary_table(summary))),
            Section("Figures", figures=figures(result))]


def heatmap_figure(frame: pd.DataFrame, head: int, terms: tuple[str, ...], meta: dict | None = None) -> Any:
    """2x2 TUPE-style heatmaps (query_pos x key_pos) of four terms of one head, from tidy rows."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=2, subplot_titles=list(terms), horizontal_spacing=0.12, vertical_spacing=0.12)
    for i, term in enumerate(terms):
        d = frame[(frame["head"] == head) & (frame.term == term)]
        z = d.pivot(index="query_pos", columns="key_pos", values="value")
        fig.add_trace(go.Heatmap(z=z.values, x=z.columns, y=z.index, coloraxis="coloraxis", name=term),
                      row=i // 2 + 1, col=i % 2 + 1)
    fig.update_yaxes(autorange="reversed", title_text="query_pos")
    fig.update_xaxes(title_text="key_pos")
    fig.update_layout(title=f"Head {head}: score terms (score units)", height=760,
                      coloraxis={"colorscale": "RdBu", "cmid": 0, "colorbar": {"title": "score"}})
    return style(fig, caption=figure_caption(meta))


def share_figure(summary: pd.DataFrame, meta: dict | None = None) -> Any:
    """Stacked bars: each term's share of within-row score variance, per head (shares sum to 1)."""
    import plotly.express as px

    d = summary[(summary.metric == "var_share") & (summary.term != "positional")]
    fig = px.bar(d, x="head", y="value", color="term", barmode="relative", color_discrete_sequence=list(COLORS),
                 title="Share of score variance per term (cov(term, score) / var(score), row-centred)",
                 labels={"value": "share of score variance", "head": "head"})
    fig.update_xaxes(dtick=1)
    reference_line(fig, 1.0, "sum of shares = 1")
    return style(fig, caption=figure_caption(meta))


def profile_figure(frame: pd.DataFrame, head: int, meta: dict | None = None) -> Any:
    """Mean pp term on each diagonal (rel_pos = query_pos - key_pos) of one head."""
    import plotly.express as px

    d = frame[(frame["head"] == head) & (frame.term == "pp")].groupby("rel_pos", as_index=False)["value"].mean()
    fig = px.line(d, x="rel_pos", y="value", markers=True, title=f"Head {head}: pp term by relative position",
                  labels={"value": "mean pp (score units)", "rel_pos": "relative position (query − key)"})
    reference_line(fig, 0.0, "0")
    return style(fig, caption=figure_caption(meta))


# --- the atlas over many models: this analysis's models side by side -----------------------------------------

def compare_section(result: Any) -> Section | None:
    """The atlas over many models' decomposition section: the layer-0 positional share of score variance per
    head and member. None where no model measured it."""
    import plotly.express as px

    d = table(result, "decomposition")
    if not len(d):
        return None
    order = member_order(result)
    share = d[(d.metric == "var_share") & (d.term == "positional")]
    per_model = share.groupby(["member", "model"], as_index=False).value.mean()
    fig = px.strip(share, x="member", y="value", category_orders={"member": order},
                   title="Layer 0: share of the score variance carried by positional terms, per head",
                   labels={"value": "positional share of score variance", "member": unit(result)})
    fig = style(fig, caption=compare_caption(result, "Exact split on learned tables (word/position terms), "
                                                     "data-driven split elsewhere (positional mean, content, residual "
                                                     "terms)."))
    methods = (result.meta.get("headline") or {}).get("decomposition", {})
    exact = sorted({member_of(result, k) for k, v in methods.items() if v.get("method") == "exact-layer0"})
    text = ("Layer-0 score variance carried by positional terms (mean over heads): "
            + ", ".join(f"{m} {spread(per_model[per_model.member == m].value)}" for m in order
                        if m in set(per_model.member))
            + f". Exact word/position split on {', '.join(exact) or 'no ' + unit(result)}; the others by the "
            "data-driven split (positional mean over the corpus; the ALiBi term is the bias itself).")
    return Section("Layer-0 score decomposition", html=f"<p>{html.escape(text)}{refused_text(result, 'decomposition')}"
                                                  "</p>", figures=[fig])
