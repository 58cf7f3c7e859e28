"""TransformerLens's TransformerBridge (TL 3.9 and 4.x): loading, recognition and the facts the bridge's
own config gets wrong or lacks (rotary base per layer, scaling), read from the wrapped Hugging Face model.

The rest of the backend dispatches here with `is_bridge(model)`. Nothing in this module imports
transformer_lens at import time: a HookedTransformer user never pays for the bridge import.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Union

import torch

from posprobe.core.rope import RotarySpec, inv_freq_table

# HF rope types whose frequencies are fixed tables (a per-band scale of the default frequencies).
# "dynamic" rescales with the sequence length and "longrope" switches tables with it; yarn/longrope also
# scale cos/sin (attention_scaling), which posprobe's rotation does not reproduce.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def is_bridge(model: Any) -> bool:
    """True when `model` is a TransformerLens TransformerBridge (checked without importing TL)."""
    # The class lives in model_bridge.bridge (TL 3.9) or model_bridge.transformer_bridge (TL 4); both
    # packages re-export it from model_bridge, which is loaded whenever a bridge exists.
    mod = sys.modules.get("transformer_lens.model_bridge")
    cls = getattr(mod, "TransformerBridge", None) if mod is not None else None
    return cls is not None and isinstance(model, cls)


def load_bridge(spec: Union[str, os.PathLike], *, device: str = "cpu", dtype: str | torch.dtype = "float32") -> Any:
    """`posprobe.load_model(spec)`: a TransformerBridge, booted offline where the weights are on disk."""
    from posprobe.backend.loading import load_model

    return load_model(spec, device=device, dtype=dtype)


def boot(source: Any, folder: Any, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
         n_ctx: int | None = None, n_devices: int = 1, device_map: Any = None) -> Any:
    """Boot a TransformerBridge for a resolved source: a local Hugging Face folder (offline; the tokenizer
    is loaded from the folder and passed in, otherwise the bridge asks the hub) or a hub name."""
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend.sources import ModelLoadError, official_name, read_hf_config

    kwargs: dict[str, Any] = dict(device=device, dtype=dtype) if device_map is None else dict(dtype=dtype, device_map=device_map)
    if n_ctx is not None:
        kwargs["n_ctx"] = n_ctx
    if n_devices > 1:
        kwargs["n_devices"] = n_devices
    if folder is not None:
        arch = (read_hf_config(folder).get("architectures") or [""])[0]
        try:
            model = TransformerBridge.boot_transformers(str(folder), tokenizer=_tokenizer_with_bos(folder), **kwargs)
        except Exception as e:  # noqa: BLE001 - the bridge raises many types for unsupported architectures
            raise ModelLoadError(f"TransformerBridge could not boot {folder} ({arch or 'no architecture'}): {e}") from e
        # A bare model folder (BertModel, GPT2Model) gets a randomly initialised head from the bridge.
        model.has_lm_head = not (arch.endswith("Model") and not arch.endswith("LMHeadModel"))
    else:
        try:
            model = TransformerBridge.boot_transformers(official_name(source.name), **kwargs)
        except OSError as e:
            raise ModelLoadError(f"Could not download '{source.name}': {e}") from e
        except ValueError as e:
            raise ModelLoadError(f"TransformerBridge cannot build '{source.name}': {e}") from e
        model.has_lm_head = model.cfg.attention_dir != "bidirectional" or hasattr(model.original_model, "cls")
    model.eval()
    model.cfg.model_name = source.name
    return model


def _tokenizer_with_bos(folder: Any) -> Any:
    """The folder's tokenizer as the bridge keeps it: with `add_bos_token=True`.

    Given a tokenizer without that flag, the bridge reloads it from disk with the flag set, so loading it
    that way here saves a second load (Gemma 3's 262k-entry tokenizer: ~4.5 s and ~300 MB of transient
    memory). Tokenizers that cannot take the flag (no BOS token) load as they are, as the bridge keeps them."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, add_bos_token=True)
    except ValueError:
        return AutoTokenizer.from_pretrained(folder)


def hf_config(model: Any) -> Any:
    """The wrapped Hugging Face model's text config (the source of truth for rotary facts)."""
    cfg = model.original_model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def hf_attention(model: Any, layer: int) -> Any:
    """The Hugging Face attention module of `layer` (holds `scaling`, `head_dim`, QK-norms, soft-cap)."""
    return model.blocks[layer].attn.original_component


def layer_type(model: Any, layer: int) -> str | None:
    """HF's layer type ("sliding_attention", "full_attention", ...) or None where the config has none."""
    types = getattr(hf_config(model), "layer_types", None)
    return types[layer] if types else None


def _rope_parameters(model: Any, layer: int) -> dict:
    cfg = hf_config(model)
    rp = getattr(cfg, "rope_parameters", None)
    if rp is None:  # older configs: rope_theta + rope_scaling
        rp = dict(getattr(cfg, "rope_scaling", None) or {})
        rp.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    lt = layer_type(model, layer)
    if lt is not None and isinstance(rp.get(lt), dict):  # per layer type (Gemma 3's local/global)
        rp = rp[lt]
    return dict(rp)


def rotary_freqs(model: Any, layer: int) -> tuple[torch.Tensor, float]:
    """(inv_freq `[band]`, cos/sin multiplier): the table HF rotates `layer` with, after any static scaling."""
    emb = model.original_model.get_decoder().rotary_emb if hasattr(model.original_model, "get_decoder") else None
    emb = emb if emb is not None else getattr(model, "rotary_emb", None)
    emb = getattr(emb, "original_component", emb)
    lt = layer_type(model, layer)
    if emb is None:
        raise NotImplementedError("Cannot find the Hugging Face rotary embedding of this TransformerBridge")
    if hasattr(emb, f"{lt}_inv_freq"):
        return getattr(emb, f"{lt}_inv_freq"), float(getattr(emb, f"{lt}_attention_scaling", 1.0))
    return emb.inv_freq, float(getattr(emb, "attention_scaling", 1.0))


def rotary_spec(model: Any, layer: int) -> RotarySpec:
    """The rotation `layer` applies, from the HF config and HF's own frequency table (the bridge's
    `cfg.rotary_base` is not reliable: 10000 for SmolLM2, whose base is 1e5). Cached per model and layer:
    reading HF's table is a device-to-host copy, and position control asks once per rotation."""
    cache = model.__dict__.setdefault("_posprobe_rotary_specs", {})
    if layer not in cache:
        cache[layer] = _rotary_spec(model, layer)
    return cache[layer]


def _rotary_spec(model: Any, layer: int) -> RotarySpec:
    rp = _rope_parameters(model, layer)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in _STATIC_ROPE_TYPES:
        raise NotImplementedError(
            f"{model.cfg.model_name} uses {kind!r} RoPE scaling, which posprobe's position control does not reproduce yet"
        )
    inv_freq, attention_scaling = rotary_freqs(model, layer)
    if attention_scaling != 1.0:
        raise NotImplementedError(
            f"{model.cfg.model_name} scales cos/sin by {attention_scaling} ({kind} RoPE); posprobe's rotation does not"
        )
    base = float(rp["rope_theta"])
    adjacent = bool(getattr(model.cfg, "rotary_adjacent_pairs", False))  # the bridge's own choice of pairing
    spec = RotarySpec(rotary_dim=2 * inv_freq.numel(), base=base, adjacent=adjacent)
    # Static scalings (linear, llama3, yarn frequencies) are a per-band factor on the default frequencies.
    hf_freq = 1.0 / inv_freq.detach().double().cpu()
    ratio = hf_freq / inv_freq_table(spec, torch.float64)
    if (ratio - 1).abs().max() > 1e-5:
        spec = RotarySpec(rotary_dim=spec.rotary_dim, base=base, adjacent=adjacent, freq_scale=tuple(ratio.tolist()))
    return spec


def qk_norms(model: Any, layer: int) -> tuple[Any, Any]:
    """(q_norm, k_norm) HF modules applied per head before rotation, or (None, None)."""
    a = hf_attention(model, layer)
    q = next((m for m in (getattr(a, "q_norm", None), getattr(a, "q_layernorm", None)) if m is not None), None)
    k = next((m for m in (getattr(a, "k_norm", None), getattr(a, "k_layernorm", None)) if m is not None), None)
    return q, k


def unsupported_qk_path(model: Any, layer: int) -> str | None:
    """Why q/k between hook_q/hook_k and rotation are not just "QK-norm per head" here, or None."""
    a = hf_attention(model, layer)
    bridge_attn = model.blocks[layer].attn
    if getattr(a, "key_multiplier", None) is not None:
        return "scales keys (key_multiplier)"
    if getattr(getattr(a, "config", None), "clip_qkv", None) is not None:
        return "clips q/k/v (clip_qkv)"
    if getattr(bridge_attn, "_qk_norm_phase", None) == "pre_reshape":
        return "normalises q/k across heads (OLMo-2 style QK-norm)"
    rp = getattr(getattr(a, "config", None), "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("llama_4_scaling_beta") is not None:
        return "scales queries by position (llama-4 attention scaling)"
    if getattr(model.cfg, "use_split_qkv_input", False) or getattr(model.cfg, "use_attn_in", False):
        return "runs with split q/k/v inputs"
    return None
