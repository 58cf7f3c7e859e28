"""Figures, console table and saved outputs of a shift test (built from the result's tables only)."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.analyses.shift import ppl_by_k


def accuracy_figure(summary: pd.DataFrame) -> Any:
    """Pair accuracy vs k with 95% bootstrap CIs, one line per field plus overall."""
    import plotly.graph_objects as go

    fig = go.Figure()
    sub = summary[summary.level.isin(["overall", "field"])]
    for group, g in sub.groupby("group", sort=False):
        g = g.sort_values("k")
        fig.add_trace(go.Scatter(
            x=g.k, y=g.accuracy, mode="lines+markers", name=str(group),
            line=dict(width=4 if group == "all" else 2),
            error_y=dict(type="data", symmetric=False, array=g.ci_high - g.accuracy, arrayminus=g.accuracy - g.ci_low),
        ))
    fig.update_layout(title="Minimal-pair accuracy vs start position k (95% bootstrap CI)",
                      xaxis_title="k (position of the first token)", yaxis_title="accuracy", yaxis_range=[0, 1.02])
    return fig


def flips_figure(summary: pd.DataFrame) -> Any:
    """Pairs whose judgment changed vs k=0, split by direction, per k."""
    import plotly.graph_objects as go

    g = summary[(summary.level == "overall") & (summary.k > 0)].sort_values("k")
    fig = go.Figure([
        go.Bar(x=g.k.astype(str), y=g.flips_to_wrong, name="correct at k=0, wrong at k"),
        go.Bar(x=g.k.astype(str), y=g.flips_to_correct, name="wrong at k=0, correct at k"),
    ])
    fig.update_layout(barmode="stack", title="Judgment flips vs k=0", xaxis_title="k", yaxis_title="pairs")
    return fig


def perplexity_figures(tokens: pd.DataFrame) -> list[Any]:
    """Perplexity vs k, and mean loss by position inside the window for each k."""
    import plotly.graph_objects as go

    p = ppl_by_k(tokens)
    f1 = go.Figure(go.Scatter(x=p.k, y=p.perplexity, mode="lines+markers", name="perplexity"))
    f1.update_layout(title="Perplexity of text windows vs k", xaxis_title="k", yaxis_title="perplexity")
    f2 = go.Figure()
    for k, g in tokens.groupby("k"):
        m = g.groupby("pos").loss.mean()
        f2.add_trace(go.Scatter(x=m.index, y=m.values, mode="lines", name=f"k={k}"))
    f2.update_layout(title="Per-token loss by position inside the window", xaxis_title="position in window",
                     yaxis_title="mean loss (nats)")
    return [f1, f2]


def drift_figure(drift: pd.DataFrame) -> Any:
    """Encoders: cosine similarity to the k=0 representation, per layer, vs k."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for layer, g in drift.groupby("layer", sort=False):
        fig.add_trace(go.Scatter(x=g.k, y=g.cosine_to_k0, mode="lines+markers", name=str(layer)))
    fig.update_layout(title="Representation drift: cosine to k=0", xaxis_title="k", yaxis_title="cosine similarity")
    return fig


def figures(result: Any) -> list[Any]:
    """All figures for the result's non-empty tables."""
    figs = []
    if len(_table(result, "summary")):
        figs += [accuracy_figure(_table(result, "summary")), flips_figure(_table(result, "summary"))]
    if len(_table(result, "tokens")):
        figs += perplexity_figures(_table(result, "tokens"))
    if len(_table(result, "drift")):
        figs.append(drift_figure(_table(result, "drift")))
    return figs


def console_table(result: Any) -> str:
    """A compact text table: per k accuracy, CI, change, flips, McNemar p, perplexity (or drift)."""
    lines = []
    if len(_table(result, "summary")):
        s = _table(result, "summary")[_table(result, "summary").level == "overall"].sort_values("k")
        ppl = ppl_by_k(_table(result, "tokens")).set_index("k").perplexity if len(_table(result, "tokens")) else {}
        lines.append(f"{'k':>6} {'acc':>7} {'95% CI':>15} {'Δacc':>7} {'flips':>6} {'McNemar p':>10} {'ppl':>9}")
        for r in s.itertuples():
            p = f"{ppl[r.k]:9.2f}" if r.k in ppl else f"{'-':>9}"
            lines.append(f"{r.k:>6} {r.accuracy:7.4f} [{r.ci_low:.3f}, {r.ci_high:.3f}] {r.delta_accuracy:+7.4f} "
                         f"{r.flips:6d} {r.mcnemar_p:10.3g} {p}")
    elif len(_table(result, "tokens")):
        for r in ppl_by_k(_table(result, "tokens")).itertuples():
            lines.append(f"k={r.k:<6} perplexity {r.perplexity:.3f}")
    if len(_table(result, "drift")):
        d = _table(result, "drift")[_table(result, "drift").layer == "pooled"]
        lines += [f"k={r.k:<6} pooled cosine to k=0: {r.cosine_to_k0:.5f}" for r in d.itertuples()]
    if "max_abs_logp_change_vs_k0" in result.meta:
        dev = max(result.meta["max_abs_logp_change_vs_k0"].values())
        lines.append(f"largest |log-prob change| vs k=0: {dev:.3g} nats")
    return "\n".join(lines)


def title(result: Any) -> str:
    """Report title."""
    return f"Shift test: {result.meta['model']['name']}"


def sections(result: Any) -> list:
    """Report sections: summary with the console table, figures, accuracy tables."""
    from posprobe.report.html import Section

    m = result.meta
    model, data = m["model"], m["data"]
    intro = (f"<p>Model <b>{html.escape(str(model['name']))}</b> ({html.escape(model['positional_kind'])} positions, "
             f"context {model['n_ctx']}, backend {model.get('backend')}). Every item starts at position k with no prior "
             f"context. Prefix: <code>{html.escape(str(m['prefix']['tokens']))}</code> ({m['prefix']['kind']}, "
             f"placed {m['prefix']['position']}). Data: {html.escape(str(data.get('source')))}"
             f"{' (posprobe built-in template pairs, not BLiMP)' if data.get('builtin') else ''}, "
             f"{data['n_items']} {data['unit']}.</p>")
    if m.get("note"):
        intro += f"<p><b>Invariance control.</b> {html.escape(m['note'])}</p>"
    intro += f"<pre>{html.escape(console_table(result))}</pre>"
    out = [Section("Summary", html=intro), Section("Figures", figures=figures(result))]
    summary = _table(result, "summary")
    if len(summary):
        out.append(Section("Accuracy by field and k", table=summary[summary.level != "paradigm"]))
        out.append(Section("Accuracy by paradigm and k", table=summary[summary.level == "paradigm"]))
    return out


def _table(result: Any, name: str) -> pd.DataFrame:
    return result.tables.get(f"shift_{name}", pd.DataFrame())
