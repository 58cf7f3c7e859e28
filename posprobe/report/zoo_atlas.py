"""Report page of the zoo atlas (`zoo-atlas`), the atlas over many models: the models, one section per analysis (each
drawn by its own report module's side-by-side function, named in meta "pages": every family in one figure and one
paragraph from the numbers, member = mean over its seeds, [lowest - highest seed] where there are several), and
what was refused. Tables and meta only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.compare import member_order, seeded, table
from posprobe.report.heads import similarity_matrix  # noqa: F401 - read from here by notebooks
from posprobe.report.html import Section


def title(result: Any) -> str:
    """Report title: a zoo's (its members) or several models' (the models a user named)."""
    if seeded(result):
        return "Zoo atlas: every positional analysis across the members"
    return f"Atlas of {len(table(result, 'models'))} models side by side: every positional analysis"


#: Each section's page function for results saved before sections named theirs in meta "pages" (since then the
#: section's AtlasSection.compare_page says it).
_SAVED_BEFORE_PAGES = {name: f"posprobe.report.{module}:{fn}" for name, module, fn in (
    ("training", "zoo_training", "compare_section"), ("extrapolation", "extrapolation", "compare_section"),
    ("shift", "shift", "compare_section"), ("probes", "probes", "compare_section"),
    ("heads", "heads", "compare_section"), ("similarity", "heads", "similarity_section"),
    ("sinks", "sinks", "compare_section"), ("geometry", "geometry", "compare_section"),
    ("decomposition", "decompose", "compare_section"), ("frequency", "frequency", "compare_section"))}


def _page(ref: str) -> Any:
    # A section's side-by-side page function, "module:function" as its AtlasSection declares it (meta "pages").
    import importlib

    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def figures(result: Any) -> list:
    """Every figure of the report, in section order."""
    return [f for s in sections(result) for f in (s.figures or [])]


def sections(result: Any) -> list[Section]:
    """Models, one section per analysis that ran, and every (model, section) that was refused with why."""
    m = result.meta
    models = table(result, "models")
    seeds = " Members are averaged over their seeds." if seeded(result) else ""
    intro = (f"<p>{len(models)} models on {html.escape(str(m['data']['source']))}; every analysis with the same text "
             f"and bounds on each.{seeds} Seconds per section: "
             + ", ".join(f"{k} {v:.0f}" for k, v in (m.get("seconds") or {}).items()) + ". Layers are described by "
             "kind with their counts; the table saved beside the page (models) has each layer's.</p>")
    shown = models.drop(columns=["spec", "layers_per_layer"], errors="ignore")
    if not seeded(result):  # a zoo's columns, empty for models a user named
        shown = shown.drop(columns=["member", "family", "block", "seed"], errors="ignore")
    out = [Section("Models", html=intro, table=shown)]
    pages = m.get("pages") or _SAVED_BEFORE_PAGES
    for name in m.get("sections") or []:
        sec = _page(pages[name])(result) if pages.get(name) else None  # a section without a page: tables only
        if sec is not None:
            out.append(sec)
    refused = table(result, "refused")
    if len(refused):
        out.append(Section("Refused", html="<p>Every (model, section) an analysis did not run, with posprobe's "
                                           "reason.</p>", table=refused))
    return out


def headline_table(result: Any) -> pd.DataFrame:
    """One row per member (mean over its seeds) with each section's headline number: training loss (nats/token),
    perplexity at L and ppl(max factor x L) / ppl(L) (chunks), text perplexity at the largest shift k over k = 0,
    probe MAE after the first and last layer (positions), sink share on text, layer-0 positional score share."""
    order = member_order(result)
    out = pd.DataFrame(index=pd.Index(order, name="member"))

    def put(col: str, s: pd.Series) -> None:
        out[col] = s.reindex(out.index)

    if len(t := table(result, "training_members")):
        put("train_loss", t.groupby("member").loss.mean())
    if len(t := table(result, "perplexity")) and "ppl" in t:
        ok = t[t.status == "ok"]
        chunks = ok[ok.protocol == "chunks"]
        put("ppl_L", chunks[chunks.factor == 1].groupby("member").ppl.mean())
        top = t[t.factor == t.factor.max()]
        top = top[top.protocol == "chunks"]
        cell = top.groupby("member").apply(lambda g: "cannot run" if (g.status == "cannot run").all()
                                           else f"{g.ppl_ratio.mean():.2f}", include_groups=False)
        put(f"ratio_{t.factor.max():g}L", cell)
    if len(t := table(result, "shift_perplexity")):
        base = t[t.k == 0].set_index("model").perplexity
        last = t[t.k == t.groupby("model").k.transform("max")]
        put("shift_ppl_ratio", (last.perplexity / last.model.map(base)).groupby(last.member).mean())
    if len(t := table(result, "probes")):
        p = t[(t.metric == "mae") & (t.condition == "probe")]
        per = p.groupby(["member", "layer"]).value.mean()
        put("probe_mae_first", per.groupby("member").first())
        put("probe_mae_last", per.groupby("member").last())
    if len(t := table(result, "sink_overall")):
        put("sink_text", t[t.condition == "text"].groupby("member").value.mean())
    if len(t := table(result, "decomposition")):
        d = t[(t.metric == "var_share") & (t.term == "positional")]
        put("positional_share_l0", d.groupby("member").value.mean())
    out = out.reset_index().round(3)
    return out if seeded(result) else out.rename(columns={"member": "model"})


#: Each headline column in words: (section, what it is, unit, which way is "better" in the comparison: "low" / "high"
#: / None).
_SAYS = {"train_loss": ("training", "final training loss", "nats/token", "low"),
         "ppl_L": ("extrapolation", "perplexity at L", "", "low"),
         "shift_ppl_ratio": ("shift", "text perplexity at the largest shift over k = 0", "", None),
         "probe_mae_first": ("probes", "a linear probe's absolute-position error after the first block", "positions",
                             "low"),
         "probe_mae_last": ("probes", "the same after the last block", "positions", "low"),
         "sink_text": ("sinks", "share of (sequence, head) pairs that sink on the first token of text (Gu et al.)",
                       "", None),
         "positional_share_l0": ("decomposition", "layer-0 positional share of the score variance", "", None)}


def printed(result: Any) -> str:
    """What the atlas over many models prints: for a zoo, the headline table per member; for models a user named,
    per section one sentence comparing them with the numbers (a ratio that is 1 by construction said as such), then
    the table."""
    from posprobe.backend.families import find

    head = headline_table(result)
    if seeded(result):
        return head.to_string(index=False)
    kinds = table(result, "models").set_index("model")["positional_kind"].to_dict() if len(
        table(result, "models")) else {}
    lines = []
    for col in head.columns[1:]:
        section, what, units, better = _SAYS.get(col, (col, col, "", None))
        if col.startswith("ratio_"):
            section, what, better = "extrapolation", f"ppl({col[6:]}) / ppl(L)", "low"
        cells, values = [], {}
        for model, v in zip(head["model"], head[col]):
            family = find(str(kinds.get(model)))  # the family says whether a common shift can change its scores
            relative = family is not None and family.shift_invariant
            if col == "shift_ppl_ratio" and relative and v == v and abs(float(v) - 1.0) < 1e-3:
                cells.append(f"{model} invariant under the shift ({kinds[model].replace('_', ' ')}: scores see "
                             "offsets only)")
                continue
            if v is None or v != v:
                cells.append(f"{model} n/a")
                continue
            cells.append(f"{model} {v:.3g}" + (f" {units}" if units else ""))
            if isinstance(v, (int, float)):
                values[model] = float(v)
        best = ""
        if better and len(values) > 1 and len(set(values.values())) > 1:
            pick = min(values, key=values.get) if better == "low" else max(values, key=values.get)
            best = f" (lowest: {pick})" if better == "low" else f" (highest: {pick})"
        lines.append(f"[{section}] {what}: " + ", ".join(cells) + best)
    return "\n".join(lines + ["", head.to_string(index=False)])
