"""`posprobe conform`: an engine's rotary positions for a model checked against Hugging Face's, which posprobe
proves for every rope type. Silent RoPE-scaling errors in engines are the field's most-reported positional failure
(vLLM #41236 and #48621, sglang #33558, llama.cpp #17945 and #14367, mlx-vlm #1709, unsloth #6197): this is the
check users otherwise build by hand.

Check 1, `declared` (`posprobe.analyses.conform_declared`): what the engine declares for the model's file under
its options (for llama.cpp the GGUF metadata and its rope options, `posprobe.backend.engines.llama_cpp`), turned into
per-band frequencies and a cos/sin multiplier per layer type by the engine's own formulas, against HF's rotary
module for HF's config of the same file; a mismatch named by its bug class. Check 2, `behaviour`
(`posprobe.analyses.conform_behaviour`): the same token ids through the engine and through the HF reference (the
same file dequantised), KL and top-1 agreement by position against the quantisation floor. Cache boundaries and
precision follow (#62)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posprobe.analyses.configs import ConformConfig
from posprobe.analyses.conform_declared import declared_tables
from posprobe.backend.families import ROTARY
from posprobe.report.result import Result
from posprobe.report.schema import make_meta

__all__ = ["engine_file", "run_conform"]


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


def _behaviour(engine: Any, path: Path, cfg: ConformConfig, options: dict, text: str | None) -> tuple[Any, Any]:
    import numpy as np
    import pandas as pd
    import torch

    from posprobe.analyses.conform_behaviour import behaviour_tables, position_metrics
    from posprobe.backend.engines.reference import reference_model
    from posprobe.data import builtin_corpus

    hf, tok = reference_model(path, cfg.rope_scaling)
    ids = tok(text if text is not None else builtin_corpus())["input_ids"]
    if len(ids) < max(cfg.lengths):
        raise ValueError(f"the text has {len(ids)} tokens; --length {max(cfg.lengths)} needs as many (give a longer "
                         "--text or a shorter --length)")
    _check_memory(cfg.lengths, int(hf.config.vocab_size))
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


def run_conform(model: str | Path, config: ConformConfig | None = None, *, text: str | None = None) -> Result:
    """Check the engine's rotary positions for `model` (a GGUF path or a packaged GGUF model) under `config`.

    `config.rope_scaling` (HF rope_parameters, e.g. {"rope_type": "yarn", "factor": 2}) is the scaling under test:
    laid over HF's config and turned into the engine's options (`engine_options` given explicitly win).

    Returns a Result with tables `declared` (per layer type: verdict "conforms" / "differs", bug class and one
    sentence, both sides' multipliers, the largest relative band difference) and `declared_bands` (per layer type
    and band: the engine's and HF's inverse frequency in rad/token and their ratio); with the behaviour check
    (`config.checks`, needs llama-cpp-python) also `behaviour` (per length and position bin: KL(HF || engine) in
    nats, top-1 agreement) and `behaviour_summary` (per length: floor and last-quarter KL, growth, the verdict
    position-flat / grows with position / differs everywhere), on `text` (default: posprobe's built-in corpus).
    meta["verdict"] is "conforms" or "differs: <what>".

    Examples:
        >>> from posprobe import ConformConfig, run_conform
        >>> run_conform("smollm2", ConformConfig(checks=("declared",))).meta["verdict"]
        'conforms'
        >>> got = run_conform("smollm2", ConformConfig(checks=("declared",), engine_options=("rope_freq_base=101000",)))
        >>> got.tables["declared"].loc[0, ["verdict", "bug_class"]].tolist()
        ['differs', 'base off']
    """
    from posprobe.backend.engines import engine_module
    from posprobe.backend.engines.reference import hf_config_of_gguf, hf_rope_tables, with_rope_scaling
    from posprobe.backend.peek import read_gguf_metadata

    cfg = config or ConformConfig()
    engine = engine_module(cfg.engine)
    path = engine_file(model, cfg.engine)
    if "behaviour" in cfg.checks and engine.missing_package() is not None:
        raise ValueError(f"{engine.missing_package()}; or run --check declared alone")
    # The scaling under test reaches both sides: HF's rope_parameters, and the engine's options for it (options
    # given explicitly win: a planted engine bug on top of a correct scaling).
    options = {**engine.options_for_scaling(cfg.rope_scaling), **engine.parse_options(cfg.engine_options)}
    meta_gguf = read_gguf_metadata(path)
    engine.check_proven(path, meta_gguf)  # a file whose rotation would be built wrongly: refused before any work
    ropes = engine.declared(meta_gguf, options)  # so is a scaling option it does not build
    hf_config = with_rope_scaling(hf_config_of_gguf(path), cfg.rope_scaling)
    summary, bands = declared_tables(ropes, hf_rope_tables(hf_config))
    tables = {"declared": summary, "declared_bands": bands}
    bugs = [b for b in dict.fromkeys(summary["bug_class"]) if b != "ok"]
    if "behaviour" in cfg.checks:
        tables["behaviour"], tables["behaviour_summary"] = _behaviour(engine, path, cfg, options, text)
        bugs += [f"behaviour {v} at {n} tokens" for n, v in zip(tables["behaviour_summary"]["length"],
                                                                  tables["behaviour_summary"]["verdict"])
                 if v != "position-flat"]
    verdict = "conforms" if not bugs else "differs: " + ", ".join(bugs)
    arch = meta_gguf.get("general.architecture")
    meta = make_meta("conform", model={"name": str(model), "positional_kind": ROTARY, "file": path.name,
                                       "architecture": arch, "hf_model_type": hf_config.model_type},
                     data={"source": ("built-in corpus" if text is None else "text")
                           if "behaviour" in cfg.checks else "the model's own file (the declared check reads no text)",
                           "n_items": max(cfg.lengths) if "behaviour" in cfg.checks else len(summary),
                           "unit": "tokens" if "behaviour" in cfg.checks else "layer types"},
                     config=cfg, engine=cfg.engine, engine_options=options, rope_scaling=cfg.rope_scaling,
                     verdict=verdict,
                     title=f"{cfg.engine} against Hugging Face: {Path(str(model)).name}")
    return Result(tables, meta)
