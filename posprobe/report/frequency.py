"""Figures and the self-contained HTML report for per-frequency RoPE usage, built from DataFrames only."""

from __future__ import annotations

import html
import json
import os
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from posprobe.report.html import Section, render_html
from posprobe.report.result import save_bundle

#: Per-head numbers shown in the report tables, with this many decimals.
DECIMALS = 4


def _band_labels(df: pd.DataFrame) -> dict[int, str]:
    w = df.drop_duplicates("band").set_index("band")["wavelength"]
    return {int(b): ("rest" if b < 0 else f"b{int(b)} ({w[b]:.3g} tok)") for b in sorted(w.index)}


def band_head_heatmap(df: pd.DataFrame, layer: int, term: str = "abs_share") -> Any:
    """Heatmap band (rows, fastest first, labelled with wavelength) x head of `term` for one layer."""
    import plotly.graph_objects as go

    d = df[(df.layer == layer) & (df.term == term)]
    piv = d.pivot_table(index="band", columns="head", values="value")
    labels = _band_labels(d)
    fig = go.Figure(go.Heatmap(z=piv.values, x=[f"H{h}" for h in piv.columns], y=[labels[b] for b in piv.index],
                               colorscale="Viridis", colorbar=dict(title=term)))
    fig.update_layout(title=f"Layer {layer}: {term} per band x head", height=520, yaxis=dict(autorange="reversed"))
    return fig


def layer_band_overview(df: pd.DataFrame, term: str = "abs_share") -> Any:
    """Heatmap layer x band of `term` averaged over heads."""
    import plotly.graph_objects as go

    d = df[(df.term == term) & (df.band >= 0)]
    piv = d.pivot_table(index="layer", columns="band", values="value", aggfunc="mean")
    fig = go.Figure(go.Heatmap(z=piv.values, x=[f"b{b}" for b in piv.columns], y=[f"L{l}" for l in piv.index],
                               colorscale="Viridis", colorbar=dict(title=term)))
    fig.update_layout(title=f"{term} (mean over heads): layer x band (band 0 = fastest)", height=560,
                      yaxis=dict(autorange="reversed"))
    return fig


def head_band_profile(df: pd.DataFrame, layer: int, head: int) -> Any:
    """q_norm, k_norm and abs_share of one head against band (wavelength on hover)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    d = df[(df.layer == layer) & (df["head"] == head) & (df.band >= 0)]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for term in ("q_norm", "k_norm"):
        t = d[d.term == term].sort_values("band")
        fig.add_trace(go.Scatter(x=t.band, y=t.value, name=term, customdata=t.wavelength,
                                 hovertemplate="band %{x}<br>wavelength %{customdata:.3g} tok<br>%{y:.4g}"))
    t = d[d.term == "abs_share"].sort_values("band")
    fig.add_trace(go.Bar(x=t.band, y=t.value, name="abs_share", opacity=0.4), secondary_y=True)
    fig.update_layout(title=f"L{layer}H{head}: band norms and score share", height=360, xaxis_title="band (0 = fastest)")
    fig.update_yaxes(title_text="mean 2-norm", secondary_y=False)
    fig.update_yaxes(title_text="share of |score|", secondary_y=True)
    return fig


def head_rel_pos_profile(profile: pd.DataFrame, layer: int, head: int) -> Any:
    """Heatmap band x rel_pos bin of the mean signed contribution of one head."""
    import plotly.graph_objects as go

    d = profile[(profile.layer == layer) & (profile["head"] == head) & (profile.term == "mean_contrib")]
    piv = d.pivot_table(index="band", columns="rel_pos", values="value")
    labels = _band_labels(d)
    his = d.drop_duplicates("rel_pos").set_index("rel_pos")["rel_pos_hi"]
    x = [f"{lo}" if lo == his[lo] else f"{lo}-{his[lo]}" for lo in piv.columns]
    fig = go.Figure(go.Heatmap(z=piv.values, x=x, y=[labels[b] for b in piv.index], colorscale="RdBu", zmid=0,
                               colorbar=dict(title="score")))
    fig.update_layout(title=f"L{layer}H{head}: mean contribution by relative distance", height=460,
                      xaxis_title="rel_pos (query - key)", yaxis=dict(autorange="reversed"))
    return fig


def sweep_figure(abl: pd.DataFrame) -> Any:
    """Loss change against fraction of bands kept rotating, drop-low (p-RoPE) vs drop-high."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for v in ("drop-low", "drop-high"):
        t = abl[abl.variant == v]
        if len(t):
            t = pd.concat([abl[abl.condition == "none"], t]).sort_values("fraction_kept")
            fig.add_trace(go.Scatter(x=t.fraction_kept, y=t.delta_loss, mode="lines+markers", name=v))
    fig.update_layout(title="Model-wide unrotation sweep", xaxis_title="p = fraction of bands kept rotating",
                      yaxis_title="loss change (nats/token)", height=380)
    return fig


def _fmt(df: pd.DataFrame) -> pd.DataFrame:
    out = df.reset_index(drop=True)
    for c in out.columns:
        if pd.api.types.is_float_dtype(out[c]):
            out[c] = out[c].map(lambda v: f"{v:.{DECIMALS}f}")
    return out


def build_report(usage: Any, ablation: pd.DataFrame | None, top: Sequence[tuple[int, int]], title: str) -> str:
    """The full HTML page: overview heatmaps, per-layer heatmaps, per-head sections, ablations."""
    df, heads = usage.df, usage.heads
    m = usage.meta
    kinds = heads.kind.value_counts().to_dict()
    summary = (f"<p>{m['n_windows']} windows of {m['window']} tokens ({m['n_tokens']} tokens). Band 0 is the "
               f"fastest rotary pair; band -1 ('rest') the unrotated dims. Scores are pre-softmax logits.</p>"
               f"<p>Head classes: {html.escape(json.dumps(kinds))}. Rule: {html.escape(m['classification_rule'])}.</p>")
    secs = [Section("Summary", html=summary, table=_fmt(heads.sort_values("eta2", ascending=False).head(20)))]
    secs.append(Section("Overview", figures=[layer_band_overview(df, "abs_share"), layer_band_overview(df, "q_norm")]))
    for layer in sorted(df.layer.unique()):
        secs.append(Section(f"Layer {layer}: band x head",
                            figures=[band_head_heatmap(df, layer, "abs_share"), band_head_heatmap(df, layer, "q_norm")]))
    if ablation is not None and len(ablation):
        secs.append(Section("Band ablations (loss change)", figures=[sweep_figure(ablation)],
                            table=_fmt(ablation[["condition", "mode", "bands", "fraction_kept", "value", "delta_loss"]])))
    for layer, head in top:
        h = heads[(heads.layer == layer) & (heads["head"] == head)]
        tables = [h[["layer", "head", "kv_head", "kind", "eta2", "fast_share", "diag_mass", "prev_mass", "first_mass"]]]
        if ablation is not None and len(ablation):
            a = ablation[(ablation.layer == layer) & (ablation["head"] == head)]
            if len(a):
                tables.append(a[["condition", "bands", "value", "delta_loss"]])
        body = "".join(_fmt(t).to_html(classes="pp-table", border=0, index=False) for t in tables[1:])
        secs.append(Section(f"Head L{layer}H{head}", html=body, table=_fmt(tables[0]),
                            figures=[head_band_profile(df, layer, head), head_rel_pos_profile(usage.profile, layer, head)]))
    return render_html(title, secs, meta={"model": m["model"]["name"], "window": m["window"],
                                           "n_tokens": m["n_tokens"], **m.get("environment", {})})


def save_report(out_dir: str | os.PathLike, usage: Any, ablation: pd.DataFrame | None, report_html: str,
                meta: dict) -> dict[str, Path]:
    """Write bands/profile/heads/ablation .parquet + .csv, meta.json and report.html into `out_dir`,
    all staged as temp files first and renamed together (nothing partial on error)."""
    tables = {"bands": usage.df, "profile": usage.profile, "heads": usage.heads}
    if ablation is not None:
        tables["ablation"] = ablation
    paths = save_bundle(out_dir, tables, meta, report_html)
    # Keyed by file name, as callers look them up.
    return {("meta.json" if k == "meta" else "report.html" if k == "report" else k): v for k, v in paths.items()}
