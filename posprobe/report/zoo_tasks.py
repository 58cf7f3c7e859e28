"""Report page of the task zoo (`zoo-tasks`): exact-answer accuracy vs instance length per task, one line per member
(mean over seeds, bars the lowest and highest seed), the training length L marked; in-distribution and
past-L accuracy per member and task; Kazemnejad et al.'s mean reciprocal rank over the lengths past L. Tables and
meta only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, REFERENCE_COLOR, caption, style


def title(result: Any) -> str:
    """Report title."""
    return "Task zoo: length generalisation on copy, reverse, addition and sorting"


def _members(result: Any) -> list[str]:
    return list(dict.fromkeys(result.tables["members"]["member"]))


def accuracy_table(result: Any) -> pd.DataFrame:
    """Member x task: accuracy on lengths 1..L ("in (n <= L)") and L+1..test_factor x L ("past L"), mean over lengths
    and seeds, each beside its seeds' range ("in seeds", "past L seeds": lowest–highest seed's mean over the lengths):
    with two seeds a mean can hide seeds that disagree (0.35 and 0.98 read as 0.67)."""
    a = result.tables["accuracy"]
    per_seed = a.groupby(["member", "task", "in_training", "seed"], sort=False).accuracy.mean().reset_index()
    g = per_seed.groupby(["member", "task", "in_training"], sort=False).accuracy
    s = pd.concat([g.mean().rename("mean"), g.min().rename("low"), g.max().rename("high")], axis=1).reset_index()
    rows = []
    for (m, task), part in s.groupby(["member", "task"], sort=False):
        row: dict[str, Any] = {"member": m, "task": task, "in (n <= L)": None}
        for label, seeds, cells in (("in (n <= L)", "in seeds", part[part.in_training]),
                                    ("past L", "past L seeds", part[~part.in_training])):
            if len(cells):
                c = cells.iloc[0]
                row[label] = float(c["mean"])
                row[seeds] = f"{c['low']:.2f}–{c['high']:.2f}"
        rows.append(row)
    return pd.DataFrame(rows).round(3)


def mean_reciprocal_rank(result: Any) -> pd.Series:
    """Per member: the mean over (task, length past L) of 1 / rank of its seed-mean accuracy among the members
    (rank 1 = best; tied members share the mean of their ranks) — Kazemnejad et al.'s summary across tasks. Cells
    where every member scores the same (all 0 far past L) rank nothing and are left out; empty if none is left."""
    a = result.tables["accuracy"]
    past = a[~a.in_training].groupby(["task", "n", "member"]).accuracy.mean().reset_index()
    spread = past.groupby(["task", "n"]).accuracy.transform(lambda v: v.max() - v.min())
    past = past[spread > 0].copy()
    past["rank"] = past.groupby(["task", "n"]).accuracy.rank(ascending=False, method="average")
    return (1 / past["rank"]).groupby(past["member"]).mean().sort_values(ascending=False)


def figures(result: Any) -> list:
    """Per task: accuracy vs instance length, one line per member, L dashed."""
    import plotly.graph_objects as go

    a = result.tables["accuracy"]
    L = int(result.meta["tasks"]["train_max"])
    cap = caption(result.meta, {"L": L, "steps": (result.meta.get("config") or {}).get("steps")},
                  note="Exact greedy answers; lines: mean over seeds, bars: lowest and highest seed.")
    out = []
    for task in dict.fromkeys(a["task"]):
        fig = go.Figure()
        part = a[a.task == task].groupby(["member", "n"]).accuracy.agg(["mean", "min", "max"]).reset_index()
        for i, m in enumerate(x for x in _members(result) if x in set(part.member)):
            line = part[part.member == m].sort_values("n")
            fig.add_trace(go.Scatter(x=line.n, y=line["mean"], name=m, mode="lines+markers",
                                     line=dict(color=COLORS[i % len(COLORS)], dash="solid" if i < len(COLORS) else
                                               "dot"),
                                     error_y=dict(type="data", symmetric=False, array=line["max"] - line["mean"],
                                                  arrayminus=line["mean"] - line["min"])))
        fig.add_vline(x=L + 0.5, line=dict(color=REFERENCE_COLOR, dash="dash", width=1.5))
        fig.update_layout(title=f"{task}: accuracy vs instance length (trained on 1..{L})",
                          xaxis_title="instance length n", yaxis_title="accuracy (exact answer)")
        fig.update_yaxes(range=[-0.02, 1.02])
        out.append(style(fig, caption=cap))
    return out


def summary_text(result: Any) -> str:
    """Which member generalises best past L (mean reciprocal rank) and each task's best in- and past-L accuracy."""
    mrr = mean_reciprocal_rank(result)
    t = accuracy_table(result)
    parts = []
    for task, g in t.groupby("task", sort=False):
        best_in = g.loc[g["in (n <= L)"].idxmax()]
        text = f"{task}: best in distribution {best_in.member} {best_in['in (n <= L)']:.2f}"
        if "past L" in g and g["past L"].notna().any():
            best = g.loc[g["past L"].idxmax()]
            text += (f", best past L {best.member} {best['past L']:.2f}" if best["past L"] > 0
                     else ", no member answers any instance past L")
        parts.append(text)
    ranks = (", ".join(f"{m} {v:.2f}" for m, v in mrr.items()) if len(mrr)
             else "not measurable (every member scores the same at every length past L)")
    return ("Mean reciprocal rank over the lengths past L where the members differ (Kazemnejad et al.: NoPE 0.69, "
            "T5 bias 0.55, ALiBi 0.50, rotary 0.33, absolute 0.22): " + ranks + ". " + "; ".join(parts) + ".")


def sections(result: Any) -> list[Section]:
    """Summary, accuracy table, per-task figures, members."""
    m = result.meta
    t = m["tasks"]
    intro = (f"<p>Every member trained on a mixture of {html.escape(', '.join(t['tasks']))} at instance lengths "
             f"1..{t['train_max']} ({(m.get('config') or {}).get('steps')} steps), then {t['test_count']} test "
             f"instances per task and length up to {int(t['test_factor'] * t['train_max'])}; an answer counts when "
             f"greedy decoding reproduces it exactly. Every member has {m.get('context')} positions (rows of a "
             "learned table past the training sequences are never trained).</p>")
    out = [Section("Summary", html=intro + f"<p>{html.escape(summary_text(result))}</p>"
                   + table_html(accuracy_table(result))),
           Section("Accuracy vs instance length", figures=figures(result)),
           Section("Members", table=result.tables["members"])]
    return out
