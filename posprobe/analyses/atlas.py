"""The atlas: every positional analysis that applies to a model, run with bounded defaults, in one report.

Sections: positional facts; head signatures; attention sinks (Gu et al.'s share, the position-vs-token
control, massive activations); per-frequency RoPE usage (RoPE models); W_pos and
residual geometry (learned positions); a position-probe summary; the shift test, which is the
invariance control for RoPE models (a common shift of queries and keys cannot change anything) and
the effect itself for learned positions; retrieval heads (Wu et al.: which heads copy a needle, and the
answers with them masked vs random heads; RoPE decoders the long-context engine runs). Where sinks and retrieval
both run, the sinks section also zeroes its strongest sink heads one at a time, and the atlas flags any head whose
zeroing barely moves the text loss (low-effect) although it is a retrieval head (table `ablation_retrieval`). Each
section is a full Result of its own analysis, saved in a subfolder; the atlas's own table holds the headline numbers
its report turns into words.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from posprobe.analyses.configs import ATLAS_SECTIONS, AtlasConfig
from posprobe.analyses.retrieval import RETRIEVAL_MIN_CTX  # noqa: F401 - the atlas's bounds, read here by users
from posprobe.analyses.sections import AtlasRun, AtlasSection, register, section, why_not
from posprobe.analyses.sinks import SINK_LENGTH
from posprobe.backend.facts import ModelFacts, hf_attention_modules, model_facts
from posprobe.backend.families import nope as nope_family
from posprobe.data import BUILTIN_CORPUS_SOURCE, builtin_corpus
from posprobe.report.atlas import facts_paragraph
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256

#: The atlas's section names in report order (each declared by its analysis: `analyses.sections`).
SECTIONS = tuple(ATLAS_SECTIONS)


class AtlasResult(Result):
    """The atlas's `atlas` table (section, metric, value) plus each section's own Result in `parts`,
    saved by `save` into subfolders named after the sections."""

    parts: dict[str, Result]

    def __init__(self, tables: dict[str, pd.DataFrame], meta: dict, parts: dict[str, Result]):
        super().__init__(tables, meta)
        self.parts = parts
        self._paragraphs: dict[str, str] = {}  # written once: printed, kept in meta and shown on the page

    def paragraph(self, name: str) -> str:
        """Section `name`'s findings in words, written by the paragraph its analysis declares (from the atlas table,
        meta and parts)."""
        if name not in self._paragraphs:
            t = self.tables["atlas"]

            def n(metric: str) -> float | None:
                v = t[(t.section == name) & (t.metric == metric)].value
                return float(v.iloc[0]) if len(v) else None

            self._paragraphs[name] = section(name).paragraph(self, n)
        return self._paragraphs[name]

    def save(self, out_dir: Any, *, figure_formats: Any = (), csv: str = "auto") -> dict[str, Path]:
        """Each section's outputs in `<out_dir>/<section>/`, then the atlas's own files and report (meta
        "paragraphs" holds each section's words, so a loaded atlas reads the same)
        (keys `<section>/<key>` for the sections, the usual keys for the atlas's own files). Every report of the
        folder loads one local `plotly.min.js` at its top (offline still; one copy instead of one per report)."""
        from posprobe.report.export import parse_formats
        from posprobe.report.html import PLOTLY_JS, write_plotlyjs
        from posprobe.report.result import csv_tables

        formats = parse_formats(figure_formats)  # a bad format fails before anything is written
        self.meta["paragraphs"] = {s: self.paragraph(s) for s in self.meta["sections"]}
        csv_tables({}, csv)  # a bad value too
        Path(out_dir).mkdir(exist_ok=True)
        paths: dict[str, Path] = {}
        for name, part in self.parts.items():
            saved = part.save(Path(out_dir) / name, figure_formats=formats, csv=csv, plotly_src="../" + PLOTLY_JS)
            paths.update({f"{name}/{k}": v for k, v in saved.items()})
        paths.update(super().save(out_dir, figure_formats=formats, csv=csv, plotly_src=PLOTLY_JS,
                                  extra={PLOTLY_JS: write_plotlyjs}))
        return paths


#: Windows (and their length, tokens) of the exact layer-0 decomposition that the atlas compares with the pattern
#: view on learned-position models: float64 pair terms grow with windows x heads x length^2.
RELATIVE_VIEW_WINDOWS = 4
RELATIVE_VIEW_TOKENS = 128

# The facts section: the model's ModelFacts, read before any other section runs (its rows are written by run_atlas).
register(AtlasSection("facts", "Positional facts", run=lambda model, r: None, headlines=lambda part: [],
                      paragraph=facts_paragraph))


def applicable(facts: ModelFacts, wanted: tuple[str, ...] | None, engine_runs: bool = False) -> list[str]:
    """The sections that apply to this model, restricted to `wanted` when given: see `skip_reasons`."""
    skip = skip_reasons(facts, engine_runs)
    return [s for s in ATLAS_SECTIONS if s not in skip and (wanted is None or s in wanted)]


def skip_reasons(facts: ModelFacts, engine_runs: bool = False) -> dict[str, str]:
    """Section -> why it does not run on this model: its positional family's own reasons (backend.families: e.g.
    frequency needs RoPE, geometry a learned table), then what posprobe has not proven for the model (position
    analyses: `facts.unsupported`; patterns: `facts.attention_unsupported`; rotated q/k the model rotates where no
    hook fires), then retrieval's needs (the long-context engine runs the model, context >= RETRIEVAL_MIN_CTX): each
    section's own `blocked` answers after its family's."""
    why = {s: why_not(s, facts, engine_runs) for s in ATLAS_SECTIONS}
    return {s: w for s, w in why.items() if w is not None}


def run_atlas(model: Any, text: str | None = None, config: AtlasConfig | None = None, *,
              source: str | None = None) -> AtlasResult:
    """Run every applicable section on `model` over `text` and return the atlas with its parts. The shift test
    scores a decoder bridge through the Hugging Face model it wraps (native position ids, pair packing; the same
    weights, not reloaded). Progress goes to stderr by stage.

    Args:
        model: a TransformerLens model; sections that do not apply to it are skipped, with the reason in meta.
        text: the text the sections read (default: posprobe's built-in corpus).
        config: the analysis's options: sections, quick tour, windows (None: its Config's defaults).
        source: what meta.json's data record names as the text (default: "posprobe built-in corpus (CC0)" or
            "text").

    Returns:
        An AtlasResult: the `atlas` table (section, metric, value: each section's headline numbers, plus
            `ablation_retrieval` and `relative_views` where those sections ran), and each section's own Result in
            `parts`.

    Examples:
        >>> import posprobe as pp
        >>> cfg = pp.AtlasConfig(quick=True, sections=("facts", "heads"), progress=False)  # all: AtlasConfig()
        >>> atlas = pp.run_atlas(pp.load_model("tiny-rope"), None, cfg)
        >>> list(atlas.parts)
        ['heads']
        >>> atlas.tables["atlas"].query("section == 'facts'").set_index("metric").value.to_dict()
        {'n_layers': 2.0, 'n_heads': 4.0, 'n_ctx': 256.0}
    """
    import sys
    import time

    cfg = config or AtlasConfig()
    cfg.check_one_model()
    facts = model_facts(model)
    body = builtin_corpus() if text is None else text
    src = source or (BUILTIN_CORPUS_SOURCE if text is None else "text")
    quiet = not cfg.progress
    w, nw = cfg.window_for(facts.n_ctx), cfg.max_windows
    # Built-in sentences are < 64 tokens: a k that would push them past the context is lowered to fit.
    ks = tuple(sorted({min(k, max(facts.n_ctx - 64, 0)) for k in cfg.ks}))
    why_skipped = skip_reasons(facts, engine_runs=_engine_runs(model))
    sections = [s for s in ATLAS_SECTIONS if s not in why_skipped and (cfg.sections is None or s in cfg.sections)]
    skipped = [s for s in ATLAS_SECTIONS if s not in sections]
    left_out = []
    if cfg.quick and cfg.sections is None and "retrieval" in sections:  # the short tour leaves out the decoding
        sections, left_out = [s for s in sections if s != "retrieval"], ["retrieval"]
    run = AtlasRun(facts, cfg, body, src, w, nw, ks, tuple(sections))
    parts: dict[str, Result] = {}
    timings: dict[str, float] = {}
    extra: dict[str, Any] = {"nope_layers": nope_layers(facts)}
    rows: list[tuple[str, str, float]] = [("facts", "n_layers", facts.n_layers), ("facts", "n_heads", facts.n_heads),
                                          ("facts", "n_ctx", facts.n_ctx)]
    for i, name in enumerate(s for s in sections if s != "facts"):
        if not quiet:
            print(f"atlas [{i + 1}/{len(sections) - ('facts' in sections)}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        sec = section(name)
        parts[name] = sec.run(model, run)
        timings[name] = round(time.perf_counter() - t0, 2)
        rows += [(name, metric, value) for metric, value in sec.headlines(parts[name])]
        extra.update(sec.meta(parts[name]))
    tables = {"atlas": pd.DataFrame(rows, columns=["section", "metric", "value"])}
    ablation = parts["sinks"].tables.get("head_ablation") if "sinks" in parts else None
    if ablation is not None and "retrieval" in parts:
        cross, extra["ablation_retrieval"] = ablation_vs_retrieval(ablation, parts["retrieval"],
                                                                   parts["sinks"].meta["ablation"])
        tables["ablation_retrieval"] = cross.assign(model=facts.name)
    if "heads" in parts and facts.family is not None and facts.family.learned_table and facts.unsupported is None:
        # Learned positions: the heads section reads relative position from the pattern, the exact layer-0 score
        # split from the position x position term; the two views side by side, per layer-0 head.
        from posprobe.analyses.decompose import corpus_rows
        from posprobe.analyses.relative_views import TERM_POSITIONAL, TERM_RELATIVE, disagreements, relative_views

        t0 = time.perf_counter()
        threshold = parts["heads"].meta["config"]["relative_r2"]
        windows = corpus_rows(model, body, min(w, RELATIVE_VIEW_TOKENS), RELATIVE_VIEW_WINDOWS)
        views = relative_views(model, windows, parts["heads"].tables["heads"])
        tables["relative_views"] = views
        extra["relative_views"] = {"pattern_threshold": threshold, "term_relative": TERM_RELATIVE,
                                   "term_positional": TERM_POSITIONAL, **disagreements(views, threshold)}
        timings["relative_views"] = round(time.perf_counter() - t0, 2)
    meta = make_meta("atlas", model=facts.summary(), data=data_meta(src, n_items=nw, unit="windows",
                                                                    sha256=text_sha256(body)),
                     config=cfg, sections=sections, skipped=skipped,
                     skipped_why={s: why_skipped[s] for s in skipped if s in why_skipped}, left_out=left_out,
                     shift_ks=list(ks), seconds=timings, window=w, sink_length=min(SINK_LENGTH, w),
                     probe_tokens=cfg.probe_tokens_used(),
                     titles={s: section(s).title for s in ATLAS_SECTIONS},
                     key_figures={s: section(s).key_figures for s in sections}, **extra)
    return AtlasResult(tables, meta, parts)


def nope_layers(facts: ModelFacts) -> list[int]:
    """The layers of a rotary model that apply no rotation (NoPE, e.g. SmolLM3's `no_rope_layers`); [] for other
    models. Read from the per-layer phrases of the facts, which name NoPE layers even where `facts.rotary` is None
    (a rotation posprobe does not reproduce)."""
    if not facts.is_rotary:
        return []
    return [l for l, p in enumerate(facts.layer_positions) if p.startswith(nope_family.FAMILY.phrase)]


def ablation_vs_retrieval(ablation: pd.DataFrame, retrieval: Result, ablation_meta: dict) -> tuple[pd.DataFrame,
                                                                                                      dict]:
    """Each zeroed sink head (`head_ablation` of the sinks section) beside its retrieval score and class (first preset
    of the retrieval section): table (layer, head, kind = the ablation label, delta_loss, metric "retrieval_score",
    value, classes = ablation label and retrieval class) and meta (rule, flagged = [layer, head] of the heads labelled
    low-effect that are retrieval heads)."""
    from posprobe.analyses.dormant import LOW_EFFECT

    cls = retrieval.tables["head_classes"]
    score = retrieval.tables["retrieval_heads"]
    preset = cls.preset.iloc[0]
    cls = cls[cls.preset == preset].set_index(["layer", "head"]).kind
    score = score[(score.preset == preset) & (score.metric == "retrieval_score")].set_index(["layer", "head"]).value
    rows = []
    for r in ablation.itertuples():
        key = (int(r.layer), int(r.head))
        rows.append(dict(layer=key[0], head=key[1], kind=r.kind, delta_loss=float(r.delta_loss),
                         metric="retrieval_score", value=float(score.get(key, float("nan"))),
                         classes=f"{r.kind},{cls.get(key, 'unmeasured')}"))
    table = pd.DataFrame(rows)
    flagged = [[int(r.layer), int(r.head)] for r in table.itertuples()
               if r.kind == LOW_EFFECT and r.classes.split(",")[1] == "retrieval"]
    meta = {"rule": f"a head labelled {LOW_EFFECT} ({ablation_meta['labels'][LOW_EFFECT]}) that the retrieval section "
                    f"classes as a retrieval head ({retrieval.meta['classes']['retrieval']}, preset {preset})",
            "preset": str(preset), "flagged": flagged}
    return table, meta


def _engine_runs(model: Any) -> bool:
    # Whether the long-context engine can run this model: a TransformerBridge over a Hugging Face decoder of a type it
    # supports, with separate q/k/v/o projections (the HF attention modules it plugs into).
    from posprobe.backend.kind import is_bridge
    from posprobe.core import long_engine as LA

    if not is_bridge(model):
        return False
    try:
        LA.require_supported(model.original_model)
    except (NotImplementedError, ValueError):
        return False
    mods = hf_attention_modules(model.original_model)
    return bool(mods) and all(hasattr(m, "q_proj") and hasattr(m, "o_proj") for m in mods)
