"""llama.cpp as an engine: the rotation it declares for a GGUF file under its options, per layer type.

The rules are llama.cpp's as of 2026 (src/llama-model.cpp `load_hparams`, src/llama-context.cpp, ggml's rope; since
PR #18006, Dec 2025, for YaRN's attention factor and PR #18553, Jan 2026, for Gemma 3's local base), restated here
as facts, not code:

- from the file: `{arch}.rope.dimension_count` (rotated dims; default the key length), `{arch}.rope.freq_base`
  (default 10000), `{arch}.rope.scaling.type` (default linear), `.factor` (freq_scale = 1/factor; 1 without),
  `.attn_factor` (default 1), `.original_context_length` (default `{arch}.context_length`);
- the options (llama-cpp-python's `Llama(...)` keywords): `rope_freq_base`, `rope_freq_scale` (0 = the file's),
  `rope_scaling_type` (-1 = the file's, 0 none, 1 linear, 2 yarn; none forces freq_scale 1), `yarn_ext_factor`
  (negative = 1 for yarn, else 0), `yarn_beta_fast` 32, `yarn_beta_slow` 1, `yarn_orig_ctx` (0 = the file's),
  `yarn_attn_factor` (1; with YaRN on, llama.cpp replaces it: the factor handed to ggml is the file's attn_factor
  times get_mscale(factor) / (1 + 0.1 ln factor), which ggml's own 1 + 0.1 ln(1/freq_scale) then cancels);
- Gemma 3 with a sliding window: layer il is local when il % 6 < 5 (`sliding_window_pattern`, default 6); local
  layers rotate with `{arch}.rope.freq_base_swa` (default 10000) and no scaling, whatever the options say; global
  layers with the options' base and scale.
Torch-free; the GGUF header is read by `posprobe.backend.peek.read_gguf_metadata`."""

from __future__ import annotations

import math
from typing import Any

from posprobe.backend.engines.rope import EngineRope

__all__ = ["OPTIONS", "PROVEN_ARCHITECTURES", "SCALING_TYPES", "check_proven", "declared", "missing_package",
           "cache_pair", "next_token_logprobs", "options_for_scaling", "parse_options", "phases"]

#: llama-cpp-python's rope keywords and their defaults (0 / negative: "the file's").
OPTIONS: dict[str, float] = {"rope_scaling_type": -1, "rope_freq_base": 0.0, "rope_freq_scale": 0.0,
                             "yarn_ext_factor": -1.0, "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0,
                             "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0}
#: llama.cpp's rope scaling types by number (LLAMA_ROPE_SCALING_TYPE_*).
SCALING_TYPES = {-1: "unspecified", 0: "none", 1: "linear", 2: "yarn", 3: "longrope"}
#: GGUF architectures whose rope rules posprobe restates and has checked on real files (SmolLM2, Gemma 3); another
#: architecture may read keys or tensors of its own (Phi-3's LongRoPE factors, DeepSeek's YaRN multiplier).
PROVEN_ARCHITECTURES = ("llama", "gemma3")
#: llama.cpp scaling types whose rotation this module builds (llama3 and longrope come from per-band tensors).
_BUILT = ("none", "linear", "yarn")
#: Architectures whose sliding-window layers rotate with their own base (llama.cpp's SWA rope hparams).
_SWA_ROPE = ("gemma3",)


def check_proven(path: Any, meta: dict[str, Any]) -> None:
    """ValueError, before any work, for a GGUF file whose rotation the declared check would not build as llama.cpp
    does: an architecture outside `PROVEN_ARCHITECTURES`, a scaling type other than none/linear/yarn, or per-band
    rope factor tensors (`rope_freqs`: Llama 3.1's scaling; `rope_factors_*`: LongRoPE), which llama.cpp applies and
    this module does not read."""
    from pathlib import Path

    from posprobe.backend.peek import gguf_tensor_names

    name = Path(path).name
    arch = str(meta.get("general.architecture", ""))
    if arch not in PROVEN_ARCHITECTURES:
        raise ValueError(f"{name}: posprobe conform restates llama.cpp's rope rules for the "
                         f"{', '.join(PROVEN_ARCHITECTURES)} architectures (checked on SmolLM2 and Gemma 3); "
                         f"{arch!r} is not among them, so its declared rotation could be built wrongly")
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    if kind not in _BUILT:
        raise ValueError(f"{name}: rope scaling type {kind!r} is not built by the declared check "
                         f"({', '.join(_BUILT)} are)")
    factors = [t for t in gguf_tensor_names(Path(path)) if t.startswith(("rope_freqs", "rope_factors"))]
    if factors:
        raise ValueError(f"{name} carries per-band rope factors ({', '.join(factors)}) that llama.cpp applies and "
                         "the declared check does not read yet")


def parse_options(pairs: list[str] | tuple[str, ...] | None) -> dict[str, float]:
    """{option: value} from `KEY=VALUE` strings (`--engine-option`); ValueError naming a key llama.cpp's rope does not
    have, or a value that is not a number."""
    out: dict[str, float] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in OPTIONS:
            raise ValueError(f"--engine-option {pair!r}: expected KEY=VALUE with KEY one of {', '.join(OPTIONS)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--engine-option {pair!r}: {value!r} is not a number") from None
    return out


def options_for_scaling(rope: dict | None) -> dict[str, float]:
    """llama.cpp's options for HF `rope_parameters` `rope` (the scaling under test): linear -> rope_scaling_type 1,
    rope_freq_scale 1/factor; yarn -> type 2, 1/factor, yarn_orig_ctx = original_max_position_embeddings (and
    beta_fast / beta_slow where given). ValueError for a rope type llama.cpp cannot take as options (llama3 and
    longrope need per-band factor tensors in the file; dynamic has no llama.cpp form)."""
    if not rope:
        return {}
    kind = str(rope.get("rope_type", rope.get("type", "default")))
    if kind == "default":
        return {}
    if kind not in ("linear", "yarn"):
        raise ValueError(f"rope type {kind!r}: llama.cpp takes linear and yarn scaling as options; {kind} needs "
                         "per-band factors written into the GGUF file (or has no llama.cpp form)")
    factor = float(rope.get("factor") or 0)
    if factor <= 0:
        raise ValueError(f"rope scaling {rope}: a {kind} scaling needs a factor > 0")
    out = {"rope_scaling_type": 1.0 if kind == "linear" else 2.0, "rope_freq_scale": 1.0 / factor}
    if kind == "yarn":
        if rope.get("original_max_position_embeddings"):
            out["yarn_orig_ctx"] = float(rope["original_max_position_embeddings"])
        for k in ("beta_fast", "beta_slow"):
            if rope.get(k) is not None:
                out[f"yarn_{k}"] = float(rope[k])
    return out


def _get_mscale(scale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * math.log(scale) + 1.0


def declared(meta: dict[str, Any], options: dict[str, float] | None = None, *, path: Any = None
             ) -> dict[str, EngineRope]:
    """{layer type: EngineRope} llama.cpp rotates the model of GGUF metadata `meta` with under `options`
    (llama-cpp-python's keywords; missing ones at its defaults): "all" for one table, else Gemma 3's
    "full_attention" and "sliding_attention" (HF's names for its global and local layers)."""
    opt = {**OPTIONS, **(options or {})}
    arch = str(meta.get("general.architecture", ""))

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = key("attention.head_count") or 1
    head_dim = key("attention.key_length") or (key("embedding_length") or 0) // heads
    n_rot = int(key("rope.dimension_count") or head_dim)
    if n_rot <= 0:
        raise ValueError(f"the GGUF file ({arch}) declares no rotary dims (rope.dimension_count, attention.key_length)")
    base_train = float(key("rope.freq_base", 10000.0))
    file_type = str(key("rope.scaling.type", "linear"))
    factor = float(key("rope.scaling.factor") or key("rope.scale_linear") or 0.0)
    scale_train = 1.0 / factor if factor else 1.0
    attn_train = float(key("rope.scaling.attn_factor", 1.0))
    ctx_train = int(key("context_length") or 0)
    orig_file = int(key("rope.scaling.original_context_length") or ctx_train)

    kind_no = int(opt["rope_scaling_type"])
    if kind_no not in SCALING_TYPES:
        raise ValueError(f"rope_scaling_type {kind_no}: llama.cpp has {SCALING_TYPES}")
    kind = file_type if kind_no == -1 else SCALING_TYPES[kind_no]
    if kind not in _BUILT:
        raise ValueError(f"rope scaling {kind!r}: llama.cpp builds it from per-band factor tensors, which the declared "
                         f"check does not read ({', '.join(_BUILT)} are built)")
    base = float(opt["rope_freq_base"]) or base_train
    freq_scale = float(opt["rope_freq_scale"]) or scale_train
    if kind == "none":
        freq_scale = 1.0
    ext = float(opt["yarn_ext_factor"])
    if ext < 0:
        ext = 1.0 if kind == "yarn" else 0.0
    orig = int(opt["yarn_orig_ctx"]) or orig_file
    if ext != 0:
        s = 1.0 / freq_scale
        attn = _get_mscale(s) / (1.0 + 0.1 * math.log(s)) * attn_train
    else:
        attn = float(opt["yarn_attn_factor"]) * attn_train
    said = {k: v for k, v in (options or {}).items() if v != OPTIONS.get(k)}
    source = (f"GGUF {arch}: rope.freq_base {base_train:g}, rope.dimension_count {n_rot}, scaling {file_type}"
              + (f" x{factor:g}" if factor else "") + f"; options {said or 'default'}")
    common = dict(n_rot=n_rot, ext_factor=ext, attn_factor=attn, beta_fast=float(opt["yarn_beta_fast"]),
                  beta_slow=float(opt["yarn_beta_slow"]), orig_ctx=orig, scaling=kind)
    window = int(key("attention.sliding_window") or 0)
    if arch not in _SWA_ROPE or window <= 0:
        return {"all": EngineRope("all", base=base, freq_scale=freq_scale, source=source, **common)}
    swa_base = float(key("rope.freq_base_swa", 10000.0))
    local = {**common, "n_rot": int(key("rope.dimension_count_swa") or n_rot)}
    return {"full_attention": EngineRope("full_attention", base=base, freq_scale=freq_scale, source=source, **common),
            "sliding_attention": EngineRope("sliding_attention", base=swa_base, freq_scale=1.0,
                                            source=source + f"; local layers: rope.freq_base_swa {swa_base:g}, "
                                                            "no scaling", **local)}


#: The options llama-cpp-python takes as integers.
_INT_OPTIONS = ("rope_scaling_type", "yarn_orig_ctx")


def missing_package() -> str | None:
    """None where llama-cpp-python imports, else one sentence naming the package and how to install it."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return ("llama.cpp runs through llama-cpp-python, which is not installed: pip install llama-cpp-python "
                "(it builds llama.cpp from its source distribution, about 3-10 minutes on a CPU; bash .ci/setup "
                "--test installs it)")
    return None


def next_token_logprobs(path: Any, ids: list[int], options: dict[str, float] | None = None, *,
                        threads: int | None = None) -> Any:
    """llama.cpp's log-probabilities of the next token at every position of token ids `ids` (`[len(ids), vocab]`,
    float32 numpy), one uncached pass through llama-cpp-python (`logits_all`, batches of 512 positions) with
    `options` (llama-cpp-python's rope keywords) in force."""
    from llama_cpp import Llama

    kw = {k: (int(v) if k in _INT_OPTIONS else float(v)) for k, v in (options or {}).items()}
    llm = Llama(model_path=str(path), n_ctx=len(ids), n_batch=512, n_ubatch=512, logits_all=True, verbose=False,
                n_threads=threads, **kw)
    try:
        llm.reset()
        llm.eval(list(ids))
        out = llm.scores[: len(ids)]  # llama-cpp-python's own float32 array: kept (no copy) after close()
    finally:
        llm.close()
    return _log_softmax_rows(out)


def _log_softmax_rows(scores: Any) -> Any:
    # llama.cpp's float32 logits -> log-probabilities in place, in float64 a block of rows at a time (memory: one
    # block)
    import numpy as np

    for a in range(0, len(scores), 512):
        block = scores[a:a + 512].astype(np.float64)
        block -= block.max(axis=1, keepdims=True)
        scores[a:a + 512] = block - np.log(np.exp(block).sum(axis=1, keepdims=True))
    return scores


def cache_pair(path: Any, ids: list[int], start: int, options: dict[str, float] | None = None, *, chunk: int = 1,
               threads: int | None = None) -> tuple[Any, Any]:
    """(uncached, cached) llama.cpp log-probabilities of the next token (float32 numpy `[len(ids) - start, vocab]`
    each) at positions `start .. len(ids) - 1` of token ids `ids`: uncached, one pass over all of `ids` in one batch
    (n_batch = n_ubatch = len(ids)); cached, a prefill of `ids[:start]`, then steps of `chunk` tokens through the KV
    cache; `options` (llama-cpp-python's rope keywords) in force on both."""
    from llama_cpp import Llama

    n = len(ids)
    kw = {k: (int(v) if k in _INT_OPTIONS else float(v)) for k, v in (options or {}).items()}
    llm = Llama(model_path=str(path), n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, verbose=False,
                n_threads=threads, **kw)
    try:
        llm.reset()
        llm.eval(list(ids))
        uncached = llm.scores[start:n].copy()
        llm.reset()
        llm.eval(list(ids[:start]))
        for a in range(start, n, chunk):
            llm.eval(list(ids[a:a + chunk]))
        cached = llm.scores[start:n].copy()
    finally:
        llm.close()
    return _log_softmax_rows(uncached), _log_softmax_rows(cached)


def phases(rope: EngineRope) -> Any:
    """positions -> the phases `[position, band]` (rad, float64 of float32 values) llama.cpp's CPU rope computes for
    `rope` (ggml's `ggml_rope_cache_init`: theta starts at the position in float32 and is multiplied by
    s = base^(-2/n_rot) (float32) once per band; each band's phase is freq_scale * theta / freq_factor, mixed with
    theta / freq_factor by YaRN's ramp, in float32)."""
    import numpy as np

    from posprobe.backend.engines.rope import yarn_mix

    s = np.float32(rope.base) ** np.float32(-2.0 / rope.n_rot)
    fs = np.float32(rope.freq_scale)
    mix = yarn_mix(rope).astype(np.float32)
    ff = (np.ones(rope.n_rot // 2) if rope.freq_factors is None else np.asarray(rope.freq_factors)).astype(np.float32)

    def of(positions: Any) -> Any:
        theta = np.asarray(positions).astype(np.float32)
        out = np.empty((len(theta), rope.n_rot // 2), dtype=np.float32)
        for j in range(rope.n_rot // 2):
            extrap = theta / ff[j]
            interp = fs * extrap
            out[:, j] = interp * (np.float32(1) - mix[j]) + extrap * mix[j] if rope.ext_factor else interp
            theta = theta * s
        return out.astype(np.float64)

    return of
