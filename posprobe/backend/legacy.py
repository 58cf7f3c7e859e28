"""The legacy adapter: TransformerLens 3's HookedTransformer / HookedEncoder, built only on request.

TL 4 removed both classes. posprobe's default backend is the TransformerBridge (`bridge.py`); this
module keeps `load_model(..., backend="hooked")` working where TL < 4 is installed, for users whose
notebooks hold HookedTransformer objects and for the tests that check both backends give the same
numbers. Nothing here is imported unless the hooked backend is asked for.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from posprobe.backend.sources import ModelLoadError, Source, read_hf_config

Model = Any  # HookedTransformer | HookedEncoder


def has_hooked() -> bool:
    """True when the installed TransformerLens still ships HookedTransformer (TL < 4)."""
    try:
        from transformer_lens import HookedTransformer  # noqa: F401
    except ImportError:
        return False
    return True


def require_hooked() -> None:
    """Raise a clear error where the installed TransformerLens has no HookedTransformer."""
    if not has_hooked():
        from importlib.metadata import version

        raise ModelLoadError(
            "backend='hooked' needs TransformerLens < 4 (HookedTransformer); "
            f"transformer-lens {version('transformer-lens')} is installed. Use the default backend "
            "(TransformerBridge), or pip install 'transformer-lens==3.9.0'."
        )


def load_hooked(source: Source, *, folder: Path | None, device: str, dtype: torch.dtype, n_ctx: int | None,
                process: bool, n_devices: int, seed: int) -> Model:
    """A HookedTransformer / HookedEncoder for a resolved source (tiny spec, HF folder, or TL hub name)."""
    require_hooked()
    if source.kind == "tiny":
        model = build_tiny_hooked(source.name, seed=seed, dtype=dtype, device=device)
        if process:
            model.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
        return model
    if source.kind == "hub":
        return _load_hub(source, device=device, dtype=dtype, n_ctx=n_ctx, process=process, n_devices=n_devices)
    assert folder is not None
    return _load_folder(folder, source, device=device, dtype=dtype, n_ctx=n_ctx, process=process, n_devices=n_devices)


def build_tiny_hooked(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """A seeded random HookedTransformer for spec `name` ("tiny-ape" or "tiny-rope"), all weights random."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from posprobe.backend.tiny import SPECS, byte_tokenizer, randomize_

    if name not in SPECS:
        raise ValueError(f"Unknown tiny spec {name!r}; choose one of {sorted(SPECS)}")
    cfg = HookedTransformerConfig(**SPECS[name], d_vocab=259, seed=seed, dtype=dtype, device=device,
                                  default_prepend_bos=True, model_name=name)
    model = HookedTransformer(cfg, tokenizer=byte_tokenizer())
    randomize_(model, seed)
    model.has_lm_head = True
    return model


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

    from posprobe.backend.hf import auto_model

    hf_cfg = read_hf_config(folder)
    arch = (hf_cfg.get("architectures") or [""])[0]
    is_bert = arch.startswith("Bert")
    if is_bert and process:
        raise ModelLoadError(
            "process_weights=True is not supported for BERT encoders (post-LN blocks cannot be folded)"
        )
    tl_name = _tl_name_for(folder, hf_cfg)
    hf = auto_model(folder, dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if is_bert:
        # TL dispatches on BertForMaskedLM for every BERT variant.
        hf.config.architectures = ["BertForMaskedLM"]
    try:
        cfg = (
            _bert_config(hf_cfg, dtype=dtype, device=device, n_ctx=n_ctx)
            if is_bert
            else loading.get_pretrained_model_config(
                tl_name,
                fold_ln=process and not is_bert,
                device=device,
                n_devices=n_devices,
                dtype=dtype,
                n_ctx=n_ctx,
            )
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
            sin, cos = a.calculate_sin_cos_rotary(
                model.cfg.rotary_dim, size, base=a._rotary_base(), dtype=model.cfg.dtype
            )
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
