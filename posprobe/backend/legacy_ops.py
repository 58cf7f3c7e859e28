"""The TL 3 legacy adapter: each model operation of the façades (`model.py`, `hooks.py`, `facts.py`) on a
HookedTransformer / HookedEncoder. Same functions, same meaning as `bridge_ops`; `dispatch.ops(model)` picks
one. TransformerLens is imported only inside the functions that need it (TL 4 has none of these classes).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from posprobe.backend import families
from posprobe.backend.kind import is_encoder, n_layers
from posprobe.backend.peek import tl_positional_kind
from posprobe.backend.vocab import NormSpec, hook_name
from posprobe.rope import RotarySpec, rotate

_OLMO = ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")

# ---- the model object


def device_of(model: Any) -> torch.device:
    return torch.device(model.cfg.device)


def dtype_of(model: Any) -> torch.dtype:
    return model.cfg.dtype


def forward(model: Any, tokens: torch.Tensor, *, stop_at_layer: int | None, attention_mask: torch.Tensor | None,
            fused_attention: bool) -> torch.Tensor:
    kwargs: dict[str, Any] = {}
    if attention_mask is not None:
        kwargs["one_zero_attention_mask"] = attention_mask
    if stop_at_layer is not None and not is_encoder(model):
        kwargs["stop_at_layer"] = stop_at_layer
    return model(tokens, **kwargs)


def finish_logits(model: Any, logits: torch.Tensor) -> torch.Tensor:
    cap = float(getattr(model.cfg, "output_logits_soft_cap", -1.0))
    return torch.tanh(logits / cap) * cap if cap > 0 else logits


def new_kv_cache(model: Any, batch: int) -> Any:
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    return TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch)


def forward_cached(model: Any, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
    return model(tokens, past_kv_cache=cache)


def position_table(model: Any) -> torch.Tensor:
    return model.W_pos


def token_table(model: Any) -> torch.Tensor:
    return model.W_E


# ---- weights and norms (score decomposition)


def norm_spec(module: Any, scale_point: str) -> NormSpec:
    """A TL LayerNorm / RMSNorm (or its *Pre form, weights folded away) read as an affine map."""
    kind = type(module).__name__
    if kind not in ("LayerNorm", "LayerNormPre", "RMSNorm", "RMSNormPre"):
        raise NotImplementedError(f"Cannot freeze a {kind} norm")
    w, b = getattr(module, "w", None), getattr(module, "b", None)
    return NormSpec(centre=kind.startswith("LayerNorm"), weight=None if w is None else w.detach(),
                    bias=None if b is None else b.detach(), scale_point=scale_point)


def qk_weights(model: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    a = model.blocks[layer].attn
    grouped = hasattr(a, "_W_K") and not getattr(model.cfg, "ungroup_grouped_query_attention", False)
    W_K, b_K = (a._W_K, a._b_K) if grouped else (a.W_K, a.b_K)
    return a.W_Q.detach(), a.b_Q.detach(), W_K.detach(), b_K.detach()


def pre_attention_norm(model: Any, layer: int) -> NormSpec | None:
    if model.cfg.normalization_type is None:
        return None
    return norm_spec(model.blocks[layer].ln1, "ln1_scale")


def _bert_embed(model: Any) -> bool:
    # TL's BertEmbed sums word, position and token-type parts under `embed.*` hooks, then normalises the sum.
    return hasattr(getattr(model, "embed", None), "token_type_embed")


def embedding_norm(model: Any) -> NormSpec | None:
    return norm_spec(model.embed.ln, "embed_ln_scale") if _bert_embed(model) else None


def embedding_points(model: Any) -> dict[str, str]:
    if _bert_embed(model):
        return {"word": "encoder_embed", "position": "encoder_pos_embed", "token_type": "token_type_embed"}
    return {"word": "embed", "position": "pos_embed"}


def kept_pairs(model: Any, layer: int, n_q: int, n_k: int) -> torch.Tensor:
    i = torch.arange(n_k - n_q, n_k)[:, None]
    j = torch.arange(n_k)[None, :]
    if getattr(model.cfg, "attention_dir", "causal") == "bidirectional":
        return torch.ones(n_q, n_k, dtype=torch.bool)
    local = getattr(model.blocks[layer].attn, "attn_type", "global") == "local"
    window = getattr(model.cfg, "window_size", None) if local else None
    return (j <= i) & (j > i - window) if window else j <= i


def scores_not_bilinear(model: Any) -> str | None:
    cfg = model.cfg
    if cfg.use_qk_norm or cfg.original_architecture in _OLMO:
        return "normalises q/k (QK-norm)"
    if cfg.attn_scores_soft_cap and cfg.attn_scores_soft_cap > 0:
        return "soft-caps attention scores"
    if cfg.use_logn_attn or cfg.clip_qkv:
        return "uses log-n attention scaling or q/k/v clipping"
    return None


# ---- hooks and attention internals


def encoder_layer_hooks(model: Any) -> list[str]:
    return [hook_name("embed_normalized", 0)] + [hook_name("resid_post_normalized", l) for l in range(n_layers(model))]


def table_length(model: Any, layer: int, length: int) -> int | None:
    return None  # TL 3's length-dependent RoPE (dynamic NTK) is refused by layer_rotary_spec


def length_rule(model: Any, layer: int) -> str | None:
    return None


def scaled_rotary_spec(model: Any, layer: int, params: dict, length: int | None = None) -> RotarySpec:
    raise NotImplementedError(f"{model.cfg.model_name}: Hugging Face rope scaling presets need a TransformerBridge "
                              "(TL 3 models carry no Hugging Face config)")


def layer_rotary_spec(model: Any, layer: int, length: int | None = None) -> RotarySpec:
    # TL 3's config, with its per-layer base for local/global attention.
    cfg = model.cfg
    if cfg.use_NTK_by_parts_rope or cfg.use_yarn_rope or cfg.use_dynamic_ntk_rope:
        raise NotImplementedError(
            f"{cfg.model_name} uses NTK-by-parts/YaRN/dynamic-NTK RoPE, which posprobe's position "
            "control does not reproduce yet"
        )
    a = model.blocks[layer].attn
    scale = getattr(cfg, "rotary_scaling_factor", 1.0)
    local = getattr(a, "attn_type", "global") == "local"
    freq_scale = None
    if scale != 1.0 and not local:
        freq_scale = (float(scale),) * (cfg.rotary_dim // 2)
    return RotarySpec(
        rotary_dim=cfg.rotary_dim, base=float(a._rotary_base()), adjacent=bool(cfg.rotary_adjacent_pairs),
        freq_scale=freq_scale,
    )


def rotation_unhooked(model: Any) -> str | None:
    return None  # HookedTransformer fires hook_rot_q/k for every rotary model it builds


def score_edits_apply(model: Any) -> bool:
    return True  # HookedTransformer computes its scores from hook_attn_scores' output


def embedding_positions(model: Any, position_ids: torch.Tensor) -> Any:
    raise NotImplementedError("TL 3 models add their positions at hook_pos_embed: use learned_positions")


def exposed(model: Any, names: Any) -> Any:
    return contextlib.nullcontext()  # TL 3's HookedTransformer fires every hook point it has


def rotate_at(model: Any, layer: int, x: torch.Tensor, positions: torch.Tensor, spec: RotarySpec,
              length: int | None = None) -> torch.Tensor:
    # TL 3's tables follow posprobe.rope's convention: the layer's own spec reproduces the model bit for bit.
    return rotate(x, positions, spec)


def pre_rotation(model: Any, layer: int, x: torch.Tensor, which: str) -> torch.Tensor:
    a = model.blocks[layer].attn
    cfg = model.cfg
    if cfg.original_architecture in _OLMO or cfg.clip_qkv:
        raise NotImplementedError(f"Position control does not support {cfg.original_architecture} yet")
    if cfg.use_qk_norm:
        return a._apply_qk_norm(x, a.q_norm if which == "q" else a.k_norm)
    return x


def attention_scores(model: Any, layer: int, q_rot: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    return model.blocks[layer].attn.calculate_attention_scores(q_rot, k_rot)


def scores_hook_is_pattern(model: Any) -> bool:
    return False


def kept_scores(model: Any, scores: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(scores)


def score_scale(model: Any, layer: int) -> float:
    return float(model.blocks[layer].attn.attn_scale)


def score_soft_cap(model: Any) -> float | None:
    cap = float(getattr(model.cfg, "attn_scores_soft_cap", -1.0))
    return cap if cap > 0 else None


# ---- positional facts (read by facts.model_facts)


def rotary_specs(model: Any) -> tuple[RotarySpec, ...] | None:
    if tl_positional_kind(model.cfg.positional_embedding_type) != families.ROTARY:
        return None
    return tuple(layer_rotary_spec(model, layer) for layer in range(n_layers(model)))


def attn_types(model: Any) -> tuple[str, ...]:
    return tuple(getattr(b.attn, "attn_type", "global") for b in model.blocks)


def bucket_bias(model: Any, rel: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("T5's relative position buckets need the TransformerBridge backend")


def alibi_slopes(model: Any) -> tuple[tuple[float, ...], ...]:
    raise NotImplementedError("ALiBi position control needs the TransformerBridge backend")


def layer_kinds(model: Any) -> tuple[str, ...]:
    return (tl_positional_kind(model.cfg.positional_embedding_type),) * n_layers(model)


def attention_unsupported(model: Any) -> str | None:
    return None  # TL 3 computes every pattern itself, as it computes the output from it


def forward_unsupported(model: Any) -> str | None:
    return None  # TL 3 builds its own weights per architecture; posprobe's legacy tests cover what it loads


def positional_unsupported(model: Any) -> str | None:
    # TL 3 reimplements each architecture itself; its HookedTransformer hooks fire for every family it builds,
    # and posprobe's legacy tests cover the families it loads (GPT-2, Llama/SmolLM2, Gemma 3, BERT).
    kind = model.cfg.positional_embedding_type
    # TL's shortformer adds its learned table to q and k only: TL 3 hooks it as it hooks "standard".
    if tl_positional_kind(kind) not in (families.LEARNED, families.ROTARY) and kind != "shortformer":
        return f"{model.cfg.model_name} uses {kind} positions, which posprobe has no adapter for yet"
    return None
