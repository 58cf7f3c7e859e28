"""Load models from names, local folders, GGUF files, objects or tiny specs: a TransformerBridge by
default (`bridge.py`), a TL 3 HookedTransformer on request (`legacy.py`); a zoo member as its plain Hugging Face class
(`load_causal_lm`), with HF's own progress bars silenced in one place (`quiet_progress`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Union

import torch

from posprobe.backend.hf import auto_model, hf_folder
from posprobe.backend.sources import ModelLoadError, fetch_revision, resolve

Model = Any  # TransformerBridge | HookedTransformer | HookedEncoder; typed loosely so importing this module stays cheap
ModelSpec = Union[str, os.PathLike, Model]

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept "float32"-style names as well as torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}") from None


BACKENDS = ("bridge", "hooked")


def load_model(
    spec: ModelSpec,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    n_ctx: int | None = None,
    process_weights: bool = False,
    n_devices: int = 1,
    seed: int = 0,
    backend: str = "bridge",
    device_map: str | dict[str, str | int] | None = None,
) -> Model:
    """Return a TransformerLens model for `spec`: a `TransformerBridge` (default; TL 3.9 and 4.x), or with
    `backend="hooked"` a TL 3 `HookedTransformer` / `HookedEncoder` (legacy adapter; needs TL < 4).

    Args:
        spec: a Hugging Face / TL model name ("gpt2"), a local Hugging Face folder, a `.gguf` file (dequantised
            once and cached under `posprobe.backend.sources.cache_dir()`), a packaged alias ("smollm2",
            "gemma3-270m", "minilm"), a built-in random spec ("tiny-ape", "tiny-rope"), or a model object you
            already hold (a TransformerBridge, a HookedTransformer/HookedEncoder; returned unchanged).
        device: where the model is put ("cpu", "cuda", ...); ignored with `device_map`.
        dtype: the weights' dtype, a name ("float32", "bfloat16", ...) or a torch.dtype.
        n_ctx: caps the context length (None: the model's own).
        process_weights: (hooked backend only) applies TL's LN folding and centring, which never changes q, k or
            attention scores.
        n_devices: the number of devices TL splits the layers over (1: one device).
        seed: the seed of a built-in random spec's weights.
        backend: "bridge" (default) or "hooked".
        device_map: spreads a model over several devices with accelerate, Hugging Face's own mechanism
            (e.g. "auto", or {"model.embed_tokens": 0, "model.layers": 1, ...}); `device` is then ignored and
            tensors posprobe makes go to the device of the first weights. Needs a Hugging Face model on the
            bridge backend.

    Returns:
        The model, in eval mode; `model.posprobe_source` records where it came from. Encoders loaded as a bridge
            carry `has_lm_head=False` (the bridge gives BERT a randomly initialised MLM head whose logits mean
            nothing).

    Examples:
        >>> import posprobe as pp
        >>> model = pp.load_model("tiny-rope")  # seeded random Llama layout, byte tokenizer: no download
        >>> type(model).__name__, model.cfg.n_layers, pp.model_facts(model).positional_kind
        ('TransformerBridge', 2, 'rotary')
    """
    if not isinstance(spec, (str, os.PathLike)):
        if not hasattr(spec, "cfg") or not hasattr(spec, "hook_dict"):
            raise ModelLoadError(f"Expected a model name, path or TransformerLens model, got {type(spec).__name__}")
        return spec
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    dt = as_dtype(dtype)
    source = fetch_revision(resolve(spec))  # a hub model at a revision: downloaded as a folder
    if backend == "hooked":
        from posprobe.backend.legacy import require_hooked

        require_hooked()  # before any conversion work
    elif process_weights:
        raise ModelLoadError(
            "process_weights=True needs backend='hooked' (TL 3's folding); the bridge keeps HF-exact weights"
        )
    if device_map is not None and (backend == "hooked" or source.kind == "tiny"):
        raise ModelLoadError(
            "device_map needs a Hugging Face model (folder, .gguf, alias or hub name) on the bridge backend"
        )
    folder = hf_folder(source) if source.kind == "hf-dir" else None
    # TL prints progress ("Moving model to device: cpu") to stdout; stdout belongs to results (`--json`).
    with contextlib.redirect_stdout(sys.stderr):
        if backend == "hooked":
            from posprobe.backend.legacy import load_hooked

            model = load_hooked(source, folder=folder, device=device, dtype=dt, n_ctx=n_ctx, process=process_weights,
                                n_devices=n_devices, seed=seed)
        elif source.kind == "tiny":
            from posprobe.backend.tiny import build_tiny

            model = build_tiny(source.name, seed=seed, dtype=dt, device=device)
        else:
            from posprobe.backend.bridge import boot

            model = boot(
                source, folder, device=device, dtype=dt, n_ctx=n_ctx, n_devices=n_devices, device_map=device_map
            )
    model.eval()
    model.posprobe_source = source.origin or source.name
    release_freed_heap()
    return model


def release_freed_heap() -> bool:
    """Hand memory freed during loading back to the OS; True where that was possible (glibc).

    Booting frees state dicts and tokenizer scratch, but glibc keeps freed blocks in its arenas, so the
    process stays that much larger for the rest of the run (~130 MB after booting Gemma 3 270M)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):  # musl and other libcs have no malloc_trim
        return False


def load_hf_model(
    spec: str | os.PathLike, *, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> tuple[Any, Any]:
    """Return (Hugging Face model, tokenizer) for a folder, GGUF file or packaged alias (no TL).

    Args:
        spec: a local Hugging Face folder, a `.gguf` file or a packaged alias; a spec without Hugging Face weights
            on disk is a ModelLoadError.
        dtype: the weights' dtype, a name ("float32", "bfloat16", ...) or a torch.dtype.
        device: where the model is put ("cpu", "cuda", ...).

    Returns:
        (model, tokenizer): the Hugging Face model in eval mode, with `model.posprobe_name` set to the source's
            name, and its AutoTokenizer.
    """
    from transformers import AutoTokenizer

    source = fetch_revision(resolve(spec))  # a hub model at a revision: downloaded as a folder
    if source.kind != "hf-dir":
        raise ModelLoadError(f"{spec} has no Hugging Face weights on disk")
    folder = hf_folder(source)
    model = auto_model(folder, as_dtype(dtype)).to(device).eval()
    model.posprobe_name = source.name  # a GGUF's converted folder has a cache name: keep the model's own
    return model, AutoTokenizer.from_pretrained(folder)


@contextmanager
def quiet_progress() -> Iterator[None]:
    """Hugging Face's own progress bars ("Loading weights", "Writing model shards") off inside the block and restored
    after it: posprobe's progress line (the zoo's tokens/s and ETA, a stage line) stays one line on stderr."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def load_causal_lm(folder: str | os.PathLike, *, config: Any = None, train: bool = False,
                   attention: str = "eager") -> Any:
    """A zoo member (or any HF causal-LM folder) as its plain Hugging Face class: float32, `attention` ("eager", or
    "sdpa" where long inputs would not fit eager's weights), in eval mode (training mode with `train`), HF's bars
    silenced; `config` replaces the folder's own (a method's rope_parameters). The decoder-only T5-bias class is
    registered first."""
    from transformers import AutoModelForCausalLM

    from posprobe.backend import t5_decoder

    t5_decoder.register_auto_class()
    kw = {} if config is None else {"config": config}
    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attention, dtype=torch.float32, **kw)
    return model.train() if train else model.eval()


def load_config(folder: str | os.PathLike, **fields: Any) -> Any:
    """The HF config of the model folder `folder` with `fields` laid over it (the T5-bias class registered first)."""
    from transformers import AutoConfig

    from posprobe.backend import t5_decoder

    t5_decoder.register_auto_class()
    return AutoConfig.from_pretrained(folder, **fields)
