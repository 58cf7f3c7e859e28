"""Engines other than Hugging Face that run a model posprobe can prove against HF: what each declares about its
rotary positions (per layer type), and how it scores token ids. One module per engine (`llama_cpp.py`); the HF
reference of the same model's positions (`reference.py`); the declared rotation of an engine as one record
(`rope.py`: `EngineRope`, its per-band frequencies by the engine's own formulas). The comparison lives in
`posprobe.analyses.conform`. Torch-free at import."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["ENGINES", "engine_module"]

#: Engine name -> its module: an engine is one module with `check_proven`, `parse_options`, `options_for_scaling`,
#: `declared` (given the GGUF metadata, the options and the file's path), `phases` (its own arithmetic of the
#: phases), `missing_package`, `next_token_logprobs` and `cache_pair` (uncached and cached scores) (llama_cpp.py's),
#: and one row here.
ENGINES = {"llama.cpp": "posprobe.backend.engines.llama_cpp", "transformer-lens": "posprobe.backend.engines.tl"}


def engine_module(name: str) -> ModuleType:
    """The module of engine `name`; ValueError naming the engines there are."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; posprobe conform reads {', '.join(ENGINES)}")
    return importlib.import_module(ENGINES[name])
