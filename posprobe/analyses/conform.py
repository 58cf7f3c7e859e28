"""`posprobe conform`: an engine's rotary positions for a model checked against Hugging Face's, which posprobe
proves for every rope type. Silent RoPE-scaling errors in engines are the field's most-reported positional failure
(vLLM #41236 and #48621, sglang #33558, llama.cpp #17945 and #14367, mlx-vlm #1709, unsloth #6197): this is the
check users otherwise build by hand.

Check 1, `declared` (`posprobe.analyses.conform_declared`): what the engine declares for the model's file under
its options (for llama.cpp the GGUF metadata and its rope options, `posprobe.backend.engines.llama_cpp`), turned into
per-band frequencies and a cos/sin multiplier per layer type by the engine's own formulas, against HF's rotary
module for HF's config of the same file; a mismatch named by its bug class. The behaviour against length, cache
boundaries and precision checks follow (#62)."""

from __future__ import annotations

from pathlib import Path

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


def run_conform(model: str | Path, config: ConformConfig | None = None) -> Result:
    """Check the engine's rotary positions for `model` (a GGUF path or a packaged GGUF model) under `config`.

    `config.rope_scaling` (HF rope_parameters, e.g. {"rope_type": "yarn", "factor": 2}) is the scaling under test:
    laid over HF's config and turned into the engine's options (`engine_options` given explicitly win).

    Returns a Result with tables `declared` (per layer type: verdict "conforms" / "differs", bug class and one
    sentence, both sides' multipliers, the largest relative band difference) and `declared_bands` (per layer type
    and band: the engine's and HF's inverse frequency in rad/token and their ratio); meta["verdict"] is "conforms"
    or "differs: <bug classes>".

    Examples:
        >>> from posprobe import ConformConfig, run_conform
        >>> run_conform("smollm2").meta["verdict"]
        'conforms'
        >>> got = run_conform("smollm2", ConformConfig(engine_options=("rope_freq_base=101000",)))
        >>> got.tables["declared"].loc[0, ["verdict", "bug_class"]].tolist()
        ['differs', 'base off']
    """
    from posprobe.backend.engines.llama_cpp import declared, options_for_scaling, parse_options
    from posprobe.backend.engines.reference import hf_config_of_gguf, hf_rope_tables, with_rope_scaling
    from posprobe.backend.peek import read_gguf_metadata

    cfg = config or ConformConfig()
    path = engine_file(model, cfg.engine)
    # The scaling under test reaches both sides: HF's rope_parameters, and the engine's options for it (options
    # given explicitly win: a planted engine bug on top of a correct scaling).
    options = {**options_for_scaling(cfg.rope_scaling), **parse_options(cfg.engine_options)}
    meta_gguf = read_gguf_metadata(path)
    hf_config = with_rope_scaling(hf_config_of_gguf(path), cfg.rope_scaling)
    summary, bands = declared_tables(declared(meta_gguf, options), hf_rope_tables(hf_config))
    bugs = [b for b in dict.fromkeys(summary["bug_class"]) if b != "ok"]
    verdict = "conforms" if not bugs else "differs: " + ", ".join(bugs)
    arch = meta_gguf.get("general.architecture")
    meta = make_meta("conform", model={"name": str(model), "positional_kind": ROTARY, "file": path.name,
                                       "architecture": arch, "hf_model_type": hf_config.model_type},
                     data={"source": "the model's own file (no text: the declared check reads parameters)",
                           "n_items": len(summary), "unit": "layer types"},
                     config=cfg, engine=cfg.engine, engine_options=options, rope_scaling=cfg.rope_scaling,
                     verdict=verdict,
                     title=f"{cfg.engine} against Hugging Face: {Path(str(model)).name}")
    return Result({"declared": summary, "declared_bands": bands}, meta)
