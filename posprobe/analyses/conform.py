"""`posprobe conform`: an engine's rotary positions for a model checked against Hugging Face's, which posprobe
proves for every rope type. Silent RoPE-scaling errors in engines are the field's most-reported positional failure
(vLLM #41236 and #48621, sglang #33558, llama.cpp #17945 and #14367, mlx-vlm #1709, unsloth #6197): this is the
check users otherwise build by hand.

Check 1, `declared` (`posprobe.analyses.conform_declared`): what the engine declares for the model's file under
its options (for llama.cpp the GGUF metadata and its rope options, `posprobe.backend.engines.llama_cpp`), turned into
per-band frequencies and a cos/sin multiplier per layer type by the engine's own formulas, against HF's rotary
module for HF's config of the same file; a mismatch named by its bug class. Check 2, `behaviour`
(`posprobe.analyses.conform_behaviour`): the same token ids through the engine and through the HF reference (the
same file dequantised), KL and top-1 agreement by position against the quantisation floor. Check 3, `cache`
(`posprobe.analyses.conform_cache`): cached against uncached scores around the position where a rope type switches,
on the reference and on the engine. Check 4, `precision` (`posprobe.analyses.conform_precision`): rotary phase error
against position in float32 / bf16 / fp16 and in the engine's own arithmetic, per layer type."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posprobe.analyses.configs import ConformConfig
from posprobe.analyses.conform_declared import declared_tables
from posprobe.backend.families import ROTARY
from posprobe.report.result import Result
from posprobe.report.schema import make_meta

__all__ = ["engine_file", "reference_path", "run_conform"]


def engine_file(model: str | Path, engine: str) -> Path:
    """The file `engine` runs for the model spec `model` (llama.cpp: a GGUF file: a path, or posprobe's packaged
    `smollm2` / `gemma3-270m`); ValueError naming what is wrong before any work."""
    from posprobe.backend.sources import ModelLoadError, resolve_local

    try:
        src = resolve_local(str(model), assemble=True)
    except ModelLoadError as e:
        raise ValueError(f"{model}: {e}") from None
    path = getattr(src, "path", None) if src is not None else None
    if path is None or Path(path).suffix != ".gguf":
        raise ValueError(f"{model}: {engine} runs GGUF files; give a .gguf path or a packaged GGUF model (smollm2, "
                         "gemma3-270m)")
    return Path(path)


def reference_path(model: str | Path) -> Path:
    """The file or folder of the HF reference an adapter's engine is checked against: a GGUF file (a path, or a
    packaged GGUF model) or a local HF folder (with config.json); ValueError naming what is wrong."""
    p = Path(str(model))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{model}: a folder without config.json is no Hugging Face model")
        return p
    return engine_file(model, "an engine adapter")


def _check_memory(lengths: tuple[int, ...], vocab: int) -> None:
    # The engine's and the reference's [length, vocab] float32 log-probabilities (and the reference's logits) at the
    # longest length, against what the machine has free: refused before either runs.
    import os

    need = 4 * max(lengths) * vocab * 4 + 2 * 1024 ** 3  # measured: Gemma 3 270M at 2,048 tokens peaks at 10.5 GB
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if need > 0.8 * free:
        raise ValueError(f"--length {max(lengths)}: the behaviour check holds ~{need / 1024 ** 3:.1f} GiB of "
                         f"log-probabilities ({vocab} tokens of vocabulary per position), more than the "
                         f"{free / 1024 ** 3:.1f} GiB free here; give a shorter --length")


def _behaviour(engine: Any, path: Path, cfg: ConformConfig, options: dict, hf: Any, ids: list[int]
               ) -> tuple[Any, Any]:
    import numpy as np
    import pandas as pd
    import torch

    from posprobe.analyses.conform_behaviour import behaviour_tables, position_metrics

    bins, rows = [], []
    for n in cfg.lengths:
        scored = engine.next_token_logprobs(path, ids[:n], options, threads=cfg.threads)
        with torch.no_grad():
            logits = hf(torch.tensor([ids[:n]])).logits[0]
        kl, top1 = np.empty(n), np.empty(n)
        for a in range(0, n, 512):  # float64 a block of positions at a time
            ref = torch.log_softmax(logits[a:a + 512].double(), dim=-1).numpy()
            kl[a:a + 512], top1[a:a + 512] = position_metrics(ref, scored[a:a + 512])
        del logits, scored
        table, row = behaviour_tables(kl, top1, length=n, bins=cfg.bins)
        bins.append(table)
        rows.append(row)
    return pd.concat(bins, ignore_index=True), pd.DataFrame(rows)


def _cache(engine: Any | None, name: str, path: Path, cfg: ConformConfig, options: dict, hf: Any, ids: list[int],
           at: int) -> tuple[Any, Any]:
    import pandas as pd

    from posprobe.analyses.conform_cache import OFFSETS, cache_tables
    from posprobe.backend.engines.reference import cached_logprobs, switch_position, uncached_logprobs

    positions = [at + o for o in OFFSETS]
    start, ids = positions[0], ids[: positions[-1] + 1]
    pick = [p - start for p in positions]
    per_prefix = switch_position(hf.config) is not None
    how = (f"uncached: {'one pass per prefix' if per_prefix else 'one pass'}; cached: a prefill of {start} tokens, "
           f"then steps of {cfg.cache_chunk}")
    tables, rows = [], []
    t, r = cache_tables("reference", uncached_logprobs(hf, ids, positions, per_prefix=per_prefix),
                        cached_logprobs(hf, ids, start, chunk=cfg.cache_chunk)[pick], at=at, positions=positions,
                        how=how)
    tables.append(t)
    rows.append(r)
    try:
        pair = None if engine is None else engine.cache_pair(path, ids, start, options, chunk=cfg.cache_chunk,
                                                             threads=cfg.threads)
    except NotImplementedError:  # an adapter without cached scoring: HF's side alone
        pair = None
    if pair is not None:
        u, c = pair
        t, r = cache_tables(name, u[pick], c[pick], at=at, positions=positions,
                            how=f"uncached: one pass in one batch; cached: a prefill of {start} tokens, then steps "
                                f"of {cfg.cache_chunk}")
        tables.append(t)
        rows.append(r)
    return pd.concat(tables, ignore_index=True), pd.DataFrame(rows)


def _engine_options(engine: Any, cfg: ConformConfig) -> dict | None:
    # The scaling under test in the engine's options (options given explicitly win: a planted engine bug on top of a
    # correct scaling); None where the engine has no form of it and only HF's side is checked (cache, precision).
    try:
        scaled = engine.options_for_scaling(cfg.rope_scaling)
    except ValueError as e:
        if set(cfg.checks) & {"declared", "behaviour"}:
            raise ValueError(f"{e}; --check cache --check precision check HF's own rotation for it without the "
                             "engine") from None
        return None
    return {**scaled, **engine.parse_options(cfg.engine_options)}


def run_conform(model: str | Path, config: ConformConfig | None = None, *, text: str | None = None,
                engine: Any = None) -> Result:
    """Check the engine's rotary positions for `model` under `config`.

    `config.rope_scaling` (HF rope_parameters, e.g. {"rope_type": "yarn", "factor": 2}) is the scaling under test:
    laid over HF's config and turned into the engine's options (`engine_options` given explicitly win); a scaling
    the engine has no form of (HF's dynamic, longrope) is checked on HF's side only, by the cache and precision
    checks.

    Args:
        model: a GGUF path or a packaged GGUF model; with `engine`, the HF reference the engine is checked
            against (a GGUF file, a packaged GGUF model or a local HF folder).
        config: the checks, engine, lengths and scaling (None: its Config's defaults).
        text: the text of the behaviour and cache checks (default: posprobe's built-in corpus).
        engine: an `EngineAdapter` (`posprobe.backend.engines.adapter`: any engine, plugged in by its user) run in
            place of `config.engine` (None: `config.engine`).

    Returns:
        A Result with tables `declared` (per layer type: verdict "conforms" / "differs", bug class and one
            sentence, both sides' multipliers, the largest relative band difference) and `declared_bands` (per
            layer type and band: the engine's and HF's inverse frequency in rad/token and their ratio); with the
            behaviour check (needs llama-cpp-python) `behaviour` (per length and position bin: KL(HF || engine) in
            nats, top-1 agreement) and `behaviour_summary` (per length: floor and last-quarter KL, growth, the
            verdict position-flat / grows with position / differs everywhere), on `text`; with the cache check
            `cache` (per side and position around the switch: KL(uncached || cached) in nats, top-1 agreement)
            and `cache_summary` (per side: the verdict cache-consistent / cached differs past the switch); with
            the precision check `precision` (per layer type and way of computing the phases: the first position
            two neighbours rotate identically, the first the fastest band reads a neighbour, the largest phase
            error in rad) and `precision_curve` (the errors against position). meta["verdict"] is "conforms" or
            `"differs: <what>"` (the engine's); meta["reference_findings"] lists what the HF reference itself does
            (its cache past a switch).

    Examples:
        >>> from posprobe import ConformConfig, run_conform
        >>> run_conform("smollm2", ConformConfig(checks=("declared",))).meta["verdict"]
        'conforms'
        >>> got = run_conform("smollm2", ConformConfig(checks=("declared",), engine_options=("rope_freq_base=101000",)))
        >>> got.tables["declared"].loc[0, ["verdict", "bug_class"]].tolist()
        ['differs', 'base off']
        >>> p = run_conform("smollm2", ConformConfig(checks=("precision",))).tables["precision"]
        >>> int(p.set_index("mode").loc["bfloat16", "first_identical_position"])  # bf16 cannot tell 257 from 256
        257
    """
    from posprobe.analyses.configs import ENGINE_RUNS
    from posprobe.backend.engines import engine_module
    from posprobe.backend.engines.reference import hf_rope_tables, reference_config, switch_position, with_rope_scaling
    from posprobe.backend.engines.rope import engine_table
    from posprobe.backend.peek import read_gguf_metadata

    cfg = config or ConformConfig()
    name = getattr(engine, "name", None) or cfg.engine
    path = engine_file(model, cfg.engine) if engine is None else reference_path(model)
    engine = engine if engine is not None else engine_module(cfg.engine)
    options = _engine_options(engine, cfg)
    runs = options is not None and bool(set(cfg.checks) & set(ENGINE_RUNS))
    if runs and engine.missing_package() is not None:
        raise ValueError(f"{engine.missing_package()}; or run --check declared --check precision alone")
    meta_gguf = read_gguf_metadata(path) if path.suffix == ".gguf" else {}
    engine.check_proven(path, meta_gguf)  # a file whose rotation would be built wrongly: refused before any work
    # so is an option it does not build
    ropes = engine.declared(meta_gguf, options, path=path) if options is not None else {}
    hf_config = with_rope_scaling(reference_config(path), cfg.rope_scaling)
    hf_tables = hf_rope_tables(hf_config)
    tables: dict[str, Any] = {}
    bugs: list[str] = []
    if "declared" in cfg.checks:
        tables["declared"], tables["declared_bands"] = declared_tables(ropes, hf_tables)
        bugs += [b for b in dict.fromkeys(tables["declared"]["bug_class"]) if b != "ok"]
    at = cfg.cache_at or switch_position(hf_config) or max(cfg.lengths)
    if {"behaviour", "cache"} & set(cfg.checks):
        ids, hf = _reference_ids(path, cfg, text, at)
        if "behaviour" in cfg.checks:
            tables["behaviour"], tables["behaviour_summary"] = _behaviour(engine, path, cfg, options, hf, ids)
            bugs += [f"behaviour {v} at {n} tokens" for n, v in zip(tables["behaviour_summary"]["length"],
                                                                      tables["behaviour_summary"]["verdict"])
                     if v != "position-flat"]
        if "cache" in cfg.checks:
            tables["cache"], tables["cache_summary"] = _cache(engine if runs else None, name, path, cfg,
                                                              options or {}, hf, ids, at)
    if "precision" in cfg.checks:
        import pandas as pd

        from posprobe.analyses.conform_precision import precision_tables

        context = max(int(hf_config.max_position_embeddings), max(cfg.lengths))
        own = {lt: (engine_table(r)[0], engine.phases(r)) for lt, r in ropes.items()}
        tables["precision"], tables["precision_curve"] = precision_tables(
            hf_tables, context=context, end=cfg.precision_end, engine=own, engine_name=name)
        mine = tables["precision"][tables["precision"]["mode"] == f"{name} (its own)"]
        bugs += [f"precision: {lt} phases read a neighbour from position {int(p)}"
                 for lt, p in zip(mine["layer_type"], mine["first_fast_neighbour_position"]) if pd.notna(p)]
    findings = []
    if "cache_summary" in tables:
        for r in tables["cache_summary"].itertuples():
            if r.verdict != "cache-consistent":
                (findings if r.side == "reference" else bugs).append(f"cache: {r.side} {r.verdict} at {r.at}")
    verdict = "conforms" if not bugs else "differs: " + ", ".join(bugs)
    if options is None:  # only HF's side ran: there is no engine verdict to give
        verdict = f"not checked: {name} has no form of the scaling under test; HF's side only"
    arch = meta_gguf.get("general.architecture", hf_config.model_type)
    reads = "behaviour" in cfg.checks or "cache" in cfg.checks
    meta = make_meta("conform", model={"name": str(model), "positional_kind": ROTARY, "file": path.name,
                                       "architecture": arch, "hf_model_type": hf_config.model_type},
                     data={"source": ("built-in corpus" if text is None else "text") if reads
                           else "the model's own file (the declared and precision checks read no text)",
                           "n_items": max(max(cfg.lengths), at + 65) if reads else len(hf_tables),
                           "unit": "tokens" if reads else "layer types"},
                     config=cfg, engine=name, engine_options=options, rope_scaling=cfg.rope_scaling,
                     verdict=verdict, reference_findings=findings,
                     title=f"{name} against Hugging Face: {Path(str(model)).name}")
    return Result(tables, meta)


def _reference_ids(path: Path, cfg: ConformConfig, text: str | None, at: int) -> tuple[list[int], Any]:
    # The HF reference and the token ids both sides read, refused before any pass where the text is too short or
    # the log-probabilities would not fit.
    from posprobe.backend.engines.reference import reference_model
    from posprobe.data import builtin_corpus

    hf, tok = reference_model(path, cfg.rope_scaling)
    ids = tok(text if text is not None else builtin_corpus())["input_ids"]
    need = max(max(cfg.lengths) if "behaviour" in cfg.checks else 0, at + 65 if "cache" in cfg.checks else 0)
    if len(ids) < need:
        raise ValueError(f"the text has {len(ids)} tokens; the checks need {need} (--length {max(cfg.lengths)}, "
                         f"--cache-at {at} + 64): give a longer --text, a shorter --length or another --cache-at")
    if "behaviour" in cfg.checks:
        _check_memory(cfg.lengths, int(hf.config.vocab_size))
    return ids, hf
