"""Self-contained, offline HTML reports.

``render_html`` produces ONE HTML page: plotly.js is inlined exactly once in a
``<script>`` in ``<head>``; figures are embedded as plain divs + inline
``Plotly.newPlot`` calls, each in a ``<figure>`` with its caption; tables are
formatted for reading (``table_html``: no index, headers in words, rounded).  The page
references no external URL (no CDN, no web fonts, no MathJax), so it renders
with networking switched off.
"""

from __future__ import annotations

import html as _html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["Section", "render_html", "table_html", "format_table"]

#: Rows of a table shown at most (all rows are in the CSV).
MAX_TABLE_ROWS = 200
#: Height used for figures whose layout does not fix one.
DEFAULT_FIGURE_HEIGHT = "460px"
_FIG_CONFIG = {"displaylogo": False, "responsive": True}

_CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; background: #fafafa; color: #1f2328;
  font: 15px/1.5 Helvetica, Arial, "Liberation Sans", system-ui, sans-serif; }
main { max-width: 1200px; margin: 0 auto; padding: 24px 20px 40px; }
h1 { font-size: 1.6em; margin: 0 0 16px; }
h2 { font-size: 1.2em; margin: 0 0 12px; border-bottom: 1px solid #e5e7eb; padding-bottom: 4px; }
section { background: #fff; border: 1px solid #e5e7eb; border-radius: 6px;
  padding: 16px 20px; margin: 0 0 20px; min-width: 0; }
figure.pp-figure { margin: 8px 0 22px; }
figure.pp-figure figcaption { color: #4b5563; font-size: 13px; margin: 4px 8px 0; }
.pp-table-wrap { overflow-x: auto; max-width: 100%; margin: 6px 0 10px; }
table.pp-table { border-collapse: collapse; font-size: 13px; max-width: 100%;
  font-variant-numeric: tabular-nums; }
table.pp-table th, table.pp-table td { border-bottom: 1px solid #e5e7eb;
  padding: 3px 8px; text-align: right; vertical-align: top; }
table.pp-table td { white-space: nowrap; }
table.pp-table td.pp-text { white-space: normal; text-align: left; overflow-wrap: break-word; }
table.pp-table th { white-space: normal; overflow-wrap: normal; min-width: 3em; }
table.pp-table thead th { background: #f3f4f6; border-bottom: 2px solid #d1d5db; }
table.pp-table tbody tr:nth-child(even) { background: #fafafa; }
details.pp-more > summary { cursor: pointer; color: #0b5cad; font-size: 13px; margin: 4px 0; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; font-size: 13px; }
footer { max-width: 1200px; margin: 0 auto; padding: 0 20px 24px; color: #6b7280; font-size: 12px; }
footer dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; margin: 0; }
footer dt { font-weight: 600; }
footer dd { margin: 0; word-break: break-all; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; overflow-wrap: anywhere; }
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


def _index_is_data(df: pd.DataFrame) -> bool:
    """A named index (from a pivot or groupby) carries data; an unnamed one is row numbers, even after filtering."""
    return any(n is not None for n in df.index.names)


def _figure_html(fig: Any, div_id: str) -> str:
    from posprobe.report import style

    if not style.is_styled(fig):  # figures from user page modules get the same theme
        style.style(fig)
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
    cap = style.get_caption(fig)
    figcaption = f'<figcaption id="caption-{div_id}">{_esc(cap)}</figcaption>' if cap else ""
    return f'<figure class="pp-figure">{body}{figcaption}</figure>'


#: Tables longer than this show their first rows, the rest behind a "show all" toggle.
COLLAPSE_ROWS = 20
#: Columns whose floats are p-values (shown with 3 significant digits).
_P_COLUMNS = {"mcnemar_p", "p", "p_value"}


def _is_listlike(v: Any) -> bool:
    return isinstance(v, (list, tuple, set, dict)) or type(v).__name__ == "ndarray"


def _cell_text(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={x}" for k, x in v.items())
    if _is_listlike(v):
        return ", ".join(str(x) for x in list(v))
    return str(v)


def _float_formatter(col: Any, values: pd.Series) -> Any:
    """One format for a float column, chosen from its magnitude (so a column reads evenly)."""
    import math

    finite = values[pd.notna(values)].astype(float)
    finite = finite[finite.map(math.isfinite)]
    big = float(finite.abs().max()) if len(finite) else 0.0
    if str(col).split(" ")[-1] in _P_COLUMNS or str(col) in _P_COLUMNS:
        return lambda x: f"{x:.3g}"
    if finite.map(lambda x: float(x).is_integer()).all() and big < 1e15:
        return lambda x: f"{x:.0f}"
    nonzero = finite[finite != 0].abs()
    if len(nonzero) and (float(nonzero.max()) < 1e-3 or big >= 1e6):
        return lambda x: f"{x:.2e}"
    decimals = 4 if big < 1 else max(0, min(4, 3 - int(math.floor(math.log10(big)))))
    return lambda x: f"{x:.{decimals}f}"


def format_table(df: pd.DataFrame) -> pd.DataFrame:
    """A display copy of `df`: index turned into columns (a RangeIndex dropped), headers in words,
    floats rounded per column, booleans as yes/no, lists as text; every cell a string."""
    from posprobe.report.style import header

    out = df.copy()
    if isinstance(out.columns, pd.MultiIndex):
        out.columns = [" ".join(str(c) for c in col if str(c) != "") for col in out.columns]
    out = out.reset_index(drop=not _index_is_data(out))
    cols: dict[str, pd.Series] = {}
    for col in out.columns:
        s = out[col]
        if pd.api.types.is_bool_dtype(s):
            text = s.map(lambda x: "yes" if x else "no")
        elif pd.api.types.is_float_dtype(s):
            f = _float_formatter(col, s)
            text = s.map(lambda x, f=f: "" if pd.isna(x) else ("inf" if x == float("inf") else
                                                                ("-inf" if x == float("-inf") else f(x))))
        elif pd.api.types.is_integer_dtype(s):
            text = s.map(lambda x: "" if pd.isna(x) else str(int(x)))
        else:
            text = s.map(lambda x: "" if (not _is_listlike(x) and pd.isna(x)) else _cell_text(x))
        cols[header(col)] = text.astype(str)
    return pd.DataFrame(cols)


def _text_columns(df: pd.DataFrame) -> set[int]:
    """Positions of columns holding free text (left-aligned, may wrap)."""
    out = set()
    for i, col in enumerate(df.columns):
        s = df[col]
        if not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s)):
            sample = s.dropna().astype(str).head(50)
            if len(sample) and not sample.str.fullmatch(r"[-+]?[0-9.,eE+\-]*").all():
                out.add(i)
    return out


def _raw_names(df: pd.DataFrame) -> list[str]:
    flat = df.copy()
    if isinstance(flat.columns, pd.MultiIndex):
        flat.columns = ["_".join(str(c) for c in col if str(c) != "") for col in flat.columns]
    return [str(c) for c in flat.reset_index(drop=not _index_is_data(flat)).columns]


def _table_tag(df: pd.DataFrame, text_cols: set[int], raw: list[str]) -> str:
    # The data column's own name rides along as a tooltip: it is what the CSV/parquet files call it.
    head = "".join(f'<th title="{_esc(r)}">{_esc(c)}</th>' for c, r in zip(df.columns, raw))
    rows = []
    for row in df.itertuples(index=False):
        cells = "".join(f'<td class="pp-text">{_esc(v)}</td>' if i in text_cols else f"<td>{_esc(v)}</td>"
                        for i, v in enumerate(row))
        rows.append(f"<tr>{cells}</tr>")
    return (f'<table class="pp-table"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>')


def table_html(df: pd.DataFrame, *, max_rows: int = MAX_TABLE_ROWS, collapse: int = COLLAPSE_ROWS) -> str:
    """A DataFrame as a report table: no pandas index, headers in words, floats rounded per column,
    lists as text. Longer than `collapse` rows: the first rows, then all (up to `max_rows`) behind a toggle."""
    shown = format_table(df.head(max_rows))
    raw = _raw_names(df.head(0))
    text_cols = _text_columns(df.reset_index(drop=not _index_is_data(df)).head(max_rows))
    more = f" (first {max_rows} of {len(df)}; all rows in the CSV)" if len(df) > max_rows else ""
    if len(shown) <= collapse:
        return f'<div class="pp-table-wrap">{_table_tag(shown, text_cols, raw)}</div>'
    return (f'<div class="pp-table-wrap">{_table_tag(shown.head(collapse // 2), text_cols, raw)}</div>'
            f'<details class="pp-more"><summary>Show all {min(len(df), max_rows)} rows{more}</summary>'
            f'<div class="pp-table-wrap">{_table_tag(shown, text_cols, raw)}</div></details>')


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


#: The file name of the one plotly.js a folder of reports shares (see `render_html(plotly_src=...)`).
PLOTLY_JS = "plotly.min.js"


#: Shown in place of blank figures when a page that loads plotly.js from its folder is opened without it (a
#: report.html copied out of its folder): the page says what is missing instead of rendering empty boxes.
_MISSING_PLOTLY_JS = (
    '<script>document.addEventListener("DOMContentLoaded", function () {'
    ' if (window.Plotly) return; var p = document.createElement("p"); p.id = "pp-missing-plotly";'
    ' p.setAttribute("style", "background:#fff3cd;border:1px solid #e0c060;padding:8px");'
    ' p.textContent = "The figures are not shown: this page loads plotly.js from SRC in its own folder, which is '
    'not beside it here. Open the report inside the folder posprobe wrote (copy the whole folder, not report.html '
    'alone).";'
    ' var m = document.querySelector("main") || document.body; m.insertBefore(p, m.firstChild); });</script>')


def write_plotlyjs(path: str) -> None:
    """Write the installed plotly.js (the same code the self-contained reports inline) to `path`."""
    from plotly.offline import get_plotlyjs

    Path(path).write_text(get_plotlyjs(), encoding="utf-8")


def render_html(title: str, sections: list[Section], meta: dict | None = None, *,
                plotly_src: str | None = None) -> str:
    """Render a complete HTML page: self-contained (plotly.js inlined once), or, with `plotly_src`, loading plotly.js
    from that relative path (a folder of several reports shares one local copy: still offline).

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

    if plotly_src is not None:
        script = (f'<script type="text/javascript" src="{_esc(plotly_src)}" charset="utf-8"></script>'
                  + _MISSING_PLOTLY_JS.replace("SRC", _esc(plotly_src)))
    else:
        plotlyjs = get_plotlyjs()
        if "</script" in plotlyjs.lower():  # would terminate the inline script early
            plotlyjs = plotlyjs.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")
        script = f'<script type="text/javascript">{plotlyjs}</script>'

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
            script,
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
