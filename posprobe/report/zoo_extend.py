"""Report page of context extension by fine-tuning (`zoo-extend`): per member, perplexity at L' against fine-tuning
steps for every method beside the unextended member's ppl at L (the threshold), the summary over seeds (ppl at L'
and 2L', in-window cost, steps-to-threshold, effective window), attention entropy against length, the mechanism's
summary and what was left out. Tables and meta only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.compare import spread, table
from posprobe.report.html import Section
from posprobe.report.style import COLORS, caption, style

#: The unextended members' rows (`posprobe.analyses.context_extension.UNEXTENDED`; kept here, below the analyses).
UNEXTENDED = "unextended"


def title(result: Any) -> str:
    """Report title."""
    return str(result.meta.get("title") or "Context extension by fine-tuning")


def summary_frame(result: Any) -> pd.DataFrame:
    """Per member, method and protocol of the result's `summary` table, over seeds as `mean [lowest–highest]`
    (`compare.spread`; "n/a" where none): the unextended ppl at L, ppl at L' at step 0 and at the last step, ppl at
    2L' at the last step, the in-window cost at L; steps-to-threshold per seed ("never" where none); with passkey
    trials the effective window per seed (unextended / step 0 / last step, tokens). What `zoo extend` prints and the
    page shows."""
    s = result.tables["summary"]
    rows = []
    for (m, method, protocol), g in s.groupby(["member", "method", "protocol"], sort=False):
        row = {"member": m, "method": method, "protocol": protocol, "ppl L unext": spread(g["ppl_L_unextended"]),
               "ppl L' step 0": spread(g["ppl_Lp_step0"]), "ppl L'": spread(g["ppl_Lp"]),
               "ppl 2L'": spread(g["ppl_2Lp"]), "cost at L": spread(g["in_window_cost"]),
               "steps to threshold": ",".join("never" if pd.isna(x) else str(int(x)) for x in g["steps_to_threshold"])}
        if "ew" in g:
            row["eff. window unext/0/last"] = ",".join(
                "/".join("-" if pd.isna(x) else str(int(x)) for x in r)
                for r in zip(g["ew_unextended"], g["ew_step0"], g["ew"]))
        rows.append(row)
    return pd.DataFrame(rows)


def printed(result: Any) -> str:
    """What `posprobe zoo extend` prints on stdout: the summary over seeds (`summary_frame`), the mechanism's and
    the attention entropy's summaries where measured, YaRN's gamma per band and what was left out."""
    lines = [summary_frame(result).to_string(index=False)]
    if len(result.tables.get("mechanism", ())):  # no rotary member among them: nothing to summarise
        lines += ["mechanism (Chen et al.): per head a(s) inside L against beyond it, logits",
                  mechanism_summary(result.tables["mechanism"]).round(3).to_string(index=False)]
    if "attention_entropy" in result.tables:
        lines += ["attention entropy / uniform's over the visible keys, mean over layers and seeds, by length (tokens)",
                  entropy_summary(result.tables["attention_entropy"]).round(3).to_string(index=False)]
    for name, gammas in result.meta.get("yarn_gamma", {}).items():
        lines.append(f"[zoo] yarn gamma per band of {name} (1 = kept, 0 = interpolated by 1/s; HF's ramp): "
                     + " ".join(f"{g:.2f}" for g in gammas))
    lines += [f"[zoo] left out {r['member']} {r['method']}: {r['why']}" for r in result.meta.get("left_out", [])]
    return "\n".join(lines)


def mechanism_summary(mechanism: pd.DataFrame) -> pd.DataFrame:
    """Per member and method (over seeds and heads): the trained length L and how far a(s) is followed (tokens), the
    heads measured, the share whose a(s) leaves its range inside L by more than the tolerance beyond it, the median and
    largest excess and the largest interpolation bound (logits): a row per (member, method), unextended first."""
    if not len(mechanism):
        return pd.DataFrame(columns=["member", "method", "context", "target", "heads", "leaving_share",
                                     "excess_median", "excess_max", "interpolation_bound_max"])
    g = mechanism.groupby(["member", "method"], sort=False)
    out = g.agg(context=("theory_context", "first"), target=("theory_target", "first"), heads=("head", "size"),
                leaving_share=("extrapolation_leaves_range", "mean"), excess_median=("excess", "median"),
                excess_max=("excess", "max"), interpolation_bound_max=("interpolation_bound", "max")).reset_index()
    first = out["method"].eq(UNEXTENDED).map({True: 0, False: 1})
    return out.assign(_o=first).sort_values(["member", "_o"], kind="stable").drop(columns="_o").reset_index(drop=True)


def entropy_summary(entropy: pd.DataFrame) -> pd.DataFrame:
    """Per member, method and length (over seeds and layers; status ok): the mean relative attention entropy
    (entropy / uniform's), one column per length, unextended first."""
    ok = entropy[entropy["status"] == "ok"]
    if not len(ok):
        return pd.DataFrame(columns=["member", "method"])
    wide = ok.pivot_table(index=["member", "method"], columns="length", values="relative", aggfunc="mean",
                          sort=False)
    wide.columns = [f"relative_at_{int(c)}" for c in wide.columns]
    out = wide.reset_index()
    first = out["method"].eq(UNEXTENDED).map({True: 0, False: 1})
    return out.assign(_o=first).sort_values(["member", "_o"], kind="stable").drop(columns="_o").reset_index(drop=True)


def _add_seed_mean(fig: Any, g: Any, method: str, i: int, col: int, dash: str = "solid") -> None:
    # One method's line in panel `col`: the mean over seeds of a grouped series, bars to the lowest and highest seed.
    import plotly.graph_objects as go

    if not len(g):
        return
    mean, lo, hi = g.mean(), g.min(), g.max()
    fig.add_trace(go.Scatter(x=list(mean.index), y=list(mean), mode="lines+markers", name=method, legendgroup=method,
                             showlegend=col == 1, line={"color": COLORS[i % len(COLORS)], "dash": dash},
                             error_y={"type": "data", "symmetric": False, "array": list(hi - mean),
                                      "arrayminus": list(mean - lo)}), row=1, col=col)


def _curves_figure(result: Any) -> Any:
    """ppl at L' (chunks) against fine-tuning step, one panel per member, one line per method (mean over seeds,
    seeds' range as error bars), the unextended member's ppl at L as a dashed line (the threshold)."""
    from plotly.subplots import make_subplots

    meta = result.meta
    L, target = int(meta["train_length"]), int(meta["target_length"])
    c = result.tables["curves"]
    c = c[(c["status"] == "ok") & (c["protocol"] == "chunks")]
    members = list(dict.fromkeys(c[c["method"] != UNEXTENDED]["member"]))
    methods = list(dict.fromkeys(c[c["method"] != UNEXTENDED]["method"]))
    fig = make_subplots(rows=1, cols=max(1, len(members)), subplot_titles=members, shared_yaxes=True)
    for col, m in enumerate(members, start=1):
        mine = c[c["member"] == m]
        for i, method in enumerate(methods):
            g = mine[(mine["method"] == method) & (mine["length"] == target)].groupby("step")["ppl"]
            _add_seed_mean(fig, g, method, i, col)
        u = mine[(mine["method"] == UNEXTENDED) & (mine["length"] == L)]["ppl"]
        if len(u):
            fig.add_hline(y=float(u.mean()), line_dash="dash", line_color="grey", row=1, col=col)
        fig.update_xaxes(title_text="fine-tuning step", row=1, col=col)
    fig.update_yaxes(title_text=f"ppl at L' = {target} (chunks)", row=1, col=1)
    fig.update_layout(title=f"Perplexity at L' = {target} against fine-tuning steps")
    cfg = meta.get("config") or {}
    note = (f"Dashed: the unextended member's ppl at L = {L} (the threshold of steps-to-threshold). Step 0 is the "
            "method at inference only. Points: mean over seeds; bars: the seeds' range.")
    options = {"steps": cfg.get("steps"), "scored tokens per length": cfg.get("eval_tokens")}
    return style(fig, caption=caption(meta, options, note=note))


def _entropy_figure(result: Any) -> Any | None:
    """Relative attention entropy (entropy / uniform's) against length, one panel per member, one line per model
    kind (unextended and each method at its last checkpoint), mean over seeds and layers."""
    import plotly.express as px

    e = table(result, "attention_entropy")
    if not len(e):
        return None
    ok = e[e["status"] == "ok"]
    if not len(ok):
        return None
    df = ok.groupby(["member", "method", "length"], as_index=False, sort=False)["relative"].mean()
    fig = px.line(df, x="length", y="relative", color="method", facet_col="member", markers=True, log_x=True,
                  color_discrete_sequence=list(COLORS), title="Attention entropy against length",
                  labels={"relative": "entropy / uniform's", "length": "tokens"})
    note = ("1 = attention spread evenly over the keys a query sees, 0 = on one key. YaRN's temperature rationale: "
            "without one, attention spreads as the context grows. Mean over layers and seeds.")
    return style(fig, caption=caption(result.meta, note=note))


def _passkey_figure(result: Any) -> Any | None:
    """Passkey success by distance, one panel per member, one line per method at its last checkpoint (and the
    unextended member), mean over seeds with the seeds' range; the trained length L and Chen's 20 % threshold drawn.
    The window alone hides where retrieval moved (a method can fail the short distances and succeed beyond L)."""
    from plotly.subplots import make_subplots

    pk = table(result, "passkey")
    if not len(pk):
        return None
    pk = pk[pk["status"] == "ok"]
    last = pk.groupby("method")["step"].transform("max")
    pk = pk[pk["step"] == last]
    if not len(pk):
        return None
    L = int(result.meta["train_length"])
    members = list(dict.fromkeys(pk["member"]))
    methods = list(dict.fromkeys(pk["method"]))
    fig = make_subplots(rows=1, cols=len(members), subplot_titles=members, shared_yaxes=True)
    for col, m in enumerate(members, start=1):
        for i, method in enumerate(methods):
            g = pk[(pk["member"] == m) & (pk["method"] == method)].groupby("distance")["success_rate"]
            _add_seed_mean(fig, g, method, i, col, dash="dash" if method == UNEXTENDED else "solid")
        fig.add_vline(x=L, line_dash="dot", line_color="grey", row=1, col=col)
        fig.add_hline(y=0.2, line_dash="dot", line_color="grey", row=1, col=col)
        fig.update_xaxes(title_text="key-to-answer distance (tokens)", row=1, col=col)
    fig.update_yaxes(title_text="exact greedy answers", range=[0, 1.02], row=1, col=1)
    fig.update_layout(title="Passkey success by distance after fine-tuning")
    steps = sorted(set(pk.loc[pk["method"] != UNEXTENDED, "step"]))
    note = (f"Each method at its last checkpoint (step {', '.join(map(str, steps))}); dashed: the unextended member. "
            f"Dotted: the trained length L = {L} and Chen et al.'s 20 % (the effective window is the longest distance "
            "at or above it with every shorter one). Points: mean over seeds; bars: the seeds' range.")
    return style(fig, caption=caption(result.meta, {"trials per distance": int(pk["trials"].max())}, note=note))


def figures(result: Any) -> list:
    """The curves at L', passkey success by distance where the zoo was trained with the skill, and attention entropy
    against length where measured."""
    out = [_curves_figure(result)]
    for extra in (_passkey_figure(result), _entropy_figure(result)):
        if extra is not None:
            out.append(extra)
    return out


def sections(result: Any) -> list[Section]:
    """What was run, the summary over seeds, the curves, passkey success by distance, entropy, the mechanism and what
    was left out."""
    meta, cfg = result.meta, result.meta.get("config") or {}
    L, target = meta.get("train_length"), meta.get("target_length")
    runs = table(result, "runs")
    seeds = sorted(set(runs["seed"])) if len(runs) else []
    intro = (f"<p>Every member continued from its training length L = {L} to L' = {target} tokens under each method "
             f"for {cfg.get('steps')} steps through the zoo's loop, seeds {', '.join(map(str, seeds))}; "
             f"perplexity scored at L, L' and 2L' ({cfg.get('eval_tokens')} tokens per length) at steps "
             f"{', '.join(map(str, cfg.get('checkpoints') or []))}. In-window cost = ppl at L after fine-tuning / "
             "the unextended member's ppl at L; steps-to-threshold = the first checkpoint whose ppl at L' is at most "
             "the unextended member's ppl at L. Values: mean over seeds [lowest–highest].</p>")
    out = [Section("Summary", html=intro, table=summary_frame(result)),
           Section("Perplexity at L' against steps", figures=[_curves_figure(result)])]
    pk = _passkey_figure(result)
    if pk is not None:
        out.append(Section("Passkey success by distance", figures=[pk]))
    ent = _entropy_figure(result)
    if ent is not None:
        out.append(Section("Attention entropy against length", figures=[ent]))
    mech = table(result, "mechanism")
    if len(mech):
        from posprobe.report.pages import PREVIEW_ROWS

        cols = ["member", "seed", "method", "layer", "head", "h_max", "excess", "interpolation_bound",
                "extrapolation_leaves_range"]
        out.append(Section("The mechanism (Chen et al.)", html=(
            "<p>Per head, a(s) = Re sum_j h_j e^{i s theta_j} on the model's own rotation: how far it leaves its "
            "range inside the trained length beyond it (excess, logits) and Chen's interpolation bound. First "
            f"{PREVIEW_ROWS} rows; the table has them all.</p>"),
            table=mech[[c for c in cols if c in mech]].head(PREVIEW_ROWS)))
    left = meta.get("left_out") or []
    if left:
        items = "".join(f"<li>{html.escape(str(r['member']))} {html.escape(str(r['method']))}: "
                        f"{html.escape(str(r['why']))}</li>" for r in left)
        out.append(Section("Left out", html=f"<ul>{items}</ul>"))
    return out
