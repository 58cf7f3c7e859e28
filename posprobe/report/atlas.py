"""Report page of the atlas: a table of contents, one paragraph in words per section generated from
the numbers, the key figure(s) of each section, and links to each section's full report."""

from __future__ import annotations

import html
from typing import Any

from posprobe.report.html import Section


def title(result: Any) -> str:
    """Report title."""
    return f"Positional atlas: {result.meta['model']['name']}"


def facts_paragraph(result: Any, n: Any) -> str:
    """The atlas's facts section in words: depth, encoder or decoder, positions (rotary dim, pairing, base; NoPE
    layers), heads and context; why position analyses were skipped, where they were."""
    f = result.meta["model"]
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
                f"layer{'s' if len(nope) > 1 else ''} {', '.join(map(str, nope))}")
    text = (f"{f['name']} is a {f['n_layers']}-layer {enc} with {kind} positions{rot}; {f['n_heads']} query heads "
            f"and {f.get('n_kv_heads', f['n_heads'])} key/value heads per layer; context {f['n_ctx']} positions.")
    if f.get("unsupported"):
        text += f" Position analyses skipped: {f['unsupported']}."
    return text


def paragraph(result: Any, section: str) -> str:
    """The section's findings in one paragraph: written by the section's own paragraph for an atlas fresh from
    run_atlas, read from meta "paragraphs" for one loaded from disk."""
    own = getattr(result, "paragraph", None)
    return own(section) if callable(own) else str(result.meta.get("paragraphs", {}).get(section, ""))


def _title(meta: dict, section: str) -> str:
    return str(meta.get("titles", {}).get(section, section))


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
    """The key figure(s) of each section that ran (needs the parts, i.e. a result fresh from run_atlas)."""
    parts, keep = getattr(result, "parts", {}), result.meta.get("key_figures", {})
    return [f for s in result.meta["sections"] if s in parts for f in parts[s].figures()[: keep.get(s, 0)]]


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
    toc = "".join(f'<li><a href="#atlas-{s}">{html.escape(_title(m, s))}</a></li>' for s in m["sections"])
    why = m.get("skipped_why", {})
    skipped = "; ".join(f"{_title(m, s)} ({why[s]})" for s in m.get("skipped", []) if s in why)
    not_asked = ", ".join(_title(m, s) for s in m.get("skipped", []) if s not in why)
    left_out = ", ".join(_title(m, s) for s in m.get("left_out", []))
    w = _window(m)
    sink = f" (attention sinks: {m['sink_length']}, as Gu et al. 2025)" if "sinks" in m["sections"] and m.get(
        "sink_length") else ""
    intro = (f"<ol>{toc}</ol><p>Data: {html.escape(str(m['data']['source']))}; windows of {w} tokens{sink}. "
             f"{('Skipped on this model: ' + html.escape(skipped) + '. ') if skipped else ''}"
             f"{('Not asked for (sections): ' + html.escape(not_asked) + '. ') if not_asked else ''}"
             f"{('Left out by --quick: ' + html.escape(left_out) + '.') if left_out else ''}</p>"
             f"<p>{html.escape(window_scope(m))}</p>")
    out = [Section("Contents", html=intro)]
    keyfig = m.get("key_figures", {})
    for s in m["sections"]:
        body = f'<a id="atlas-{s}"></a><p>{html.escape(paragraph(result, s))}</p>'
        if s in parts:
            secs = m.get("seconds", {}).get(s)
            body += (f'<p><a href="{s}/report.html">Full {html.escape(_title(m, s).lower())} report</a> '
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
        out.append(Section(_title(m, s), html=body, figures=figs, table=table))
    return out
