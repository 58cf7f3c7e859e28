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
from dataclasses import replace
from pathlib import Path

import pandas as pd

from posprobe.analyses.configs import PROTOCOLS, ZOO_ATLAS_SECTIONS, ExtrapolationConfig, ZooAtlasConfig
from posprobe.analyses.sections import AtlasSection, CompareRun, ModelEntry, register, section
from posprobe.report import zoo_training as zoo_training_report
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.zoo.folder import member_info, resolve_text, training_tables, zoo_models

__all__ = ["ZOO_ATLAS_SECTIONS", "ZooAtlasConfig", "evaluate_zoo", "ratio_summary", "run_zoo_atlas"]


def _training(models: list[ModelEntry], run: CompareRun) -> tuple[dict[str, pd.DataFrame], dict[str, str]]:
    # The zoo's own loss curves, as `posprobe zoo train` saved them (the first zoo folder named that has them).
    return training_tables(list(run.paths))[0], {}


def training_data(paths: list[str]) -> dict | None:
    """The training text's data record of the first zoo folder in `paths` that has one (the training figure's
    caption names it, not the text the atlas measured), or None."""
    return training_tables(paths)[1]


register(AtlasSection("training", "Training", None, None, None, across=_training,
                      compare_page=zoo_training_report.compare_section))


def run_zoo_atlas(paths: list[str], config: ZooAtlasConfig | None = None, *, text: str | None = None,
                  source: str | None = None, device: str = "cpu") -> Result:
    """Every section of `config` on every model of `paths` (zoo folders stand for their members; member folders and
    other model specs for themselves) over `text` (default: the zoo's held-out eval.txt). Returns a Result
    (analysis "zoo-atlas") whose tables are the sections' own tables concatenated over models with columns member,
    family, block, seed (NaN outside a zoo), plus `models` (one row per model) and `refused` (model, section, why).
    Progress goes to stderr by model and section."""
    from posprobe.backend.facts import model_facts
    from posprobe.backend.loading import load_model
    from posprobe.backend.sources import ModelLoadError

    cfg = config or ZooAtlasConfig()
    specs = zoo_models(paths)
    text, source = resolve_text(paths, text, source)
    source = source or "text"
    wanted = cfg.wanted()
    declared = {name: section(name) for name in wanted}  # a section that is not declared fails before any load
    models = []
    for spec, rec in specs:
        m = ModelEntry(Path(spec).name if rec is not None else spec, spec, rec)
        try:
            m.model = load_model(spec, device=device)
            m.facts = model_facts(m.model)
        except (ValueError, NotImplementedError, ModelLoadError) as e:
            m.why = str(e)
        models.append(m)
    run = CompareRun(cfg, text, tuple(str(p) for p in paths))
    frames: dict[str, list[pd.DataFrame]] = {}
    refused: list[dict] = []
    headline: dict[str, dict] = {}
    timings: dict[str, float] = {}

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if cfg.progress else (lambda msg: None)
    for name, sec in declared.items():
        t0 = time.perf_counter()
        if sec.across is not None:  # a cross-model section: every model at once
            say(f"zoo atlas: {name} of {sum(m.model is not None for m in models)} models ...")
            tabs, why = sec.across(models, run)
            for tab, df in tabs.items():
                frames.setdefault(tab, []).append(df)
            refused += [dict(model=lab, section=name, why=w) for lab, w in why.items()]
        else:
            for i, m in enumerate(models):
                if m.model is None:
                    refused.append(dict(model=m.label, section=name, why=m.why))
                    continue
                say(f"zoo atlas: {name} [{i + 1}/{len(models)}] {m.label} ...")
                try:
                    got = sec.compare(m, run)
                except (ValueError, NotImplementedError) as e:
                    refused.append(dict(model=m.label, section=name, why=str(e).splitlines()[0]))
                    continue
                if isinstance(got, str):  # the analysis does not apply: posprobe's own reason
                    refused.append(dict(model=m.label, section=name, why=got))
                    continue
                tables, head = got
                for tab, df in tables.items():
                    if df is not None and len(df):
                        frames.setdefault(tab, []).append(_tag(df, m))
                if head:
                    headline.setdefault(name, {})[m.label] = head
        timings[name] = round(time.perf_counter() - t0, 2)
    tables = {name: pd.concat(parts, ignore_index=True) for name, parts in frames.items()}
    if "perplexity" in tables:  # ppl(xL) / ppl(L) per member over its seeds, as `zoo eval` gives it
        tables["ratios"] = ratio_summary(tables["perplexity"])
    tables["models"] = pd.DataFrame([_model_row(m) for m in models])
    tables["refused"] = pd.DataFrame(refused, columns=["model", "section", "why"])
    for name, df in tables.items():
        tables[name] = df.reset_index(drop=True)
    meta = make_meta("zoo-atlas", model={"name": "zoo", "positional_kind": "several",
                                         "models": [m.spec for m in models]},
                     data=data_meta(source, n_items=len(text), unit="characters", sha256=text_sha256(text)),
                     config=cfg, sections=wanted, seconds=timings, headline=headline,
                     training_data=training_data(paths) if "training" in declared else None,
                     pages={n: _page_ref(sec) for n, sec in declared.items()},
                     extrapolation=dict(factors=list(cfg.factors), protocols=list(PROTOCOLS),
                                        max_tokens=cfg.extrapolation_tokens))
    return Result(tables, meta)


def _page_ref(sec: AtlasSection) -> str | None:
    # The section's page function as "module:function", so that a saved result renders without the analyses.
    fn = sec.compare_page
    return None if fn is None else f"{fn.__module__}:{fn.__name__}"


def _tag(df: pd.DataFrame, m: ModelEntry) -> pd.DataFrame:
    return df.assign(model=m.label, **member_info(m.label, m.record))


def _model_row(m: ModelEntry) -> dict:
    row = {"model": m.label, "spec": m.spec, **member_info(m.label, m.record)}
    if m.facts is not None:
        row.update(positional_kind=m.facts.positional_kind, n_ctx=m.facts.n_ctx, n_layers=m.facts.n_layers,
                   n_heads=m.facts.n_heads, layers="; ".join(m.facts.layer_positions), status="loaded", why="")
    else:
        row.update(status="refused", why=m.why)
    return row


def evaluate_zoo(paths: list[str], config: ExtrapolationConfig | None = None, *, text: str | None = None,
                 source: str | None = None, device: str = "cpu") -> Result:
    """Perplexity vs evaluation length for every model in `paths` (zoo folders, member folders, other model
    specs) on `text` (default: the zoo's held-out eval.txt). Each zoo member is evaluated at its own training
    length L. Returns a Result with tables `perplexity` (every model x protocol x length, with the member's family,
    block and seed) and `ratios` (ppl(xL) / ppl(L) per member, protocol and factor: mean, min and max over seeds)."""
    from posprobe.analyses.extrapolation import run_extrapolation
    from posprobe.backend.loading import load_model
    from posprobe.backend.sources import ModelLoadError

    config = config or ExtrapolationConfig()
    models = zoo_models(paths)
    text, source = resolve_text(paths, text, source)
    frames = []
    for spec, rec in models:
        label = Path(spec).name if rec is not None else spec
        cfg = config
        if rec is not None and config.train_length is None:
            cfg = replace(config, train_length=int(rec["widths"]["length"]))
        info = member_info(label, rec)
        try:
            model = load_model(spec, device=device)
            df = run_extrapolation(model, text, cfg, source=source, label=label).tables["perplexity"]
        except (ValueError, NotImplementedError, ModelLoadError) as e:
            df = pd.DataFrame([{"model": label, "status": "refused", "why": str(e)}])
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
