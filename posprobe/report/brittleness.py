"""Report page of key-position brittleness by distance (`brittleness`): the loss increase over sigma 0 per bucket and
sigma, as a table and one curve per bucket. Built from the tables and meta only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, caption, style


def figure_brittleness(summary: pd.DataFrame, meta: dict | None = None) -> Any:
    """Plotly figure: loss increase over sigma 0 (nats/token) vs noise sigma (tokens), one line per bucket, with the
    bootstrap interval as error bars (from a `brittleness_summary` table)."""
    import plotly.express as px

    df = summary.copy()
    df["up"] = df.ci_high - df.delta_nll
    df["down"] = df.delta_nll - df.ci_low
    fig = px.line(df, x="sigma", y="delta_nll", color="bucket", markers=True, error_y="up", error_y_minus="down",
                  title="Loss increase vs key-position noise, by distance bucket",
                  labels={"sigma": "noise sigma on the jittered keys' positions (tokens)",
                          "delta_nll": "loss increase over sigma 0 (nats/token)", "bucket": "bucket"},
                  color_discrete_sequence=list(COLORS))
    m = meta or {}
    cfg = m.get("config") or {}
    note = "Error bars: 95% percentile bootstrap over windows."
    return style(fig, caption=caption(m, {"window": cfg.get("window"), "buckets": cfg.get("buckets")}, note=note))


def title(result: Any) -> str:
    """Report title."""
    return f"Key-position brittleness by distance: {result.meta['model']['name']}"


def figures(result: Any) -> list:
    """The loss-increase curves (one line per bucket)."""
    return [figure_brittleness(result.tables["brittleness_summary"], result.meta)]


def sections(result: Any) -> list[Section]:
    """What was measured, the bucket x sigma table of loss increases, and the figure."""
    m = result.meta
    s = result.tables["brittleness_summary"]
    grid = s.pivot_table(index="bucket", columns="sigma", values="delta_nll", sort=False).reset_index()
    grid.columns = ["bucket", *(f"sigma {c:g}" for c in grid.columns[1:])]
    base = float(s[s.sigma == 0].nll.mean())
    intro = (f"<p>{m['data']['n_items']} window(s) of {', '.join(map(str, m.get('window_lengths', [])))} tokens from "
             f"{html.escape(str(m['data']['source']))}. Within each bucket the keys' positions move by Gaussian noise "
             f"(per key, tokens); every other pair keeps its relative position. Loss at sigma 0: {base:.4f} "
             "nats/token. Below: loss increase over sigma 0 (nats/token).</p>")
    return [Section("Summary", html=intro + table_html(grid)), Section("Figures", figures=figures(result)),
            Section("Summary table", table=s)]
