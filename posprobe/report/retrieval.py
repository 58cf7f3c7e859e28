"""Report page of the retrieval-head analysis (`retrieval`): retrieval score per layer x head per preset, the
masking curve (needle accuracy with the top-k heads masked vs k random heads), built from the tables only."""

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


def masking_curve(masking: pd.DataFrame, meta: dict | None = None) -> Any:
    """Needle accuracy against the number of heads masked: top retrieval heads vs random heads, per preset."""
    import plotly.graph_objects as go

    acc = masking[masking.metric == "string_match_all"]
    fig = go.Figure()
    for i, (preset, d) in enumerate(acc.groupby("preset", sort=False)):
        base = d[d.masked == "none"]
        for kind, dash in (("top", "solid"), ("random", "dot")):
            part = pd.concat([base, d[d.masked == kind]]).groupby("n_masked", sort=True).agg(
                value=("value", "mean"), ci_low=("ci_low", "min"), ci_high=("ci_high", "max")).reset_index()
            fig.add_trace(go.Scatter(
                x=part.n_masked, y=part.value, mode="lines+markers", name=f"{preset}: {kind}",
                line=dict(dash=dash, color=COLORS[i % len(COLORS)]),
                error_y=dict(type="data", symmetric=False, array=part.ci_high - part.value,
                             arrayminus=part.value - part.ci_low)))
    fig.update_layout(title="Needle accuracy with heads masked", xaxis_title="heads masked",
                      yaxis_title="string_match_all", yaxis_range=[-0.02, 1.02])
    return style(fig, caption=figure_caption(meta, "Bars: 95% percentile-bootstrap CI over prompts (random: the widest "
                                                   "over draws; the line is the mean over draws)."), height=420)


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


def summary_text(result: Any) -> str:
    """One paragraph per preset in words: the retrieval heads, the accuracy, and what masking them does."""
    heads, cls, masking = (result.tables[t] for t in ("retrieval_heads", "head_classes", "retrieval_masking"))
    out = []
    for preset in heads.preset.unique():
        score = heads[(heads.preset == preset) & (heads.metric == "retrieval_score")].sort_values(
            ["value", "layer", "head"], ascending=[False, True, True])
        n = int((cls[cls.preset == preset].kind == "retrieval").sum())
        top = ", ".join(f"L{int(r.layer)}H{int(r.head)} {r.value:.2f}" for r in score.head(5).itertuples())
        m = masking[(masking.preset == preset) & (masking.metric == "string_match_all")]
        base = m[m.masked == "none"].value.iloc[0]
        jac = masking[(masking.preset == preset) & (masking.metric == "retrieval_jaccard")].value.iloc[0]
        jt = masking[(masking.preset == preset) & (masking.metric == "retrieval_jaccard_tasks")].value
        if score.value.max() > 0:
            text = f"{preset}: needle accuracy {base:.2f}; {n} retrieval heads of {len(score)} (top: {top})"
        else:
            text = f"{preset}: needle accuracy {base:.2f}; no head copied a needle token"
        mass = heads[(heads.preset == preset) & (heads.metric == "needle_mass")].sort_values(
            ["value", "layer", "head"], ascending=[False, True, True]).iloc[0]
        text += f"; most attention on the needle: L{int(mass['layer'])}H{int(mass['head'])} {mass['value']:.2f}"
        if jac == jac:  # NaN without two prompts that have a retrieval head between them
            text += f"; the retrieval sets overlap by {jac:.2f} (mean Jaccard) across prompts"
        if len(jt) and jt.iloc[0] == jt.iloc[0]:
            text += f" and by {jt.iloc[0]:.2f} across needle tasks"
        for k in sorted(m[m.masked == "top"].n_masked.unique()):
            t = m[(m.masked == "top") & (m.n_masked == k)].value.iloc[0]
            r = m[(m.masked == "random") & (m.n_masked == k)].value.mean()
            text += f"; masking the top {k}: {t:.2f}, {k} random heads: {r:.2f}"
        out.append(text)
    return "Retrieval heads (Wu et al. 2025). " + ". ".join(out) + "."


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
