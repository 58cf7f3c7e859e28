"""TransformerLens hook names and the few TL internals posprobe relies on, in one place.

Each function takes the TransformerBridge path first and the TL 3 legacy path second.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from posprobe.backend.bridge import qk_norms, rotary_adjacent, rotary_freqs, rotary_spec, unsupported_qk_path
from posprobe.backend.kind import hf_attention, is_bridge, is_encoder, n_layers
from posprobe.rope import RotarySpec, hf_cos_sin, hf_rotate, rotate

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


def encoder_layer_hooks(model: Any) -> list[str]:
    """Hook names of an encoder's per-layer token representations: the normalised embedding (before the
    LN's affine part), then each block's normalised output."""
    prefix = "bridge_" if is_bridge(model) else ""
    return [hook_name(prefix + "embed_normalized", 0)] + [
        hook_name(prefix + "resid_post_normalized", l) for l in range(n_layers(model))]


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
    """The rotation layer `layer` applies, read from TL's config (per-layer base for local/global); on a
    TransformerBridge from the wrapped HF config and rotary table."""
    if is_bridge(model):
        return rotary_spec(model, layer)
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


def rotate_at(model: Any, layer: int, x: torch.Tensor, positions: torch.Tensor, spec: RotarySpec) -> torch.Tensor:
    """Rotate `x` (`batch pos head_index d_head`) to `positions` (`[pos]` or `[batch, pos]`) with `spec`.

    Where `spec` is the layer's own rotation, the result is bit-equal to the model's: TL 3's tables follow
    posprobe's `posprobe.rope` convention, and on a TransformerBridge HF's cos/sin recipe is replayed
    (angle = position * inv_freq, not position / freq: the one-ulp angle difference alone moved
    SmolLM2's logits by 4e-5). Other specs (new base, scaled or removed bands) use `posprobe.rope.rotate`.
    """
    if is_bridge(model) and _plain(spec) == _plain(layer_rotary_spec(model, layer)):
        return _bridge_rotate(model, layer, x, positions)
    return rotate(x, positions, spec)


def _plain(spec: RotarySpec) -> RotarySpec:
    # A per-band scale of exactly 1 everywhere (YaRN or NTK at scale 1) is the unscaled rotation.
    if spec.freq_scale is not None and all(f == 1.0 for f in spec.freq_scale):
        return RotarySpec(rotary_dim=spec.rotary_dim, base=spec.base, adjacent=spec.adjacent, removed=spec.removed)
    return spec


def _bridge_rotate(model: Any, layer: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    inv_freq, scaling = rotary_freqs(model, layer)
    adjacent = rotary_adjacent(model)
    cos, sin = hf_cos_sin(positions.to(x.device), inv_freq.to(x.device), adjacent=adjacent, scaling=scaling)
    return hf_rotate(x, cos[..., None, :], sin[..., None, :], adjacent=adjacent)  # broadcast over heads


def pre_rotation(model: Any, layer: int, x: torch.Tensor, which: str) -> torch.Tensor:
    """Turn a hook_q / hook_k output into the vector TL actually rotates (applies QK-norm if any)."""
    if is_bridge(model):
        return _bridge_pre_rotation(model, layer, x, which)
    a = attn(model, layer)
    cfg = model.cfg
    if cfg.original_architecture in ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM") or cfg.clip_qkv:
        raise NotImplementedError(f"Position control does not support {cfg.original_architecture} yet")
    if cfg.use_qk_norm:
        return a._apply_qk_norm(x, a.q_norm if which == "q" else a.k_norm)
    return x


def _bridge_pre_rotation(model: Any, layer: int, x: torch.Tensor, which: str) -> torch.Tensor:
    why = unsupported_qk_path(model, layer)
    if why is not None:
        raise NotImplementedError(f"Position control on a TransformerBridge whose attention {why} is not supported yet")
    # The bridge's per-head QK-norms (Gemma 3 style) act on the last dim, so TL's layout is fine.
    norm = qk_norms(model, layer)[0 if which == "q" else 1]
    return x if norm is None else norm(x)


def attention_scores(model: Any, layer: int, q_rot: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    """Scores exactly as the layer computes them from rotated q and k (scale, GQA, soft-cap)."""
    if is_bridge(model):
        # The bridge's own recipe: q.k * HF's `scaling`, keys repeated per query group, then the soft-cap.
        h, kv = q_rot.shape[2], k_rot.shape[2]
        k = k_rot.repeat_interleave(h // kv, dim=2) if h != kv else k_rot
        scores = torch.einsum("bqhd,bkhd->bhqk", q_rot, k) * _bridge_scaling(model, layer)
        cap = _bridge_soft_cap(model, layer)
        return torch.tanh(scores / cap) * cap if cap else scores
    return attn(model, layer).calculate_attention_scores(q_rot, k_rot)


def scores_hook_is_pattern(model: Any) -> bool:
    """True where the model's `hook_attn_scores` carries the softmax pattern instead of the pre-softmax
    scores: TransformerBridge BERT encoders (TL 3.9 and 4.3; measured: equal to hook_pattern, rows sum
    to 1). Callers then compute the scores from hook_q/hook_k with `attention_scores`."""
    if not is_bridge(model):
        return False
    return is_encoder(model)


def kept_scores(model: Any, scores: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the `hook_attn_scores` entries the layer did not mask out (causal, padding)."""
    if is_bridge(model):
        # The bridge masks with the dtype's most negative finite value (-inf only in compatibility mode).
        return scores > torch.finfo(scores.dtype).min
    return torch.isfinite(scores)


def _bridge_scaling(model: Any, layer: int) -> float:
    a = hf_attention(model, layer)
    a = getattr(a, "self", a)  # BERT: BertAttention holds BertSelfAttention
    if hasattr(a, "scaling"):
        return float(a.scaling)
    return float(getattr(a, "head_dim", getattr(a, "attention_head_size", 0)) ** -0.5)


def _bridge_soft_cap(model: Any, layer: int) -> float | None:
    cap = getattr(hf_attention(model, layer), "attn_logit_softcapping", None)
    return float(cap) if cap else None


def score_scale(model: Any, layer: int) -> float:
    """The divisor of q.k in the layer's pre-softmax score (sqrt(d_head) unless the model sets another)."""
    if is_bridge(model):
        return 1.0 / _bridge_scaling(model, layer)
    return float(attn(model, layer).attn_scale)


def score_soft_cap(model: Any) -> float | None:
    """The attention-score soft-cap (Gemma 2 style tanh cap), or None when scores are not capped."""
    if is_bridge(model):
        return _bridge_soft_cap(model, 0)
    cap = float(getattr(model.cfg, "attn_scores_soft_cap", -1.0))
    return cap if cap > 0 else None


# Context levels of posprobe's hooks, far above TL's own (which count up from 0 per nested `hooks()`).
_LEVELS = itertools.count(1_000_000)


def live_hook_count(model: Any) -> int:
    """Number of forward/backward hooks currently attached to the model's HookPoints."""
    # A bridge lists one HookPoint under several alias names: count each HookPoint once.
    # Permanent hooks are the model's own wiring (TL 4's BERT bridge routes hook_mlp_in that way), not ours.
    points = {id(hp): hp for hp in model.hook_dict.values()}.values()
    return sum(not getattr(h, "is_permanent", False) for hp in points for h in (*hp.fwd_hooks, *hp.bwd_hooks))


@contextmanager
def hooked(model: Any, fwd_hooks: Sequence[tuple[str, Callable]]) -> Iterator[Any]:
    """Attach `fwd_hooks` (TL-style `fn(tensor, hook=...)`) for the duration of the block; they are
    removed on exit, also on error. Unknown hook names raise before anything is attached."""
    known = model.hook_dict  # a bridge rebuilds this dict (~40 ms) on every access: read it once
    for name, _ in fwd_hooks:
        if name not in known:
            raise ValueError(f"{model.cfg.model_name} has no hook {name!r}")
    # Attach straight to the HookPoints under a level of our own (TL's `model.hooks()` re-reads the hook
    # dict per hook, ~5 s per forward on a bridge), and remove exactly that level on exit.
    level = next(_LEVELS)
    points = {}
    try:
        for name, fn in fwd_hooks:
            hp = known[name]
            points[id(hp)] = hp
            hp.add_hook(fn, dir="fwd", level=level)
        yield model
    finally:
        for hp in points.values():
            hp.remove_hooks("fwd", level=level)
