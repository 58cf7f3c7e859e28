"""TransformerLens hook names and the few TL internals posprobe relies on, in one place.

A move to another backend (TL 4's TransformerBridge) should only need a new version of this module.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from posprobe.core.rope import RotarySpec

# What a capture can ask for, mapped to TL 3 hook names (per layer unless noted).
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
}


def hook_name(point: str, layer: int) -> str:
    """TL hook name for a capture point ("q", "rot_k", "scores", "resid_post", ...) at `layer`."""
    try:
        return POINTS[point].format(l=layer)
    except KeyError:
        raise ValueError(f"Unknown capture point {point!r}; choose from {sorted(POINTS)}") from None


def pos_embed_hook(model: Any) -> str:
    """Name of the hook that outputs the learned position embedding added to the residual stream."""
    return "embed.hook_pos_embed" if "embed.hook_pos_embed" in model.hook_dict else "hook_pos_embed"


def attn(model: Any, layer: int) -> Any:
    """The attention module of `layer`."""
    return model.blocks[layer].attn


def layer_rotary_spec(model: Any, layer: int) -> RotarySpec:
    """The rotation layer `layer` applies, read from TL's config (per-layer base for local/global)."""
    cfg = model.cfg
    if cfg.use_NTK_by_parts_rope or cfg.use_yarn_rope or cfg.use_dynamic_ntk_rope:
        raise NotImplementedError(
            f"{cfg.model_name} uses NTK-by-parts/YaRN/dynamic-NTK RoPE, which posprobe's position "
            "control does not reproduce yet"
        )
    a = attn(model, layer)
    scale = getattr(cfg, "rotary_scaling_factor", 1.0)
    local = getattr(a, "attn_type", "global") == "local"
    freq_scale = None
    if scale != 1.0 and not local:
        freq_scale = (float(scale),) * (cfg.rotary_dim // 2)
    return RotarySpec(
        rotary_dim=cfg.rotary_dim, base=float(a._rotary_base()), adjacent=bool(cfg.rotary_adjacent_pairs),
        freq_scale=freq_scale,
    )


def pre_rotation(model: Any, layer: int, x: torch.Tensor, which: str) -> torch.Tensor:
    """Turn a hook_q / hook_k output into the vector TL actually rotates (applies QK-norm if any)."""
    a = attn(model, layer)
    cfg = model.cfg
    if cfg.original_architecture in ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM") or cfg.clip_qkv:
        raise NotImplementedError(f"Position control does not support {cfg.original_architecture} yet")
    if cfg.use_qk_norm:
        return a._apply_qk_norm(x, a.q_norm if which == "q" else a.k_norm)
    return x


def attention_scores(model: Any, layer: int, q_rot: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    """Scores exactly as the layer computes them from rotated q and k (scale, GQA, soft-cap)."""
    return attn(model, layer).calculate_attention_scores(q_rot, k_rot)


def score_scale(model: Any, layer: int) -> float:
    """The divisor of q.k in the layer's pre-softmax score (sqrt(d_head) unless the model sets another)."""
    return float(attn(model, layer).attn_scale)


def score_soft_cap(model: Any) -> float | None:
    """The attention-score soft-cap (Gemma 2 style tanh cap), or None when scores are not capped."""
    cap = float(getattr(model.cfg, "attn_scores_soft_cap", -1.0))
    return cap if cap > 0 else None


def live_hook_count(model: Any) -> int:
    """Number of forward/backward hooks currently attached to the model's HookPoints."""
    return sum(len(hp.fwd_hooks) + len(hp.bwd_hooks) for hp in model.hook_dict.values())


@contextmanager
def hooked(model: Any, fwd_hooks: Sequence[tuple[str, Callable]]) -> Iterator[Any]:
    """Attach `fwd_hooks` (TL-style `fn(tensor, hook=...)`) for the duration of the block; they are
    removed on exit, also on error. Unknown hook names raise before anything is attached."""
    for name, _ in fwd_hooks:
        if name not in model.hook_dict:
            raise ValueError(f"{model.cfg.model_name} has no hook {name!r}")
    # TL's own context manager removes exactly the hooks it added, at its context level.
    with model.hooks(fwd_hooks=list(fwd_hooks)):
        yield model
