"""Names and small value types every backend adapter shares: capture points and their hook names, and the
affine reading of a norm. Imports nothing of posprobe, so both adapters and the façades can use it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# What a capture can ask for, mapped to TL 3 hook names (per layer unless noted). A TransformerBridge
# registers the same names as aliases (e.g. "blocks.{l}.attn.hook_q" -> "blocks.{l}.attn.q.hook_out",
# "blocks.{l}.hook_resid_pre" -> "blocks.{l}.hook_in") and converts q/k/rot_q/rot_k to TL's
# `batch pos head_index d_head` layout, so one table serves both backends for decoders.
POINTS = {
    "q": "blocks.{l}.attn.hook_q",
    "k": "blocks.{l}.attn.hook_k",
    "v": "blocks.{l}.attn.hook_v",
    "rot_q": "blocks.{l}.attn.hook_rot_q",
    "rot_k": "blocks.{l}.attn.hook_rot_k",
    "scores": "blocks.{l}.attn.hook_attn_scores",
    "pattern": "blocks.{l}.attn.hook_pattern",
    "z": "blocks.{l}.attn.hook_z",
    "resid_pre": "blocks.{l}.hook_resid_pre",
    "resid_mid": "blocks.{l}.hook_resid_mid",
    "resid_post": "blocks.{l}.hook_resid_post",
    "ln1_scale": "blocks.{l}.ln1.hook_scale",
    "ln1_normalized": "blocks.{l}.ln1.hook_normalized",
    # Encoders (post-LN): the normalised embedding and each block's normalised output.
    "embed_normalized": "embed.ln.hook_normalized",
    "resid_post_normalized": "blocks.{l}.hook_normalized_resid_post",
    # Embedding parts and the embedding LN scale (not per layer; the layer is ignored). Decoders and
    # HookedEncoder name them differently: model.embedding_points(model) says which ones apply.
    "embed": "hook_embed",
    "pos_embed": "hook_pos_embed",
    "encoder_embed": "embed.hook_embed",
    "encoder_pos_embed": "embed.hook_pos_embed",
    "token_type_embed": "embed.hook_token_type_embed",
    "embed_ln_scale": "embed.ln.hook_scale",
    # The same parts on a TransformerBridge (its `hook_embed` alias is not the word part on BERT).
    "bridge_embed": "embed.hook_out",
    "bridge_pos_embed": "pos_embed.hook_out",
    "bridge_token_type_embed": "token_type_embed.hook_out",
    "bridge_embed_ln_scale": "embed_ln.hook_scale",
    "bridge_embed_normalized": "embed_ln.hook_normalized",
    "bridge_resid_post_normalized": "blocks.{l}.hook_resid_post",  # a post-LN block's output is normalised
}



def hook_name(point: str, layer: int) -> str:
    """TL hook name for a capture point ("q", "rot_k", "scores", "resid_post", ...) at `layer`."""
    try:
        return POINTS[point].format(l=layer)
    except KeyError:
        raise ValueError(f"Unknown capture point {point!r}; choose from {sorted(POINTS)}") from None


@dataclass(frozen=True)
class NormSpec:
    """A norm read as an affine map once its per-token scale s is known (captured at `scale_point`):
    y = (x - mean(x) if centre else x) / s * weight + bias; weight / bias are `[d_model]` or None."""

    centre: bool
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    scale_point: str
