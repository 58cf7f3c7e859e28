"""Report page of the retrieval-head analysis (`retrieval`): retrieval score per layer x head per preset, the
masking curve (needle accuracy with the top-k heads masked vs k random heads), built from the tables and meta."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, caption, layer_head_heatmap, style


def title(result: Any) -> str:
    """Report title."""
    return f"Retrieval heads: {result.meta['model']['name']}"


def figure_caption(meta: dict | None, note: str | None = None) -> str:
    """Caption: model, data, tasks, lengths, depths, presets."""
    m = meta or {}
    cfg = m.get("config", {})
    return caption(m, {"tasks": cfg.get("tasks"), "lengths": cfg.get("lengths"), "depths": cfg.get("depths"),
                       "presets": cfg.get("presets")}, note=note)


def heatmap(heads: pd.DataFrame, preset: str, metric: str, meta: dict | None = None) -> Any:
    """Layer x head heatmap of one per-head metric under one preset."""
    return layer_head_heatmap(heads[(heads.preset == preset) & (heads.metric == metric)], metric,
                              f"{metric.replace('_', ' ')} per head ({preset})", figure_caption(meta), height=440)


def interval_name(meta: dict | None) -> str:
    """The accuracy intervals in words, from meta["intervals"] (results before it was recorded: the bootstrap)."""
    method = ((meta or {}).get("intervals") or {}).get("method", "percentile-bootstrap")
    return "95% Wilson score interval" if method == "wilson" else "95% percentile-bootstrap interval"


def masking_curve(masking: pd.DataFrame, meta: dict | None = None) -> Any:
    """Needle accuracy against the number of heads masked: top retrieval heads vs random heads, per preset. Points
    are joined by lines only across three or more k (the baseline counts): two points are markers, not a curve."""
    import plotly.graph_objects as go

    acc = masking[masking.metric == "string_match_all"]
    fig = go.Figure()
    for i, (preset, d) in enumerate(acc.groupby("preset", sort=False)):
        base = d[d.masked == "none"]
        for j, (kind, dash) in enumerate((("top", "solid"), ("random", "dot"))):
            part = pd.concat([base, d[d.masked == kind]]).groupby("n_masked", sort=True).agg(
                value=("value", "mean"), ci_low=("ci_low", "min"), ci_high=("ci_high", "max")).reset_index()
            fig.add_trace(go.Scatter(
                x=part.n_masked, y=part.value, mode="lines+markers" if len(part) >= 3 else "markers",
                name=f"{preset}: {kind}", line=dict(dash=dash, color=COLORS[i % len(COLORS)]),
                marker=dict(symbol=("circle", "diamond")[j], size=9, color=COLORS[i % len(COLORS)]),
                error_y=dict(type="data", symmetric=False, array=part.ci_high - part.value,
                             arrayminus=part.value - part.ci_low)))
    fig.update_layout(title="Needle accuracy with heads masked", xaxis_title="heads masked",
                      yaxis_title="string_match_all", yaxis_range=[-0.02, 1.02])
    return style(fig, caption=figure_caption(meta, f"Bars: {interval_name(meta)} over prompts (random: the widest "
                                                   "over draws; the point is the mean over draws). Lines join points "
                                                   "only across three or more k."), height=420)


def figures(result: Any) -> list:
    """Per preset the retrieval-score and needle-mass heatmaps, then the masking curve."""
    heads = result.tables["retrieval_heads"]
    figs = []
    for preset in heads.preset.unique():
        figs += [heatmap(heads, preset, m, result.meta) for m in ("retrieval_score", "needle_mass")]
    masking = result.tables["retrieval_masking"]
    if (masking.masked != "none").any():
        figs.append(masking_curve(masking, result.meta))
    return figs


def beyond_context_note(meta: dict | None) -> str:
    """A sentence naming the lengths past the model's context ("" where none is)."""
    beyond = (meta or {}).get("beyond_context") or {}
    if not beyond.get("lengths"):
        return ""
    lengths = ", ".join(f"{L:,}" for L in beyond["lengths"])
    which = f"length {lengths} is" if len(beyond["lengths"]) == 1 else f"lengths {lengths} are"
    return (f"Note: {which} past the model's context of {beyond['context']:,} positions "
            "(max_position_embeddings), so the accuracy there measures extrapolation beyond it.")


def _acc(row: Any) -> str:
    # An accuracy with its interval and the number of prompts behind it.
    return f"{row.value:.2f} [{row.ci_low:.2f}, {row.ci_high:.2f}] (n={int(row['count'])})"


def summary_text(result: Any) -> str:
    """One paragraph per preset in words: the retrieval heads, the accuracy (interval, n), and what masking them
    does; led by a note where lengths run past the model's context."""
    heads, cls, masking = (result.tables[t] for t in ("retrieval_heads", "head_classes", "retrieval_masking"))
    out = []
    for preset in heads.preset.unique():
        score = heads[(heads.preset == preset) & (heads.metric == "retrieval_score")].sort_values(
            ["value", "layer", "head"], ascending=[False, True, True])
        n = int((cls[cls.preset == preset].kind == "retrieval").sum())
        top = ", ".join(f"L{int(r.layer)}H{int(r.head)} {r.value:.2f}" for r in score.head(5).itertuples())
        m = masking[(masking.preset == preset) & (masking.metric == "string_match_all")]
        base = _acc(m[m.masked == "none"].iloc[0])
        jac = masking[(masking.preset == preset) & (masking.metric == "retrieval_jaccard")].value.iloc[0]
        jt = masking[(masking.preset == preset) & (masking.metric == "retrieval_jaccard_tasks")].value
        if score.value.max() > 0:
            text = f"{preset}: needle accuracy {base}; {n} retrieval heads of {len(score)} (top: {top})"
        else:
            text = f"{preset}: needle accuracy {base}; no head copied a needle token"
        mass = heads[(heads.preset == preset) & (heads.metric == "needle_mass")].sort_values(
            ["value", "layer", "head"], ascending=[False, True, True]).iloc[0]
        text += f"; most attention on the needle: L{int(mass['layer'])}H{int(mass['head'])} {mass['value']:.2f}"
        if jac == jac:  # NaN without two prompts that have a retrieval head between them
            text += f"; the retrieval sets overlap by {jac:.2f} (mean Jaccard) across prompts"
        if len(jt) and jt.iloc[0] == jt.iloc[0]:
            text += f" and by {jt.iloc[0]:.2f} across needle tasks"
        for k in sorted(m[m.masked == "top"].n_masked.unique()):
            t = _acc(m[(m.masked == "top") & (m.n_masked == k)].iloc[0])
            r = m[(m.masked == "random") & (m.n_masked == k)]
            text += (f"; masking the top {k}: {t}, {k} random heads: {r.value.mean():.2f} (mean of {len(r)} "
                     f"draw{'s' if len(r) != 1 else ''})")
        out.append(text)
    note = beyond_context_note(result.meta)
    return ((note + " " if note else "") + "Retrieval heads (Wu et al. 2025). " + ". ".join(out)
            + f". Accuracy intervals: {interval_name(result.meta)}, n = prompts.")


def sections(result: Any) -> list[Section]:
    """Summary in words, figures, the masking table, the strongest heads."""
    m = result.meta
    intro = (f"<p>{html.escape(summary_text(result))}</p><p>{m['data']['n_items']} prompts per preset and masking "
             f"variant. A head copies at an answer step when its most-attended key lies in an asked needle's value "
             f"and carries the token generated; retrieval score = distinct value tokens copied / value tokens, mean "
             f"over prompts; retrieval head: {html.escape(m['classes']['retrieval'])}. "
             f"{html.escape(m['masking'])}.</p>")
    masking = result.tables["retrieval_masking"].drop(columns="model").round(3)
    score = result.tables["retrieval_heads"]
    wide = score.pivot_table(index=["preset", "layer", "head"], columns="metric", values="value").reset_index()
    wide = wide.sort_values("retrieval_score", ascending=False).head(40).round(3)
    return [Section("Summary", html=intro + table_html(masking)), Section("Figures", figures=figures(result)),
            Section("Strongest heads (by retrieval score)", table=wide)]


def atlas_paragraph(result: Any, n: Any) -> str:
    """The atlas's retrieval section in words: the retrieval summary, and the cross-check with the sinks section's
    zeroed heads where both ran."""
    from posprobe.report.atlas import cross_check_text

    return summary_text(result.parts["retrieval"]) + cross_check_text(result.meta)
