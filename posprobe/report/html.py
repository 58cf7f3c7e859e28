"""Self-contained, offline HTML reports.

``render_html`` produces ONE HTML page: plotly.js is inlined exactly once in a
``<script>`` in ``<head>``; figures are embedded as plain divs + inline
``Plotly.newPlot`` calls; tables come from ``DataFrame.to_html``.  The page
references no external URL (no CDN, no web fonts, no MathJax), so it renders
with networking switched off.
"""

from __future__ import annotations

import html as _html
import json
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

__all__ = ["Section", "render_html", "table_html"]

#: Tables longer than this are truncated (pandas shows a "..." row).
MAX_TABLE_ROWS = 200
#: Height used for figures whose layout does not fix one.
DEFAULT_FIGURE_HEIGHT = "460px"
_FIG_CONFIG = {"displaylogo": False, "responsive": True}

_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; background: #fafafa; color: #1f2328;
  font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 20px 40px; }
h1 { font-size: 1.6em; margin: 0 0 16px; }
h2 { font-size: 1.2em; margin: 0 0 12px; border-bottom: 1px solid #e5e7eb; padding-bottom: 4px; }
section { background: #fff; border: 1px solid #e5e7eb; border-radius: 6px;
  padding: 16px 20px; margin: 0 0 20px; }
.pp-figure { margin: 8px 0 16px; }
.pp-table-wrap { overflow-x: auto; }
table.pp-table { border-collapse: collapse; font-size: 13px;
  font-variant-numeric: tabular-nums; }
table.pp-table th, table.pp-table td { border-bottom: 1px solid #e5e7eb;
  padding: 4px 10px; text-align: right; white-space: nowrap; }
table.pp-table thead th { background: #f3f4f6; border-bottom: 2px solid #d1d5db; }
table.pp-table tbody tr:nth-child(even) { background: #fafafa; }
footer { max-width: 1100px; margin: 0 auto; padding: 0 20px 24px; color: #6b7280; font-size: 12px; }
footer dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; margin: 0; }
footer dt { font-weight: 600; }
footer dd { margin: 0; word-break: break-all; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
"""


@dataclass
class Section:
    """One block of the report.

    ``heading`` is plain text (escaped).  ``html`` is a *trusted* raw HTML
    fragment inserted verbatim (escape user text yourself with
    ``html.escape``).  ``figures`` are plotly figures; ``table`` an optional
    DataFrame rendered after the figures.
    """

    heading: str
    html: str = ""
    figures: list = field(default_factory=list)
    table: pd.DataFrame | None = None


def _esc(x: Any) -> str:
    return _html.escape(str(x), quote=True)


def _has_trivial_index(df: pd.DataFrame) -> bool:
    return isinstance(df.index, pd.RangeIndex) and df.index.name is None


def _figure_html(fig: Any, div_id: str) -> str:
    height = None if getattr(fig.layout, "height", None) else DEFAULT_FIGURE_HEIGHT
    body = fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        include_mathjax=False,
        div_id=div_id,
        config=_FIG_CONFIG,
        default_width="100%",
        default_height=height or "100%",
    )
    return f'<div class="pp-figure">{body}</div>'


def table_html(df: pd.DataFrame) -> str:
    """A DataFrame as an HTML table in the report style (index shown only when meaningful)."""
    table = df.to_html(
        classes="pp-table",
        border=0,
        index=not _has_trivial_index(df),
        escape=True,
        max_rows=MAX_TABLE_ROWS,
        na_rep="",
    )
    return f'<div class="pp-table-wrap">{table}</div>'


def _meta_value(v: Any) -> str:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return _esc(v)
    if isinstance(v, dict):
        return ", ".join(f"{_esc(k)}={_esc(x)}" for k, x in v.items())
    text = json.dumps(v, default=str)
    return _esc(text if len(text) <= 300 else text[:297] + "...")


def _footer_html(meta: dict | None) -> str:
    if not meta:
        return ""
    rows = "".join(
        f"<dt>{_esc(k)}</dt><dd>{_meta_value(v)}</dd>"
        for k, v in sorted(meta.items(), key=lambda kv: str(kv[0]))
    )
    return f"<footer><dl>{rows}</dl></footer>"


def render_html(title: str, sections: list[Section], meta: dict | None = None) -> str:
    """Render a complete, self-contained HTML page (plotly.js inlined once).

    Figure divs get the ids ``posprobe-fig-0``, ``posprobe-fig-1``, ... in
    document order.  ``meta`` (e.g. model name, versions) goes in a footer.
    """
    from plotly.offline import get_plotlyjs  # heavy import, keep lazy

    parts: list[str] = []
    n_fig = 0
    for sec in sections:
        body = [f"<h2>{_esc(sec.heading)}</h2>"] if sec.heading else []
        if sec.html:
            body.append(sec.html)
        for fig in sec.figures or []:
            body.append(_figure_html(fig, f"posprobe-fig-{n_fig}"))
            n_fig += 1
        if sec.table is not None:
            body.append(table_html(sec.table))
        parts.append("<section>" + "\n".join(body) + "</section>")

    plotlyjs = get_plotlyjs()
    if "</script" in plotlyjs.lower():  # would terminate the inline script early
        plotlyjs = plotlyjs.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            '<meta name="generator" content="posprobe">',
            f"<title>{_esc(title)}</title>",
            f"<style>{_CSS}</style>",
            f'<script type="text/javascript">{plotlyjs}</script>',
            "</head>",
            "<body>",
            "<main>",
            f"<h1>{_esc(title)}</h1>",
            *parts,
            "</main>",
            _footer_html(meta),
            "</body>",
            "</html>",
            "",
        ]
    )
