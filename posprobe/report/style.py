"""The one figure style of every posprobe report: theme, fonts, captions, reference lines, table headers.

Every page module builds its figures with `style(fig, caption=...)`; `html.py` shows the caption under
each figure and static export (`posprobe.report.export`) prints it below the plot. A caption is built
from `result.meta` alone (`caption(meta, options)`), so a figure rebuilt from saved tables says what it
shows: model, data, N, seed and the options that matter.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "FONT_FAMILY", "COLORS", "template", "style", "caption", "get_caption", "reference_line", "slug",
    "header", "small_multiples_grid",
]

FONT_FAMILY = "Helvetica, Arial, 'Liberation Sans', sans-serif"
#: Okabe-Ito: distinguishable with the common colour-vision deficiencies and in greyscale print.
COLORS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
REFERENCE_COLOR = "#6b7280"
#: Key in `fig.layout.meta` under which the caption travels with the figure (and its JSON).
CAPTION_KEY = "posprobe_caption"

_TEMPLATE: Any = None


def template() -> Any:
    """The posprobe plotly template: plotly_white with larger fonts and a colour-blind-safe colourway."""
    global _TEMPLATE
    if _TEMPLATE is None:
        import plotly.graph_objects as go
        import plotly.io as pio

        t = go.layout.Template(pio.templates["plotly_white"])
        t.layout.update(
            font=dict(family=FONT_FAMILY, size=14, color="#1f2328"),
            title=dict(font=dict(size=17), x=0, xanchor="left", xref="paper"),
            colorway=list(COLORS),
            margin=dict(l=70, r=30, t=70, b=70),
            legend=dict(font=dict(size=13)),
            hoverlabel=dict(font=dict(family=FONT_FAMILY)),
        )
        t.layout.xaxis.update(showline=True, linecolor="#9ca3af", ticks="outside", title=dict(font=dict(size=15)))
        t.layout.yaxis.update(showline=True, linecolor="#9ca3af", ticks="outside", title=dict(font=dict(size=15)))
        _TEMPLATE = t
    return _TEMPLATE


def style(fig: Any, *, caption: str | None = None, height: int | None = None) -> Any:
    """Apply the posprobe theme to `fig` in place, attach `caption`; returns `fig` for chaining."""
    meta = dict(fig.layout.meta) if isinstance(fig.layout.meta, dict) else {}
    meta["posprobe_style"] = True
    if caption is not None:
        meta[CAPTION_KEY] = caption
    fig.update_layout(template=template(), meta=meta)
    if height is not None:
        fig.update_layout(height=height)
    return fig


def is_styled(fig: Any) -> bool:
    """Whether `style` was applied to `fig`."""
    meta = getattr(getattr(fig, "layout", None), "meta", None)
    return isinstance(meta, dict) and bool(meta.get("posprobe_style"))


def get_caption(fig: Any) -> str | None:
    """The caption attached by `style` (None when the figure has none)."""
    meta = getattr(getattr(fig, "layout", None), "meta", None)
    return meta.get(CAPTION_KEY) if isinstance(meta, dict) else None


def _fmt_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt_value(x) for x in v)
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def caption(meta: dict, options: dict[str, Any] | None = None, *, note: str | None = None) -> str:
    """One caption line from a result's meta: model, data (source, N and unit), seed, then `options`.

    `options` maps a label to a value ("k": [0, 100]); None values are left out. `note` ends the caption.
    """
    parts: list[str] = []
    model = meta.get("model") or {}
    if isinstance(model, dict) and model.get("name"):
        kind = model.get("positional_kind")
        parts.append(f"Model: {model['name']}" + (f" ({str(kind).replace('_', ' ')} positions)" if kind else ""))
    data = meta.get("data") or {}
    if isinstance(data, dict) and data.get("source") is not None:
        src = str(data["source"]) + (" (posprobe built-in template pairs, not BLiMP)" if data.get("builtin") else "")
        n = f", N = {data['n_items']} {data.get('unit', '')}".rstrip() if data.get("n_items") is not None else ""
        parts.append(f"Data: {src}{n}")
    seed = (meta.get("config") or {}).get("seed") if isinstance(meta.get("config"), dict) else None
    if seed is not None:
        parts.append(f"seed {seed}")
    for label, value in (options or {}).items():
        if value is not None and value != [] and value != ():
            parts.append(f"{label} {_fmt_value(value)}")
    text = ". ".join([parts[0], "; ".join(parts[1:])] if len(parts) > 1 else parts)
    if note:
        text = f"{text}. {note}" if text else note
    return text + ("" if text.endswith(".") else ".")


def reference_line(fig: Any, y: float, label: str, *, row: Any = None, col: Any = None,
                   axis: str = "y") -> Any:
    """A dashed grey horizontal (axis="y") or vertical (axis="x") reference line labelled `label`."""
    kw = dict(line=dict(color=REFERENCE_COLOR, dash="dash", width=1.5))
    if row is not None:
        kw.update(row=row, col=col)
    if axis == "y":
        fig.add_hline(y=y, annotation_text=label, annotation_position="bottom right",
                      annotation_font=dict(size=12, color=REFERENCE_COLOR), **kw)
    else:
        fig.add_vline(x=y, annotation_text=label, annotation_position="top right",
                      annotation_font=dict(size=12, color=REFERENCE_COLOR), **kw)
    return fig


def layer_head_heatmap(frame: Any, metric: str, title: str, caption: str | None, height: int = 420) -> Any:
    """Layer x head heatmap of one per-head metric: `frame` has columns layer, head, value (one row per head)."""
    import plotly.graph_objects as go

    d = frame.pivot(index="layer", columns="head", values="value")
    fig = go.Figure(go.Heatmap(z=d.values, x=d.columns, y=d.index, colorscale="Viridis", colorbar=dict(title=metric),
                               hovertemplate="layer %{y}, head %{x}<br>%{z:.3f}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="head", yaxis_title="layer")
    return style(fig, caption=caption, height=height)


def small_multiples_grid(n: int, max_cols: int = 4) -> tuple[int, int]:
    """(rows, cols) of a small-multiples grid for `n` panels."""
    cols = max(1, min(max_cols, n))
    return (n + cols - 1) // cols, cols


def slug(text: str, max_len: int = 48) -> str:
    """A file-name-safe lower-case slug of a figure title."""
    text = re.sub(r"<[^>]+>", " ", text or "")
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return (s[:max_len].rstrip("-") or "figure")


# Column name -> header in words. Columns not listed get their underscores replaced by spaces.
HEADERS: dict[str, str] = {
    "k": "k (start position)",
    "n_pairs": "pairs",
    "accuracy": "accuracy",
    "ci_low": "95% CI low",
    "ci_high": "95% CI high",
    "mean_margin": "mean margin (nats)",
    "delta_accuracy": "Δ accuracy vs k=0",
    "flips": "flips vs k=0",
    "flips_to_wrong": "flips to wrong",
    "flips_to_correct": "flips to correct",
    "mcnemar_p": "McNemar p",
    "logp_good": "log p good (nats)",
    "logp_bad": "log p bad (nats)",
    "margin": "margin (nats)",
    "loss": "loss (nats)",
    "mean_loss": "mean loss (nats)",
    "n_tokens_good": "tokens (good)",
    "n_tokens_bad": "tokens (bad)",
    "pair_id": "pair",
    "layer": "layer",
    "head": "head",
    "kv_head": "KV head",
    "band": "band",
    "bands": "bands",
    "n_bands": "bands (count)",
    "rel_pos": "relative position",
    "query_pos": "query position",
    "key_pos": "key position",
    "pos": "position",
    "eta2": "η² (rel. position)",
    "fast_share": "fast-band share",
    "self_mass": "attention to self",
    "prev_mass": "attention to previous",
    "first_mass": "attention to first",
    "fraction_kept": "fraction of bands kept",
    "delta_loss": "Δ loss (nats/token)",
    "base_loss": "base loss (nats/token)",
    "value": "value",
    "wavelength": "wavelength (tokens)",
    "frequency": "frequency (rad/token)",
    "base": "RoPE base",
    "kind": "head class",
    "mode": "mode",
    "condition": "condition",
    "preset": "preset",
}


def header(column: Any) -> str:
    """A table header in words for a column name (tuples from pivots are joined)."""
    if isinstance(column, tuple):
        return " ".join(header(c) for c in column if str(c) != "")
    name = str(column)
    return HEADERS.get(name, name.replace("_", " "))
