"""TransformerLens's TransformerBridge (TL 3.9 and 4.x): booting one, and the facts the bridge's own config
gets wrong or lacks (rotary base per layer, scaling, QK-norms), read from the wrapped Hugging Face model
through `backend.hf`.

The rest of the backend dispatches here with `kind.is_bridge(model)`. Nothing in this module imports
transformer_lens at import time: a HookedTransformer user never pays for the bridge import.
"""

from __future__ import annotations

from typing import Any

import torch

from posprobe.backend import hf
from posprobe.backend.architectures import of_config
from posprobe.backend.kind import hf_attention
from posprobe.rope import RotarySpec


def boot(source: Any, folder: Any, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
         n_ctx: int | None = None, n_devices: int = 1, device_map: Any = None) -> Any:
    """Boot a TransformerBridge for a resolved source: a local Hugging Face folder (offline; the tokenizer
    is loaded from the folder and passed in, otherwise the bridge asks the hub) or a hub name."""
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend import t5_decoder
    from posprobe.backend.sources import ModelLoadError, official_name

    t5_decoder.register()
    kwargs: dict[str, Any] = (
        dict(device=device, dtype=dtype) if device_map is None else dict(dtype=dtype, device_map=device_map)
    )
    if n_ctx is not None:
        kwargs["n_ctx"] = n_ctx
    if n_devices > 1:
        kwargs["n_devices"] = n_devices
    if folder is not None:
        arch = hf.folder_architecture(folder)
        try:
            model = TransformerBridge.boot_transformers(str(folder), tokenizer=_tokenizer_with_bos(folder), **kwargs)
        except Exception as e:  # noqa: BLE001 - the bridge raises many types for unsupported architectures
            raise ModelLoadError(f"TransformerBridge could not boot {folder} ({arch or 'no architecture'}): {e}") from e
        # A bare model folder (BertModel, GPT2Model) gets a randomly initialised head from the bridge; an
        # architecture row says where a class so named is a whole LM (Pix2Struct's text decoder).
        model.has_lm_head = of_config(hf.text_config(model.original_model)).whole_lm or not (
            arch.endswith("Model") and not arch.endswith("LMHeadModel"))
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


def layer_type(model: Any, layer: int) -> str | None:
    """HF's layer type ("sliding_attention", "full_attention", ...) or None where the config has none."""
    return hf.layer_type(model.original_model, layer)


def rotary_freqs(model: Any, layer: int, length: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq `[band]`, cos/sin multiplier): the table HF rotates `layer` with for an input of `length` tokens
    (None: the table it was loaded with), after any scaling. Tables built for a length are cached per model and
    layer; the loaded table is the module's buffer, which follows the model across devices."""
    at = hf.table_length(model.original_model, layer, length)
    if at is None:
        return hf.inv_freq(model.original_model, layer)
    cache = model.__dict__.setdefault("_posprobe_rope_tables", {})
    key = (layer, at)
    if key not in cache:
        cache[key] = hf.rope_table(model.original_model, layer, length)
    return cache[key]


def rotary_adjacent(model: Any) -> bool:
    """True where the bridge rotates adjacent pairs (GLM style, Cohere's interleaved cos/sin, or GPT-J / CodeGen,
    whose attention TL does not re-implement with these flags), False for half-split pairs."""
    cfg = model.cfg
    return bool(getattr(cfg, "rotary_adjacent_pairs", False) or getattr(cfg, "rotary_interleaved_cos_sin", False)
                or hf.adjacent_pairs(model.original_model))


def rotary_spec(model: Any, layer: int, length: int | None = None) -> RotarySpec:
    """The rotation `layer` applies, from the HF config and HF's own frequency table (the bridge's
    `cfg.rotary_base` is not reliable: 10000 for SmolLM2, whose base is 1e5). Cached per model and layer:
    reading HF's table is a device-to-host copy, and position control asks once per rotation."""
    cache = model.__dict__.setdefault("_posprobe_rotary_specs", {})
    key = (layer, hf.table_length(model.original_model, layer, length))
    if key not in cache:
        cache[key] = hf.rotary_spec(model.original_model, layer, adjacent=rotary_adjacent(model),
                                    name=str(model.cfg.model_name), length=length)
    return cache[key]


def plain_hf_model(model: Any) -> Any:
    """The Hugging Face model the bridge wraps, as a plain model sharing the bridge's weight tensors (no reload,
    no copy): it runs HF's own forward, bit-equal to the same folder loaded with `load_hf_model`."""
    wrapped = model.original_model
    # The bridge wraps HF modules in place; their weights appear under `<name>._original_component`.
    sd = {k.replace("._original_component", ""): v for k, v in wrapped.state_dict().items()}
    return hf.twin(wrapped, sd)


def qk_norms(model: Any, layer: int) -> tuple[Any, Any]:
    """(q_norm, k_norm) HF modules applied per head before rotation, or (None, None)."""
    a = hf_attention(model, layer)
    q = next((m for m in (getattr(a, "q_norm", None), getattr(a, "q_layernorm", None)) if m is not None), None)
    k = next((m for m in (getattr(a, "k_norm", None), getattr(a, "k_layernorm", None)) if m is not None), None)
    return q, k


def unsupported_qk_path(model: Any, layer: int) -> str | None:
    """Why q/k between hook_q/hook_k and rotation are not just a QK-norm (per head, or across heads as OLMo-2), or
    None."""
    a = hf_attention(model, layer)
    if getattr(a, "key_multiplier", None) is not None:
        return "scales keys (key_multiplier)"
    if getattr(getattr(a, "config", None), "clip_qkv", None) is not None:
        return "clips q/k/v (clip_qkv)"
    rp = getattr(getattr(a, "config", None), "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("llama_4_scaling_beta") is not None:
        return "scales queries by position (llama-4 attention scaling)"
    if getattr(model.cfg, "use_split_qkv_input", False) or getattr(model.cfg, "use_attn_in", False):
        return "runs with split q/k/v inputs"
    return None
