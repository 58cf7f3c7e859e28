"""The atlas over many models (`posprobe zoo atlas`, `posprobe zoo eval`): every positional analysis run on every
member of a zoo (and any other models named), side by side.

Each section is declared once, beside its analysis (`analyses.sections.AtlasSection`: `compare` for one model at a
time, `across` for every model at once; `compare_page` for the report function that draws the models side by side),
and runs with the same data and bounds on every model; its tables are concatenated with the member's family, block
and seed, so one figure compares the families. This module is the loop. A model an analysis refuses (a family it
does not apply to, a model posprobe has not proven) is a row of table `refused` with posprobe's own reason, never
dropped silently. Sections:

- training: the zoo's loss curves (read from `<zoo>/training`);
- extrapolation: perplexity from L to 8L, both of Press et al.'s protocols (`run_extrapolation`);
- shift: minimal-pair accuracy and text perplexity vs start position k (`run_shift_test`; Sinha et al. 2022);
- probes: absolute position recovered from the residual stream after each layer (`run_probes`; Haviv et al. 2022);
- heads: head signatures and classes (`run_heads`), with each head's attention window (the distance holding 90% of
  its attention);
- similarity: for each head of model A the nearest head of model B in the same layer by Jensen-Shannon divergence
  of attention patterns on the same inputs, averaged per layer (Kazemnejad et al. 2023, Fig. 4);
- sinks: Gu et al.'s sink share on random tokens and text, the position-vs-token control, massive activations by
  Sun et al.'s definition (`run_sinks`);
- geometry: add or concatenate? the position table's top-k subspace against the token embeddings' (`run_geometry`);
- decomposition: the exact / data-driven split of layer-0 scores into terms (`run_decompose`);
- frequency: per-band RoPE usage (`run_frequency`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

from posprobe.analyses.configs import PROTOCOLS, ZOO_ATLAS_SECTIONS, ExtrapolationConfig, ZooAtlasConfig
from posprobe.analyses.sections import AtlasSection, CompareRun, ModelEntry, register, section
from posprobe.report import zoo_training as zoo_training_report
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.zoo.folder import member_info, resolve_text, training_tables, zoo_models

__all__ = ["ZOO_ATLAS_SECTIONS", "ZooAtlasConfig", "collapse_layers", "evaluate_zoo", "ratio_summary", "run_zoo_atlas"]


def _training(models: list[ModelEntry], run: CompareRun) -> tuple[dict[str, pd.DataFrame], dict[str, str]]:
    # The zoo's own loss curves, as `posprobe zoo train` saved them (the first zoo folder named that has them).
    return training_tables(list(run.paths))[0], {}


def training_data(paths: list[str]) -> dict | None:
    """The training text's data record of the first zoo folder in `paths` that has one (the training figure's
    caption names it, not the text the atlas measured), or None."""
    return training_tables(paths)[1]


register(AtlasSection("training", "Training", None, None, None, across=_training, across_reads_models=False,
                      compare_page=zoo_training_report.compare_section))


def run_zoo_atlas(paths: list[str], config: ZooAtlasConfig | None = None, *, text: str | None = None,
                  source: str | None = None, device: str = "cpu") -> Result:
    """Every section of `config` on every model of `paths`. Progress goes to stderr by model and section.

    Args:
        paths: zoo folders (standing for their members), member folders and other model specs (for themselves).
        config: the sections and their options (None: its Config's defaults).
        text: the text the sections read (default: the zoo's held-out eval.txt; none and no zoo folder is a
            ValueError).
        source: what meta.json's data record names as the text (default: the eval.txt's path when the text is
            the zoo's own, else "text").
        device: where the model runs ("cpu", "cuda", ...).

    Returns:
        A Result (analysis "zoo-atlas") whose tables are the sections' own tables concatenated over models with
            columns member, family, block, seed (NaN outside a zoo), plus `models` (one row per model),
            `refused` (model, section, why) and, with the extrapolation section, `ratios`.

    Examples:
        >>> import posprobe as pp
        >>> from posprobe.data import BUILTIN_TEXT
        >>> cfg = pp.ZooAtlasConfig(sections=("heads",), window=32, max_windows=2, progress=False)
        >>> r = pp.run_zoo_atlas(["tiny-rope", "tiny-ape"], cfg, text=BUILTIN_TEXT)
        >>> r.tables["models"][["model", "positional_kind", "status"]].values.tolist()
        [['tiny-rope', 'rotary', 'loaded'], ['tiny-ape', 'learned_absolute', 'loaded']]
        >>> r.tables["head_classes"].groupby("model").size().to_dict()  # every head of both, side by side
        {'tiny-ape': 8, 'tiny-rope': 8}
    """
    cfg = config or ZooAtlasConfig()
    specs = zoo_models(paths)
    text, source = resolve_text(paths, text, source)
    source = source or "text"
    wanted = cfg.wanted()
    declared = {name: section(name) for name in wanted}  # a section that is not declared fails before any load
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if cfg.progress else (lambda msg: None)
    models, outcomes, timings = compare_models(specs, declared, CompareRun(cfg, text, tuple(map(str, paths))),
                                               device=device, say=say)
    tables, refused, headline = collect(outcomes)
    if "perplexity" in tables:  # ppl(xL) / ppl(L) per member over its seeds, as `zoo eval` gives it
        tables["ratios"] = ratio_summary(tables["perplexity"])
    tables["models"] = pd.DataFrame([model_row(m) for m in models])
    zoo = "seed" in tables["models"] and bool(tables["models"]["seed"].notna().any())
    tables["refused"] = refused
    for name, df in tables.items():
        tables[name] = df.reset_index(drop=True)
    # One vocabulary by what was compared: a zoo's members and seeds, or the models a user named.
    name = "zoo" if zoo else ", ".join(m.label for m in models)
    meta = make_meta("zoo-atlas", model={"name": name, "positional_kind": "several",
                                         "models": [m.spec for m in models]}, vocabulary="zoo" if zoo else "models",
                     data=data_meta(source, n_items=len(text), unit="characters", sha256=text_sha256(text)),
                     config=cfg, sections=wanted, seconds=timings, headline=headline,
                     training_data=training_data(paths) if "training" in declared else None,
                     pages={n: _page_ref(sec) for n, sec in declared.items()},
                     extrapolation=dict(factors=list(cfg.factors), protocols=list(PROTOCOLS),
                                        max_tokens=cfg.extrapolation_tokens))
    return Result(tables, meta)


@dataclass
class Outcome:
    """One section on one model (or, for a cross-model section, on all of them: model None) in the atlas over many
    models: its tables and headline, or why it did not run (`failed`: the analysis raised, `why` its message)."""

    section: str
    label: str
    model: ModelEntry | None = None
    tables: dict = field(default_factory=dict)
    headline: dict | None = None
    why: str | None = None
    failed: bool = False


def compare_models(specs: list[tuple[str, dict | None]], declared: dict[str, AtlasSection], run: CompareRun, *,
                   device: str = "cpu", say: Callable[[str], None] = lambda msg: None,
                   ) -> tuple[list[ModelEntry], list[Outcome], dict[str, float]]:
    """The loop of the atlas over many models: each model of `specs` (spec, zoo record) loaded in turn, every
    declared per-model section run on it, then the cross-model sections on all of them. A model is kept in memory
    only where a cross-model section reads the models (head similarity); otherwise one model is loaded at a time.
    Returns the model entries (model dropped once used), the outcomes in model order (per-model sections) then
    section order (cross-model ones), and the seconds spent per section."""
    from posprobe.backend.facts import model_facts
    from posprobe.backend.loading import load_model
    from posprobe.backend.sources import ModelLoadError

    per_model = {n: s for n, s in declared.items() if s.across is None}
    keep = any(s.across is not None and s.across_reads_models for s in declared.values())
    timings = dict.fromkeys(declared, 0.0)
    models: list[ModelEntry] = []
    outcomes: list[Outcome] = []
    for i, (spec, rec) in enumerate(specs):
        m = ModelEntry(Path(spec).name if rec is not None else spec, spec, rec)
        models.append(m)
        try:  # loaded even when no per-model section runs: the models table states what each model is
            m.model = load_model(spec, device=device)
            m.facts = model_facts(m.model)
        except (ValueError, NotImplementedError, ModelLoadError) as e:
            m.why = str(e)
        for name, sec in per_model.items():
            if m.model is None:
                outcomes.append(Outcome(name, m.label, m, why=m.why))
                continue
            say(f"atlas: {name} [{i + 1}/{len(specs)}] {m.label} ...")
            t0 = time.perf_counter()
            try:
                got = sec.compare(m, run)
            except (ValueError, NotImplementedError, ModelLoadError) as e:
                got = e
            timings[name] += time.perf_counter() - t0
            if isinstance(got, Exception):
                outcomes.append(Outcome(name, m.label, m, why=str(got), failed=True))
            elif isinstance(got, str):  # the analysis does not apply: posprobe's own reason
                outcomes.append(Outcome(name, m.label, m, why=got))
            else:
                outcomes.append(Outcome(name, m.label, m, tables=got[0], headline=got[1]))
        if not keep:
            m.model = None  # the next model loads into the memory this one held
    for name, sec in declared.items():
        if sec.across is None:
            continue
        say(f"atlas: {name} of {sum(m.model is not None for m in models)} models ...")
        t0 = time.perf_counter()
        tabs, why = sec.across(models, run)
        timings[name] += time.perf_counter() - t0
        outcomes.append(Outcome(name, "", tables=tabs))
        outcomes += [Outcome(name, lab, why=w) for lab, w in why.items()]
    return models, outcomes, {n: round(t, 2) for n, t in timings.items()}


def collect(outcomes: list[Outcome]) -> tuple[dict[str, pd.DataFrame], pd.DataFrame, dict[str, dict]]:
    """What the atlas over many models keeps of its outcomes: each table concatenated over the models (a model's
    rows tagged with its model, member, family, block and seed), the table of what was refused (model, section,
    why: the first line of an analysis's error, or posprobe's reason it does not apply) and the headlines
    {section: {model: headline}}."""
    frames: dict[str, list[pd.DataFrame]] = {}
    refused: list[dict] = []
    headline: dict[str, dict] = {}
    for o in outcomes:
        if o.why is not None:
            refused.append(dict(model=o.label, section=o.section, why=o.why.splitlines()[0] if o.failed else o.why))
            continue
        for tab, df in o.tables.items():
            if df is not None and len(df):
                frames.setdefault(tab, []).append(df if o.model is None else _tag(df, o.model))
        if o.headline:
            headline.setdefault(o.section, {})[o.label] = o.headline
    tables = {name: pd.concat(parts, ignore_index=True) for name, parts in frames.items()}
    return tables, pd.DataFrame(refused, columns=["model", "section", "why"]), headline


def _page_ref(sec: AtlasSection) -> str | None:
    # The section's page function as "module:function", so that a saved result renders without the analyses.
    fn = sec.compare_page
    return None if fn is None else f"{fn.__module__}:{fn.__name__}"


def _tag(df: pd.DataFrame, m: ModelEntry) -> pd.DataFrame:
    return df.assign(model=m.label, **member_info(m.label, m.record))


def collapse_layers(parts: list[str] | tuple[str, ...]) -> str:
    """Per-layer descriptions collapsed by kind, with counts, in the order first seen: "rotary ..., base 1e+06 ×3;
    rotary ..., sliding window 512 ×15" (one description: itself; "×n" only where n > 1)."""
    counts: dict[str, int] = {}
    for p in parts:
        counts[p] = counts.get(p, 0) + 1
    return "; ".join(f"{p} ×{n}" if n > 1 else p for p, n in counts.items())


def model_row(m: ModelEntry) -> dict:
    """The models table's row of one model: model, spec, member, family, block, seed, and its facts (positional
    kind, context, layers, heads, positions per layer) with status "loaded", or status "refused" and why."""
    row = {"model": m.label, "spec": m.spec, **member_info(m.label, m.record)}
    if m.facts is not None:
        row.update(positional_kind=m.facts.positional_kind, n_ctx=m.facts.n_ctx, n_layers=m.facts.n_layers,
                   n_heads=m.facts.n_heads, layers=collapse_layers(m.facts.layer_positions),
                   layers_per_layer="; ".join(m.facts.layer_positions), status="loaded", why="")
    else:
        row.update(status="refused", why=m.why)
    return row


def evaluate_zoo(paths: list[str], config: ExtrapolationConfig | None = None, *, text: str | None = None,
                 source: str | None = None, device: str = "cpu") -> Result:
    """Perplexity vs evaluation length for every model in `paths`. Each zoo member is evaluated at its own
    training length L; one model is in memory at a time, and a model that is refused is a row with the reason.

    Args:
        paths: zoo folders (standing for their members), member folders, other model specs; one that is none of
            these is a ValueError before any model loads.
        config: the extrapolation options: lengths, protocols, token budget (None: its Config's defaults).
        text: the evaluation text (default: the zoo's held-out eval.txt; none and no zoo folder is a ValueError).
        source: what meta.json's data record names as the text (default: the eval.txt's path when the text is
            the zoo's own; None when `text` is given without it).
        device: where the models run ("cpu", "cuda", ...).

    Returns:
        A Result (analysis "zoo-eval") with tables `perplexity` (every model x protocol x length, with the
            member's family, block and seed; status and why for a refused model) and `ratios` (ppl(xL) / ppl(L)
            per member, protocol and factor: mean, min and max over seeds).

    Examples:
        >>> import posprobe as pp
        >>> from posprobe.data import BUILTIN_TEXT
        >>> cfg = pp.ExtrapolationConfig(train_length=32, factors=(1, 2), max_tokens=256, progress=False)
        >>> r = pp.evaluate_zoo(["tiny-rope", "tiny-ape"], cfg, text=BUILTIN_TEXT)
        >>> r.tables["ratios"][["member", "protocol", "factor", "status"]].values.tolist()[:2]
        [['tiny-rope', 'chunks', 1.0, 'ok'], ['tiny-rope', 'chunks', 2.0, 'ok']]
    """
    config = config or ExtrapolationConfig()
    models = zoo_models(paths)
    text, source = resolve_text(paths, text, source)
    # The atlas's extrapolation section under its old name, with every knob of ExtrapolationConfig: one model in
    # memory at a time; a model it refuses is a row with the reason, in its place.
    run = CompareRun(ZooAtlasConfig(sections=("extrapolation",), progress=False), text, tuple(map(str, paths)),
                     source=source, extrapolation=config)
    _, outcomes, _ = compare_models(models, {"extrapolation": section("extrapolation")}, run, device=device)
    frames = []
    for o in outcomes:
        info = member_info(o.label, o.model.record)
        df = (pd.DataFrame([{"model": o.label, "status": "refused", "why": o.why}]) if o.why is not None
              else o.tables["perplexity"])
        frames.append(df.assign(**info))
    table = pd.concat(frames, ignore_index=True)
    meta = make_meta("zoo-eval", model={"name": "zoo", "positional_kind": "several", "models": [s for s, _ in models]},
                     data=data_meta(source, n_items=len(text), unit="characters", sha256=text_sha256(text)),
                     config=config)
    return Result({"perplexity": table, "ratios": ratio_summary(table)}, meta)


def ratio_summary(table: pd.DataFrame) -> pd.DataFrame:
    """ppl(xL) / ppl(L) per member, protocol and factor: mean over seeds, min and max, seeds counted; rows that
    cannot run keep their status; a member none of whose models ran is one row with status "refused" and its why."""
    if "ppl_ratio" not in table:
        table = table.assign(ppl_ratio=float("nan"), protocol=None, factor=float("nan"))
    ok = table[table["status"].isin(["ok", "cannot run"])]
    keys = ["member", "family", "block", "protocol", "factor"]
    g = ok.groupby(keys, sort=False, dropna=False)
    out = g.agg(ppl_ratio=("ppl_ratio", "mean"), ratio_low=("ppl_ratio", "min"), ratio_high=("ppl_ratio", "max"),
                n_seeds=("model", "nunique"), status=("status", "first")).reset_index()
    # A member none of whose models ran stays a row (status refused, with the first reason), so every table that
    # lists members lists it.
    gone = table[~table["member"].isin(ok["member"])].drop_duplicates("member")
    if len(gone):
        why = gone["why"] if "why" in gone else ""
        out = pd.concat([out, gone[["member", "family", "block"]].assign(status="refused", why=why)],
                        ignore_index=True)
    return out
