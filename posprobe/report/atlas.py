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
        nope = result.meta.get("nope_layers") or []
        if nope:  # a hybrid (SmolLM3's no_rope_layers): which layers rotate is part of the fact
            rot += (f", on {f['n_layers'] - len(nope)} of {f['n_layers']} layers; no rotary (NoPE) on "
                    f"layer{'s' if len(nope) > 1 else ''} {_layer_list(nope)}")
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
        text = (f"Gu et al. 2025 Sink_1^0.3: {rnd:.0%} of (sequence, head) pairs sink on the first token on random "
                f"tokens, {txt:.0%} on text" if rnd is not None and txt is not None else "Attention sinks")
        if the is not None:
            text += f"; {the:.0%} with the text's first token replaced by 'the' (does the sink follow the token?)"
        part = getattr(result, "parts", {}).get("sinks")
        if part is not None:
            from posprobe.report.sinks import ablation_text, control_reading, massive_text

            return text + "." + control_reading(part) + massive_text(part) + ablation_text(part)
        return text + "."
    if section == "frequency":
        fast, slow = n("abs_share_fastest_quarter"), n("abs_share_slowest_quarter")
        kinds = {r.metric[2:]: int(r.value) for r in result.tables["atlas"].itertuples()
                 if r.section == "frequency" and r.metric.startswith("n_")}
        return (f"On average a head draws {fast:.0%} of its score magnitude from the fastest quarter of rotary "
                f"bands and {slow:.0%} from the slowest quarter. By how much of the score's variance relative "
                f"distance explains: {', '.join(f'{v} {k}' for k, v in kinds.items())} heads"
                f"{_frequency_scope(result.meta, sum(kinds.values()))}.")
    if section == "geometry":
        from posprobe.report.geometry import overlap_text

        pc1 = n("wpos_pc1_explained")
        part = getattr(result, "parts", {}).get("geometry")
        sentence = overlap_text(part) if part is not None else ""
        extra = " " + sentence if sentence else ""
        return (f"The first principal component of the learned position table explains {pc1:.0%} of its variance; "
                "the report shows the trajectory of positions in the top components and their sinusoid fits."
                + extra if pc1 is not None else "Residual-stream position geometry (see the section report).")
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

            return summary_text(part) + cross_check_text(result.meta)
        return (f"Needle accuracy {n('needle_accuracy'):.2f}; {n('n_retrieval'):.0f} retrieval heads; with the top "
                f"heads masked {n('needle_accuracy_top_masked'):.2f}, with random heads masked "
                f"{n('needle_accuracy_random_masked'):.2f}." + cross_check_text(result.meta))
    return ""


def _layer_list(layers: list[int]) -> str:
    return ", ".join(map(str, layers))


def _frequency_scope(meta: dict, counted: int) -> str:
    # Why the counts cover fewer heads than the model has: the section measures rotary layers only.
    f = meta["model"]
    total = int(f["n_layers"]) * int(f["n_heads"])
    if counted >= total:
        return f" (all {total} query heads)"
    measured = meta.get("frequency_layers")
    if measured is None:
        return f" ({counted} of {total} query heads: the rotary layers' only)"
    missing = [l for l in range(int(f["n_layers"])) if l not in measured]
    if not missing:
        return f" ({counted} of {total} query heads)"
    why = "no rotary bands to measure (NoPE)" if set(missing) <= set(meta.get("nope_layers") or []) else "not measured"
    return (f" ({counted} of {total} query heads: those of the {len(measured)} rotary layers; layer"
            f"{'s' if len(missing) > 1 else ''} {_layer_list(missing)} {'have' if len(missing) > 1 else 'has'} {why})")


def cross_check_text(meta: dict) -> str:
    """The heads that zeroing barely moves on the text loss although they are retrieval heads, in one sentence ("" where
    the atlas did not run both)."""
    cc = meta.get("ablation_retrieval")
    if not cc:
        return ""
    flagged = cc["flagged"]
    if not flagged:
        return " Cross-check: no head labelled low-effect by zeroing it (sinks section, text loss) is a retrieval head."
    names = ", ".join(f"L{l}H{h}" for l, h in flagged)
    many = len(flagged) > 1
    return (f" Cross-check: {names} {'are' if many else 'is'} labelled low-effect by zeroing (sinks section: the text "
            f"loss barely moves) yet {'are retrieval heads' if many else 'is a retrieval head'} here: a low effect on "
            "that loss does not mean a head does nothing.")


def skipped_sections(meta: dict) -> list[tuple[str, str]]:
    """(section, why) for each section the atlas did not run: not applicable to the model (the reason from
    `skip_reasons`), not among the sections asked for, or left out by --quick."""
    why = meta.get("skipped_why", {})
    # skipped_why holds the model's reasons only; a skipped section without one was not asked for.
    out = [(s, why.get(s, "not among the sections asked for")) for s in meta.get("skipped", [])]
    return out + [(s, "left out by --quick (the short tour)") for s in meta.get("left_out", [])]


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
    skipped = "; ".join(f"{_TITLES[s]} ({why[s]})" for s in m.get("skipped", []) if s in why)
    not_asked = ", ".join(_TITLES[s] for s in m.get("skipped", []) if s not in why)
    left_out = ", ".join(_TITLES[s] for s in m.get("left_out", []))
    w = _window(m)
    sink = f" (attention sinks: {m['sink_length']}, as Gu et al. 2025)" if "sinks" in m["sections"] and m.get(
        "sink_length") else ""
    intro = (f"<ol>{toc}</ol><p>Data: {html.escape(str(m['data']['source']))}; windows of {w} tokens{sink}. "
             f"{('Skipped on this model: ' + html.escape(skipped) + '. ') if skipped else ''}"
             f"{('Not asked for (sections): ' + html.escape(not_asked) + '. ') if not_asked else ''}"
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
        table = None
        cross = result.tables.get("ablation_retrieval")
        if s == "retrieval" and cross is not None and len(cross):
            flagged = {tuple(x) for x in m["ablation_retrieval"]["flagged"]}
            table = cross.drop(columns=["model"], errors="ignore").round(4).assign(
                flag=["low-effect on the text loss, yet a retrieval head" if (r.layer, r.head) in flagged else ""
                      for r in cross.itertuples()])
            body += f"<p>Cross-check rule: {html.escape(m['ablation_retrieval']['rule'])}.</p>"
        out.append(Section(_TITLES[s], html=body, figures=figs, table=table))
    return out
