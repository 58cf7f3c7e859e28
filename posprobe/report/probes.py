"""Figures and report page of the position probes, built from the `probes` table and meta only."""

from __future__ import annotations

import html
from typing import Any

from posprobe.analyses.probes import POINTS, summarize
from posprobe.report.html import Section, table_html


def title(result: Any) -> str:
    """Report title."""
    return f"Position probes: {result.meta['model']['name']}"


def figures(result: Any) -> list:
    """MAE and bucket accuracy by layer (probe, control, chance)."""
    return probe_figures(result.tables["probes"])


def sections(result: Any) -> list[Section]:
    """Summary (data, folds, control, per point/layer means and stds) and the figures."""
    m = result.meta
    s = summarize(result.tables["probes"])
    table = s.pivot_table(index=["point", "layer"], columns=["metric", "condition"], values=["mean", "std"]).round(3)
    summary = (f"<p>{m['n_rows']} rows of {m['n_pos']} tokens from {html.escape(str(m['data']['source']))}; "
               f"{m['n_tokens']} sampled tokens; {m['config']['n_splits']}-fold GroupKFold by row. Control: training "
               "positions shuffled within each row. Chance: predict the training mean / majority bucket.</p>")
    return [Section("Summary", html=summary + table_html(table)), Section("Figures", figures=figures(result))]


def probe_figures(df: pd.DataFrame) -> list:
    """Plotly figures from a probe df: MAE and accuracy by layer (probe, control, chance; bars = fold std)."""
    import plotly.graph_objects as go

    s = summarize(df)
    order = {p: i for i, p in enumerate(POINTS)}
    s = s.assign(x=s.layer + s.point.map(order).fillna(0) / len(POINTS)).sort_values("x")
    figs = []
    for metric, title in (("mae", "Held-out MAE (positions)"), ("accuracy", "Held-out bucket accuracy")):
        fig = go.Figure()
        sub = s[s.metric == metric]
        # Chance depends only on the labels, identical for every point: one trace is enough.
        sub = sub[(sub.condition != "chance") | (sub.point == sub.point.iloc[0])]
        for (point, condition), g in sub.groupby(["point", "condition"], sort=False):
            fig.add_trace(go.Scatter(x=g.x, y=g["mean"], error_y=dict(type="data", array=g["std"]),
                                     mode="lines+markers", name="chance" if condition == "chance" else f"{condition} ({point})",
                                     line=dict(dash={"probe": "solid", "control": "dash"}.get(condition, "dot"))))
        fig.update_layout(title=f"{title} by layer (resid_pre at L, resid_mid at L+1/3, resid_post at L+2/3)",
                          xaxis_title="layer", yaxis_title=metric)
        figs.append(fig)
    return figs
