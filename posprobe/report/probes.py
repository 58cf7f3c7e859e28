"""Figures and report page of the position probes, built from the `probes` table and meta only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.compare import compare_caption, layer_name, line_figure, member_order, refused_text, table
from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, REFERENCE_COLOR, caption, style


def fold_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over folds per (model, point, layer, condition, metric) of a `probes` table, plus the
    fold count (`n_folds`)."""
    keys = ["model", "point", "layer", "condition", "metric"]
    g = df.groupby(keys, sort=False)["value"]
    return pd.concat([g.mean().rename("mean"), g.std(ddof=0).rename("std"), g.size().rename("n_folds")],
                     axis=1).reset_index()


def title(result: Any) -> str:
    """Report title."""
    return f"Position probes: {result.meta['model']['name']}"


def figures(result: Any) -> list:
    """MAE and bucket accuracy by layer (probe, control, chance)."""
    return probe_figures(result.tables["probes"], result.meta)


def figure_caption(meta: dict | None) -> str:
    """Caption of a probe figure: model, data, tokens, folds, probe and control."""
    m = meta or {}
    cfg = m.get("config") or {}
    opts = {"tokens sampled": m.get("n_tokens"), "positions": m.get("n_pos"),
            "folds": f"{cfg['n_splits']} (GroupKFold by row)" if cfg.get("n_splits") else None,
            "classifier": cfg.get("classifier"), "buckets": cfg.get("n_buckets")}
    return caption(m, opts, note="Error bars: std over folds. Control: positions shuffled within each row; "
                                 "chance: training mean / majority bucket.")


def sections(result: Any) -> list[Section]:
    """Summary (data, folds, control, per point/layer means and stds) and the figures."""
    m = result.meta
    s = fold_summary(result.tables["probes"])
    table = s.pivot_table(index=["point", "layer"], columns=["metric", "condition"], values=["mean", "std"])
    table.columns = [f"{metric} {cond} ({stat})" for stat, metric, cond in table.columns]
    summary = (f"<p>{m['n_rows']} rows of {m['n_pos']} tokens from {html.escape(str(m['data']['source']))}; "
               f"{m['n_tokens']} sampled tokens; {m['config']['n_splits']}-fold GroupKFold by row. Control: training "
               "positions shuffled within each row. Chance: predict the training mean / majority bucket.</p>")
    return [Section("Summary", html=summary + table_html(table)), Section("Figures", figures=figures(result))]


def layer_axis_title(points: list[str]) -> str:
    """The x-axis title of a probe figure that plots `points` (in this order) at layer L + i / len(points): only the
    points it plots, each at its own offset."""
    from fractions import Fraction

    if len(points) == 1:
        return f"layer ({points[0]})"
    at = [p + (" at L" if i == 0 else f" at L+{Fraction(i, len(points))}") for i, p in enumerate(points)]
    return f"layer ({', '.join(at)})"


def probe_figures(df: pd.DataFrame, meta: dict | None = None) -> list:
    """Plotly figures from a probe df: MAE and accuracy by layer (probe, control, chance; bars = fold std)."""
    import plotly.graph_objects as go

    s = fold_summary(df)
    points = list(dict.fromkeys(s.point))  # in the order the probes ran them (resid_pre, resid_mid, resid_post)
    order = {p: i for i, p in enumerate(points)}
    s = s.assign(x=s.layer + s.point.map(order).fillna(0) / len(points)).sort_values("x")
    xaxis = layer_axis_title(points)
    figs = []
    for metric, title in (("mae", "Held-out MAE (positions)"), ("accuracy", "Held-out bucket accuracy")):
        fig = go.Figure()
        sub = s[s.metric == metric]
        # Chance depends only on the labels, identical for every point: one trace is enough.
        sub = sub[(sub.condition != "chance") | (sub.point == sub.point.iloc[0])]
        points = list(dict.fromkeys(sub.point))
        for (point, condition), g in sub.groupby(["point", "condition"], sort=False):
            color = REFERENCE_COLOR if condition == "chance" else COLORS[points.index(point) % len(COLORS)]
            fig.add_trace(
                go.Scatter(
                    x=g.x,
                    y=g["mean"],
                    error_y=dict(type="data", array=g["std"]),
                    mode="lines+markers",
                    name="chance" if condition == "chance" else f"{condition} ({point})",
                    line=dict(color=color, dash={"probe": "solid", "control": "dash"}.get(condition, "dot")),
                )
            )
        fig.update_layout(
            title=f"{title} by layer",
            xaxis_title=xaxis,
            yaxis_title="mean absolute error (positions)" if metric == "mae" else "bucket accuracy",
        )
        if metric == "accuracy":
            fig.update_yaxes(range=[0, 1.02])
        else:
            fig.update_yaxes(rangemode="tozero")
        figs.append(style(fig, caption=figure_caption(meta)))
    return figs


def atlas_paragraph(result: Any, n: Any) -> str:
    """The atlas's probes section in words: the position error after the first and last block against the
    shuffled-label control and chance."""
    first, last, ctrl, chance = (n(k) for k in ("mae_first_layer", "mae_last_layer", "mae_control", "mae_chance"))
    return (f"A linear probe recovers a token's absolute position from the residual stream with a mean absolute "
            f"error of {first:.1f} positions after the first block and {last:.1f} after the last, against "
            f"{ctrl:.1f} for the shuffled-label control and {chance:.1f} for predicting the mean.")


# --- the atlas over many models: this analysis's models side by side -----------------------------------------

def compare_section(result: Any) -> Section | None:
    """The atlas over many models' probe section: position-probe error per layer, one line per member, chance
    dashed. None where no model measured it."""
    p = table(result, "probes")
    if not len(p):
        return None
    order = member_order(result)
    mae = p[p.metric == "mae"]
    probe, chance = mae[mae.condition == "probe"], mae[mae.condition == "chance"]
    chance_level = float(chance.value.mean()) if len(chance) else float("nan")
    control = mae[mae.condition == "control"]
    sentences = []
    for m in [m for m in order if m in set(probe.member)]:
        g = probe[probe.member == m].groupby("layer").value.mean().sort_index()
        best = g.idxmin()
        sentences.append(f"{m} {g.iloc[0]:.1f} {layer_name(int(g.index[0]))}, {g.iloc[-1]:.1f} after layer "
                         f"{int(g.index[-1])} (lowest {g.min():.1f} {layer_name(int(best))})")
    fig = line_figure(probe, "layer", "value", order, "Absolute position recovered from the residual stream",
                       "layer (residual stream after it; -1 = the embedding)", "probe mean absolute error (positions)",
                       compare_caption(result, "Ridge probe, grouped cross-validation over windows; dashed: chance."))
    if chance_level == chance_level:
        fig.add_hline(y=chance_level, line=dict(color=REFERENCE_COLOR, dash="dash", width=1.5))
    text = (f"Mean absolute error (positions) of a linear probe for the token's position, chance {chance_level:.1f}, "
            f"shuffled-label control {control.value.mean():.1f}: " + "; ".join(sentences) + ". Haviv et al. (2022): "
            "a causal model without positions still learns absolute position (from the causal mask), within its "
            "first layers." + refused_text(result, "probes"))
    return Section("Position probes per layer", html=f"<p>{text}</p>", figures=[fig])
