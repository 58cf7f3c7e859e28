"""Report page of the key-squishing study (`squish-study`): adherence per instruction and condition with intervals,
persistence over distance, what the conditions change beyond adherence (KL from no instruction, attention on the
instruction, reference-answer loss, acknowledgement), and the summary in words. Built from tables and meta only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, caption, style


def title(result: Any) -> str:
    """Report title."""
    return f"Key-squishing study: {result.meta['model']['name']}"


def figure_caption(meta: dict | None, note: str | None = None) -> str:
    """Caption: model, questions, placements, distances, conditions, answer length."""
    m = meta or {}
    cfg = m.get("config") or {}
    return caption(m, {"questions": (m.get("data") or {}).get("n_items"), "placements": cfg.get("placements"),
                       "filler turns": cfg.get("distances"), "conditions": cfg.get("conditions"),
                       "answer tokens": cfg.get("max_new_tokens")}, note=note)


def pooled(result: Any, concerned: bool = True) -> pd.DataFrame:
    """Adherence (0..1) per condition and distance pooled over instructions and placements, with a 95 % Wilson
    interval over the pooled answers, and the means of the other measures; over the questions each instruction
    concerns (`concerned=False`: the others, where adherence is a topic instruction's leak)."""
    from posprobe.core.stats import wilson_ci

    df = result.tables["squish_adherence"]
    df = df[df.concerned == concerned] if "concerned" in df else df
    rows = []
    for (cond, dist), part in df.groupby(["condition", "distance"], sort=False):
        k, n = float((part.adherence * part.n).sum()), int(part.n.sum())
        lo, hi = wilson_ci(int(round(k)), n)
        w = part.n / n
        rows.append(dict(condition=cond, distance=int(dist), n=n, adherence=k / n, ci_low=lo, ci_high=hi,
                         acknowledged=float((part.acknowledged * w).sum()), kl_first=float((part.kl_first * w).sum()),
                         ref_nll=float((part.ref_nll * w).sum()),
                         span_attention=float((part.span_attention * w).sum()),
                         distance_tokens=float(part.distance_tokens.mean())))
    return pd.DataFrame(rows)


def _order(df: pd.DataFrame, meta: dict) -> list[str]:
    conds = list((meta.get("config") or {}).get("conditions") or df.condition.unique())
    return [c for c in conds if c in set(df.condition)]


def figures(result: Any) -> list:
    """Adherence per instruction x condition (bars with intervals, first distance); persistence: pooled adherence vs
    distance per condition; KL from no instruction vs adherence per condition."""
    import plotly.graph_objects as go

    m = result.meta
    df = result.tables["squish_adherence"]
    conds = _order(df, m)
    out = []
    if "concerned" in df:
        df = df[df.concerned]
    first = df[df.distance == df.distance.min()]
    fig = go.Figure()
    for i, c in enumerate(conds):
        part = first[first.condition == c].groupby("instruction", sort=False).agg(
            adherence=("adherence", "mean"), ci_low=("ci_low", "min"), ci_high=("ci_high", "max")).reset_index()
        fig.add_trace(go.Bar(x=part.instruction, y=part.adherence, name=c, marker_color=COLORS[i % len(COLORS)],
                             error_y=dict(type="data", symmetric=False, array=part.ci_high - part.adherence,
                                          arrayminus=part.adherence - part.ci_low)))
    fig.update_layout(barmode="group", title=f"Adherence per instruction ({int(first.distance.min())} filler turns)",
                      yaxis_title="answers following the instruction", yaxis_range=[0, 1.02])
    out.append(style(fig, caption=figure_caption(m, "Bars: 95% Wilson intervals over questions; 'none' is the "
                                                    "no-instruction answers scored by each checker (chance).")))
    pool = pooled(result)
    if pool.distance.nunique() > 1:
        fig = go.Figure()
        for i, c in enumerate(conds):
            part = pool[pool.condition == c].sort_values("distance")
            fig.add_trace(go.Scatter(x=part.distance, y=part.adherence, name=c,
                                     mode="lines+markers" if len(part) >= 3 else "markers",
                                     marker=dict(size=9, color=COLORS[i % len(COLORS)]),
                                     error_y=dict(type="data", symmetric=False, array=part.ci_high - part.adherence,
                                                  arrayminus=part.adherence - part.ci_low)))
        fig.update_layout(title="Persistence: adherence vs distance from the instruction",
                          xaxis_title="filler turns between instruction and question",
                          yaxis_title="answers following (all instructions)", yaxis_range=[0, 1.02])
        out.append(style(fig, caption=figure_caption(m)))
    fig = go.Figure()
    for i, c in enumerate(x for x in conds if x != "none"):
        part = pool[pool.condition == c]
        fig.add_trace(go.Scatter(x=part.kl_first, y=part.adherence, name=c, mode="markers",
                                 text=[f"{d} turns" for d in part.distance],
                                 marker=dict(size=11, color=COLORS[i % len(COLORS)])))
    fig.update_layout(title="How much the instruction changes vs how much it is followed",
                      xaxis_title="KL(no instruction || condition), first answer token (nats)",
                      yaxis_title="answers following (all instructions)")
    out.append(style(fig, caption=figure_caption(m, "A fine-tune-like effect moves every answer (KL) whether or not "
                                                    "it follows; a conversational instruction moves the answers it "
                                                    "governs.")))
    return out


def _fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def _normal(df: pd.DataFrame, r: Any) -> float:
    """The normal condition's adherence in the cell of row `r` (same placement, distance, instruction, questions)."""
    m = df[(df.condition == "normal") & (df.placement == r.placement) & (df.distance == r.distance)
           & (df.instruction == r.instruction) & (df.concerned == r.concerned)]
    return float(m.adherence.iloc[0]) if len(m) else float("nan")


def summary_text(result: Any) -> str:
    """The study in words: per condition, pooled adherence with its interval against normal positions, per distance;
    the instructions where a squished condition differs from normal at p < 0.05 (exact McNemar); KL, attention and
    acknowledgement means."""
    m = result.meta
    pool = pooled(result)
    df = result.tables["squish_adherence"]
    lines = []
    for dist, part in pool.groupby("distance", sort=True):
        tok = part.distance_tokens.dropna()
        where = f"{int(dist)} filler turns" + (f" (~{tok.mean():.0f} tokens)" if len(tok) and dist else "")
        cells = [f"{r.condition} {r.adherence:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}]" for r in part.itertuples()]
        lines.append(f"{where}: adherence " + ", ".join(cells) + f" (n = {int(part.n.iloc[0])} answers each)")
    sig = df[(df.p_vs_normal < 0.05)]
    # With several placements the same instruction x condition x distance appears once per placement: name it.
    several = df.placement.nunique() > 1

    def where(r: Any) -> str:
        tags = ([r.placement] if several else []) + ([] if getattr(r, "concerned", True) else ["leak"])
        return f" ({', '.join(tags)})" if tags else ""

    if len(sig):
        lines.append("differs from normal positions at p < 0.05 (exact McNemar, same questions): " + "; ".join(
            f"{r.instruction} {r.condition}{where(r)} at {int(r.distance)} turns ({r.adherence:.2f} vs "
            f"{_normal(df, r):.2f} normal, p = {r.p_vs_normal:.3f})" for r in sig.itertuples()))
    else:
        lines.append("no instruction x condition cell differs from normal positions at p < 0.05 (exact McNemar)")
    leak = pooled(result, concerned=False)
    if len(leak):
        lines.append("questions a topic instruction does not concern (its behaviour there is a leak): " + ", ".join(
            f"{r.condition} at {int(r.distance)} turns {r.adherence:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}] "
            f"(KL from no instruction {_fmt(r.kl_first, 3)} nats, n = {r.n})" for r in leak.itertuples()))
    other = pool[pool.condition != "none"].groupby("condition", sort=False).agg(
        kl=("kl_first", "mean"), attn=("span_attention", "mean"), ack=("acknowledged", "mean"),
        ref=("ref_nll", "mean"))
    lines.append("means over distances: " + "; ".join(
        f"{c}: KL from no instruction {_fmt(r.kl, 3)} nats, attention on the instruction {_fmt(r.attn, 3)}, "
        f"acknowledged {_fmt(r.ack)}, reference loss {_fmt(r.ref, 3)} nats/token" for c, r in other.iterrows()))
    lines.append(f"instructions: {', '.join(m.get('instructions') or [])}")
    return "\n".join(lines)


def sections(result: Any) -> list[Section]:
    """Summary, the pooled table, the per-cell table, and example answers per condition."""
    m = result.meta
    answers = result.tables["squish_answers"]
    out = [Section("Summary", html="".join(f"<p>{html.escape(x)}</p>" for x in summary_text(result).split("\n")))]
    out.append(Section("Adherence pooled over instructions", table=pooled(result)))
    out.append(Section("Adherence per instruction, condition and distance", table=result.tables["squish_adherence"]))
    ex = answers[answers.question == answers.question.min()]
    ex = ex[["placement", "distance", "instruction", "condition", "followed", "answer"]]
    out.append(Section("The first question's answers", html=table_html(ex)))
    meas = m.get("measures") or {}
    out.append(Section("Measures", html="<ul>" + "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>"
                                                        for k, v in meas.items()) + "</ul>"))
    return out
