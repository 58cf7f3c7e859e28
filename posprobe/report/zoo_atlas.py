"""Report page of the zoo atlas (`zoo-atlas`): one section per analysis, every family in one figure, and one paragraph
per section generated from the numbers (member = mean over its seeds, [lowest - highest seed] where there are
several). Tables and meta only."""

from __future__ import annotations

import html
from types import SimpleNamespace
from typing import Any

import pandas as pd

from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, REFERENCE_COLOR, caption, style

_TITLES = {"training": "Training", "extrapolation": "Perplexity past the training length",
           "shift": "Shift test: the same text at start position k", "probes": "Position probes per layer",
           "heads": "Head classes and attention windows", "similarity": "Head similarity across members",
           "sinks": "Attention sinks and massive activations", "geometry": "Add or concatenate?",
           "decomposition": "Layer-0 score decomposition", "frequency": "RoPE frequency usage"}


def title(result: Any) -> str:
    """Report title."""
    return "Zoo atlas: every positional analysis across the members"


def _t(result: Any, name: str) -> pd.DataFrame:
    return result.tables.get(name, pd.DataFrame())


def _order(result: Any) -> list[str]:
    # Members in the order of the models table (zoo members first, as listed, then other models).
    return list(dict.fromkeys(_t(result, "models").get("member", pd.Series(dtype=str)).astype(str)))


def _spread(values: pd.Series, fmt: str = "{:.2f}") -> str:
    v = values.dropna()
    if not len(v):
        return "n/a"
    if len(v) == 1:
        return fmt.format(v.iloc[0])
    return f"{fmt.format(v.mean())} [{fmt.format(v.min())}–{fmt.format(v.max())}]"


def _by_member(df: pd.DataFrame, value: str, order: list[str]) -> pd.Series:
    s = df.groupby("member")[value].mean()
    return s.reindex([m for m in order if m in s.index])


def _refused(result: Any, section: str) -> pd.DataFrame:
    r = _t(result, "refused")
    return r[r.section == section] if len(r) else r


def _refused_text(result: Any, section: str) -> str:
    r = _refused(result, section)
    if not len(r):
        return ""
    parts = [f"{html.escape(', '.join(g.model))}: {html.escape(why)}" for why, g in r.groupby("why", sort=False)]
    return " Not measured — " + "; ".join(parts) + "."


def _pct(v: Any) -> str:
    return "n/a" if v is None or v != v else f"{v:.0%}"


def _line_figure(df: pd.DataFrame, x: str, y: str, order: list[str], title: str, xlab: str, ylab: str, cap: str,
                 log_y: bool = False) -> Any:
    # One line per member (mean over seeds), its seeds' range as error bars.
    import plotly.graph_objects as go

    fig = go.Figure()
    g = df.groupby(["member", x])[y].agg(["mean", "min", "max", "count"]).reset_index()
    for i, name in enumerate(m for m in order if m in set(g.member)):
        line = g[g.member == name].sort_values(x)
        fig.add_trace(go.Scatter(x=line[x], y=line["mean"], name=name, mode="lines+markers",
                                 line=dict(color=COLORS[i % len(COLORS)], dash="solid" if i < len(COLORS) else "dot"),
                                 error_y=dict(type="data", symmetric=False, array=line["max"] - line["mean"],
                                              arrayminus=line["mean"] - line["min"],
                                              visible=bool((line["count"] > 1).any()))))
    fig.update_layout(title=title, xaxis_title=xlab, yaxis_title=ylab)
    if log_y:
        fig.update_yaxes(type="log")
    return style(fig, caption=cap)


def _cap(result: Any, note: str, *, meta: dict | None = None, **options: Any) -> str:
    # `meta`: the record the caption names in place of the result's own (the training figure's training text).
    return caption(meta or result.meta, options, note=note + " Lines: mean over seeds; bars: lowest and highest seed.")


# --- sections ---------------------------------------------------------------------------------------------------

def _training(result: Any) -> Section | None:
    df = _t(result, "training")
    if not len(df):
        return None
    members = _t(result, "training_members")
    final = _by_member(members, "loss", _order(result)).sort_values()
    text = ("Final training loss (nats/token, mean of the last 10 steps, mean over seeds): "
            + ", ".join(f"{m} {v:.2f}" for m, v in final.items()) + ".")
    # The caption names the training text, not the text the other sections were measured on.
    trained = {**result.meta, "data": result.meta.get("training_data") or {"source": "the zoo's training text"}}
    fig = _line_figure(df, "tokens", "loss", _order(result), "Training loss", "training tokens",
                       "training loss (nats/token)", _cap(result, "Read from the zoo's training folder.", meta=trained))
    return Section(_TITLES["training"], html=f"<p>{text}</p>", figures=[fig])


def _extrapolation(result: Any) -> Section | None:
    from posprobe.report.extrapolation import figures, ratio_table
    from posprobe.report.result import Result

    df = _t(result, "perplexity")
    if not len(df):
        return None
    sub = Result({"perplexity": df, "ratios": _t(result, "ratios")},
                 {**result.meta, "analysis": "zoo-eval", "config": result.meta.get("extrapolation") or {}})
    r = sub.tables["ratios"]
    chunks = r[(r.protocol == r.protocol.iloc[0]) & (r.factor == r.factor.max())]
    ok = chunks[chunks.status == "ok"].sort_values("ppl_ratio")
    cannot = chunks[chunks.status == "cannot run"].member.tolist()
    text = (f"ppl({chunks.factor.max():g}L) / ppl(L), {chunks.protocol.iloc[0]} protocol, mean over seeds, from most "
            "to least robust: " + ", ".join(f"{x.member} {x.ppl_ratio:.2f}" for x in ok.itertuples()) + "."
            + (f" Cannot run past L: {', '.join(cannot)} (a learned table has L rows)." if cannot else ""))
    return Section(_TITLES["extrapolation"], html=f"<p>{text}</p>" + table_html(ratio_table(sub)),
                   figures=figures(sub))


def _shift(result: Any) -> Section | None:
    ppl = _t(result, "shift_perplexity")
    acc = _t(result, "shift_summary")
    if not len(ppl) and not len(acc):
        return None
    order = _order(result)
    figs, sentences = [], []
    if len(ppl):
        base = ppl[ppl.k == 0].set_index("model").perplexity
        ppl = ppl.assign(ratio=ppl.perplexity / ppl.model.map(base))
        last = ppl[ppl.k == ppl.groupby("model").k.transform("max")]
        for m in [m for m in order if m in set(last.member)]:
            g = last[last.member == m]
            sentences.append(f"{m} {_spread(g.ratio, '{:.3f}')} at k = {int(g.k.max())}")
        figs.append(_line_figure(ppl, "k", "ratio", order, "Text perplexity at start position k, relative to k = 0",
                                 "start position k (tokens)", "perplexity(k) / perplexity(0)",
                                 _cap(result, "The same text windows, every position moved by k.")))
    if len(acc):
        figs.append(_line_figure(acc, "k", "accuracy", order, "Minimal-pair accuracy at start position k",
                                 "start position k (tokens)", "accuracy",
                                 _cap(result, "posprobe's built-in template pairs (not BLiMP).")))
    text = ("Perplexity of the same text windows started at position k, over perplexity at k = 0: "
            + "; ".join(sentences) + ". A learned table sees other rows at k > 0 and may degrade (Sinha et al. 2022); "
            "rotary members are the control: a common shift of queries and keys cannot change their scores, so any "
            "change there is numerical." + _refused_text(result, "shift"))
    return Section(_TITLES["shift"], html=f"<p>{text}</p>", figures=figs)


def _probes(result: Any) -> Section | None:
    p = _t(result, "probes")
    if not len(p):
        return None
    order = _order(result)
    mae = p[p.metric == "mae"]
    probe, chance = mae[mae.condition == "probe"], mae[mae.condition == "chance"]
    chance_level = float(chance.value.mean()) if len(chance) else float("nan")
    control = mae[mae.condition == "control"]
    sentences = []
    for m in [m for m in order if m in set(probe.member)]:
        g = probe[probe.member == m].groupby("layer").value.mean().sort_index()
        best = g.idxmin()
        sentences.append(f"{m} {g.iloc[0]:.1f} {_layer_name(int(g.index[0]))}, {g.iloc[-1]:.1f} after layer "
                         f"{int(g.index[-1])} (lowest {g.min():.1f} {_layer_name(int(best))})")
    fig = _line_figure(probe, "layer", "value", order, "Absolute position recovered from the residual stream",
                       "layer (residual stream after it; -1 = the embedding)", "probe mean absolute error (positions)",
                       _cap(result, "Ridge probe, grouped cross-validation over windows; dashed: chance."))
    if chance_level == chance_level:
        fig.add_hline(y=chance_level, line=dict(color=REFERENCE_COLOR, dash="dash", width=1.5))
    text = (f"Mean absolute error (positions) of a linear probe for the token's position, chance {chance_level:.1f}, "
            f"shuffled-label control {control.value.mean():.1f}: " + "; ".join(sentences) + ". Haviv et al. (2022): "
            "a causal model without positions still learns absolute position (from the causal mask), within its "
            "first layers." + _refused_text(result, "probes"))
    return Section(_TITLES["probes"], html=f"<p>{text}</p>", figures=[fig])


def _layer_name(layer: int) -> str:
    return "at the embedding" if layer < 0 else f"after layer {layer}"


def _heads(result: Any) -> Section | None:
    import plotly.express as px

    cls = _t(result, "head_classes")
    heads = _t(result, "heads")
    if not len(cls):
        return None
    order = _order(result)
    n_models = cls.groupby("member").model.nunique()
    counts = cls.groupby(["member", "kind"]).size().div(n_models, level="member").rename("heads").reset_index()
    fig = px.bar(counts, x="member", y="heads", color="kind", category_orders={"member": order},
                 color_discrete_sequence=list(COLORS), title="Head classes per member (mean over seeds)")
    figs = [style(fig, caption=_cap(result, "Classes by posprobe's head-signature rules (heads report)."))]
    win = heads[heads.metric == "window"] if len(heads) else heads
    sentences = []
    if len(win):
        box = px.box(win, x="member", y="value", points="all", category_orders={"member": order},
                     title="Attention window per head: the distance holding 90% of the attention",
                     labels={"value": "window (tokens back)"})
        figs.append(style(box, caption=_cap(result, "Per head: the smallest d whose offsets 0..d hold 90% of the "
                                                    "mean attention; heads wider than the window measured are "
                                                    "left out.")))
        med, low = win.groupby("member").value.median(), win.groupby("member").value.min()
        sentences.append("Attention window (tokens back holding 90% of a head's attention), median and narrowest "
                         "head: " + ", ".join(f"{m} {med[m]:.0f} / {low[m]:.0f}" for m in order
                                              if m in med.index and med[m] == med[m]) + ".")
    prev = counts[counts.kind == "previous-token"].set_index("member").heads
    sink = counts[counts.kind == "sink"].set_index("member").heads
    sentences.append("Previous-token heads per model: " + ", ".join(f"{m} {prev.get(m, 0):.1f}" for m in order
                                                                   if m in n_models.index)
                     + "; sink heads: " + ", ".join(f"{m} {sink.get(m, 0):.1f}" for m in order if m in n_models.index)
                     + ".")
    return Section(_TITLES["heads"], html="<p>" + " ".join(sentences) + _refused_text(result, "heads") + "</p>",
                   figures=figs)


def similarity_matrix(layer_table: pd.DataFrame) -> pd.DataFrame:
    """Member x other member: Kazemnejad et al.'s number (per layer the mean over A's heads of the JSD to B's nearest
    head), averaged over layers and over the pairs of models of the two members (a member against itself: its
    seeds against each other; NaN with one seed)."""
    d = layer_table[layer_table.model != layer_table.other]
    return d.pivot_table(index="member", columns="other_member", values="jsd_min", aggfunc="mean")


def _similarity(result: Any) -> Section | None:
    import plotly.graph_objects as go

    t = _t(result, "head_similarity_layer")
    if not len(t):
        return None
    order = [m for m in _order(result) if m in set(t.member)]
    mat = similarity_matrix(t).reindex(index=order, columns=order)
    fig = go.Figure(go.Heatmap(z=mat.values, x=order, y=order, colorscale="Viridis_r",
                               colorbar=dict(title="JSD (nats)"),
                               hovertemplate="%{y} heads vs nearest %{x} head: %{z:.3f}<extra></extra>"))
    fig.update_layout(title="Head similarity: mean JSD to the nearest head of the other member, same layer",
                      xaxis_title="other member (B)", yaxis_title="member (A)")
    fig = style(fig, caption=caption(result.meta, None, note="Diagonal: a member's seeds against each other. Lower "
                                                             "= more alike."), height=560)
    sentences = []
    for m in order:
        row = mat.loc[m].drop(m, errors="ignore").dropna().sort_values()
        if not len(row):
            continue
        own = mat.loc[m, m] if m in mat.columns else float("nan")
        sentences.append(f"{m}: nearest {row.index[0]} ({row.iloc[0]:.3f}), farthest {row.index[-1]} "
                         f"({row.iloc[-1]:.3f})" + (f", its other seed {own:.3f}" if own == own else ""))
    text = ("For every head of member A, the Jensen-Shannon divergence (nats) of its attention to the nearest head of "
            "member B in the same layer on the same inputs, averaged over heads, layers and seeds: "
            + "; ".join(sentences) + ". Kazemnejad et al. (2023, Fig. 4) found NoPE's heads as close to T5-bias "
            "heads as to another NoPE seed and far from rotary and absolute ones." + _refused_text(result,
                                                                                                  "similarity"))
    return Section(_TITLES["similarity"], html=f"<p>{text}</p>", figures=[fig])


def _sinks(result: Any) -> Section | None:
    import plotly.express as px

    share = _t(result, "sink_overall")
    if not len(share):
        return None
    order = _order(result)
    fig = px.bar(share.groupby(["member", "condition"], as_index=False).value.mean(), x="member", y="value",
                 color="condition", barmode="group", category_orders={"member": order},
                 color_discrete_sequence=list(COLORS), labels={"value": "sink share"},
                 title="Attention sinks: share of (sequence, head) pairs with Sink_1^0.3 (Gu et al. 2025)")
    # A share is a fraction: a fixed 0..1 axis, so a zoo without sinks shows bars at 0, not an empty -1..1 frame.
    fig.update_yaxes(range=[0, 1], tickformat=".0%")
    if not (share["value"] > 0).any():
        fig.add_annotation(text="every share is 0: no model has a sink (Sink_1^0.3) on these inputs", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5)
    fig = style(fig, caption=_cap(result, "Random tokens and text windows."))
    by = share.pivot_table(index="member", columns="condition", values="value", aggfunc="mean")
    parts = [f"{m} {_pct(by.loc[m].get('random'))} / {_pct(by.loc[m].get('text'))}" for m in order if m in by.index]
    text = "Sink share on random tokens / text: " + ", ".join(parts) + "."
    ctl = _t(result, "sink_control")
    if len(ctl):
        c = ctl[ctl.metric == "sink_share"].pivot_table(index="member", columns="variant", values="value",
                                                         aggfunc="mean")
        moved = [v for v in c.columns if v.startswith("first token at position")]
        if "as is" in c.columns and moved:
            text += (" Does the sink follow position 0 or the token? Share with the first token moved to a later "
                     "position, against as is: " + ", ".join(
                         f"{m} {_pct(c.loc[m, moved[0]])} vs {_pct(c.loc[m, 'as is'])}" for m in order if m in c.index)
                     + ".")
    heads = (result.meta.get("headline") or {}).get("sinks", {})
    found = {k: v["massive"] for k, v in heads.items() if (v.get("massive") or {}).get("layer") is not None}
    text += (" Massive activations (Sun et al.: above 1000x the layer's median and 100): "
             + ("; ".join(f"{k} layer {v['layer']}, dims {v.get('dims')}" for k, v in found.items()) if found
                else "none in any model") + ".")
    return Section(_TITLES["sinks"], html=f"<p>{html.escape(text)}{_refused_text(result, 'sinks')}</p>",
                   figures=[fig])


def _geometry(result: Any) -> Section | None:
    import plotly.graph_objects as go

    from posprobe.report.geometry import overlap_text

    t = _t(result, "pos_token_subspace")
    if not len(t):
        return None
    fig = go.Figure()
    sentences = []
    for i, (model, g) in enumerate(t.groupby("model", sort=False)):
        w = g.pivot_table(index="k", columns="metric", values="value").sort_index()
        fig.add_trace(go.Scatter(x=w.index, y=w["pos_share_in_token"], name=str(model), mode="lines+markers",
                                 line=dict(color=COLORS[i % len(COLORS)])))
        if i == 0:
            fig.add_trace(go.Scatter(x=w.index, y=w["random_share"], name="random subspace (k / d_model)",
                                     mode="lines", line=dict(color=REFERENCE_COLOR, dash="dot")))
        one = SimpleNamespace(tables={"pos_token_subspace": g})  # overlap_text reads a result's tables
        sentences.append(f"<b>{html.escape(str(model))}</b>: {html.escape(overlap_text(one))}")
    fig.update_layout(title="Add or concatenate? The position table's variance inside the tokens' top-k subspace",
                      xaxis_title="k (subspace dimension)", yaxis_title="share of the table's variance",
                      xaxis_type="log")
    fig = style(fig, caption=caption(result.meta, None, note="Below the random line: positions avoid the tokens' "
                                                             "main directions (a learned concatenation)."))
    return Section(_TITLES["geometry"], html="<p>" + " ".join(sentences) + _refused_text(result, "geometry") + "</p>",
                   figures=[fig])


def _decomposition(result: Any) -> Section | None:
    import plotly.express as px

    d = _t(result, "decomposition")
    if not len(d):
        return None
    order = _order(result)
    share = d[(d.metric == "var_share") & (d.term == "positional")]
    per_model = share.groupby(["member", "model"], as_index=False).value.mean()
    fig = px.strip(share, x="member", y="value", category_orders={"member": order},
                   title="Layer 0: share of the score variance carried by positional terms, per head",
                   labels={"value": "positional share of score variance"})
    fig = style(fig, caption=_cap(result, "Exact split on learned tables (word/position terms), data-driven split "
                                          "elsewhere (positional mean, content, residual terms)."))
    methods = (result.meta.get("headline") or {}).get("decomposition", {})
    exact = sorted({_member_of(result, k) for k, v in methods.items() if v.get("method") == "exact-layer0"})
    text = ("Layer-0 score variance carried by positional terms (mean over heads): "
            + ", ".join(f"{m} {_spread(per_model[per_model.member == m].value)}" for m in order
                        if m in set(per_model.member))
            + f". Exact word/position split on {', '.join(exact) or 'no member'}; the others by the data-driven "
            "split (positional mean over the corpus; the ALiBi term is the bias itself).")
    return Section(_TITLES["decomposition"], html=f"<p>{html.escape(text)}{_refused_text(result, 'decomposition')}"
                                                  "</p>", figures=[fig])


def _member_of(result: Any, model: str) -> str:
    m = _t(result, "models")
    got = m[m.model == model].member
    return str(got.iloc[0]) if len(got) else model


def _frequency(result: Any) -> Section | None:
    b = _t(result, "bands")
    if not len(b):
        return None
    order = _order(result)
    # Bands as a fraction of the rotated bands, so a partial rotary member's few bands sit beside the full ones.
    n = b.groupby("model").band.transform("max") + 1
    b = b.assign(band_fraction=(b.band + 0.5) / n)
    per = b.groupby(["member", "model", "band_fraction"], as_index=False).value.mean()
    fig = _line_figure(per, "band_fraction", "value", order, "Share of |q·k| per RoPE band (fast → slow)",
                       "band (fraction of the rotated bands, fastest first)", "share of |score|",
                       _cap(result, "Mean over heads and layers."))
    fast = b[b.band < (n + 3) // 4].groupby(["member", "model", "layer", "head"]).value.sum()
    fast = fast.groupby(["member", "model"]).mean().reset_index()
    text = ("Share of the score's magnitude in the fastest quarter of the rotated bands (mean over heads): "
            + ", ".join(f"{m} {_spread(fast[fast.member == m].value)}" for m in order if m in set(fast.member)) + ".")
    return Section(_TITLES["frequency"], html=f"<p>{text}{_refused_text(result, 'frequency')}</p>", figures=[fig])


_SECTIONS = {"training": _training, "extrapolation": _extrapolation, "shift": _shift, "probes": _probes,
             "heads": _heads, "similarity": _similarity, "sinks": _sinks, "geometry": _geometry,
             "decomposition": _decomposition, "frequency": _frequency}


def _page(ref: str) -> Any:
    # A section's side-by-side page function, "module:function" as its AtlasSection declares it (meta "pages"; a
    # result saved before sections named their pages falls back to this module's own).
    import importlib

    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def figures(result: Any) -> list:
    """Every figure of the report, in section order."""
    return [f for s in sections(result) for f in (s.figures or [])]


def sections(result: Any) -> list[Section]:
    """Models, one section per analysis that ran, and every (model, section) that was refused with why."""
    m = result.meta
    models = _t(result, "models")
    intro = (f"<p>{len(models)} models on {html.escape(str(m['data']['source']))}; every analysis with the same text "
             "and bounds on each. Members are averaged over their seeds. Seconds per section: "
             + ", ".join(f"{k} {v:.0f}" for k, v in (m.get("seconds") or {}).items()) + ".</p>")
    out = [Section("Models", html=intro, table=models.drop(columns=["spec"], errors="ignore"))]
    pages = m.get("pages") or {}
    for name in m.get("sections") or []:
        sec = _page(pages.get(name))(result) if pages.get(name) else _SECTIONS[name](result)
        if sec is not None:
            out.append(sec)
    refused = _t(result, "refused")
    if len(refused):
        out.append(Section("Refused", html="<p>Every (model, section) an analysis did not run, with posprobe's "
                                           "reason.</p>", table=refused))
    return out


def headline_table(result: Any) -> pd.DataFrame:
    """One row per member (mean over its seeds) with each section's headline number: training loss (nats/token),
    perplexity at L and ppl(max factor x L) / ppl(L) (chunks), text perplexity at the largest shift k over k = 0,
    probe MAE after the first and last layer (positions), sink share on text, layer-0 positional score share."""
    order = _order(result)
    out = pd.DataFrame(index=pd.Index(order, name="member"))

    def put(col: str, s: pd.Series) -> None:
        out[col] = s.reindex(out.index)

    if len(t := _t(result, "training_members")):
        put("train_loss", t.groupby("member").loss.mean())
    if len(t := _t(result, "perplexity")) and "ppl" in t:
        ok = t[t.status == "ok"]
        chunks = ok[ok.protocol == "chunks"]
        put("ppl_L", chunks[chunks.factor == 1].groupby("member").ppl.mean())
        top = t[t.factor == t.factor.max()]
        top = top[top.protocol == "chunks"]
        cell = top.groupby("member").apply(lambda g: "cannot run" if (g.status == "cannot run").all()
                                           else f"{g.ppl_ratio.mean():.2f}", include_groups=False)
        put(f"ratio_{t.factor.max():g}L", cell)
    if len(t := _t(result, "shift_perplexity")):
        base = t[t.k == 0].set_index("model").perplexity
        last = t[t.k == t.groupby("model").k.transform("max")]
        put("shift_ppl_ratio", (last.perplexity / last.model.map(base)).groupby(last.member).mean())
    if len(t := _t(result, "probes")):
        p = t[(t.metric == "mae") & (t.condition == "probe")]
        per = p.groupby(["member", "layer"]).value.mean()
        put("probe_mae_first", per.groupby("member").first())
        put("probe_mae_last", per.groupby("member").last())
    if len(t := _t(result, "sink_overall")):
        put("sink_text", t[t.condition == "text"].groupby("member").value.mean())
    if len(t := _t(result, "decomposition")):
        d = t[(t.metric == "var_share") & (t.term == "positional")]
        put("positional_share_l0", d.groupby("member").value.mean())
    return out.reset_index().round(3)
