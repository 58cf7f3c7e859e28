"""What kind of model object posprobe was handed, asked without importing TransformerLens.

The lowest module of the backend: a TransformerBridge (TL 3.9 / 4.x), a TL 3 HookedTransformer /
HookedEncoder (the legacy adapter), or a plain Hugging Face model; encoder or decoder; its depth.
Every other backend module dispatches through these few functions.
"""

from __future__ import annotations

import sys
from typing import Any


def is_bridge(model: Any) -> bool:
    """True when `model` is a TransformerLens TransformerBridge (checked without importing TL)."""
    # The class lives in model_bridge.bridge (TL 3.9) or model_bridge.transformer_bridge (TL 4); both
    # packages re-export it from model_bridge, which is loaded whenever a bridge exists.
    mod = sys.modules.get("transformer_lens.model_bridge")
    cls = getattr(mod, "TransformerBridge", None) if mod is not None else None
    return cls is not None and isinstance(model, cls)


def hf_attention(model: Any, layer: int) -> Any:
    """The Hugging Face attention module of `layer` inside a TransformerBridge (holds `scaling`,
    `head_dim`, QK-norms, soft-cap)."""
    return model.blocks[layer].attn.original_component


def n_layers(model: Any) -> int:
    """Number of transformer blocks."""
    return int(model.cfg.n_layers)


def is_encoder(model: Any) -> bool:
    """True for bidirectional encoders (BERT-like), False for causal decoders."""
    if is_bridge(model):  # TL 3.9's bridge leaves cfg.attention_dir "causal" for BERT: ask HF's attention
        a = hf_attention(model, 0)
        return getattr(a, "is_causal", getattr(getattr(a, "self", None), "is_causal", True)) is False
    return type(model).__name__ == "HookedEncoder" or model.cfg.attention_dir == "bidirectional"
