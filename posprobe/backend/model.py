"""What the rest of posprobe may ask of a model object (a TransformerBridge or a TL 3 model), in one place.

Analyses and core code never read `model.cfg`, `model.blocks`, class names or TL caches themselves; they
call these functions (with `hooks.py` for hook names and position-control internals, `facts.py` for the
positional facts). Where the two backends differ, the work is done by the adapter `dispatch.ops(model)`
returns (`bridge_ops` / `legacy_ops`); what they share is written here once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posprobe.backend.dispatch import ops
from posprobe.backend.kind import is_bridge, is_encoder, n_layers  # noqa: F401 - re-exported for the layers above
from posprobe.backend.vocab import NormSpec


def context_length(model: Any) -> int:
    """Positions the model has (learned table size / trained context); position ids must stay below it."""
    return int(model.cfg.n_ctx)


def hf_learned_table(hf_model: Any) -> torch.nn.Embedding | None:
    """The learned position table of a plain HF model of GPT-2's class (`transformer.wpe`, one row per position),
    None for a model whose positions are not such a table (rotary, ALiBi, T5 buckets, NoPE, other classes)."""
    wpe = getattr(getattr(hf_model, "transformer", None), "wpe", None)
    return wpe if isinstance(wpe, torch.nn.Embedding) else None


def device_of(model: Any) -> torch.device:
    """The device the model's weights live on (tensors made for it go there)."""
    return ops(model).device_of(model)


def dtype_of(model: Any) -> torch.dtype:
    """The dtype of the model's weights and activations."""
    return ops(model).dtype_of(model)


def model_name(model: Any) -> str:
    """The model's display name (what `load_model` was given, or its own name)."""
    return str(model.cfg.model_name)


def hf_model_name(hf_model: Any) -> str:
    """A plain HF model's display name: the name `load_hf_model` recorded (the same `load_model` gives:
    smollm2 -> SmolLM2-135M-Instruct, a folder -> its name), else the last part of its `_name_or_path`."""
    recorded = getattr(hf_model, "posprobe_name", None)
    if recorded:
        return str(recorded)
    cfg = getattr(hf_model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    return Path(str(getattr(cfg, "_name_or_path", "") or "model")).name


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
    return ops(model).forward(model, tokens, stop_at_layer=stop_at_layer, attention_mask=attention_mask,
                              fused_attention=fused_attention)


def residual_to_logits(model: Any, resid: torch.Tensor) -> torch.Tensor:
    """Final norm, unembedding and what the model does after it (logit scaling, soft-cap) applied to residual
    vectors `[..., d_model]`."""
    shape = resid.shape
    flat = resid.reshape(-1, 1, shape[-1])
    logits = ops(model).finish_logits(model, model.unembed(model.ln_final(flat))[:, 0])
    return logits.reshape(*shape[:-1], logits.shape[-1])


def token_losses(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss in nats, `[batch, pos - 1]`: -log p(token t+1 | tokens <= t)."""
    return model(tokens, return_type="loss", loss_per_token=True)


def new_kv_cache(model: Any, batch: int) -> Any:
    """An empty key/value cache for incremental decoding, to pass to `forward_cached`.

    On a TransformerBridge this is a token record and each step recomputes the full forward: HF's cache
    stores keys after rotation, and position control must be able to re-rotate every key (exact, O(n^2)).
    """
    return ops(model).new_kv_cache(model, batch)


def forward_cached(model: Any, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
    """Logits of `tokens` continuing the sequence held in `cache` (which is extended in place)."""
    return ops(model).forward_cached(model, tokens, cache)


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
    return ops(model).position_table(model)


def token_table(model: Any) -> torch.Tensor:
    """The token embedding W_E, `[d_vocab, d_model]`, unscaled (as the model's embedding module stores it)."""
    return ops(model).token_table(model)


# --- weights and norms used by the score decomposition


def qk_weights(model: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W_Q, b_Q, W_K, b_K) of `layer` in TL layout: W `[head_index, d_model, d_head]`, b `[head_index, d_head]`;
    the key side in the layout `hooks.attention_scores` expects (GQA: at the key/value-head count, it expands)."""
    return ops(model).qk_weights(model, layer)


def pre_attention_norm(model: Any, layer: int) -> NormSpec | None:
    """The norm between `resid_pre` of `layer` and its attention (scale at capture point "ln1_scale"),
    or None where attention reads `resid_pre` directly (no norm; BERT's post-LN blocks)."""
    return None if is_encoder(model) else ops(model).pre_attention_norm(model, layer)


def embedding_norm(model: Any) -> NormSpec | None:
    """The norm applied to the sum of the `embedding_points` parts before block 0 (BERT's embedding
    LayerNorm, scale at capture point "embed_ln_scale"), or None where that sum is the residual stream
    (decoders; a decoder's post-embedding LN, if any, acts on the word part before its hook)."""
    return ops(model).embedding_norm(model)


def embedding_points(model: Any) -> dict[str, str]:
    """Capture points of the additive embedding parts, `[batch pos d_model]` each, residual units:
    {"word": ..., "position": ...} and "token_type" where the model adds a segment embedding."""
    return ops(model).embedding_points(model)


def scores_not_bilinear(model: Any) -> str | None:
    """Why attention scores are not bilinear in the (normalised) attention input (QK-norm, soft-cap,
    log-n scaling, q/k/v clipping), or None when they are."""
    return ops(model).scores_not_bilinear(model)


def weights_fingerprint(model: Any) -> dict[str, Any]:
    """An identity of a model's weights for checkpoint keys: parameter count, dtype, device type, and a sha256
    over every parameter's name, shape, float64 sum and float64 norm (one read of the weights, no copies);
    changes when any parameter does."""
    import hashlib

    h = hashlib.sha256()
    n, first = 0, None
    with torch.no_grad():
        for name, p in model.named_parameters():
            first = p if first is None else first
            n += p.numel()
            total = float(p.sum(dtype=torch.float64))
            norm = float(torch.linalg.vector_norm(p, dtype=torch.float64))
            h.update(f"{name}:{tuple(p.shape)}:{total!r}:{norm!r};".encode())
    if first is None:
        return {"n_params": 0}
    return {"n_params": n, "dtype": str(first.dtype).removeprefix("torch."), "device": first.device.type,
            "digest": h.hexdigest()}
