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
    return "\n".join(lines)


def figures(result: Any) -> list:
    """The engine's inverse frequency over HF's per band, one line per layer type."""
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
    return [Section("Declared positions", html=intro, table=pd.DataFrame(d[keep]), figures=figures(result))]
