"""The Hugging Face reference of a model's rotary positions, from its config alone: per layer type, the inverse
frequencies (rad/token) and the cos/sin multiplier (the attention factor) of HF's own rotary module for the config,
built on the CPU (the class the config names, its `rotary_emb` instantiated from the config: no weights). posprobe
proves these tables against HF's forward for every rope type (tests/test_rope_types.py)."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["cached_logprobs", "hf_config_of_gguf", "hf_rope_tables", "reference_config",
           "switch_position", "uncached_logprobs", "with_rope_scaling"]


def hf_rope_tables(config: Any) -> dict[str, tuple[Any, float]]:
    """{layer type: (inverse frequencies `[band]` float64 numpy, cos/sin multiplier)} of HF's rotary module for
    `config` ("all" where the model has one table for every layer, else HF's layer types, e.g. Gemma 3's
    "full_attention" and "sliding_attention"). ValueError where the config's class has no rotary module."""
    import torch
    from transformers import AutoModelForCausalLM

    from posprobe.backend import t5_decoder

    t5_decoder.register_auto_class()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    found = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
    if not found:
        raise ValueError(f"HF's {config.model_type} class has no rotary module: its positions are not rotations")
    module = type(found[0])(config=getattr(found[0], "config", config))
    types = getattr(module, "layer_types", None)
    if types:
        return {t: (getattr(module, f"{t}_inv_freq").double().numpy(),
                    float(getattr(module, f"{t}_attention_scaling", 1.0))) for t in types}
    return {"all": (module.inv_freq.double().numpy(), float(getattr(module, "attention_scaling", 1.0)))}


def hf_config_of_gguf(path: Any) -> Any:
    """HF's config of the GGUF file `path` (posprobe's converted folder's config.json where the file was converted
    before, else transformers' own GGUF reader), read once per file and process: the config returned is shared, not
    to be modified (`with_rope_scaling` copies it). ValueError where transformers cannot read the architecture."""
    from pathlib import Path

    p = Path(path)
    return _config_of_gguf(str(p.resolve()), p.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _config_of_gguf(path: str, mtime: int) -> Any:
    """HF's config of the GGUF file `path`: posprobe's converted folder's config.json where the file was converted
    before (`posprobe.backend.hf.hf_folder`: instant), else transformers' own GGUF reader (its metadata only, ~10 s:
    the tokenizer's arrays are parsed too). ValueError naming the architecture where transformers cannot read it."""
    from pathlib import Path

    from transformers import AutoConfig

    from posprobe.backend.sources import gguf_cache_path

    path = Path(path)
    cached = gguf_cache_path(path)
    try:
        if (cached / "config.json").is_file():
            return AutoConfig.from_pretrained(cached)
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError/KeyError/OSError by architecture
        from posprobe.backend.peek import read_gguf_metadata

        arch = read_gguf_metadata(path).get("general.architecture", "?")
        raise ValueError(f"{path.name}: Hugging Face cannot read this GGUF's architecture {arch!r} "
                         f"({type(e).__name__}: {e}), so there is no proven reference to check an engine against"
                         ) from None


def reference_config(path: Any) -> Any:
    """HF's config of the reference model at `path`: a GGUF file (`hf_config_of_gguf`, shared: not to be modified)
    or a local HF folder."""
    from pathlib import Path

    if Path(path).suffix == ".gguf":
        return hf_config_of_gguf(path)
    from posprobe.backend.loading import load_config

    return load_config(path)


def with_rope_scaling(config: Any, rope: dict | None) -> Any:
    """`config` with HF `rope_parameters` `rope` laid over its own (the scaling under test): over the one table, or
    over the full-attention layers' where the config keeps one per layer type (Gemma 3 scales only its global
    layers); a yarn, llama3 or longrope scaling without its original length gets the config's context; a dynamic one
    with `original_max_position_embeddings` gets it as max_position_embeddings (where HF's dynamic NTK reads its L).
    The config is copied."""
    import copy

    if not rope:
        return config
    new = copy.deepcopy(config)
    params = dict(getattr(new, "rope_parameters", None) or {})
    per_type = all(isinstance(v, dict) for v in params.values()) and params
    own = dict(params.get("full_attention", {})) if per_type else params
    merged = {**own, **rope}
    if merged.get("rope_type") in ("yarn", "llama3", "longrope"):
        merged.setdefault("original_max_position_embeddings", int(new.max_position_embeddings))
    if merged.get("rope_type") == "dynamic" and merged.get("original_max_position_embeddings"):
        # HF's dynamic NTK reads its L from max_position_embeddings: the length it was given goes there
        new.max_position_embeddings = int(merged["original_max_position_embeddings"])
    new.rope_parameters = {**params, "full_attention": merged} if per_type else merged
    return new


def reference_model(path: Any, rope: dict | None = None) -> tuple[Any, Any]:
    """(HF model, tokenizer) of the GGUF file `path` as posprobe loads it (dequantised once, cached: the same file
    the engine reads) or of the local HF folder `path`, float32, eval mode, with HF `rope_parameters` `rope` laid
    over its config (the scaling under test; `with_rope_scaling`)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from posprobe.backend.hf import hf_folder
    from posprobe.backend.loading import load_causal_lm
    from posprobe.backend.sources import resolve

    folder = hf_folder(resolve(str(Path(path))))
    config = with_rope_scaling(reference_config(path), rope) if rope else None
    # SDPA: HF's own attention path that does not hold [head, n, n] weights (the behaviour check runs 8k+ tokens).
    return load_causal_lm(folder, config=config, attention="sdpa"), AutoTokenizer.from_pretrained(folder)


def _rope_parameters(config: Any) -> list[dict]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        return list(params.values())
    return [params]


def switch_position(config: Any) -> int | None:
    """The position at which HF's rotation for `config` switches with the input's length (dynamic NTK: its L,
    max_position_embeddings; longrope: original_max_position_embeddings): the first position scored by a pass longer
    than that; None for a static rotation."""
    for p in _rope_parameters(config):
        kind = p.get("rope_type", "default")
        if kind == "dynamic":
            return int(config.max_position_embeddings)
        if kind == "longrope":
            return int(p.get("original_max_position_embeddings") or config.max_position_embeddings)
    return None


def uncached_logprobs(model: Any, ids: list[int], positions: list[int], *, per_prefix: bool) -> Any:
    """HF's next-token log-probabilities (float64 numpy `[len(positions), vocab]`) at `positions` of token ids `ids`
    without a cache: one pass per prefix `ids[:p + 1]` (`per_prefix`: what a length-dependent rotation needs), else
    one pass over `ids[:max(positions) + 1]` (a causal model with a static rotation scores each position alike).
    Each pass starts from the rotary table the model was loaded with (HF's dynamic module keeps its last one)."""
    import torch

    from posprobe.backend.hf import fresh_rope_state

    def run(n: int) -> Any:
        fresh_rope_state(model)
        return model(torch.tensor([ids[:n]]), use_cache=False).logits[0]

    with torch.no_grad():
        logits = (torch.stack([run(p + 1)[-1] for p in positions]) if per_prefix
                  else run(max(positions) + 1)[positions])
        return torch.log_softmax(logits.double(), dim=-1).numpy()


def cached_logprobs(model: Any, ids: list[int], start: int, *, chunk: int = 1) -> Any:
    """HF's next-token log-probabilities (float64 numpy `[len(ids) - start, vocab]`) at positions `start ..
    len(ids) - 1` through its own cache (the one its forward returns: sliding layers keep their window): a prefill
    of `ids[:start]` from the loaded rotary table, then steps of `chunk` tokens (1: decoding)."""
    import torch

    from posprobe.backend.hf import cache_kwargs, fresh_rope_state

    def returned(out: Any) -> Any:  # transformers 5.24 renamed the output's past_key_values to cache
        cache = out.get("cache")
        return cache if cache is not None else out.get("past_key_values")

    rows = []
    with torch.no_grad():
        fresh_rope_state(model)
        cache = returned(model(torch.tensor([ids[:start]]), use_cache=True))
        for a in range(start, len(ids), chunk):
            out = model(torch.tensor([ids[a:a + chunk]]), **cache_kwargs(model, cache))
            cache = returned(out)
            rows.append(torch.log_softmax(out.logits[0].double(), dim=-1))
    return torch.cat(rows).numpy()
