"""Figures, console table and saved outputs of a shift test (built from the result's tables only)."""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np
import pandas as pd

from posprobe.report.compare import compare_caption, line_figure, member_order, refused_text, spread, table, unit
from posprobe.report.html import Section
from posprobe.report.style import COLORS, REFERENCE_COLOR, caption, reference_line, small_multiples_grid, style


def ppl_by_k(tokens: pd.DataFrame) -> pd.DataFrame:
    """Mean loss (nats/token) and perplexity per k of a `shift_tokens` table."""
    g = tokens.groupby("k").loss.mean().rename("mean_loss").reset_index()
    g["perplexity"] = np.exp(g.mean_loss)
    return g


#: Largest |Δ log p| (nats, summed over a sentence) that float32 rounding explains; the control's band.
#: A result may carry its own in meta["logp_tolerance"].
LOGP_TOLERANCE = 1e-3
#: Floor for exact zeros on the log axis of the deviation plot.
_LOG_FLOOR = 1e-12
_MAX_PANELS = 24


def prefix_text(meta: dict) -> str:
    """The prefix as text ('<|endoftext|> (eot, with-sentence)'), never a Python list repr."""
    p = meta.get("prefix") or {}
    toks = p.get("tokens") or []
    shown = " ".join(str(t) for t in toks) if toks else "none"
    extra = ", ".join(str(x) for x in (p.get("kind"), p.get("position")) if x)
    return f"{shown} ({extra})" if extra else shown


def figure_caption(meta: dict, note: str | None = None) -> str:
    """Caption of a shift-test figure: model, data, N, seed, ks, prefix, bootstrap resamples."""
    cfg = meta.get("config") or {}
    opts = {"k =": cfg.get("ks"), "prefix": prefix_text(meta) if meta.get("prefix") else None,
            "bootstrap resamples": cfg.get("n_bootstrap")}
    text = meta.get("text")
    if isinstance(text, dict) and text.get("window"):
        opts["text windows of"] = f"{text['window']} tokens (at most {text.get('max_windows')})"
    return caption(meta, opts, note=note)


def _accuracy_traces(fig: Any, g: pd.DataFrame, *, name: str, color: str, row: Any = None, col: Any = None,
                     showlegend: bool = False) -> None:
    import plotly.graph_objects as go

    g = g.sort_values("k")
    kw = dict(row=row, col=col) if row is not None else {}
    fig.add_trace(go.Scatter(
        x=g.k, y=g.accuracy, mode="lines+markers", name=name, showlegend=showlegend, line=dict(color=color, width=2),
        error_y=dict(type="data", symmetric=False, array=g.ci_high - g.accuracy, arrayminus=g.accuracy - g.ci_low),
        customdata=g[["ci_low", "ci_high", "n_pairs"]].values,
        hovertemplate="k=%{x}<br>accuracy %{y:.3f} [%{customdata[0]:.3f}, %{customdata[1]:.3f}]"
                      "<br>%{customdata[2]} pairs<extra>" + name + "</extra>"), **kw)


def _panels(summary: pd.DataFrame, groups: list[str], title: str, meta: dict, *, level: str) -> Any:
    """Small multiples: accuracy vs k with 95% CI, one panel per group, chance at 0.5 in each."""
    from plotly.subplots import make_subplots

    rows, cols = small_multiples_grid(len(groups), 4)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=groups, shared_yaxes=True,
                        horizontal_spacing=0.04, vertical_spacing=min(0.12, 0.5 / rows))
    for i, group in enumerate(groups):
        r, c = i // cols + 1, i % cols + 1
        g = summary[(summary.level.isin(level.split("|"))) & (summary.group == group)]
        _accuracy_traces(fig, g, name=group, color=COLORS[0], row=r, col=c)
        fig.add_hline(y=0.5, line=dict(color=REFERENCE_COLOR, dash="dash", width=1), row=r, col=c)
    fig.update_yaxes(range=[0, 1.05], tickvals=[0, 0.5, 1])
    fig.update_yaxes(title_text="accuracy", col=1)
    fig.update_xaxes(title_text="k", row=rows)
    fig.update_annotations(font_size=12)
    fig.update_layout(title=title, showlegend=False, height=max(300, 70 + 210 * rows))
    return style(fig, caption=figure_caption(meta, "Bars: 95% percentile-bootstrap CI; dashed line: chance (0.5)."))


def accuracy_figure(summary: pd.DataFrame, meta: dict | None = None) -> Any:
    """Pair accuracy vs k with 95% bootstrap CIs: one panel for all pairs and one per field; chance at 0.5."""
    meta = meta or {}
    groups = ["all"] + [g for g in summary[summary.level == "field"].group.drop_duplicates() if g != "all"]
    return _panels(summary, groups, "Minimal-pair accuracy vs start position k (overall and per field)", meta,
                   level="overall|field")


def paradigm_figure(summary: pd.DataFrame, meta: dict | None = None) -> Any:
    """Per paradigm: small multiples of accuracy vs k (at most 24 panels), else a paradigm x k heatmap of Δ accuracy."""
    import plotly.graph_objects as go

    meta = meta or {}
    par = summary[summary.level == "paradigm"]
    groups = list(par.group.drop_duplicates())
    if len(groups) <= _MAX_PANELS:
        return _panels(summary, groups, "Accuracy vs k per paradigm", meta, level="paradigm")
    piv = par.pivot_table(index="group", columns="k", values="delta_accuracy")
    fig = go.Figure(go.Heatmap(z=piv.values, x=[str(k) for k in piv.columns], y=list(piv.index), colorscale="RdBu",
                               zmid=0, colorbar=dict(title="Δ acc")))
    fig.update_layout(
        title="Change in accuracy vs k = 0 per paradigm",
        xaxis_title="k",
        height=max(400, 16 * len(groups)),
        yaxis=dict(autorange="reversed", tickfont=dict(size=10)),
    )
    return style(fig, caption=figure_caption(meta or {}))


def flips_figure(summary: pd.DataFrame, meta: dict | None = None) -> Any:
    """Pairs whose judgment changed vs k=0, split by direction, per k (y axis from 0)."""
    import plotly.graph_objects as go

    g = summary[(summary.level == "overall") & (summary.k > 0)].sort_values("k")
    fig = go.Figure([
        go.Bar(x=g.k.astype(str), y=g.flips_to_wrong, name="correct at k=0, wrong at k", marker_color=COLORS[3]),
        go.Bar(x=g.k.astype(str), y=g.flips_to_correct, name="wrong at k=0, correct at k", marker_color=COLORS[2]),
    ])
    top = float((g.flips_to_wrong + g.flips_to_correct).max()) if len(g) else 0.0
    fig.update_layout(barmode="stack", title="Judgment flips vs k = 0", xaxis_title="k", yaxis_title="pairs",
                      yaxis_range=[0, max(1.0, top * 1.1)])
    return style(fig, caption=figure_caption(meta or {}))


def logp_change(pairs: pd.DataFrame) -> pd.DataFrame:
    """Per k: max and median |log p(k) - log p(k=0)| over the good and bad sentences of every pair (nats)."""
    base = pairs[pairs.k == 0].set_index(["paradigm", "pair_id"])[["logp_good", "logp_bad"]]
    rows = []
    for k, g in pairs[pairs.k != 0].groupby("k"):
        d = (g.set_index(["paradigm", "pair_id"])[["logp_good", "logp_bad"]] - base).abs().stack()
        rows.append({"k": int(k), "max": float(d.max()), "median": float(d.median())})
    return pd.DataFrame(rows, columns=["k", "max", "median"])


def logp_change_figure(pairs: pd.DataFrame, meta: dict | None = None) -> Any:
    """max (and median) |Δ log p| of a sentence vs k, log scale, with the float-rounding tolerance band.

    For a RoPE model this is the invariance control's own quantity: every point should sit in the band."""
    import plotly.graph_objects as go

    meta = meta or {}
    tol = float(meta.get("logp_tolerance", LOGP_TOLERANCE))
    d = logp_change(pairs)
    fig = go.Figure()
    ys = []
    for col, name, color in (("max", "max over sentences", COLORS[3]), ("median", "median", COLORS[0])):
        y = d[col].clip(lower=_LOG_FLOOR)
        ys += list(y)
        fig.add_trace(go.Scatter(x=d.k, y=y, mode="lines+markers", name=f"{name} |Δ log p|", customdata=d[col],
                                 line=dict(color=color), hovertemplate="k=%{x}<br>%{customdata:.3g} nats"))
    lo = min(ys + [tol]) / 10
    hi = max(ys + [tol]) * 10
    fig.add_hrect(y0=lo, y1=tol, fillcolor=COLORS[2], opacity=0.15, line_width=0,
                  annotation_text=f"float32 rounding tolerance (≤ {tol:g} nats)", annotation_position="top left",
                  annotation_font=dict(size=12, color="#1f2328"))
    fig.update_layout(title="Largest change of a sentence's log-probability vs k = 0", xaxis_title="k",
                      yaxis_title="|log p(k) − log p(0)| (nats)")
    fig.update_yaxes(type="log", range=[math.log10(lo), math.log10(hi)], exponentformat="power")
    note = ("Invariance control (RoPE): a common shift of queries and keys leaves relative positions unchanged, "
            "so every point should lie in the shaded band." if meta.get("note") else None)
    return style(fig, caption=figure_caption(meta, note))


def perplexity_figures(tokens: pd.DataFrame, meta: dict | None = None) -> list[Any]:
    """Perplexity vs k, and mean loss by position inside the window for each k."""
    import plotly.graph_objects as go

    meta = meta or {}
    p = ppl_by_k(tokens)
    f1 = go.Figure(go.Scatter(x=p.k, y=p.perplexity, mode="lines+markers", name="perplexity"))
    f1.update_layout(title="Perplexity of text windows vs k", xaxis_title="k", yaxis_title="perplexity")
    f2 = go.Figure()
    for k, g in tokens.groupby("k"):
        m = g.groupby("pos").loss.mean()
        f2.add_trace(go.Scatter(x=m.index, y=m.values, mode="lines", name=f"k={k}"))
    f2.update_layout(title="Per-token loss by position inside the window", xaxis_title="position in window",
                     yaxis_title="mean loss (nats)")
    cap = figure_caption(meta)
    return [style(f1, caption=cap), style(f2, caption=cap)]


def drift_figure(drift: pd.DataFrame, meta: dict | None = None) -> Any:
    """Encoders: cosine similarity to the k=0 representation, per layer, vs k (1 = unchanged)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for layer, g in drift.groupby("layer", sort=False):
        fig.add_trace(go.Scatter(x=g.k, y=g.cosine_to_k0, mode="lines+markers", name=str(layer)))
    fig.update_layout(title="Representation drift: cosine to k = 0", xaxis_title="k", yaxis_title="cosine similarity",
                      legend_title_text="layer")
    reference_line(fig, 1.0, "unchanged")
    return style(fig, caption=figure_caption(meta or {}))


def figures(result: Any) -> list[Any]:
    """All figures for the result's non-empty tables."""
    m = result.meta
    figs = []
    summary, pairs = _table(result, "summary"), _table(result, "pairs")
    if len(summary):
        figs.append(accuracy_figure(summary, m))
        if (summary.level == "paradigm").any():
            figs.append(paradigm_figure(summary, m))
    if len(pairs) and (pairs.k == 0).any() and (pairs.k != 0).any():
        figs.append(logp_change_figure(pairs, m))
    if len(summary):
        over = summary[(summary.level == "overall") & (summary.k > 0)]
        if len(over) and int(over.flips.sum()) > 0:  # an all-zero flips chart says nothing; the text says it
            figs.append(flips_figure(summary, m))
    if len(_table(result, "tokens")):
        figs += perplexity_figures(_table(result, "tokens"), m)
    if len(_table(result, "drift")):
        figs.append(drift_figure(_table(result, "drift"), m))
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
    prefix = f"Prefix: <code>{html.escape(prefix_text(m))}</code>. " if m.get("prefix") else ""
    intro = (
        f"<p>Model <b>{html.escape(str(model['name']))}</b> ({html.escape(str(model['positional_kind']))} positions, "
        f"context {model.get('n_ctx')}, backend {html.escape(str(model.get('backend')))}). Every item starts at "
        f"position k with no prior context. {prefix}Data: {html.escape(str(data.get('source')))}"
        f"{' (posprobe built-in template pairs, not BLiMP)' if data.get('builtin') else ''}, "
        f"{data['n_items']} {html.escape(str(data['unit']))}.</p>"
    )
    summary = _table(result, "summary")
    if m.get("note"):
        intro += f"<p><b>Invariance control.</b> {html.escape(m['note'])}</p>"
    if len(summary):
        over = summary[(summary.level == "overall") & (summary.k > 0)]
        if len(over) and int(over.flips.sum()) == 0:
            intro += "<p>No pair changed its judgement at any k (no flips), so no flips chart is drawn.</p>"
    intro += f"<pre>{html.escape(console_table(result))}</pre>"
    out = [Section("Summary", html=intro), Section("Figures", figures=figures(result))]
    if len(summary):
        cols = ["k", "level", "group", "n_pairs", "accuracy", "ci_low", "ci_high", "delta_accuracy", "mean_margin",
                "flips", "mcnemar_p"]
        cols = [c for c in cols if c in summary.columns]
        out.append(Section("Accuracy by field and k", table=summary[summary.level != "paradigm"][cols]))
        par = summary[summary.level == "paradigm"][[c for c in cols if c != "level"]].rename(
            columns={"group": "paradigm"}
        )
        out.append(Section("Accuracy by paradigm and k", table=par))
    return out


def _table(result: Any, name: str) -> pd.DataFrame:
    return result.tables.get(f"shift_{name}", pd.DataFrame())


def atlas_paragraph(result: Any, n: Any) -> str:
    """The atlas's shift section in words: an encoder's representation drift, else minimal-pair accuracy per k and
    what the family makes of it (an invariance control, or the effect of absolute positions)."""
    from posprobe.backend import families

    rows = result.tables["atlas"]
    cos = {int(r.metric.split("_k")[1]): r.value for r in rows.itertuples()
           if r.section == "shift" and r.metric.startswith("pooled_cosine_k")}
    if cos:
        far = max(cos)
        return (f"An encoder has no LM head, so the shift test measures representation drift: the mean-pooled last "
                f"layer at start position k={far} has cosine {cos[far]:.3f} to the same sentences at k=0 "
                f"({', '.join(f'{v:.3f} at k={k}' for k, v in sorted(cos.items()) if k)}).")
    accs = {int(r.metric.split("_k")[1]): r.value for r in rows.itertuples()
            if r.section == "shift" and r.metric.startswith("accuracy_k")}
    dev = n("max_abs_logp_change")
    ks = sorted(accs)
    text = ("Minimal-pair accuracy (built-in pairs) " +
            ", ".join(f"{accs[k]:.3f} at k={k}" for k in ks) + ".")
    kind = result.meta["model"]["positional_kind"]
    fam = families.find(kind)
    if fam is not None and fam.shift_invariant:
        text += (f" {fam.label} control: shifting queries and keys together cannot change relative positions, and "
                 f"the largest change of any sentence's log-probability was {dev:.2g} nats (float rounding).")
    elif len(ks) > 1:
        text += (f" {families.label(kind).capitalize()} positions: starting the sentences at k={ks[-1]} instead of 0 "
                 f"changes accuracy by {accs[ks[-1]] - accs[0]:+.3f}.")
    return text


# --- the atlas over many models: this analysis's models side by side -----------------------------------------

def compare_section(result: Any) -> Section | None:
    """The atlas over many models' shift section: text perplexity and pair accuracy against start position k,
    one line per member. None where no model measured it."""
    ppl = table(result, "shift_perplexity")
    acc = table(result, "shift_summary")
    if not len(ppl) and not len(acc):
        return None
    order = member_order(result)
    figs, sentences = [], []
    if len(ppl):
        base = ppl[ppl.k == 0].set_index("model").perplexity
        ppl = ppl.assign(ratio=ppl.perplexity / ppl.model.map(base))
        last = ppl[ppl.k == ppl.groupby("model").k.transform("max")]
        for m in [m for m in order if m in set(last.member)]:
            g = last[last.member == m]
            sentences.append(f"{m} {spread(g.ratio, '{:.3f}')} at k = {int(g.k.max())}")
        figs.append(line_figure(ppl, "k", "ratio", order, "Text perplexity at start position k, relative to k = 0",
                                 "start position k (tokens)", "perplexity(k) / perplexity(0)",
                                 compare_caption(result, "The same text windows, every position moved by k.")))
    if len(acc):
        figs.append(line_figure(acc, "k", "accuracy", order, "Minimal-pair accuracy at start position k",
                                 "start position k (tokens)", "accuracy",
                                 compare_caption(result, "posprobe's built-in template pairs (not BLiMP).")))
    text = ("Perplexity of the same text windows started at position k, over perplexity at k = 0: "
            + "; ".join(sentences) + ". A learned table sees other rows at k > 0 and may degrade (Sinha et al. 2022); "
            f"rotary {unit(result, plural=True)} are the control: a common shift of queries and keys cannot change "
            "their scores, so any change there is numerical." + refused_text(result, "shift"))
    return Section("Shift test: the same text at start position k", html=f"<p>{text}</p>", figures=figs)
