"""Report page of `posprobe conform`: the verdict per layer type with its bug class and sentence, and the engine's
per-band frequency over HF's against the band (1 everywhere when the engine conforms). Tables and meta only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.html import Section
from posprobe.report.style import COLORS, caption, style

__all__ = ["figures", "sections", "summary_text", "title"]


def title(result: Any) -> str:
    """Report title."""
    return str(result.meta.get("title") or "Engine positions against Hugging Face")


def summary_text(result: Any) -> str:
    """What `posprobe conform` prints: the verdict, then one line per layer type (its bug class and sentence)."""
    m = result.meta
    lines = [f"[conform] {m.get('engine')} on {m['model']['name']} ({m['model'].get('file')}), options "
             f"{m.get('engine_options') or 'default'}: {m.get('verdict')}"]
    for r in result.tables["declared"].itertuples():
        why = f": {r.why}" if isinstance(r.why, str) and r.why else ""
        lines.append(f"[declared] {r.layer_type}: {r.verdict} ({r.bug_class}){why}")
    for r in result.tables.get("behaviour_summary", pd.DataFrame()).itertuples():
        lines.append(f"[behaviour] {r.length} tokens: {r.verdict}: {r.why}")
    return "\n".join(lines)


def figures(result: Any) -> list:
    """The engine's inverse frequency over HF's per band, one line per layer type; with the behaviour check, the
    divergence against position (KL and top-1 agreement by position bin, one line per length)."""
    return _declared_figure(result) + _behaviour_figure(result)


def _behaviour_figure(result: Any) -> list:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    b = result.tables.get("behaviour")
    if b is None or not len(b):
        return []
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KL(HF || engine), nats", "top-1 agreement"))
    for i, (n, g) in enumerate(b.groupby("length", sort=True)):
        mid = (g["first_position"] + g["last_position"]) / 2
        color = COLORS[i % len(COLORS)]
        fig.add_trace(go.Scatter(x=mid, y=g["kl"], mode="lines+markers", name=f"{n} tokens",
                                 line={"color": color}), row=1, col=1)
        fig.add_trace(go.Scatter(x=mid, y=g["top1_agreement"], mode="lines+markers", name=f"{n} tokens",
                                 line={"color": color}, showlegend=False), row=1, col=2)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_xaxes(title_text="position (bin centre)")
    fig.update_layout(title="Behaviour against position: the engine against the HF reference on the same ids")
    note = ("A flat line is the engine's quantisation floor; a line that rises with position is the signature of a "
            "rotation error.")
    return [style(fig, caption=caption(result.meta, {"engine": result.meta.get("engine"),
                                                     "options": result.meta.get("engine_options") or None},
                                       note=note))]


def _declared_figure(result: Any) -> list:
    import plotly.graph_objects as go

    bands = result.tables["declared_bands"]
    if not len(bands):
        return []
    fig = go.Figure()
    for i, (lt, g) in enumerate(bands.groupby("layer_type", sort=False)):
        fig.add_trace(go.Scatter(x=g["band"], y=g["ratio"], mode="lines+markers", name=str(lt),
                                 line={"color": COLORS[i % len(COLORS)]}))
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(title="Declared positions: the engine's frequency / Hugging Face's, per rotary band",
                      xaxis_title="band j (fastest first)", yaxis_title="engine / HF inverse frequency")
    note = "1 on every band and an equal cos/sin multiplier: the engine rotates as HF does."
    return [style(fig, caption=caption(result.meta, {"engine": result.meta.get("engine"),
                                                     "options": result.meta.get("engine_options") or None},
                                       note=note))]


def sections(result: Any) -> list[Section]:
    """The verdict and the per-layer-type table, then the figure."""
    d = result.tables["declared"]
    keep = [c for c in ("layer_type", "verdict", "bug_class", "why", "engine_bands", "hf_bands", "engine_base",
                        "engine_freq_scale", "engine_multiplier", "hf_multiplier", "max_rel_diff") if c in d]
    intro = (f"<p><b>{html.escape(str(result.meta.get('verdict')))}</b>. Declared positions: what the engine reads "
             "for this file under its options, turned into per-band frequencies by its own formulas, against Hugging "
             "Face's rotary module for HF's config of the same file (relative tolerance 1e-6).</p>")
    out = [Section("Declared positions", html=intro, table=pd.DataFrame(d[keep]), figures=_declared_figure(result))]
    summary = result.tables.get("behaviour_summary")
    if summary is not None and len(summary):
        text = ("<p>The same token ids through the engine and through the HF reference (the same file, dequantised): "
                "KL(HF || engine) of the next-token distributions and top-1 agreement by position. The floor is the "
                "first quarter's mean (after the first 16 positions); growth is the last quarter's over it.</p>")
        out.append(Section("Behaviour against position", html=text, table=summary, figures=_behaviour_figure(result)))
    return out
