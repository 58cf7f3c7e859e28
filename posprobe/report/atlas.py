"""Report page of the atlas: a table of contents, one paragraph in words per section generated from
the numbers, the key figure(s) of each section, and links to each section's full report."""

from __future__ import annotations

import html
from typing import Any

from posprobe.report.html import Section

_TITLES = {"facts": "Positional facts", "heads": "Head signatures", "sinks": "Attention sinks",
           "frequency": "RoPE frequency usage",
           "geometry": "Learned-position geometry", "probes": "Position probes", "shift": "Shift test",
           "retrieval": "Retrieval heads"}


def title(result: Any) -> str:
    """Report title."""
    return f"Positional atlas: {result.meta['model']['name']}"


def _num(result: Any, section: str, metric: str) -> float | None:
    t = result.tables["atlas"]
    v = t[(t.section == section) & (t.metric == metric)].value
    return float(v.iloc[0]) if len(v) else None


def relative_views_text(views: dict | None) -> str:
    """The two views of relative position in layer 0 (learned positions) in one sentence; "" without them."""
    if not views:
        return ""

    def names(heads: list, values: bool = False) -> str:
        if not heads:
            return "none"
        return ", ".join(f"L{l}H{h}" + (f" ({t:.2f} vs {p:.2f})" if values else "") for l, h, t, p in heads)

    term, pattern = views["term"], views["pattern"]
    return (f" Layer 0, two views of relative position: the position x position score term follows the offset i - j "
            f"(R² >= {views['term_relative']}) and carries >= {views['term_positional']:.0%} of the score variance in "
            f"{len(term)} heads ({names(term)}); the attention pattern does (R² > {views['pattern_threshold']}) in "
            f"{len(pattern)} ({names(pattern)}). Score term only: {names(views['term_only'], True)}; pattern only: "
            f"{names(views['pattern_only'], True)} (term R² vs pattern R²).")


def paragraph(result: Any, section: str) -> str:
    """The section's findings in one paragraph, from the atlas table and meta."""
    f = result.meta["model"]
    n = lambda metric: _num(result, section, metric)  # noqa: E731
    if section == "facts":
        kind = f["positional_kind"].replace("_", " ")
        rot = ""
        if f.get("rotary_dim"):
            base = f.get("rotary_base_per_layer")
            rot = (f", rotary dim {f['rotary_dim']} ({f.get('rotary_pairing')} pairing), base "
                   f"{base if not isinstance(base, list) else 'per layer ' + ', '.join(map(str, sorted(set(base))))}")
        enc = "encoder" if f.get("is_encoder") else "decoder"
        text = (f"{f['name']} is a {f['n_layers']}-layer {enc} with {kind} positions{rot}; {f['n_heads']} query heads "
                f"and {f.get('n_kv_heads', f['n_heads'])} key/value heads per layer; context {f['n_ctx']} positions.")
        if f.get("unsupported"):
            text += f" Position analyses skipped: {f['unsupported']}."
        return text
    if section == "heads":
        from posprobe.report.heads import summary_text

        part = getattr(result, "parts", {}).get("heads")
        if part is not None:
            return summary_text(part) + relative_views_text(result.meta.get("relative_views"))
        return (f"Strongest previous-token attention {n('max_prev_mass'):.2f}; mean attention on the first token "
                f"{n('mean_first_mass'):.2f}; {n('sink_fraction'):.0%} of heads are sink heads.")
    if section == "sinks":
        rnd, txt, the = n("sink_share_random"), n("sink_share_text"), n("sink_share_the_first")
        text = (f"Gu et al.'s Sink_1^0.3: {rnd:.0%} of (sequence, head) pairs sink on the first token on random "
                f"tokens, {txt:.0%} on text" if rnd is not None and txt is not None else "Attention sinks")
        if the is not None:
            text += f"; {the:.0%} with the text's first token replaced by 'the' (does the sink follow the token?)"
        part = getattr(result, "parts", {}).get("sinks")
        if part is not None:
            from posprobe.report.sinks import massive_text

            text += "." + massive_text(part)
            return text
        return text + "."
    if section == "frequency":
        fast, slow = n("abs_share_fastest_quarter"), n("abs_share_slowest_quarter")
        kinds = {r.metric[2:]: int(r.value) for r in result.tables["atlas"].itertuples()
                 if r.section == "frequency" and r.metric.startswith("n_")}
        return (f"On average a head draws {fast:.0%} of its score magnitude from the fastest quarter of rotary "
                f"bands and {slow:.0%} from the slowest quarter. By how much of the score's variance relative "
                f"distance explains: {', '.join(f'{v} {k}' for k, v in kinds.items())} heads.")
    if section == "geometry":
        pc1 = n("wpos_pc1_explained")
        return (f"The first principal component of the learned position table explains {pc1:.0%} of its variance; "
                "the report shows the trajectory of positions in the top components and their sinusoid fits."
                if pc1 is not None else "Residual-stream position geometry (see the section report).")
    if section == "probes":
        first, last, ctrl, chance = (n(k) for k in ("mae_first_layer", "mae_last_layer", "mae_control", "mae_chance"))
        return (f"A linear probe recovers a token's absolute position from the residual stream with a mean absolute "
                f"error of {first:.1f} positions after the first block and {last:.1f} after the last, against "
                f"{ctrl:.1f} for the shuffled-label control and {chance:.1f} for predicting the mean.")
    if section == "shift":
        cos = {int(r.metric.split("_k")[1]): r.value for r in result.tables["atlas"].itertuples()
               if r.section == "shift" and r.metric.startswith("pooled_cosine_k")}
        if cos:
            far = max(cos)
            return (f"An encoder has no LM head, so the shift test measures representation drift: the mean-pooled last "
                    f"layer at start position k={far} has cosine {cos[far]:.3f} to the same sentences at k=0 "
                    f"({', '.join(f'{v:.3f} at k={k}' for k, v in sorted(cos.items()) if k)}).")
        accs = {int(r.metric.split("_k")[1]): r.value for r in result.tables["atlas"].itertuples()
                if r.section == "shift" and r.metric.startswith("accuracy_k")}
        dev = n("max_abs_logp_change")
        ks = sorted(accs)
        text = ("Minimal-pair accuracy (built-in pairs) " +
                ", ".join(f"{accs[k]:.3f} at k={k}" for k in ks) + ".")
        if f["positional_kind"] == "rotary":
            text += (f" RoPE control: shifting queries and keys together cannot change relative positions, and the "
                     f"largest change of any sentence's log-probability was {dev:.2g} nats (float rounding).")
        elif len(ks) > 1:
            text += (f" Learned absolute positions: starting the sentences at k={ks[-1]} instead of 0 changes "
                     f"accuracy by {accs[ks[-1]] - accs[0]:+.3f}.")
        return text
    if section == "retrieval":
        part = getattr(result, "parts", {}).get("retrieval")
        if part is not None:
            from posprobe.report.retrieval import summary_text

            return summary_text(part)
        return (f"Needle accuracy {n('needle_accuracy'):.2f}; {n('n_retrieval'):.0f} retrieval heads; with the top "
                f"heads masked {n('needle_accuracy_top_masked'):.2f}, with random heads masked "
                f"{n('needle_accuracy_random_masked'):.2f}.")
    return ""


def figures(result: Any) -> list:
    """The key figure of each section that ran (needs the parts, i.e. a result fresh from run_atlas)."""
    parts = getattr(result, "parts", {})
    figs = []
    if "heads" in parts:
        figs += parts["heads"].figures()[:2]
    if "sinks" in parts:
        figs += parts["sinks"].figures()[:1]
    if "frequency" in parts:
        figs += parts["frequency"].figures()[:1]
    if "geometry" in parts:
        figs += parts["geometry"].figures()[:1]
    if "probes" in parts:
        figs += parts["probes"].figures()[:1]
    if "shift" in parts:
        figs += parts["shift"].figures()[:1]
    if "retrieval" in parts:
        figs += parts["retrieval"].figures()[:1]
    return figs


def _window(meta: dict) -> int:
    # The window the sections ran on (meta "window"; older atlases only had the configured one).
    return int(meta.get("window") or meta["config"]["window"])


def window_scope(meta: dict) -> str:
    """What windows of this size can and cannot show, in words: the share of the context, the offsets and positions a
    head signature or probe sees, the probe's chance error, and (RoPE) how many bands turn once inside a window."""
    import math

    f, sections = meta["model"], meta["sections"]
    n_ctx = int(f["n_ctx"])
    w = min(_window(meta), n_ctx)
    text = (f"Windows of {w} tokens cover {w / n_ctx:.1%} of the {n_ctx}-position context: head signatures see "
            f"offsets 0-{w - 1} only, so behaviour at longer range cannot show")
    if "probes" in sections:
        text += f"; the probes see positions 0-{w - 1} (predicting the mean errs by {w / 4:.0f} positions)"
    if "frequency" in sections and f.get("rotary_dim"):
        bases = f.get("rotary_base_per_layer")
        base = min(bases) if isinstance(bases, list) else float(bases)
        d = int(f["rotary_dim"])
        turning = sum(2 * math.pi * base ** (2 * i / d) <= w for i in range(d // 2))
        text += (f"; {turning} of {d // 2} rotary bands complete a turn inside a window (base {base:g}), the slower "
                 f"{d // 2 - turning} are seen over part of a turn")
    return text + ". Larger windows (AtlasConfig.window, --window) show more, at a cost linear to quadratic in w."


def sections(result: Any) -> list[Section]:
    """Table of contents, then per section: heading, paragraph, key figure(s), link to the full report."""
    m = result.meta
    parts = getattr(result, "parts", {})
    toc = "".join(f'<li><a href="#atlas-{s}">{html.escape(_TITLES[s])}</a></li>' for s in m["sections"])
    why = m.get("skipped_why", {})
    skipped = "; ".join(_TITLES[s] + (f" ({why[s]})" if s in why else "") for s in m.get("skipped", []))
    left_out = ", ".join(_TITLES[s] for s in m.get("left_out", []))
    w = _window(m)
    sink = f" (attention sinks: {m['sink_length']}, as Gu et al.)" if "sinks" in m["sections"] and m.get(
        "sink_length") else ""
    intro = (f"<ol>{toc}</ol><p>Data: {html.escape(str(m['data']['source']))}; windows of {w} tokens{sink}. "
             f"{('Skipped on this model: ' + html.escape(skipped) + '. ') if skipped else ''}"
             f"{('Left out by --quick: ' + html.escape(left_out) + '.') if left_out else ''}</p>"
             f"<p>{html.escape(window_scope(m))}</p>")
    out = [Section("Contents", html=intro)]
    keyfig = {"heads": 2, "sinks": 1, "frequency": 1, "geometry": 1, "probes": 1, "shift": 1, "retrieval": 1}
    for s in m["sections"]:
        body = f'<a id="atlas-{s}"></a><p>{html.escape(paragraph(result, s))}</p>'
        if s in parts:
            secs = m.get("seconds", {}).get(s)
            body += (f'<p><a href="{s}/report.html">Full {html.escape(_TITLES[s].lower())} report</a> '
                     f"(tables in <code>{s}/</code>{f', {secs:.0f} s' if secs is not None else ''}).</p>")
        figs = parts[s].figures()[: keyfig.get(s, 0)] if s in parts else []
        out.append(Section(_TITLES[s], html=body, figures=figs))
    return out
