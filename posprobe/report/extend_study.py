"""Report page of the extension study (`zoo-extend-study`): passkey success within and beyond the trained length L
per method, one panel per head dim and L, a colour per fine-tuning, with 95 % Wilson intervals, and the table.
Tables and meta only."""

from __future__ import annotations

from typing import Any

import pandas as pd

from posprobe.report.html import Section
from posprobe.report.style import COLORS, REFERENCE_COLOR, caption, style

#: The unextended member's colour: it is one model, drawn once per panel, whatever the fine-tuning.
_BEFORE = REFERENCE_COLOR
#: Horizontal offset between fine-tunings at one method (in method slots).
_SPREAD = 0.28


def title(result: Any) -> str:
    """Report title."""
    return "Context extension across runs: does the passkey skill survive?"


def plotted(df: pd.DataFrame) -> pd.DataFrame:
    """The rows the figure draws: each method at its last step per head dim, L and fine-tuning, and the unextended
    member once per head dim and L (it is the same model under every fine-tuning). Sorted as in the table."""
    if not len(df):
        return df
    last = df.groupby(["head_dim", "L", "fine_tuning", "method"])["step"].transform("max")
    df = df[df["step"] == last]
    before = df["method"] == "unextended"
    once = df[before].drop_duplicates(["head_dim", "L"])
    return pd.concat([once, df[~before]]).sort_values(["L", "head_dim", "fine_tuning", "method"], kind="stable")


def _panel(r: pd.Series) -> str:
    return f"{r['head_dim']} dims, L = {r['L']}<br>{r['bands_within_L']} of {r['bands']} bands turn within L"


def figure(result: Any) -> Any | None:
    """Success within L (top row) and beyond L (bottom row) per method, one column per head dim and L; a point per
    fine-tuning with its 95 % Wilson interval as the error bar; the unextended member in grey."""
    from plotly.subplots import make_subplots

    df = plotted(result.tables["study"])
    if not len(df):
        return None
    cells = list(dict.fromkeys((int(r["L"]), int(r["head_dim"])) for _, r in df.iterrows()))
    names = {c: _panel(df[(df["L"] == c[0]) & (df["head_dim"] == c[1])].iloc[0]) for c in cells}
    methods = ["unextended"] + [m for m in dict.fromkeys(df["method"]) if m != "unextended"]
    tunings = list(dict.fromkeys(df["fine_tuning"]))
    fig = make_subplots(rows=2, cols=len(cells), shared_yaxes=True, shared_xaxes=True, vertical_spacing=0.08,
                        horizontal_spacing=0.03, subplot_titles=[names[c] for c in cells] + [""] * len(cells))
    shown: set[str] = set()
    for col, (L, hd) in enumerate(cells, start=1):
        here = df[(df["L"] == L) & (df["head_dim"] == hd)]
        for row, side in ((1, "within"), (2, "beyond")):
            for series, g in [("unextended", here[here["method"] == "unextended"])] + [
                    (t, here[(here["fine_tuning"] == t) & (here["method"] != "unextended")]) for t in tunings]:
                if not len(g):
                    continue
                i = tunings.index(series) if series in tunings else None
                shift = 0.0 if i is None else (i - (len(tunings) - 1) / 2) * _SPREAD
                p, lo, hi = (g[f"success_{side}_L{x}"].to_numpy(float) for x in ("", "_low", "_high"))
                name = "unextended" if i is None else f"fine-tuned on {series}"
                fig.add_scatter(
                    x=[methods.index(m) + shift for m in g["method"]], y=p, mode="markers", name=name,
                    legendgroup=name, showlegend=name not in shown, row=row, col=col,
                    marker=dict(size=9, color=_BEFORE if i is None else COLORS[i % len(COLORS)],
                                symbol="diamond" if i is None else "circle"),
                    error_y=dict(type="data", symmetric=False, array=hi - p, arrayminus=p - lo, thickness=1.5),
                    customdata=g[["step", "seeds", f"trials_{side}_L", "window_seeds"]].to_numpy(),
                    hovertemplate=(f"%{{y:.2f}} {side} L (error bar: 95 % CI)<br>step %{{customdata[0]}}, "
                                   "%{customdata[1]} seeds, %{customdata[2]} trials<br>windows %{customdata[3]}"
                                   "<extra>" + name + "</extra>"))
                shown.add(name)
            fig.update_xaxes(tickvals=list(range(len(methods))), ticktext=methods, range=[-0.6, len(methods) - 0.4],
                             tickangle=-30, row=row, col=col)
    fig.update_yaxes(range=[-0.03, 1.03])
    fig.update_yaxes(title_text="success within L", row=1, col=1)
    fig.update_yaxes(title_text="success beyond L", row=2, col=1)
    fig.update_layout(title="Passkey success after extension, by head dim and trained length",
                      legend=dict(orientation="h", yanchor="top", y=-0.16, xanchor="left", x=0),
                      margin=dict(t=110))
    fig.update_annotations(font_size=13)
    targets = sorted({f"{t / L:g}" for L, t in zip(df["L"], df["target"])})
    note = ("Exact greedy answers, every trial of every seed and distance pooled (within L: distances up to L; beyond "
            "L: up to L'); error bars: 95 % Wilson intervals. Each method at its last checkpoint; grey diamonds: the "
            "member before extension. Bands: rotary bands whose period fits in L.")
    lo, hi = int(df["seeds"].min()), int(df["seeds"].max())
    return style(fig, height=620, caption=caption(result.meta, {"scale s": ", ".join(targets),
                                                                "seeds": str(hi) if lo == hi else f"{lo}–{hi}"},
                                                  note=note))


def mechanism_figure(result: Any) -> Any | None:
    """Success within L against the strongest previous-token head's attention to i - 1, as a share of the unextended
    member's: a point per head dim, L, fine-tuning and method at its last step (the unextended member at 1), with the
    Wilson interval as the error bar; None where no run measured the previous-token attention."""
    import plotly.graph_objects as go

    df = plotted(result.tables["study"])
    df = df[df["prev_token_attention"].notna() & df["prev_token_attention_unextended"].gt(0)]
    if not len(df):
        return None
    fig = go.Figure()
    methods = ["unextended"] + [m for m in dict.fromkeys(df["method"]) if m != "unextended"]
    for i, method in enumerate(methods):
        g = df[df["method"] == method]
        p, lo, hi = (g[f"success_within_L{x}"].to_numpy(float) for x in ("", "_low", "_high"))
        fig.add_scatter(x=(g["prev_token_attention"] / g["prev_token_attention_unextended"]).to_numpy(float), y=p,
                        mode="markers", name=method,
                        marker=dict(size=10, color=_BEFORE if method == "unextended" else COLORS[(i - 1) % len(COLORS)],
                                    symbol="diamond" if method == "unextended" else "circle"),
                        error_y=dict(type="data", symmetric=False, array=hi - p, arrayminus=p - lo, thickness=1),
                        customdata=g[["head_dim", "L", "fine_tuning", "prev_token_attention"]].to_numpy(),
                        hovertemplate=("%{customdata[0]} dims, L = %{customdata[1]}, %{customdata[2]}<br>attention to "
                                       "i-1 %{customdata[3]:.2f} (%{x:.2f} of unextended)<br>success within L %{y:.2f}"
                                       "<extra>" + method + "</extra>"))
    fig.update_xaxes(title_text="strongest previous-token head, share of the unextended member's", rangemode="tozero")
    fig.update_yaxes(title_text="success within L", range=[-0.03, 1.03])
    fig.update_layout(title="The previous-token head against the skill")
    note = ("Previous-token attention: the largest over a model's heads of the mean attention from i to i - 1 on "
            "windows of L tokens, mean over seeds, divided by the unextended member's. A point per head dim, L, "
            "fine-tuning and method at its last checkpoint; error bars: 95 % Wilson intervals.")
    return style(fig, height=480, caption=caption(result.meta, note=note))


def figures(result: Any) -> list:
    """The success figure and the previous-token figure, where the study has what they need."""
    return [f for f in (figure(result), mechanism_figure(result)) if f is not None]


def sections(result: Any) -> list[Section]:
    """The figure, then the study table (every step it was built with)."""
    intro = ("<p>Does a context-extension method keep the passkey skill the member learned at L, and does the answer "
             "move with the number of rotary bands turning within L (head dim and L)? Success pooled over every trial "
             "of every seed; Chen et al.'s effective window per seed in <code>window_seeds</code>; the fast-band "
             "share of |q·k| and Chen's interpolation bound where the run measured its mechanism (docs/zoo-extend.md "
             "says what each column is).</p>")
    out = [Section("Success within and beyond L", html=intro, figures=[f for f in [figure(result)] if f is not None],
                   table=result.tables["study"])]
    mech = mechanism_figure(result)
    if mech is not None:
        out.append(Section("The previous-token head", html=(
            "<p>Passkey retrieval is a copy: a head that reads the token before each position feeds the head that "
            "finds the key. Position Interpolation turns offset 1 into 1 / s, so that head loses its sharpness; "
            "here, how much of it each method keeps against how much of the skill survives.</p>"), figures=[mech]))
    return out
