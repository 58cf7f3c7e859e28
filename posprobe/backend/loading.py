"""Load models into TransformerLens from names, local folders, GGUF files, objects or tiny specs.

This is one of the two modules that touch TransformerLens internals (the other is hooks.py).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Union

import torch

from posprobe.backend.sources import ModelLoadError, Source, gguf_cache_path, read_hf_config, resolve

log = logging.getLogger(__name__)

Model = Any  # HookedTransformer | HookedEncoder; typed loosely so importing this module stays cheap
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


def load_model(
    spec: ModelSpec,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    n_ctx: int | None = None,
    process_weights: bool = False,
    n_devices: int = 1,
    seed: int = 0,
) -> Model:
    """Return a TransformerLens model (HookedTransformer or HookedEncoder) for `spec`.

    spec: a TL model name ("gpt2"), a local Hugging Face folder, a `.gguf` file (dequantised once
    and cached under `posprobe.backend.sources.cache_dir()`), a packaged alias ("smollm2", "gemma3-270m",
    "minilm"), a built-in random spec ("tiny-ape", "tiny-rope"), or an already-built TL model
    (returned unchanged). `n_ctx` caps the context length (and the buffers that scale with it).
    `process_weights` applies TL's folding/centering (LN folded, weights centred): it never changes
    q, k or attention scores, costs ~4x the weights in peak memory, and is off by default.
    The model is in eval mode; `model.posprobe_source` records where it came from.
    """
    if not isinstance(spec, (str, os.PathLike)):
        if not hasattr(spec, "cfg") or not hasattr(spec, "hook_dict"):
            raise ModelLoadError(f"Expected a model name, path or TransformerLens model, got {type(spec).__name__}")
        return spec
    dt = as_dtype(dtype)
    source = resolve(spec)
    # TL prints progress ("Moving model to device: cpu") to stdout; stdout belongs to results (`--json`).
    with contextlib.redirect_stdout(sys.stderr):
        if source.kind == "tiny":
            from posprobe.backend.tiny import build_tiny

            model = build_tiny(source.name, seed=seed, dtype=dt, device=device)
            if process_weights:
                model.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
        elif source.kind == "hub":
            model = _load_hub(source, device=device, dtype=dt, n_ctx=n_ctx, process=process_weights, n_devices=n_devices)
        else:
            folder = hf_folder(source)
            model = _load_folder(folder, source, device=device, dtype=dt, n_ctx=n_ctx, process=process_weights,
                                 n_devices=n_devices)
    model.eval()
    model.posprobe_source = source.origin or source.name
    return model


def hf_folder(source: Source) -> Path:
    """A Hugging Face folder for `source`, converting (and caching) a GGUF file on first use."""
    assert source.path is not None
    if source.path.suffix != ".gguf":
        return source.path
    target = gguf_cache_path(source.path)
    if (target / "config.json").is_file():
        return target
    return _convert_gguf(source.path, target)


def _convert_gguf(gguf: Path, target: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s once to %s (dequantising)", gguf, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"Could not read GGUF file {gguf}: {e}") from e
    # save_pretrained refuses quantised models; after dequantisation the weights are plain fp32.
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del hf
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:
        # Another process converted the same file meanwhile; its copy is identical.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def load_hf_model(spec: str | os.PathLike, *, dtype: str | torch.dtype = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """Return (Hugging Face model, tokenizer) for a folder, GGUF file or packaged alias (no TL)."""
    from transformers import AutoTokenizer

    source = resolve(spec)
    if source.kind != "hf-dir":
        raise ModelLoadError(f"{spec} has no Hugging Face weights on disk")
    folder = hf_folder(source)
    model = _hf_auto(folder, as_dtype(dtype)).to(device).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _hf_auto(folder: Path, dtype: torch.dtype) -> Any:
    import transformers

    arch = (read_hf_config(folder).get("architectures") or ["AutoModelForCausalLM"])[0]
    if arch in ("BertModel", "BertForMaskedLM", "BertForPreTraining"):
        # TL's BERT converter wants the pre-training heads; a bare encoder gets fresh heads,
        # recorded as absent in ModelFacts (has_lm_head=False).
        return transformers.BertForPreTraining.from_pretrained(folder, dtype=dtype)
    cls = getattr(transformers, arch, None) or transformers.AutoModelForCausalLM
    return cls.from_pretrained(folder, dtype=dtype)


def _tl_name_for(folder: Path, hf_cfg: dict) -> str:
    """The name TL's config tables need: some architectures are only known by official name."""
    mt = hf_cfg.get("model_type", "")
    if mt.startswith("gemma3"):
        from transformer_lens.loading_from_pretrained import OFFICIAL_MODEL_NAMES

        layers, width = hf_cfg.get("num_hidden_layers"), hf_cfg.get("hidden_size")
        sizes = {(18, 640): "270m", (26, 1152): "1b"}
        size = sizes.get((layers, width))
        names = [n for n in OFFICIAL_MODEL_NAMES if n.startswith("google/gemma-3-") and size and size in n]
        if not names:
            raise ModelLoadError(f"Gemma 3 folder {folder} ({layers} layers, d={width}) matches no TL Gemma 3 config")
        return names[0]
    return str(folder)


def _load_folder(folder: Path, source: Source, *, device: str, dtype: torch.dtype, n_ctx: int | None,
                 process: bool, n_devices: int) -> Model:
    from transformer_lens import HookedEncoder, HookedTransformer, loading
    from transformers import AutoTokenizer

    hf_cfg = read_hf_config(folder)
    arch = (hf_cfg.get("architectures") or [""])[0]
    is_bert = arch.startswith("Bert")
    if is_bert and process:
        raise ModelLoadError("process_weights=True is not supported for BERT encoders (post-LN blocks cannot be folded)")
    tl_name = _tl_name_for(folder, hf_cfg)
    hf = _hf_auto(folder, dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if is_bert:
        # TL dispatches on BertForMaskedLM for every BERT variant.
        hf.config.architectures = ["BertForMaskedLM"]
    try:
        cfg = _bert_config(hf_cfg, dtype=dtype, device=device, n_ctx=n_ctx) if is_bert else loading.get_pretrained_model_config(
            tl_name,
            fold_ln=process and not is_bert, device=device, n_devices=n_devices, dtype=dtype, n_ctx=n_ctx,
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"TransformerLens does not support the architecture of {folder} ({arch}): {e}") from e
    if is_bert and cfg.original_architecture != "BertForMaskedLM":
        cfg.original_architecture = "BertForMaskedLM"
    state_dict = loading.get_pretrained_state_dict(str(folder), cfg, hf_model=hf, dtype=dtype)
    # The state dict holds views of the HF tensors: dropping the HF model lets each storage be
    # freed as soon as its converted entry is loaded, keeping peak memory near one copy.
    del hf
    gc.collect()
    if is_bert:
        model = _assemble(HookedEncoder, cfg, tokenizer, state_dict)
        model.has_lm_head = arch != "BertModel"
    elif process:
        # TL's folding/centering needs real tensors and about 4x the weights in memory; it never
        # changes q, k or attention scores, so it is opt-in.
        model = HookedTransformer(cfg, tokenizer, move_to_device=False)
        model.load_and_process_state_dict(state_dict)
        model.has_lm_head = True
    else:
        model = _assemble(HookedTransformer, cfg, tokenizer, state_dict)
        model.has_lm_head = True
    del state_dict
    model.cfg.model_name = source.name
    return model.to(device)


def _assemble(cls: Any, cfg: Any, tokenizer: Any, state_dict: dict[str, torch.Tensor]) -> Model:
    """Build a TL model on the meta device and adopt the converted tensors without copying them."""
    with torch.device("meta"):
        model = cls(cfg, tokenizer, move_to_device=False)
    for name, p in model.state_dict().items():
        if name in state_dict:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("b") or leaf.startswith("_b"):
            state_dict[name] = torch.zeros(p.shape, dtype=p.dtype)  # architectures without biases
        elif leaf == "w":
            state_dict[name] = torch.ones(p.shape, dtype=p.dtype)
        elif p.is_meta and leaf not in ("mask", "IGNORE", "rotary_sin", "rotary_cos"):
            raise ModelLoadError(f"Converted weights lack {name}; TL's converter does not cover this model")
    buffers = {n for n, _ in model.named_buffers()}
    model.load_state_dict({k: v for k, v in state_dict.items() if k not in buffers}, strict=False, assign=True)
    _rebuild_buffers(model)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        raise ModelLoadError(f"Could not materialise {leftover[:3]} when loading {cfg.model_name}")
    return model


def _rebuild_buffers(model: Any) -> None:
    # Buffers made under the meta device hold no data; recompute them as TL's __init__ does.
    for block in model.blocks:
        a = block.attn
        a.register_buffer("IGNORE", torch.tensor(-torch.inf, dtype=torch.float32))
        a.register_buffer("mask", torch.empty((0, 0), dtype=torch.bool))
        if hasattr(a, "rotary_sin"):
            size = min(model.cfg.n_ctx, a.ROTARY_INITIAL_CACHE_SIZE)
            sin, cos = a.calculate_sin_cos_rotary(model.cfg.rotary_dim, size, base=a._rotary_base(), dtype=model.cfg.dtype)
            a.register_buffer("rotary_sin", sin)
            a.register_buffer("rotary_cos", cos)


def _bert_config(hf_cfg: dict, *, dtype: torch.dtype, device: str, n_ctx: int | None) -> Any:
    # TL reads BERT configs only for BertForMaskedLM; a bare BertModel folder has the same shape.
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig(
        d_model=hf_cfg["hidden_size"], d_head=hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"],
        n_heads=hf_cfg["num_attention_heads"], d_mlp=hf_cfg["intermediate_size"], n_layers=hf_cfg["num_hidden_layers"],
        n_ctx=min(n_ctx or hf_cfg["max_position_embeddings"], hf_cfg["max_position_embeddings"]),
        eps=hf_cfg.get("layer_norm_eps", 1e-12), d_vocab=hf_cfg["vocab_size"], act_fn="gelu",
        attention_dir="bidirectional", original_architecture="BertForMaskedLM", init_weights=False,
        dtype=dtype, device=device, model_name=hf_cfg.get("_name_or_path", "bert"),
    )


def _load_hub(source: Source, *, device: str, dtype: torch.dtype, n_ctx: int | None, process: bool,
              n_devices: int) -> Model:
    from transformer_lens import HookedEncoder, HookedTransformer

    kwargs: dict[str, Any] = dict(device=device, dtype=dtype, n_devices=n_devices)
    if n_ctx is not None:
        kwargs["n_ctx"] = n_ctx
    try:
        if "bert" in source.name.lower():
            model = HookedEncoder.from_pretrained(source.name, device=device, dtype=dtype)
            model.has_lm_head = True
            return model
        loader = HookedTransformer.from_pretrained if process else HookedTransformer.from_pretrained_no_processing
        model = loader(source.name, **kwargs)
    except OSError as e:
        raise ModelLoadError(f"Could not download '{source.name}': {e}") from e
    except ValueError as e:
        raise ModelLoadError(f"'{source.name}' is not a TransformerLens model name: {e}") from e
    model.has_lm_head = True
    return model
