"""Report page of the head signatures, built from the `heads`, `head_classes` and `offsets` tables only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.compare import compare_caption, member_order, over_seeds, refused_text, seeded, table, unit
from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, caption, layer_head_heatmap, style

#: Signatures shown as layer x head heatmaps, with what the colour means.
HEATMAPS = {
    "prev_mass": "mean attention to the previous token",
    "sink_score": "attention sink score (first token, Gu et al. 2025)",
    "self_mass": "mean attention to the current token",
    "induction_score": "induction score (repeated random tokens)",
    "relative_r2": "R² of the pattern explained by offset alone",
    "relative_entropy": "entropy / log(keys seen)",
}


def title(result: Any) -> str:
    """Report title."""
    return f"Head signatures: {result.meta['model']['name']}"


def _wide(result: Any) -> pd.DataFrame:
    h = result.tables["heads"]
    return h.pivot_table(index=["layer", "head"], columns="metric", values="value").reset_index()


def figure_caption(meta: dict | None, note: str | None = None) -> str:
    """Caption of a head-signature figure: model, data, windows, induction sequences."""
    m = meta or {}
    return caption(m, {"window": m.get("window"), "induction": m.get("induction")}, note=note)


def heatmap(heads: pd.DataFrame, metric: str, label: str, meta: dict | None = None) -> Any:
    """Layer x head heatmap of one signature."""
    return layer_head_heatmap(heads[heads.metric == metric], metric, label, figure_caption(meta))


def offset_profiles(offsets: pd.DataFrame, picks: list[tuple[str, int, int]], meta: dict | None = None) -> Any:
    """Mean attention by offset i - j for the chosen heads (one line each, labelled by class)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for label, layer, head in picks:
        d = offsets[(offsets.layer == layer) & (offsets["head"] == head)].sort_values("rel_pos")
        fig.add_trace(go.Scatter(x=d.rel_pos, y=d.value, mode="lines+markers", name=f"L{layer}H{head} ({label})"))
    fig.update_layout(title="Offset profiles of the strongest head of each class",
                      xaxis_title="offset i - j (tokens)", yaxis_title="mean attention")
    return style(fig, caption=figure_caption(meta, "Mean attention from a query to the key d tokens back."),
                 height=420)


def _picks(result: Any) -> list[tuple[str, int, int]]:
    wide, classes = _wide(result), result.tables["head_classes"]
    key = {"sink": "sink_score", "previous-token": "prev_mass", "current-token": "self_mass",
           "induction": "induction_score", "fixed-offset": "fixed_offset_mass", "relative-position": "relative_r2"}
    picks = []
    for cls, metric in key.items():
        members = classes[classes.classes.str.split(",").apply(lambda c, cls=cls: cls in c)]
        if len(members) and metric in wide:
            m = wide.merge(members[["layer", "head"]], on=["layer", "head"]).sort_values(metric, ascending=False)
            picks.append((cls, int(m.layer.iloc[0]), int(m["head"].iloc[0])))
    return picks


def figures(result: Any) -> list:
    """Heatmaps of the main signatures, and offset profiles of each class's strongest head."""
    heads = result.tables["heads"]
    figs = [heatmap(heads, m, label, result.meta) for m, label in HEATMAPS.items()
            if m in set(heads.metric) and heads[heads.metric == m].value.notna().any()]
    picks = _picks(result)
    if picks:
        figs.append(offset_profiles(result.tables["offsets"], picks, result.meta))
    return figs


def summary_text(result: Any) -> str:
    """One paragraph in words from the numbers: class counts, sinks, strongest previous-token heads."""
    m, classes, wide = result.meta, result.tables["head_classes"], _wide(result)
    n = len(classes)
    counts = {c: int(classes.classes.str.split(",").apply(lambda x, c=c: c in x).sum()) for c in m["class_order"]}
    parts = [f"{counts[c]} {c}" for c in m["class_order"] if counts[c]]
    top = wide.sort_values("prev_mass", ascending=False).head(3)
    prev = ", ".join(f"L{int(r.layer)}H{int(r.head)} ({r.prev_mass:.2f})" for r in top.itertuples())
    sink_layers = wide[wide.sink_score > m["config"]["sink_threshold"]].groupby("layer").size()
    if len(sink_layers):  # every layer tied at the top, not three of them picked by sort order
        most = int(sink_layers.max())
        tied = sorted(int(l) for l, c in sink_layers.items() if c == most)
        per_layer = int(wide.groupby("layer").size().iloc[0])
        sinks = (f"most sink heads in layer{'s' if len(tied) > 1 else ''} {', '.join(map(str, tied))} ({most} of "
                 f"{per_layer} heads{' each' if len(tied) > 1 else ''})")
    else:
        sinks = "no layer has a sink head"
    return (
        f"Of {n} heads: {', '.join(parts) if parts else 'none in any class'} (a head can be in several). "
        f"{m['sink_fraction']:.0%} of heads are sink heads (threshold {m['config']['sink_threshold']}); "
        f"mean attention on the first token over all heads {wide.first_mass.mean():.2f}; {sinks}. "
        f"Strongest previous-token heads: {prev}."
    )


def sections(result: Any) -> list[Section]:
    """Summary in words, the class rules, class counts per layer, figures, per-head table."""
    m = result.meta
    rules = "".join(f"<li><b>{html.escape(c)}</b>: {html.escape(r)}</li>" for c, r in m["class_rules"].items())
    intro = (f"<p>{html.escape(summary_text(result))}</p><p>{m['n_windows']} windows of {m['window']} tokens from "
             f"{html.escape(str(m['data']['source']))}; induction: {html.escape(m['induction'])}. A head's kind is its "
             f"first class in this order:</p><ul>{rules}</ul>")
    classes = result.tables["head_classes"]
    per_layer = classes.groupby(["layer", "kind"]).size().unstack(fill_value=0)
    wide = _wide(result).round(3)
    return [Section("Summary", html=intro + table_html(per_layer)), Section("Figures", figures=figures(result)),
            Section("Every head", table=wide.merge(classes[["layer", "head", "kind"]], on=["layer", "head"]))]


def relative_views_text(views: dict | None) -> str:
    """The two views of relative position in layer 0 (learned positions) in one sentence; "" without them."""
    if not views:
        return ""

    def names(heads: list, values: bool = False) -> str:
        if not heads:
            return "none"
        return ", ".join(f"L{l}H{h}" + (f" ({t:.2f} vs {p:.2f})" if values else "") for l, h, t, p in heads)

    term, pattern = views["term"], views["pattern"]
    return (f" Layer 0, two views of relative position: the position x position score term follows the offset i - j "
            f"(R² >= {views['term_relative']}) and carries >= {views['term_positional']:.0%} of the score variance in "
            f"{len(term)} heads ({names(term)}); the attention pattern does (R² > {views['pattern_threshold']}) in "
            f"{len(pattern)} ({names(pattern)}). Score term only: {names(views['term_only'], True)}; pattern only: "
            f"{names(views['pattern_only'], True)} (term R² vs pattern R²).")


def atlas_paragraph(result: Any, n: Any) -> str:
    """The atlas's heads section in words: the heads summary, and on learned positions the two views of layer 0."""
    return summary_text(result.parts["heads"]) + relative_views_text(result.meta.get("relative_views"))


# --- the atlas over many models: this analysis's models side by side -----------------------------------------

def compare_section(result: Any) -> Section | None:
    """The atlas over many models' heads section: head classes per member and each head's attention window.
    None where no model measured it."""
    import plotly.express as px

    cls = table(result, "head_classes")
    heads = table(result, "heads")
    if not len(cls):
        return None
    order = member_order(result)
    n_models = cls.groupby("member").model.nunique()
    counts = cls.groupby(["member", "kind"]).size().div(n_models, level="member").rename("heads").reset_index()
    fig = px.bar(counts, x="member", y="heads", color="kind", category_orders={"member": order},
                 color_discrete_sequence=list(COLORS), title=f"Head classes per {unit(result)}{over_seeds(result)}",
                 labels={"member": unit(result)})
    figs = [style(fig, caption=compare_caption(result, "Classes by posprobe's head-signature rules (heads report)."))]
    win = heads[heads.metric == "window"] if len(heads) else heads
    sentences = []
    if len(win):
        box = px.box(win, x="member", y="value", points="all", category_orders={"member": order},
                     title="Attention window per head: the distance holding 90% of the attention",
                     labels={"value": "window (tokens back)", "member": unit(result)})
        note = ("Per head: the smallest d whose offsets 0..d hold 90% of the mean attention; heads wider than the "
                "window measured are left out.")
        figs.append(style(box, caption=compare_caption(result, note)))
        med, low = win.groupby("member").value.median(), win.groupby("member").value.min()
        sentences.append("Attention window (tokens back holding 90% of a head's attention), median and narrowest "
                         "head: " + ", ".join(f"{m} {med[m]:.0f} / {low[m]:.0f}" for m in order
                                              if m in med.index and med[m] == med[m]) + ".")
    prev = counts[counts.kind == "previous-token"].set_index("member").heads
    sink = counts[counts.kind == "sink"].set_index("member").heads
    sentences.append("Previous-token heads per model: " + ", ".join(f"{m} {prev.get(m, 0):.1f}" for m in order
                                                                   if m in n_models.index)
                     + "; sink heads: " + ", ".join(f"{m} {sink.get(m, 0):.1f}" for m in order if m in n_models.index)
                     + ".")
    return Section("Head classes and attention windows",
                   html="<p>" + " ".join(sentences) + refused_text(result, "heads") + "</p>", figures=figs)


def similarity_matrix(layer_table: pd.DataFrame) -> pd.DataFrame:
    """Member x other member: Kazemnejad et al.'s number (per layer the mean over A's heads of the JSD to B's nearest
    head), averaged over layers and over the pairs of models of the two members (a member against itself: its
    seeds against each other; NaN with one seed)."""
    d = layer_table[layer_table.model != layer_table.other]
    return d.pivot_table(index="member", columns="other_member", values="jsd_min", aggfunc="mean")


def similarity_section(result: Any) -> Section | None:
    """The atlas over many models' similarity section: member x member heat map of the mean JSD to the nearest
    head (Kazemnejad et al. 2023, Fig. 4). None where no model measured it."""
    import plotly.graph_objects as go

    t = table(result, "head_similarity_layer")
    if not len(t):
        return None
    order = [m for m in member_order(result) if m in set(t.member)]
    mat = similarity_matrix(t).reindex(index=order, columns=order)
    fig = go.Figure(go.Heatmap(z=mat.values, x=order, y=order, colorscale="Viridis_r",
                               colorbar=dict(title="JSD (nats)"),
                               hovertemplate="%{y} heads vs nearest %{x} head: %{z:.3f}<extra></extra>"))
    word = unit(result)
    fig.update_layout(title=f"Head similarity: mean JSD to the nearest head of the other {word}, same layer",
                      xaxis_title=f"other {word} (B)", yaxis_title=f"{word} (A)")
    diagonal = "Diagonal: a member's seeds against each other. " if seeded(result) else ""
    fig = style(fig, caption=caption(result.meta, None, note=f"{diagonal}Lower = more alike."), height=560)
    sentences = []
    for m in order:
        row = mat.loc[m].drop(m, errors="ignore").dropna().sort_values()
        if not len(row):
            continue
        own = mat.loc[m, m] if m in mat.columns else float("nan")
        sentences.append(f"{m}: nearest {row.index[0]} ({row.iloc[0]:.3f}), farthest {row.index[-1]} "
                         f"({row.iloc[-1]:.3f})" + (f", its other seed {own:.3f}" if own == own else ""))
    over = over_seeds(result, " and seeds")
    text = (f"For every head of {word} A, the Jensen-Shannon divergence (nats) of its attention to the nearest head of "
            f"{word} B in the same layer on the same inputs, averaged over heads, layers{over}: "
            + "; ".join(sentences) + ". Kazemnejad et al. (2023, Fig. 4) found NoPE's heads as close to T5-bias "
            "heads as to another NoPE seed and far from rotary and absolute ones." + refused_text(result,
                                                                                                  "similarity"))
    return Section(f"Head similarity across {unit(result, plural=True)}", html=f"<p>{text}</p>", figures=[fig])
