"""Report page of the attention-sink analysis, built from the `sink_heads` and `sink_share` tables only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.compare import compare_caption, member_order, pct, refused_text, table, unit
from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, caption, layer_head_heatmap, style

#: Per-head metrics shown as layer x head heatmaps (one per condition), with what the colour means.
HEATMAPS = {
    "first_attention": "mean attention on the first token (alpha_1)",
    "first_key_norm_ratio": "first token's key norm / other keys' mean norm",
    "first_value_norm_ratio": "first token's value norm / other values' mean norm",
}


def title(result: Any) -> str:
    """Report title."""
    return f"Attention sinks: {result.meta['model']['name']}"


def figure_caption(meta: dict | None, note: str | None = None) -> str:
    """Caption of a sink figure: model, data, sequence length, epsilon."""
    m = meta or {}
    cfg = m.get("config", {})
    return caption(m, {"T": cfg.get("length"), "epsilon": cfg.get("epsilon"), "sequences": m.get("sequences")},
                   note=note)


def share_by_layer(share: pd.DataFrame, meta: dict | None = None) -> Any:
    """Sink_1^epsilon per layer, one line per condition."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for cond, d in share.groupby("condition", sort=False):
        fig.add_trace(go.Scatter(x=d.layer, y=d.value, mode="lines+markers", name=str(cond)))
    fig.update_layout(title="Share of heads that sink on the first token, per layer (Gu et al. 2025 Sink_1^epsilon)",
                      xaxis_title="layer", yaxis_title="share of (sequence, head) pairs", yaxis_range=[0, 1.02])
    return style(fig, caption=figure_caption(meta, "A head sinks on a sequence when its attention on the first "
                                                   "token, averaged over all queries, exceeds epsilon."), height=400)


def heatmap(heads: pd.DataFrame, metric: str, condition: str, label: str, meta: dict | None = None) -> Any:
    """Layer x head heatmap of one metric under one condition."""
    return layer_head_heatmap(heads[(heads.metric == metric) & (heads.condition == condition)], metric,
                              f"{label} ({condition})", figure_caption(meta))


def figures(result: Any) -> list:
    """Share per layer, then heatmaps of the first token's attention and key/value norm ratios per condition."""
    heads = result.tables["sink_heads"]
    figs = [share_by_layer(result.tables["sink_share"], result.meta)]
    for cond in heads.condition.unique():
        figs += [heatmap(heads, m, cond, label, result.meta) for m, label in HEATMAPS.items()]
    return figs


def summary_text(result: Any) -> str:
    """One paragraph in words from the numbers: the share per condition and what sets the first token apart."""
    m, heads = result.meta, result.tables["sink_heads"]
    eps, T = m["config"]["epsilon"], m["config"]["length"]
    parts = []
    for cond, value in m["sink_share"].items():
        h = heads[heads.condition == cond].groupby("metric").value
        sinking = heads[(heads.condition == cond) & (heads.metric == "sink_rate") & (heads.value > 0.5)]
        ratio = heads[(heads.condition == cond) & (heads.metric.isin(["first_key_norm_ratio",
                                                                      "first_value_norm_ratio"]))]
        w = ratio.pivot_table(index=["layer", "head"], columns="metric", values="value")
        keys = sinking[["layer", "head"]].merge(w.reset_index(), on=["layer", "head"])
        why = (f"; on the heads that sink on most sequences ({len(keys)}), the first token's key norm is "
               f"{keys.first_key_norm_ratio.median():.2f}x and its value norm "
               f"{keys.first_value_norm_ratio.median():.2f}x the other tokens' (medians)") if len(keys) else ""
        means = h.mean()
        delim = ""
        if m.get("delimiter_sequences", {}).get(cond) and means.get("delim_attention") == means.get("delim_attention"):
            delim = (f"; the first delimiter ({m['delimiter_sequences'][cond]} sequences have one) gets "
                     f"{means['delim_attention']:.2f} of the later queries' attention on average, its value norm "
                     f"{means['delim_value_norm_ratio']:.2f}x the others'")
        parts.append(f"{cond} ({m['sequences'][cond]} sequences): {value:.1%} of (sequence, head) pairs sink; queries' "
                     f"cosine with the first key {means['first_key_cos']:.2f} vs {means['other_key_cos']:.2f} "
                     f"with the others{why}{delim}")
    return (f"Sink_1^{eps} on {T}-token sequences (Gu et al. 2025): " + "; ".join(parts) + "." + control_text(result)
            + massive_text(result) + ablation_text(result))


#: What moving the first token from position 0 to position p predicts by the positional mechanism alone, before any
#: sink, keyed by how the family's positions are set (`Family.control`); "{p}" is the position it moves to.
CONTROL_READINGS = {
    "score bias": ("each head's score bias falls linearly with query-key distance, so it favours near keys. The first "
                   "token at position {p} is {p} positions nearer to every later query (and ahead of the queries "
                   "before {p}), so the bias alone predicts more attention on it, sink or no sink; the second token at "
                   "position 0 brings it one position nearer. A change in the position variants is what the bias "
                   "predicts, not evidence that the sink follows position 0."),
    "q/k rotation": ("scores see only query-key offsets; the first token at position {p} is {p} positions nearer to "
                     "every later query. A sink that needs the token at the start of the sequence would fade; one "
                     "carried by the token itself would stay."),
    "position ids": ("the first token gets position {p}'s embedding instead of position 0's. A sink carried by the "
                     "position-0 embedding would fade; one carried by the token itself would stay."),
}


def control_meaning(positional_kind: str, moved_to: int) -> dict:
    """What the position variants of the sink control can show on a model of `positional_kind`, the first token moved
    to `moved_to`: {"moved_to", "mechanism" (the family's phrase), "reading" (None where posprobe cannot move the
    family's positions), "predicts_more_attention" (True where the mechanism alone predicts more attention on the
    moved token, None where it predicts no direction)}."""
    from posprobe.backend.families import SCORE_BIAS, find

    fam = find(positional_kind)
    reading = None if fam is None or fam.control is None else CONTROL_READINGS.get(fam.control)
    return {"moved_to": int(moved_to), "mechanism": fam.phrase if fam is not None else positional_kind,
            "reading": reading.format(p=moved_to) if reading else None,
            # Only a distance bias fixes the direction in advance: nearer keys get a larger score.
            "predicts_more_attention": True if fam is not None and fam.control == SCORE_BIAS else None}


def control_reading(result: Any) -> str:
    """What the model's positional mechanism alone predicts for the control's position variants, and (where it
    predicts a direction) whether the measured first-token attention went that way ("" where there is nothing to
    read: no control, no position variants, a family posprobe cannot move)."""
    ctl = result.tables.get("sink_control")
    if ctl is None or not len(ctl):
        return ""
    m = result.meta
    meaning = m.get("control") or {}
    if "reading" not in meaning:  # a result saved before meta["control"]: rebuilt from the facts and the config
        meaning = control_meaning(m["model"]["positional_kind"], m["config"]["length"] // 2)
    first = ctl[ctl.metric == "first_attention"].set_index("variant").value
    moved = f"first token at position {meaning['moved_to']}"
    if meaning.get("reading") is None or moved not in first.index:
        return ""
    out = f" With {meaning['mechanism']} positions, {meaning['reading']}"
    if meaning.get("predicts_more_attention") is not None:
        agree = (first[moved] > first["as is"]) == meaning["predicts_more_attention"]
        how = "the direction the mechanism predicts" if agree else "against what the mechanism alone predicts"
        out += (f" Measured: mean first-token attention {first['as is']:.3f} as is, {first[moved]:.3f} moved "
                f"({how}).")
    return out


def control_text(result: Any) -> str:
    """The position-vs-token control in words, with what the model's positional mechanism alone predicts for the
    position variants ("" without the control)."""
    ctl = result.tables.get("sink_control")
    if ctl is None or not len(ctl):
        return ""
    share = ctl[ctl.metric == "sink_share"].set_index("variant").value
    parts = [f"{v} {share[v]:.1%}" for v in share.index if v != "as is"]
    return (f" Position vs token (text windows, sink share as is {share['as is']:.1%}): " + ", ".join(parts) + "."
            + control_reading(result))


def ablation_text(result: Any) -> str:
    """The zeroed sink heads in words, each label with its measured definition ("" without the table)."""
    d, m = result.tables.get("head_ablation"), result.meta.get("ablation", {})
    if d is None or not len(d):
        return f" Zeroing sink heads: no candidate ({m['rule']})." if m.get("candidates") == 0 else ""
    counts = []
    for label in m.get("labels", {}):
        heads = d[d.kind == label]
        if len(heads):
            names = ", ".join(f"L{int(r.layer)}H{int(r.head)}" for r in heads.itertuples())
            counts.append(f"{len(heads)} {label} ({names})")
    return (f" Zeroing each of the {len(d)} heads with the most first-token attention, one at a time: "
            f"{'; '.join(counts)}, by the mean next-token loss on the {m['tokens']}-token text windows (low-effect: "
            f"|delta| < {m['max_delta']} nats/token on this loss only; the head may matter elsewhere, e.g. for "
            f"long-context retrieval; median |delta| {d.delta_loss.abs().median():.4f} nats/token).")


def massive_text(result: Any) -> str:
    """A sentence on the massive activations and their intervention, from the tables ("" without them)."""
    acts, m = result.tables.get("massive_activations"), result.meta.get("massive", {})
    if acts is None or not len(acts):
        return ""
    top = acts.sort_values("ratio", ascending=False).iloc[0]
    out = (f" Largest residual activation: {top.value:.1f} ({top.ratio:.0f}x the median |activation|) in layer "
           f"{int(top.layer)}, dim {int(top.dim)}, position {int(top.pos)} ({top.token!r}, {top.condition}).")
    eff = result.tables.get("massive_intervention")
    if eff is None or not len(eff):
        return out + f" No intervention: {m.get('skipped', 'no massive activation')}."
    v = eff.set_index(["variant", "metric"]).value
    zero, mean = v["zero", "nll"] - v["none", "nll"], v["mean", "nll"] - v["none", "nll"]
    rule = f"|h| > {m['min_abs']:g} and > {m['ratio']:g}x its sequence's median" if "min_abs" in m else "massive"
    if (m.get("min_abs"), m.get("ratio")) == (100.0, 1000.0):
        rule += ", Sun et al."  # their definition only at their bars
    out += (f" Setting the {m['massive_entries']} massive entries ({rule}) of layer {m['layer']} (dims "
            f"{', '.join(map(str, m['dims']))}) to zero changes the text loss by {zero:+.3f} nats/token, to their "
            f"mean by {mean:+.3f}")
    if ("none", "first_attention") in v.index:
        out += (f"; the first token's attention in later layers goes from {v['none', 'first_attention']:.2f} to "
                f"{v['zero', 'first_attention']:.2f} (zero) / {v['mean', 'first_attention']:.2f} (mean)")
    return out + "."


def _runs(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)) else (
        ", ".join(map(str, layers)))


def sections(result: Any) -> list[Section]:
    """Summary in words, the share per layer, figures, per-head table."""
    m = result.meta
    points = "; ".join(f"{pts} on layers {_runs(ls)}" for pts, ls in m["qk_points"].items())
    intro = (f"<p>{html.escape(summary_text(result))}</p><p>q/k read at: {html.escape(points)}; first tokens "
             f"of the first sequences: {html.escape(str(m['first_tokens']))}.</p>")
    share = result.tables["sink_share"].pivot(index="layer", columns="condition", values="value").round(3)
    wide = result.tables["sink_heads"].pivot_table(index=["condition", "layer", "head"], columns="metric",
                                                   values="value").reset_index().round(3)
    out = [Section("Summary", html=intro + table_html(share)), Section("Figures", figures=figures(result)),
           Section("Every head", table=wide)]
    ctl = result.tables.get("sink_control")
    if ctl is not None and len(ctl):
        out.append(Section("Position or token?", html="<p>Text windows as they are, with the first token moved to "
                           "position length // 2 (still seen first), and with it replaced by 'the' or a newline."
                           f"{html.escape(control_reading(result))}</p>",
                           table=ctl.pivot_table(index="variant", columns="metric", values="value", sort=False)
                           .round(3).reset_index()))
    ablation = result.tables.get("head_ablation")
    if ablation is not None and len(ablation):
        labels = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>"
                         for k, v in m["ablation"]["labels"].items())
        out.append(Section("Zeroing sink heads: effect on the text loss",
                           html=f"<p>{html.escape(m['ablation']['rule'])}.</p><ul>{labels}</ul>",
                           table=ablation.drop(columns="model").round(4)))
    acts = result.tables.get("massive_activations")
    if acts is not None and len(acts):
        cfg = m["config"]
        rule = (f"Per layer the {cfg['massive_top']} largest |residual activations| after the block at distinct "
                "(position, dimension), over the corpus; ratio to the mean over sequences of the median "
                "|activation|. Massive (Sun et al. 2024): above "
                f"{cfg['massive_ratio']:g}x the median and above {cfg.get('massive_abs', 0):g} in magnitude. "
                "Intervention: at the first layer with a massive activation, the massive entries of those dimensions "
                "are set to zero or to their mean over the text.")
        eff = result.tables.get("massive_intervention")
        extra = table_html(eff.drop(columns="model").round(4)) if eff is not None and len(eff) else ""
        out.append(Section("Massive activations", html=f"<p>{html.escape(rule)}</p>" + extra,
                           table=acts.drop(columns="model").round(3)))
    return out


def atlas_paragraph(result: Any, n: Any) -> str:
    """The atlas's sinks section in words: Gu et al.'s share on random tokens and text, the 'the'-first control,
    the position-vs-token reading, massive activations and the ablation."""
    rnd, txt, the = n("sink_share_random"), n("sink_share_text"), n("sink_share_the_first")
    text = (f"Gu et al. 2025 Sink_1^0.3: {rnd:.0%} of (sequence, head) pairs sink on the first token on random "
            f"tokens, {txt:.0%} on text" if rnd is not None and txt is not None else "Attention sinks")
    if the is not None:
        text += f"; {the:.0%} with the text's first token replaced by 'the' (does the sink follow the token?)"
    part = result.parts["sinks"]
    return text + "." + control_reading(part) + massive_text(part) + ablation_text(part)


# --- the atlas over many models: this analysis's models side by side -----------------------------------------

def compare_section(result: Any) -> Section | None:
    """The atlas over many models' sinks section: sink share on random tokens and text, the position-vs-token
    control and massive activations per member. None where no model measured it."""
    import plotly.express as px

    share = table(result, "sink_overall")
    if not len(share):
        return None
    order = member_order(result)
    fig = px.bar(share.groupby(["member", "condition"], as_index=False).value.mean(), x="member", y="value",
                 color="condition", barmode="group", category_orders={"member": order},
                 color_discrete_sequence=list(COLORS), labels={"value": "sink share", "member": unit(result)},
                 title="Attention sinks: share of (sequence, head) pairs with Sink_1^0.3 (Gu et al. 2025)")
    # A share is a fraction: a fixed 0..1 axis, so a zoo without sinks shows bars at 0, not an empty -1..1 frame.
    fig.update_yaxes(range=[0, 1], tickformat=".0%")
    if not (share["value"] > 0).any():
        fig.add_annotation(text="every share is 0: no model has a sink (Sink_1^0.3) on these inputs", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5)
    fig = style(fig, caption=compare_caption(result, "Random tokens and text windows."))
    by = share.pivot_table(index="member", columns="condition", values="value", aggfunc="mean")
    parts = [f"{m} {pct(by.loc[m].get('random'))} / {pct(by.loc[m].get('text'))}" for m in order if m in by.index]
    text = "Sink share on random tokens / text: " + ", ".join(parts) + "."
    ctl = table(result, "sink_control")
    if len(ctl):
        c = ctl[ctl.metric == "sink_share"].pivot_table(index="member", columns="variant", values="value",
                                                         aggfunc="mean")
        moved = [v for v in c.columns if v.startswith("first token at position")]
        if "as is" in c.columns and moved:
            text += (" Does the sink follow position 0 or the token? Share with the first token moved to a later "
                     "position, against as is: " + ", ".join(
                         f"{m} {pct(c.loc[m, moved[0]])} vs {pct(c.loc[m, 'as is'])}" for m in order if m in c.index)
                     + ".")
    heads = (result.meta.get("headline") or {}).get("sinks", {})
    found = {k: v["massive"] for k, v in heads.items() if (v.get("massive") or {}).get("layer") is not None}
    text += (" Massive activations (Sun et al.: above 1000x the layer's median and 100): "
             + ("; ".join(f"{k} layer {v['layer']}, dims {v.get('dims')}" for k, v in found.items()) if found
                else "none in any model") + ".")
    return Section("Attention sinks and massive activations",
                   html=f"<p>{html.escape(text)}{refused_text(result, 'sinks')}</p>", figures=[fig])
