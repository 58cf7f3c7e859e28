"""What the rest of posprobe may ask of a model object (a TransformerBridge or a TL 3 model), in one place.

Analyses and core code never read `model.cfg`, `model.blocks`, class names or TL caches themselves; they
call these functions (with `hooks.py` for hook names and position-control internals, `facts.py` for the
positional facts). Each function takes the bridge path first and the TL 3 legacy path second.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from posprobe.backend import hf
from posprobe.backend.bridge import qk_norms, unsupported_qk_path
from posprobe.backend.fast_attention import sdpa_attention
from posprobe.backend.hooks import hook_name, score_soft_cap
from posprobe.backend.kind import is_bridge, is_encoder, n_layers  # noqa: F401 - re-exported for the layers above


def context_length(model: Any) -> int:
    """Positions the model has (learned table size / trained context); position ids must stay below it."""
    return int(model.cfg.n_ctx)


def device_of(model: Any) -> torch.device:
    """The device the model's weights live on (tensors made for it go there)."""
    if is_bridge(model):  # a bridge moved with .to() keeps a stale cfg.device
        return next(model.original_model.parameters()).device
    return torch.device(model.cfg.device)


def dtype_of(model: Any) -> torch.dtype:
    """The dtype of the model's weights and activations."""
    if is_bridge(model):
        return next(model.original_model.parameters()).dtype
    return model.cfg.dtype


def model_name(model: Any) -> str:
    """The model's display name (what `load_model` was given, or its own name)."""
    return str(model.cfg.model_name)


def tokenizer_of(model: Any) -> Any:
    """The model's Hugging Face tokenizer (None for models built without one)."""
    return model.tokenizer


def has_lm_head(model: Any) -> bool:
    """False where the model has no trained vocabulary head (a bare encoder)."""
    return bool(getattr(model, "has_lm_head", True))


def special_tokens(model: Any) -> tuple[list[int], list[int]]:
    """Token ids the model expects around a text: ([CLS], [SEP]) for encoders, ([BOS], []) for decoders
    that prepend one, else ([], [])."""
    tok = model.tokenizer
    if is_encoder(model):
        return [tok.cls_token_id], [tok.sep_token_id]
    bos = tok.bos_token_id if (tok is not None and model.cfg.default_prepend_bos) else None
    return ([bos] if bos is not None else []), []


def forward(model: Any, tokens: torch.Tensor, *, stop_at_layer: int | None = None,
            attention_mask: torch.Tensor | None = None, fused_attention: bool = False) -> torch.Tensor:
    """One forward pass: logits, or the residual stream entering block `stop_at_layer` (decoders only:
    the blocks after it are not run). `attention_mask` is a [batch, pos] 1/0 padding mask (encoders).
    `fused_attention`: on a TransformerBridge, run attention with PyTorch SDPA where no hook sits inside an
    attention layer (`backend.fast_attention`; otherwise, and on other models, it changes nothing)."""
    if is_bridge(model):
        with sdpa_attention(model) if fused_attention else contextlib.nullcontext():
            return _bridge_forward(model, tokens, stop_at_layer=stop_at_layer, attention_mask=attention_mask)
    kwargs: dict[str, Any] = {}
    if attention_mask is not None:
        kwargs["one_zero_attention_mask"] = attention_mask
    if stop_at_layer is not None and not is_encoder(model):
        kwargs["stop_at_layer"] = stop_at_layer
    return model(tokens, **kwargs)


def _bridge_forward(model: Any, tokens: torch.Tensor, *, stop_at_layer: int | None,
                    attention_mask: torch.Tensor | None) -> torch.Tensor:
    kwargs: dict[str, Any] = {}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if stop_at_layer is None or is_encoder(model):
        return model(tokens, **kwargs)
    if stop_at_layer < n_layers(model):
        return model(tokens, stop_at_layer=stop_at_layer, **kwargs)
    # The bridge's stop_at_layer only stops *before* a block, so "after the last block" (the residual
    # the final norm reads) would run the unembedding. Stop there with the bridge's own exception, which
    # its forward catches and returns; the hook is removed before returning.
    from transformer_lens.model_bridge.exceptions import StopAtLayerException

    def stop(resid: torch.Tensor, hook: Any) -> torch.Tensor:
        raise StopAtLayerException(resid)

    with model.hooks(fwd_hooks=[(f"blocks.{n_layers(model) - 1}.hook_resid_post", stop)]):
        return model(tokens, **kwargs)


def residual_to_logits(model: Any, resid: torch.Tensor) -> torch.Tensor:
    """Final norm, unembedding and logit soft-cap applied to residual vectors `[..., d_model]`."""
    shape = resid.shape
    flat = resid.reshape(-1, 1, shape[-1])
    logits = model.unembed(model.ln_final(flat))[:, 0]
    if is_bridge(model):
        cap = hf.final_logit_softcap(model.original_model)
    else:
        tl_cap = float(getattr(model.cfg, "output_logits_soft_cap", -1.0))
        cap = tl_cap if tl_cap > 0 else None
    logits = hf.softcap_logits(logits, cap)
    return logits.reshape(*shape[:-1], logits.shape[-1])


def token_losses(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss in nats, `[batch, pos - 1]`: -log p(token t+1 | tokens <= t)."""
    return model(tokens, return_type="loss", loss_per_token=True)


def new_kv_cache(model: Any, batch: int) -> Any:
    """An empty key/value cache for incremental decoding, to pass to `forward_cached`.

    On a TransformerBridge this is a token record and each step recomputes the full forward: HF's cache
    stores keys after rotation, and position control must be able to re-rotate every key (exact, O(n^2)).
    """
    if is_bridge(model):
        return _Recompute()
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    return TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch)


class _Recompute:
    """The bridge's stand-in for a KV cache: the tokens seen so far."""

    def __init__(self) -> None:
        self.tokens: torch.Tensor | None = None


def forward_cached(model: Any, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
    """Logits of `tokens` continuing the sequence held in `cache` (which is extended in place)."""
    if isinstance(cache, _Recompute):
        cache.tokens = tokens if cache.tokens is None else torch.cat([cache.tokens, tokens], dim=1)
        return model(cache.tokens)[:, -tokens.shape[1]:]
    return model(tokens, past_kv_cache=cache)


def encode_text(model: Any, text: str) -> list[int]:
    """Token ids of `text` with no special tokens added (no truncation)."""
    return list(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def first_token(model: Any) -> int | None:
    """The token a text window should start with: the tokenizer's BOS, else its CLS, else None."""
    tok = model.tokenizer
    if is_encoder(model) and getattr(tok, "cls_token_id", None) is not None:
        return tok.cls_token_id  # a bridge gives BERT's tokenizer a BOS ([UNK]); the model was trained with [CLS]
    if tok.bos_token_id is not None:
        return tok.bos_token_id
    return getattr(tok, "cls_token_id", None)



def position_table(model: Any) -> torch.Tensor:
    """The learned absolute position embedding W_pos, `[n_ctx, d_model]` (learned-APE models only)."""
    if is_bridge(model):
        return model.pos_embed.original_component.weight
    return model.W_pos


# --- weights and norms used by the score decomposition


@dataclass(frozen=True)
class NormSpec:
    """A norm read as an affine map once its per-token scale s is known (captured at `scale_point`):
    y = (x - mean(x) if centre else x) / s * weight + bias; weight / bias are `[d_model]` or None."""

    centre: bool
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    scale_point: str


def _norm_spec(module: Any, scale_point: str) -> NormSpec:
    orig = getattr(module, "original_component", None)
    if orig is not None:  # a bridge's NormalizationBridge around the HF norm
        kind = type(orig).__name__
        w, b = getattr(orig, "weight", None), getattr(orig, "bias", None)
        if kind.startswith("Gemma") and w is not None:
            w = 1.0 + w  # Gemma's RMSNorm multiplies by (1 + weight)
        if not ("LayerNorm" in kind or "RMSNorm" in kind):
            raise NotImplementedError(f"Cannot freeze a {kind} norm")
        return NormSpec(centre="LayerNorm" in kind, weight=None if w is None else w.detach(),
                        bias=None if b is None else b.detach(), scale_point=scale_point)
    kind = type(module).__name__
    if kind not in ("LayerNorm", "LayerNormPre", "RMSNorm", "RMSNormPre"):
        raise NotImplementedError(f"Cannot freeze a {kind} norm")
    w, b = getattr(module, "w", None), getattr(module, "b", None)
    return NormSpec(centre=kind.startswith("LayerNorm"), weight=None if w is None else w.detach(),
                    bias=None if b is None else b.detach(), scale_point=scale_point)


def qk_weights(model: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W_Q, b_Q, W_K, b_K) of `layer` in TL layout: W `[head_index, d_model, d_head]`, b `[head_index, d_head]`;
    the key side in the layout `hooks.attention_scores` expects (GQA: at the key/value-head count, it expands)."""
    a = model.blocks[layer].attn
    if is_bridge(model):  # the bridge's W_* views of the HF projections (keys at the KV-head count)
        W_Q, W_K = a.W_Q.detach(), a.W_K.detach()
        b_Q, b_K = (b.detach() if b is not None else W.new_zeros(W.shape[0], W.shape[2])
                    for b, W in ((a.b_Q, W_Q), (a.b_K, W_K)))  # no bias (Llama): zeros
        return W_Q, b_Q, W_K, b_K
    grouped = hasattr(a, "_W_K") and not getattr(model.cfg, "ungroup_grouped_query_attention", False)
    W_K, b_K = (a._W_K, a._b_K) if grouped else (a.W_K, a.b_K)
    return a.W_Q.detach(), a.b_Q.detach(), W_K.detach(), b_K.detach()


def pre_attention_norm(model: Any, layer: int) -> NormSpec | None:
    """The norm between `resid_pre` of `layer` and its attention (scale at capture point "ln1_scale"),
    or None where attention reads `resid_pre` directly (no norm; BERT's post-LN blocks)."""
    if is_encoder(model):
        return None
    if is_bridge(model):
        ln1 = getattr(model.blocks[layer], "ln1", None)
        return None if ln1 is None else _norm_spec(ln1, "ln1_scale")
    if model.cfg.normalization_type is None:
        return None
    return _norm_spec(model.blocks[layer].ln1, "ln1_scale")


def embedding_norm(model: Any) -> NormSpec | None:
    """The norm applied to the sum of the `embedding_points` parts before block 0 (BERT's embedding
    LayerNorm, scale at capture point "embed_ln_scale"), or None where that sum is the residual stream
    (decoders; a decoder's post-embedding LN, if any, acts on the word part before its hook)."""
    if is_bridge(model):
        ln = getattr(model, "embed_ln", None)
        return None if ln is None else _norm_spec(ln, "bridge_embed_ln_scale")
    if not _bert_embed(model):
        return None
    return _norm_spec(model.embed.ln, "embed_ln_scale")


def embedding_points(model: Any) -> dict[str, str]:
    """Capture points of the additive embedding parts, `[batch pos d_model]` each, residual units:
    {"word": ..., "position": ...} and "token_type" where the model adds a segment embedding."""
    if is_bridge(model):
        known = model.hook_dict
        out = {"word": "bridge_embed", "position": "bridge_pos_embed", "token_type": "bridge_token_type_embed"}
        return {k: v for k, v in out.items() if hook_name(v, 0) in known}
    if _bert_embed(model):
        return {"word": "encoder_embed", "position": "encoder_pos_embed", "token_type": "token_type_embed"}
    return {"word": "embed", "position": "pos_embed"}


def _bert_embed(model: Any) -> bool:
    # TL's BertEmbed sums word, position and token-type parts under `embed.*` hooks, then normalises the sum.
    return hasattr(getattr(model, "embed", None), "token_type_embed")


def scores_not_bilinear(model: Any) -> str | None:
    """Why attention scores are not bilinear in the (normalised) attention input (QK-norm, soft-cap,
    log-n scaling, q/k/v clipping), or None when they are."""
    if is_bridge(model):
        for layer in range(n_layers(model)):
            if any(n is not None for n in qk_norms(model, layer)):
                return "normalises q/k (QK-norm)"
            why = unsupported_qk_path(model, layer)
            if why is not None:
                return why
        return "soft-caps attention scores" if score_soft_cap(model) else None
    cfg = model.cfg
    if cfg.use_qk_norm or cfg.original_architecture in ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM"):
        return "normalises q/k (QK-norm)"
    if cfg.attn_scores_soft_cap and cfg.attn_scores_soft_cap > 0:
        return "soft-caps attention scores"
    if cfg.use_logn_attn or cfg.clip_qkv:
        return "uses log-n attention scaling or q/k/v clipping"
    return None
