"""Figures and the self-contained HTML report for per-frequency RoPE usage, built from DataFrames only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.compare import compare_caption, line_figure, member_order, refused_text, spread, table
from posprobe.report.html import Section, table_html
from posprobe.report.style import caption, reference_line, style

#: Per-head numbers shown in the report tables, with this many decimals.
DECIMALS = 4


def _band_labels(df: pd.DataFrame) -> dict[int, str]:
    w = df.drop_duplicates("band").set_index("band")["wavelength"]
    return {int(b): ("rest" if b < 0 else f"b{int(b)} ({w[b]:.3g} tok)") for b in sorted(w.index)}


def band_head_heatmap(df: pd.DataFrame, layer: int, metric: str = "abs_share", meta: dict | None = None) -> Any:
    """Heatmap band (rows, fastest first, labelled with wavelength) x head of `metric` for one layer."""
    import plotly.graph_objects as go

    d = df[(df.layer == layer) & (df.metric == metric)]
    piv = d.pivot_table(index="band", columns="head", values="value")
    labels = _band_labels(d)
    fig = go.Figure(go.Heatmap(z=piv.values, x=[f"H{h}" for h in piv.columns], y=[labels[b] for b in piv.index],
                               colorscale="Viridis", colorbar=dict(title=metric)))
    fig.update_layout(title=f"Layer {layer}: {_METRIC.get(metric, metric)} per band × head", height=520,
                      yaxis=dict(autorange="reversed"), xaxis_title="head", yaxis_title="band (wavelength)")
    return style(fig, caption=figure_caption(meta))


def layer_band_overview(df: pd.DataFrame, metric: str = "abs_share", meta: dict | None = None) -> Any:
    """Heatmap layer x band of `metric` averaged over heads."""
    import plotly.graph_objects as go

    d = df[(df.metric == metric) & (df.band >= 0)]
    piv = d.pivot_table(index="layer", columns="band", values="value", aggfunc="mean")
    fig = go.Figure(go.Heatmap(z=piv.values, x=[f"b{b}" for b in piv.columns], y=[f"L{l}" for l in piv.index],
                               colorscale="Viridis", colorbar=dict(title=metric)))
    fig.update_layout(title=f"{_METRIC.get(metric, metric)} (mean over heads): layer × band (band 0 = fastest)",
                      height=560, yaxis=dict(autorange="reversed"), xaxis_title="band", yaxis_title="layer")
    return style(fig, caption=figure_caption(meta))


def head_band_profile(df: pd.DataFrame, layer: int, head: int, meta: dict | None = None) -> Any:
    """q_norm, k_norm and abs_share of one head against band (wavelength on hover)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    d = df[(df.layer == layer) & (df["head"] == head) & (df.band >= 0)]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for metric in ("q_norm", "k_norm"):
        t = d[d.metric == metric].sort_values("band")
        fig.add_trace(go.Scatter(x=t.band, y=t.value, name=metric, customdata=t.wavelength,
                                 hovertemplate="band %{x}<br>wavelength %{customdata:.3g} tok<br>%{y:.4g}"))
    t = d[d.metric == "abs_share"].sort_values("band")
    fig.add_trace(go.Bar(x=t.band, y=t.value, name="abs_share", opacity=0.4), secondary_y=True)
    fig.update_layout(
        title=f"L{layer}H{head}: band norms and score share", height=360, xaxis_title="band (0 = fastest)"
    )
    fig.update_yaxes(title_text="mean 2-norm", secondary_y=False)
    fig.update_yaxes(title_text="share of |score|", secondary_y=True)
    return style(fig, caption=figure_caption(meta))


def head_rel_pos_profile(profile: pd.DataFrame, layer: int, head: int, meta: dict | None = None) -> Any:
    """Heatmap band x rel_pos bin of the mean signed contribution of one head."""
    import plotly.graph_objects as go

    d = profile[(profile.layer == layer) & (profile["head"] == head) & (profile.metric == "mean_contrib")]
    piv = d.pivot_table(index="band", columns="rel_pos", values="value")
    labels = _band_labels(d)
    his = d.drop_duplicates("rel_pos").set_index("rel_pos")["rel_pos_hi"]
    x = [f"{lo}" if lo == his[lo] else f"{lo}-{his[lo]}" for lo in piv.columns]
    fig = go.Figure(go.Heatmap(z=piv.values, x=x, y=[labels[b] for b in piv.index], colorscale="RdBu", zmid=0,
                               colorbar=dict(title="score")))
    fig.update_layout(title=f"L{layer}H{head}: mean contribution by relative distance", height=460,
                      xaxis_title="relative position (query − key)", yaxis=dict(autorange="reversed"))
    return style(fig, caption=figure_caption(meta))


def score_by_distance_figure(bands: pd.DataFrame, theory: pd.DataFrame, heads: list[tuple[int, int]],
                             meta: dict | None = None) -> Any:
    """a(s) of each listed head's mean pair against distance s = 0..L'-1 (tokens, log axis), a line at the context L:
    Chen et al.'s score-by-distance, inside and beyond the trained context."""
    import numpy as np
    import plotly.graph_objects as go

    from posprobe.rope_theory import score_by_distance

    L, L2 = int(theory.theory_context.iloc[0]), int(theory.theory_target.iloc[0])
    s = np.unique(np.round(np.geomspace(1, L2 - 1, 400)).astype(int))
    fig = go.Figure()
    for layer, head in heads:
        d = bands[(bands.layer == layer) & (bands["head"] == head) & (bands.band >= 0)]
        re, im = (d[d.metric == m].sort_values("band") for m in ("h_re", "h_im"))
        a = score_by_distance(re.value.to_numpy() + 1j * im.value.to_numpy(), re.frequency.to_numpy(), s)
        fig.add_trace(go.Scatter(x=s, y=a, mode="lines", name=f"L{layer}H{head}"))
    fig.add_vline(x=L, line_dash="dash")
    # On a log axis an annotation's x is given in log10 units (a shape's is not): add_vline's own label went off-page.
    fig.add_annotation(x=float(np.log10(L)), y=1.0, yref="paper", text=f"context L = {L:,}", showarrow=False,
                       xanchor="right", yanchor="bottom")
    fig.update_layout(title="Score of each head's mean query-key pair against distance (Chen et al.'s a(s))",
                      xaxis=dict(type="log", title="distance s (tokens)"), yaxis_title="score (logits)", height=420)
    return style(fig, caption=figure_caption(meta, {"a(s) up to": f"{L2:,} tokens"}))


def sweep_figure(abl: pd.DataFrame, meta: dict | None = None) -> Any:
    """Loss change against fraction of bands kept rotating, drop-low (p-RoPE) vs drop-high."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for v in ("drop-low", "drop-high"):
        t = abl[abl.variant == v]
        if len(t):
            t = pd.concat([abl[abl.condition == "none"], t]).sort_values("fraction_kept")
            fig.add_trace(go.Scatter(x=t.fraction_kept, y=t.delta_loss, mode="lines+markers", name=v))
    fig.update_layout(title="Model-wide unrotation sweep", xaxis_title="p = fraction of bands kept rotating",
                      yaxis_title="loss change (nats/token)", height=400)
    reference_line(fig, 0.0, "no change")
    opts = {"ablation windows": (meta or {}).get("ablate_windows")}
    return style(fig, caption=figure_caption(meta, opts))


_METRIC = {"abs_share": "share of |score|", "q_norm": "q norm", "k_norm": "k norm"}


def figure_caption(meta: dict | None, extra: dict | None = None) -> str:
    """Caption of a frequency figure: model, data, windows x tokens, which queries are scored, RoPE facts."""
    m = meta or {}
    model = m.get("model") or {}
    opts = {"windows of": f"{m['window']} tokens" if m.get("window") else None,
            "scores on": m.get("score_queries"),
            "RoPE base": model.get("rotary_base_per_layer"), "rotary dim": model.get("rotary_dim"),
            **(extra or {})}
    return caption(m, opts)


def _fmt(df: pd.DataFrame) -> pd.DataFrame:
    out = df.reset_index(drop=True)
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            out[c] = out[c].map(lambda v: f"{v:.{DECIMALS}f}")
    return out


def title(result: Any) -> str:
    """Report title."""
    return f"Per-frequency RoPE usage: {result.meta['model']['name']}"


def figures(result: Any) -> list:
    """Overview heatmaps (abs score share and q norm by layer and band) and the ablation sweep."""
    df, m = result.tables["bands"], result.meta
    figs = [layer_band_overview(df, "abs_share", m), layer_band_overview(df, "q_norm", m)]
    abl = result.tables.get("ablation")
    if abl is not None and len(abl):
        figs.append(sweep_figure(abl, m))
    return figs


def sections(result: Any) -> list[Section]:
    """Summary, overview, band x head heatmaps per layer, ablations, one section per top head."""
    df, heads, profile = result.tables["bands"], result.tables["heads"], result.tables["profile"]
    ablation = result.tables.get("ablation")
    m = result.meta
    top = [tuple(x) for x in m.get("top_heads", [])]
    kinds = heads.kind.value_counts().to_dict()
    summary = (
        f"<p>{m['n_windows']} windows of {m['window']} tokens ({m['n_tokens']} tokens). Band 0 is the "
        f"fastest rotary pair; band -1 ('rest') the unrotated dims. Scores are pre-softmax logits.</p>"
        f"<p>Head classes: {html.escape(', '.join(f'{k}: {v}' for k, v in kinds.items()))}. "
        f"Rule: {html.escape(m['classification_rule'])}.</p>"
    )
    secs = [Section("Summary", html=summary, table=_fmt(heads.sort_values("eta2", ascending=False).head(20)))]
    secs.append(
        Section("Overview", figures=[layer_band_overview(df, "abs_share", m), layer_band_overview(df, "q_norm", m)])
    )
    for layer in sorted(df.layer.unique()):
        secs.append(
            Section(
                f"Layer {layer}: band x head",
                figures=[band_head_heatmap(df, layer, "abs_share", m), band_head_heatmap(df, layer, "q_norm", m)],
            )
        )
    theory = result.tables.get("theory")
    if theory is not None and len(theory):
        worst = theory.sort_values("excess", ascending=False)
        picks = [(int(r.layer), int(r["head"])) for _, r in worst.head(6).iterrows()]
        t = m.get("theory", {})
        secs.append(Section(
            "Chen et al.'s bounds per head",
            html=(f"<p>{html.escape(theory_sentence(dict(_theory_numbers(theory))).strip())}</p>"
                  f"<p>h_j is each band's product of the head's mean unrotated query and key "
                  f"({html.escape(str(t.get('mean_pair', '')))}); a(s) = Re &Sigma; h_j e<sup>i s &theta;_j</sup>. "
                  f"Rule: {html.escape(str(t.get('rule', '')))}. The table lists the heads by excess.</p>"),
            table=_fmt(worst.head(20)[_theory_columns(worst)]),
            figures=[score_by_distance_figure(result.tables["bands"], theory, picks, m)]))
    if ablation is not None and len(ablation):
        secs.append(
            Section(
                "Band ablations (loss change)",
                figures=[sweep_figure(ablation, m)],
                table=_fmt(ablation[["condition", "mode", "bands", "fraction_kept", "value", "delta_loss"]]),
            )
        )
    for layer, head in top:
        h = heads[(heads.layer == layer) & (heads["head"] == head)]
        tables = [h[["layer", "head", "kv_head", "kind", "eta2", "fast_share", "self_mass", "prev_mass", "first_mass"]]]
        if ablation is not None and len(ablation):
            a = ablation[(ablation.layer == layer) & (ablation["head"] == head)]
            if len(a):
                tables.append(a[["condition", "bands", "value", "delta_loss"]])
        body = "".join(table_html(_fmt(t)) for t in tables[1:])
        secs.append(
            Section(
                f"Head L{layer}H{head}",
                html=body,
                table=_fmt(tables[0]),
                figures=[head_band_profile(df, layer, head, m), head_rel_pos_profile(profile, layer, head, m)],
            )
        )
    return secs


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers))


def _frequency_scope(meta: dict, counted: int) -> str:
    # Why the counts cover fewer heads than the model has: the section measures rotary layers only.
    f = meta["model"]
    total = int(f["n_layers"]) * int(f["n_heads"])
    if counted >= total:
        return f" (all {total} query heads)"
    measured = meta.get("frequency_layers")
    if measured is None:
        return f" ({counted} of {total} query heads: the rotary layers' only)"
    missing = [l for l in range(int(f["n_layers"])) if l not in measured]
    if not missing:
        return f" ({counted} of {total} query heads)"
    why = "no rotary bands to measure (NoPE)" if set(missing) <= set(meta.get("nope_layers") or []) else "not measured"
    return (f" ({counted} of {total} query heads: those of the {len(measured)} rotary layers; layer"
            f"{'s' if len(missing) > 1 else ''} {_layer_list(missing)} {'have' if len(missing) > 1 else 'has'} {why})")


def headline_numbers(part: Any) -> list[tuple[str, float]]:
    """(name, value) of a frequency result's headline: the mean per-head share of |score| from the fastest and the
    slowest quarter of bands (fractions), the number of heads of each kind (`n_<kind>`) and, from Chen et al.'s
    per-head theory, the largest interpolation bound and extrapolation excess (score units), the number of heads whose
    mean-pair score leaves its in-context range beyond L, and L and L' (tokens)."""
    b = part.tables["bands"]
    share = b[(b.metric == "abs_share") & (b.band >= 0)]
    n_bands = int(share.band.max()) + 1
    q = n_bands // 4 or 1
    per_head = lambda rows: float(rows.groupby(["layer", "head"]).value.sum().mean())  # noqa: E731
    return ([("abs_share_fastest_quarter", per_head(share[share.band < q])),
             ("abs_share_slowest_quarter", per_head(share[share.band >= n_bands - q]))]
            + [(f"n_{k}", float(v)) for k, v in part.tables["heads"].kind.value_counts().items()]
            + _theory_numbers(part.tables.get("theory")))


def _theory_numbers(theory: pd.DataFrame | None) -> list[tuple[str, float]]:
    if theory is None or not len(theory):
        return []
    return [("max_interpolation_bound", float(theory.interpolation_bound.max())),
            ("max_extrapolation_excess", float(theory.excess.max())),
            ("heads_leaving_range", float(theory.extrapolation_leaves_range.sum())),
            ("theory_context", float(theory.theory_context.iloc[0])),
            ("theory_target", float(theory.theory_target.iloc[0]))]


def _theory_columns(theory: pd.DataFrame) -> list[str]:
    # The columns that fit the page (all 19 are in the theory table and its CSV); `attention` only where a layer is
    # local, the bounds' L and L' are in the section's text.
    cols = ["layer", "head", "h_max", "a_in_min", "a_in_max", "a_out_min", "a_out_max", "excess",
            "interpolation_bound"]
    return cols[:2] + ["attention"] + cols[2:] if (theory.attention == "local").any() else cols


def theory_sentence(numbers: dict[str, Any]) -> str:
    """Chen et al.'s per-head theory in one sentence (empty without its numbers): the largest interpolation bound,
    and how many heads' mean-pair score leaves its in-context range beyond L."""
    if numbers.get("max_interpolation_bound") is None:
        return ""
    L, L2 = int(numbers["theory_context"]), int(numbers["theory_target"])
    return (f" Chen et al.'s bound: interpolating positions moves a typical query-key pair's score by at most "
            f"{numbers['max_interpolation_bound']:.3g} logits in any head; beyond the context (s = {L:,}..{L2:,} "
            f"tokens) the mean pair's score leaves its range inside L by more than 1 logit in "
            f"{int(numbers['heads_leaving_range'])} heads (largest excess {numbers['max_extrapolation_excess']:.3g}).")


def summary_text(result: Any) -> str:
    """The line `freq-report` prints: the atlas's frequency sentence, from the same numbers."""
    numbers = dict(headline_numbers(result))
    kinds = {k[2:]: int(v) for k, v in numbers.items() if k.startswith("n_")}
    layers = sorted(int(x) for x in result.tables["heads"].layer.unique())
    meta = {**result.meta, "frequency_layers": result.meta.get("frequency_layers", layers)}
    return "[frequency] " + _paragraph(numbers["abs_share_fastest_quarter"], numbers["abs_share_slowest_quarter"],
                                       kinds, meta) + theory_sentence(numbers)


def atlas_paragraph(result: Any, n: Any) -> str:
    """The atlas's frequency section in words: score magnitude from the fastest and slowest quarter of bands, and
    the heads by how much relative distance explains, with the heads they cover."""
    kinds = {r.metric[2:]: int(r.value) for r in result.tables["atlas"].itertuples()
             if r.section == "frequency" and r.metric.startswith("n_")}
    theory = {k: n(k) for k in ("max_interpolation_bound", "max_extrapolation_excess", "heads_leaving_range",
                                "theory_context", "theory_target")}
    return (_paragraph(n("abs_share_fastest_quarter"), n("abs_share_slowest_quarter"), kinds, result.meta)
            + theory_sentence(theory))


def _paragraph(fast: float, slow: float, kinds: dict[str, int], meta: dict) -> str:
    return (f"On average a head draws {fast:.0%} of its score magnitude from the fastest quarter of rotary "
            f"bands and {slow:.0%} from the slowest quarter. By how much of the score's variance relative "
            f"distance explains: {', '.join(f'{v} {k}' for k, v in kinds.items())} heads"
            f"{_frequency_scope(meta, sum(kinds.values()))}.")


# --- the atlas over many models: this analysis's models side by side -----------------------------------------

def compare_section(result: Any) -> Section | None:
    """The atlas over many models' frequency section: share of |q·k| per RoPE band, one line per member.
    None where no model measured it."""
    b = table(result, "bands")
    if not len(b):
        return None
    order = member_order(result)
    # Bands as a fraction of the rotated bands, so a partial rotary member's few bands sit beside the full ones.
    n = b.groupby("model").band.transform("max") + 1
    b = b.assign(band_fraction=(b.band + 0.5) / n)
    per = b.groupby(["member", "model", "band_fraction"], as_index=False).value.mean()
    fig = line_figure(per, "band_fraction", "value", order, "Share of |q·k| per RoPE band (fast → slow)",
                       "band (fraction of the rotated bands, fastest first)", "share of |score|",
                       compare_caption(result, "Mean over heads and layers."))
    fast = b[b.band < (n + 3) // 4].groupby(["member", "model", "layer", "head"]).value.sum()
    fast = fast.groupby(["member", "model"]).mean().reset_index()
    text = ("Share of the score's magnitude in the fastest quarter of the rotated bands (mean over heads): "
            + ", ".join(f"{m} {spread(fast[fast.member == m].value)}" for m in order if m in set(fast.member)) + ".")
    return Section("RoPE frequency usage", html=f"<p>{text}{refused_text(result, 'frequency')}</p>", figures=[fig])
