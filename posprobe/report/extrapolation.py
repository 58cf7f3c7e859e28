"""Report page of length extrapolation (`extrapolation` for one model, `zoo-eval` across a zoo): perplexity vs
evaluation length in the format of Press et al.'s Figure 1 (one line per model, L marked; a learned-position model
stops at its table), the ratio ppl(xL) / ppl(L) and every row that could not run, with why. Tables and meta only."""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from posprobe.report.compare import over_seeds, seeded, table
from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, REFERENCE_COLOR, caption, style


def title(result: Any) -> str:
    """Report title."""
    if result.analysis == "zoo-eval":
        return "Zoo: perplexity past the training length"
    return f"Perplexity past the training length: {result.meta['model']['name']}"


def _curves(df: pd.DataFrame) -> pd.DataFrame:
    # One line per member (its seeds averaged; min/max as the error band) and protocol.
    ok = df[df["status"] == "ok"]
    if ok.empty:
        return ok
    g = ok.groupby(["member", "protocol", "length"], sort=False)
    return g.agg(ppl=("ppl", "mean"), low=("ppl", "min"), high=("ppl", "max"), factor=("factor", "first"),
                 seeds=("model", "nunique")).reset_index()


def figures(result: Any) -> list:
    """Per protocol: perplexity vs evaluation length (log axes), one line per member, the training length dashed."""
    import plotly.graph_objects as go

    df = result.tables["perplexity"]
    curves = _curves(df)
    cap = caption(result.meta, {"protocols": (result.meta.get("config") or {}).get("protocols")},
                  note=("Lines: mean over seeds; bars: lowest and highest seed. " if seeded(result) else "")
                  + "A learned-position model stops at its table's last row.")
    out = []
    for protocol, part in curves.groupby("protocol", sort=False):
        fig = go.Figure()
        for i, (name, line) in enumerate(part.groupby("member", sort=False)):
            line = line.sort_values("length")
            fig.add_trace(go.Scatter(
                x=line["length"], y=line["ppl"], name=str(name), mode="lines+markers",
                line=dict(color=COLORS[i % len(COLORS)], dash="solid" if i < len(COLORS) else "dot"),
                error_y=dict(type="data", symmetric=False, array=line["high"] - line["ppl"],
                             arrayminus=line["ppl"] - line["low"], visible=bool((line["seeds"] > 1).any()))))
        what = ("non-overlapping sequences" if protocol == "chunks"
                else "the same targets with growing context")
        fig.update_layout(title=f"Perplexity vs evaluation length ({protocol}: {what})",
                          xaxis_title="evaluation length (tokens)", yaxis_title="perplexity")
        ticks = sorted(part["length"].unique())
        fig.update_xaxes(type="log", tickvals=ticks, ticktext=[f"{int(t):,}" for t in ticks])
        fig.update_yaxes(type="log")
        # Each training length L once (a zoo has one; other models passed beside it may have their own). On a log
        # axis a shape takes the length itself but an annotation its log10 (plotly): drawn apart, or the label
        # stretches the axis to 10^L.
        for L in sorted(df.loc[(df["status"] == "ok") & (df["factor"] == 1), "length"].unique()):
            fig.add_vline(x=float(L), line=dict(color=REFERENCE_COLOR, dash="dash", width=1.5))
            fig.add_annotation(x=math.log10(float(L)), y=1, yref="paper", text=f"L = {int(L)}", showarrow=False,
                               xanchor="left", font=dict(size=12, color=REFERENCE_COLOR))
        out.append(style(fig, caption=cap))
    return out


def ratio_table(result: Any) -> pd.DataFrame:
    """Wide ratio table: member x (protocol, factor) of ppl(xL) / ppl(L), "cannot run" where it cannot; a member of
    several seeds shows the mean with the lowest and highest seed, "1.29 [1.26–1.32]"; "refused" for every cell of a
    member that was not measured (every member given is a row)."""
    r = result.tables.get("ratios")
    if r is None:
        df = result.tables["perplexity"]
        r = df.assign(member=df["model"])
    r = r.copy()
    measured = r[r["status"].isin(["ok", "cannot run"])]
    cells = [_ratio_cell(row) for row in measured.to_dict("records")]
    wide = measured.assign(cell=cells).pivot_table(index="member", columns=["protocol", "factor"], values="cell",
                                                   aggfunc="first", sort=False)
    wide.columns = [f"{p} {f:g}L" for p, f in wide.columns]
    # Members with no measured row (refused, failed) keep a row, "refused" in every cell, in the members' order.
    order = list(dict.fromkeys(r["member"]))
    missing = [m for m in order if m not in wide.index]
    wide = wide.reindex(order)
    if not len(wide.columns):
        wide["ratio"] = None
    wide.loc[missing] = "refused"
    return wide.rename_axis("member").reset_index()


def _ratio_cell(row: dict) -> str:
    if row["status"] == "cannot run":
        return "cannot run"
    cell = f"{row['ppl_ratio']:.2f}"
    if row.get("n_seeds", 1) > 1:  # a seed mean hides how far the seeds are apart
        cell += f" [{row['ratio_low']:.2f}–{row['ratio_high']:.2f}]"
    return cell


def sections(result: Any) -> list[Section]:
    """Ratios, figures, and the rows that could not run or were refused."""
    m = result.meta
    cfg = m.get("config") or {}
    intro = (f"<p>Text: {html.escape(str(m['data']['source']))}. Perplexity = exp(mean next-token loss), at evaluation "
             f"lengths {', '.join(f'{f:g}' for f in cfg.get('factors', ()))} x the training length L, up to "
             f"{cfg.get('max_tokens')} scored tokens per length. <b>chunks</b>: the text cut into non-overlapping "
             "sequences of each length, every token but each sequence's first scored (Press et al.'s tables); "
             "<b>sliding</b>: the same target tokens at every length, each block of targets at the end of a window "
             "of that length (their appendix B). Ratio = ppl(xL) / ppl(L); a ratio near 1 means the model "
             "extrapolates.</p>")
    out = [Section("Ratio ppl(xL) / ppl(L)", html=intro + table_html(ratio_table(result))),
           Section("Figures", figures=figures(result))]
    df = result.tables["perplexity"]
    bad = df[df["status"] != "ok"]
    if len(bad):
        out.append(Section("Not measured", html="<p>Rows that could not run, with why.</p>",
                           table=bad[["model", "protocol", "length", "status", "why"]].fillna("")))
    return out


# --- the atlas over many models: this analysis's models side by side -----------------------------------------

def compare_section(result: Any) -> Section | None:
    """The atlas over many models' extrapolation section: ppl(xL) / ppl(L) per member, most to least robust,
    with the figures of `zoo eval`. None where no model measured it."""
    from posprobe.report.result import Result

    df = table(result, "perplexity")
    if not len(df):
        return None
    sub = Result({"perplexity": df, "ratios": table(result, "ratios")},
                 {**result.meta, "analysis": "zoo-eval", "config": result.meta.get("extrapolation") or {}})
    r = sub.tables["ratios"]
    chunks = r[(r.protocol == r.protocol.iloc[0]) & (r.factor == r.factor.max())]
    ok = chunks[chunks.status == "ok"].sort_values("ppl_ratio")
    cannot = chunks[chunks.status == "cannot run"].member.tolist()
    seeds = over_seeds(result, ", mean over seeds")
    text = (f"ppl({chunks.factor.max():g}L) / ppl(L), {chunks.protocol.iloc[0]} protocol{seeds}, from most to least "
            "robust: " + ", ".join(f"{x.member} {x.ppl_ratio:.2f}" for x in ok.itertuples()) + "."
            + (f" Cannot run past L: {', '.join(cannot)} (a learned table has L rows)." if cannot else ""))
    return Section("Perplexity past the training length", html=f"<p>{text}</p>" + table_html(ratio_table(sub)),
                   figures=figures(sub))
