"""TransformerLens as an engine: the model as posprobe loads it through TL (`posprobe.load_model`), a
`TransformerBridge` (TL 3.9 and 4.x, `--engine-option backend=bridge`, the default) or a TL 3 `HookedTransformer`
(`backend=hooked`, where the installed TL has it), checked against the HF reference of the same file.

What TL declares is its config: `cfg.rotary_base`, `cfg.rotary_dim` (None: the head dim), `cfg.rotary_base_local`
for Gemma 3's local layers where TL sets `use_local_attn`. A HookedTransformer computes its rotation from exactly
these (`calculate_sin_cos_rotary`: float32 positions over float32 base^(j / (d/2)), the arithmetic `phases`
restates); a bridge runs the wrapped HF model's own rotary module, so its config is what TL's utilities and a user
reading `model.cfg` get, while its forward is what the behaviour check measures. Cached scoring: the bridge's
`past_key_values` (its "manual KV-cache injection", an HF cache), the HookedTransformer's own key-value cache.
TL takes the model's own config: a scaling under test cannot be handed to it (refused with one sentence)."""

from __future__ import annotations

import functools
from typing import Any

from posprobe.backend.engines.rope import EngineRope

__all__ = ["BACKENDS", "cache_pair", "check_proven", "declared", "missing_package", "next_token_logprobs",
           "options_for_scaling", "parse_options", "phases"]

#: TL's two model classes, by posprobe's `load_model(backend=...)` name.
BACKENDS = ("bridge", "hooked")


def parse_options(pairs: Any) -> dict[str, Any]:
    """{"backend": "bridge" | "hooked"} from `backend=...` (`--engine-option`); ValueError for anything else."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = str(pair).partition("=")
        if key.strip() != "backend" or value.strip() not in BACKENDS:
            raise ValueError(f"--engine-option {pair!r}: TransformerLens takes backend=bridge or backend=hooked")
        out["backend"] = value.strip()
    return out


def options_for_scaling(rope: dict | None) -> dict[str, Any]:
    """{} without a scaling; ValueError for one (TL loads the model's own config)."""
    if rope and str(rope.get("rope_type", rope.get("type", "default"))) != "default":
        raise ValueError("TransformerLens loads the model's own config: a scaling under test cannot be handed to it")
    return {}


def missing_package() -> str | None:
    """None where transformer_lens imports, else one sentence naming the package."""
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        return "TransformerLens is not installed: pip install transformer-lens"
    return None


def check_proven(path: Any, meta: dict[str, Any]) -> None:
    """Nothing beyond what posprobe's loader refuses (it loads only what TL and posprobe support)."""


@functools.lru_cache(maxsize=1)
def _model(path: str, backend: str) -> Any:
    from posprobe.backend.loading import load_model

    return load_model(path, backend=backend)


def _backend(options: dict | None) -> str:
    return (options or {}).get("backend", "bridge")


def declared(meta: dict[str, Any], options: dict | None = None, *, path: Any = None) -> dict[str, EngineRope]:
    """{layer type: EngineRope} of TL's config for the model at `path` (one table, or Gemma 3's global and local
    where TL keeps a local base)."""
    model = _model(str(path), _backend(options))
    cfg = model.cfg
    n_rot = int(getattr(cfg, "rotary_dim", None) or cfg.d_head)
    source = (f"TransformerLens {type(model).__name__} cfg: rotary_base {cfg.rotary_base:g}, rotary_dim "
              f"{getattr(cfg, 'rotary_dim', None)}")
    for flag in ("use_NTK_by_parts_rope", "use_yarn_rope"):
        if getattr(cfg, flag, False):
            raise ValueError(f"TransformerLens's {flag} is not built by the declared check")
    factor = float(getattr(cfg, "rotary_scaling_factor", 1.0) or 1.0)  # TL: global layers' freq x factor
    local_base = getattr(cfg, "rotary_base_local", None)
    if "local" in (getattr(cfg, "attn_types", None) or ()) or getattr(cfg, "use_local_attn", False):
        return {"full_attention": EngineRope("full_attention", n_rot=n_rot, base=float(cfg.rotary_base),
                                             freq_scale=1.0 / factor, source=source),
                "sliding_attention": EngineRope("sliding_attention", n_rot=n_rot,
                                                base=float(local_base if local_base is not None else cfg.rotary_base),
                                                source=source + f", rotary_base_local {local_base}")}
    if _backend(options) == "bridge":
        source += " (the bridge's forward runs HF's own rotary module: the behaviour check measures that)"
    return {"all": EngineRope("all", n_rot=n_rot, base=float(cfg.rotary_base), freq_scale=1.0 / factor,
                              source=source)}


def phases(rope: EngineRope) -> Any:
    """positions -> the phases `[position, band]` (rad) TL's HookedTransformer computes for `rope`: float32
    positions divided by float32 base^(j / (n_rot / 2)) (times the scaling factor: `calculate_sin_cos_rotary`)."""
    import numpy as np
    import torch

    j = torch.arange(rope.n_rot // 2, dtype=torch.float32)
    freq = rope.base ** (j / (rope.n_rot / 2))
    if rope.freq_scale != 1.0:
        freq = freq * (1.0 / rope.freq_scale)

    def of(positions: Any) -> Any:
        p = torch.as_tensor(np.asarray(positions), dtype=torch.float32)
        return (p[:, None] / freq[None, :]).double().numpy()

    return of


def _fits(model: Any, n: int) -> None:
    ctx = getattr(model.cfg, "n_ctx", None)
    if ctx is not None and n > ctx:
        raise ValueError(f"TransformerLens's {type(model).__name__} was loaded with n_ctx {ctx}; {n} tokens do not fit "
                         "(give a shorter --length / --cache-at)")


def _logprobs(model: Any, ids: list[int], **kw: Any) -> Any:
    import torch

    out = model(torch.tensor([ids]), **kw)
    return torch.log_softmax(out[0].float(), dim=-1)


def next_token_logprobs(path: Any, ids: list[int], options: dict | None = None, *, threads: int | None = None) -> Any:
    """TL's next-token log-probabilities `[len(ids), vocab]` (float32 numpy), one pass of the TL model."""
    import torch

    model = _model(str(path), _backend(options))
    _fits(model, len(ids))
    with torch.no_grad():
        return _logprobs(model, list(ids)).numpy()


def cache_pair(path: Any, ids: list[int], start: int, options: dict | None = None, *, chunk: int = 1,
               threads: int | None = None) -> tuple[Any, Any]:
    """(uncached, cached) TL next-token log-probabilities at positions `start ..` (float32 numpy each): one pass,
    against a prefill of `ids[:start]` and steps of `chunk` tokens through TL's cache (the bridge: an HF
    DynamicCache as `past_key_values`; a HookedTransformer: its own key-value cache)."""
    import torch

    model = _model(str(path), _backend(options))
    _fits(model, len(ids))
    with torch.no_grad():
        uncached = _logprobs(model, list(ids))[start:]
        if _backend(options) == "hooked":
            try:  # TL 3.x; TL 2.x kept it in past_key_value_caching
                from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache as KV
            except ImportError:
                from transformer_lens.past_key_value_caching import HookedTransformerKeyValueCache as KV

            kw = {"past_kv_cache": KV.init_cache(model.cfg, model.cfg.device, 1)}
        else:
            from transformers import DynamicCache

            kw = {"past_key_values": DynamicCache()}
        _logprobs(model, list(ids[:start]), **kw)
        rows = [_logprobs(model, list(ids[a:a + chunk]), **kw) for a in range(start, len(ids), chunk)]
    return uncached.numpy(), torch.cat(rows).numpy()
