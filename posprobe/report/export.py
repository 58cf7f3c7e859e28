"""Static figure export (SVG, PDF, PNG) with plotly's exporter, kaleido >= 1.0, driving a system Chromium.

Optional: `pip install 'posprobe[figures]'` brings kaleido; the browser is the system's Chrome/Chromium
(Debian: `apt-get install chromium`), found on PATH or through `$BROWSER_PATH`. Nothing here is imported
unless figures are exported, and a missing piece gives one `FigureExportError` saying what to install.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from posprobe.report import style

__all__ = ["FORMATS", "FigureExportError", "parse_formats", "figure_names", "export_figures", "find_browser",
           "EXPORT_WIDTH", "PNG_SCALE"]

FORMATS = ("svg", "pdf", "png")
#: Width of exported figures in CSS pixels (PDF/SVG page size; PNG is `PNG_SCALE` times larger).
EXPORT_WIDTH = 900
DEFAULT_HEIGHT = 500
PNG_SCALE = 2
_CAPTION_LINE_PX = 17
_CAPTION_CHARS = 120


class FigureExportError(RuntimeError):
    """Static export is not possible here (exporter or browser missing) or failed; the message says why."""


def parse_formats(formats: str | Sequence[str] | None) -> tuple[str, ...]:
    """'svg,pdf' or ['svg', 'pdf'] -> ('svg', 'pdf'); raises ValueError naming the allowed formats."""
    if not formats:
        return ()
    items = formats.split(",") if isinstance(formats, str) else list(formats)
    out = []
    for f in (x.strip().lower().lstrip(".") for x in items):
        if not f:
            continue
        if f not in FORMATS:
            raise ValueError(f"unknown figure format {f!r}; choose from {', '.join(FORMATS)}")
        if f not in out:
            out.append(f)
    return tuple(out)


def figure_names(figures: Sequence[Any]) -> list[str]:
    """`<nn>-<slug>` per figure, numbered in report order, slug from the figure's title."""
    names = []
    for i, fig in enumerate(figures, 1):
        title = getattr(getattr(fig.layout, "title", None), "text", None) or f"figure {i}"
        names.append(f"{i:02d}-{style.slug(title)}")
    return names


def find_browser() -> str | None:
    """The Chrome/Chromium kaleido will use ($BROWSER_PATH first), or None."""
    env = os.environ.get("BROWSER_PATH")
    if env:
        return env if os.access(env, os.X_OK) else None
    try:
        from choreographer.browsers.chromium import Chromium

        return Chromium.find_browser(skip_local=False)
    except Exception:  # noqa: BLE001 - an older choreographer: fall back to PATH
        import shutil

        for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
            if shutil.which(name):
                return shutil.which(name)
    return None


def _require_exporter() -> str:
    try:
        import kaleido
    except ImportError:
        raise FigureExportError(
            "static figure export needs the kaleido package (>= 1.0), which drives a system Chrome/Chromium: "
            "pip install 'posprobe[figures]' (or pip install 'kaleido>=1'). The HTML report needs neither."
        ) from None
    major = str(getattr(kaleido, "__version__", "1")).split(".")[0]
    if major.isdigit() and int(major) < 1:
        raise FigureExportError(f"static figure export needs kaleido >= 1.0 (found {kaleido.__version__}): "
                                "pip install -U 'kaleido>=1'")
    browser = find_browser()
    if browser is None:
        raise FigureExportError(
            "static figure export needs Chrome or Chromium and none was found (looked at $BROWSER_PATH, then "
            "chromium, chromium-browser, google-chrome on PATH): apt-get install chromium, or set "
            "BROWSER_PATH=/path/to/chromium. The HTML report needs no browser."
        )
    return browser


def _wrap(text: str, width: int = _CAPTION_CHARS) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width) or [""]


def for_export(fig: Any) -> tuple[Any, int]:
    """A copy of `fig` sized for a page with its caption printed below the plot; returns (figure, height)."""
    import plotly.graph_objects as go

    out = go.Figure(fig)
    if not style.is_styled(out):
        style.style(out)
    height = int(out.layout.height or DEFAULT_HEIGHT)
    cap = style.get_caption(out)
    if cap:
        import html

        lines = _wrap(cap)
        extra = _CAPTION_LINE_PX * len(lines) + 12
        bottom = out.layout.margin.b if out.layout.margin.b is not None else 70
        out.update_layout(margin=dict(b=bottom + extra), height=height + extra)
        # Below the x-axis title, in the bottom margin; paper y=0 is the bottom of the plot area.
        out.add_annotation(text="<br>".join(html.escape(x) for x in lines), xref="paper", yref="paper", x=0, y=0,
                           xanchor="left", yanchor="top", yshift=-(bottom - 8), showarrow=False, align="left",
                           font=dict(size=11, color="#4b5563"))
        height += extra
    return out, height


def export_figures(figures: Sequence[Any], paths: Sequence[str | os.PathLike], formats: Sequence[str]) -> None:
    """Write `figures[i]` to `paths[i]` in `formats[i]` (one Chromium session for all).

    Raises `FigureExportError` when kaleido or a browser is missing, or when the export fails.
    """
    if not figures:
        return
    browser = _require_exporter()
    import plotly.io as pio

    prepared = [for_export(f) for f in figures]
    try:
        pio.write_images(
            [f for f, _ in prepared], [Path(p) for p in paths], format=list(formats),
            width=[EXPORT_WIDTH] * len(prepared), height=[h for _, h in prepared],
            scale=[PNG_SCALE if fmt == "png" else 1 for fmt in formats],
        )
    except Exception as e:  # noqa: BLE001 - kaleido/choreographer raise many types
        raise FigureExportError(
            f"static figure export failed in kaleido with {browser}: {type(e).__name__}: {e}"
        ) from e
