"""Report page of `posprobe conform`: the verdict per layer type with its bug class and sentence, and the engine's
per-band frequency over HF's against the band (1 everywhere when the engine conforms); the divergence against
position; cached against uncached scores around the switch; rotary phase error against position per dtype. Tables
and meta only."""

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
    """What `posprobe conform` prints: the verdict, then one line per layer type and check (its verdict and
    sentence)."""
    m = result.meta
    opts = m.get("engine_options")
    shown = "engine not run" if opts is None else f"options {opts or 'default'}"
    lines = [f"[conform] {m.get('engine')} on {m['model']['name']} ({m['model'].get('file')}), {shown}: "
             f"{m.get('verdict')}"]
    for r in result.tables.get("declared", pd.DataFrame()).itertuples():
        why = f": {r.why}" if isinstance(r.why, str) and r.why else ""
        said = getattr(r, "source", None)
        by = f" [declared by {said}]" if r.verdict != "conforms" and isinstance(said, str) and said else ""
        lines.append(f"[declared] {r.layer_type}: {r.verdict} ({r.bug_class}){why}{by}")
    for r in result.tables.get("behaviour_summary", pd.DataFrame()).itertuples():
        lines.append(f"[behaviour] {r.length} tokens: {r.verdict}: {r.why}")
    for r in result.tables.get("cache_summary", pd.DataFrame()).itertuples():
        lines.append(f"[cache] {r.side} around position {r.at}: {r.verdict}: {r.why}")
    for r in result.tables.get("precision", pd.DataFrame()).itertuples():
        lines.append(f"[precision] {r.layer_type}, {r.mode}: {_precision_sentence(r)}")
    return "\n".join(lines)


def _position(p: Any, end: int) -> str:
    return f"none up to {int(end):,}" if pd.isna(p) else f"{int(p):,}"


def _precision_sentence(r: Any) -> str:
    return (f"neighbours rotate identically from {_position(r.first_identical_position, r.scanned_to)}; the fastest "
            f"band reads a neighbour from {_position(r.first_fast_neighbour_position, r.scanned_to)}; largest phase "
            f"error {r.max_phase_error_in_context:.3g} rad within {r.context:,} tokens")


def figures(result: Any) -> list:
    """The engine's inverse frequency over HF's per band, one line per layer type; with the behaviour check, the
    divergence against position (KL and top-1 agreement by position bin, one line per length)."""
    return _declared_figure(result) + _behaviour_figure(result) + _cache_figure(result) + _precision_figure(result)


def _styled(result: Any, fig: Any, note: str) -> list:
    # One caption for every figure of the page: the engine and its options in force.
    return [style(fig, caption=caption(result.meta, {"engine": result.meta.get("engine"),
                                                     "options": result.meta.get("engine_options") or None},
                                       note=note))]


def _cache_figure(result: Any) -> list:
    import plotly.graph_objects as go

    c = result.tables.get("cache")
    if c is None or not len(c):
        return []
    fig = go.Figure()
    for i, (side, g) in enumerate(c.groupby("side", sort=False)):
        fig.add_trace(go.Scatter(x=g["position"], y=g["kl"].clip(lower=1e-16), mode="lines+markers", name=str(side),
                                 line={"color": COLORS[i % len(COLORS)]}))
    at = int(result.tables["cache_summary"]["at"].iloc[0])
    fig.add_vline(x=at - 0.5, line_dash="dot")
    fig.update_yaxes(type="log", title_text="KL(uncached || cached), nats")
    fig.update_xaxes(title_text="position")
    fig.update_layout(title=f"Cache boundary: cached against uncached scores around position {at}")
    note = ("Flat across the dotted line: the cache rotates as a fresh pass does; a step up past it: the cache keeps "
            "keys rotated for a shorter length (a length-dependent rotation).")
    return _styled(result, fig, note)


def _precision_figure(result: Any) -> list:
    import plotly.graph_objects as go

    c = result.tables.get("precision_curve")
    if c is None or not len(c):
        return []
    fig = go.Figure()
    for i, ((lt, mode), g) in enumerate(c.groupby(["layer_type", "mode"], sort=False)):
        name = mode if c["layer_type"].nunique() == 1 else f"{lt}: {mode}"
        fig.add_trace(go.Scatter(x=g["position"], y=g["fast_position_error"].clip(lower=1e-9), mode="lines",
                                 name=name, line={"color": COLORS[i % len(COLORS)]}))
    fig.add_hline(y=0.5, line_dash="dot")
    fig.update_xaxes(type="log", title_text="position")
    fig.update_yaxes(type="log", title_text="fastest band's error, tokens")
    fig.update_layout(title="Precision: the fastest rotary band's position error against position, per dtype")
    note = ("Against float64 phases of the same frequencies. Above the dotted line (half a token) the band reads a "
            "neighbour: bf16 from position 257, fp16 from 2,049.")
    return _styled(result, fig, note)


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
    return _styled(result, fig, note)


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
    return _styled(result, fig, note)


def sections(result: Any) -> list[Section]:
    """One section per check run: its table and its figure (the verdict heads the first)."""
    out: list[Section] = []
    d = result.tables.get("declared")
    if d is not None:
        keep = [c for c in ("layer_type", "verdict", "bug_class", "why", "engine_bands", "hf_bands", "engine_base",
                            "engine_freq_scale", "engine_multiplier", "hf_multiplier", "max_rel_diff") if c in d]
        intro = (f"<p><b>{html.escape(str(result.meta.get('verdict')))}</b>. Declared positions: what the engine "
                 "reads for this file under its options, turned into per-band frequencies by its own formulas, "
                 "against Hugging Face's rotary module for HF's config of the same file (relative tolerance "
                 "1e-6).</p>")
        out.append(Section("Declared positions", html=intro, table=pd.DataFrame(d[keep]),
                           figures=_declared_figure(result)))
    summary = result.tables.get("behaviour_summary")
    if summary is not None and len(summary):
        text = ("<p>The same token ids through the engine and through the HF reference (the same file, dequantised): "
                "KL(HF || engine) of the next-token distributions and top-1 agreement by position. The floor is the "
                "first quarter's mean (after the first 16 positions); growth is the last quarter's over it.</p>")
        out.append(Section("Behaviour against position", html=text, table=summary, figures=_behaviour_figure(result)))
    cache = result.tables.get("cache_summary")
    if cache is not None and len(cache):
        text = ("<p>Cached against uncached next-token distributions around the position where a rope type switches "
                "with the length (HF's dynamic NTK and longrope; any position for a static rotation): KL(uncached "
                "|| cached) per position, on the HF reference and on the engine. Past a switch, a cache that keeps "
                "keys rotated for a shorter length differs from a fresh pass (transformers #25104).</p>")
        out.append(Section("Cache boundaries", html=text, table=cache, figures=_cache_figure(result)))
    prec = result.tables.get("precision")
    if prec is not None and len(prec):
        text = ("<p>Rotary phases computed in float32, bfloat16 and float16 (and in the engine's own arithmetic) "
                "against float64 phases of the same frequencies, per layer type: the first position whose rotation "
                "equals its predecessor's, the first where the fastest band is off by half a token, and the largest "
                "phase error (rad).</p>")
        out.append(Section("Precision", html=text, table=prec, figures=_precision_figure(result)))
    return out
