"""Hugging Face's decoder-only T5-bias language model (`Pix2StructTextModel`, model_type "pix2struct_text_model")
on TransformerLens's bridge, which has no adapter for it in 3.9 or 4.x.

`register()` (idempotent, called before any bridge boots) makes three additions (`register_auto_class()` the first
alone, for training and plain HF loading without TransformerLens's import):
- `AutoModelForCausalLM` learns the class, since transformers maps it to no causal-LM auto class.
- TransformerLens learns an adapter: embed, pos_embed (layer 0's bucket table, shared by every layer), blocks
  (ln1, attn, ln2, gated mlp), ln_final and unembed.
- Its attention component computes the attention itself, as TL's rotary components do, rather than delegating to
  HF's module and firing hooks after the fact. So `hook_attn_scores` carries the pre-softmax scores (q.k + bucket
  bias + causal mask), `hook_pattern` the weights, and an edit of either reaches the output.

The recipe is HF's eager one, step for step: no 1/sqrt(d_head) scaling (T5's convention), the bias added before
the mask, softmax in the input dtype. Tests hold the bridge to an independent HF model with the same weights.
"""

from __future__ import annotations

from typing import Any

import torch

from posprobe.backend.families import relative

ARCHITECTURE = "Pix2StructTextModel"
#: The bucket table's module inside the HF model (layer 0 computes the bias; later layers reuse it).
BIAS_MODULE = "layer.0.self_attention.attention.relative_attention_bias"

_done: list[bool] = []


def register_auto_class() -> None:
    """Teach transformers' `AutoModelForCausalLM` the decoder-only T5-bias class (no TransformerLens import: what
    training and plain HF loading need)."""
    from transformers import AutoModelForCausalLM, Pix2StructTextConfig, Pix2StructTextModel

    AutoModelForCausalLM.register(Pix2StructTextConfig, Pix2StructTextModel, exist_ok=True)


def register() -> None:
    """Teach transformers' `AutoModelForCausalLM` and TransformerLens's bridge the decoder-only T5-bias class
    (once per process)."""
    if _done:
        return
    from transformer_lens.factories import architecture_adapter_factory as factory

    register_auto_class()
    adapter = _adapter_class()
    # The bridge picks an architecture from SUPPORTED_ARCHITECTURES before it asks the factory's registry.
    factory.SUPPORTED_ARCHITECTURES[ARCHITECTURE] = adapter
    factory.ArchitectureAdapterFactory.register_adapter(ARCHITECTURE, adapter)
    _done.append(True)


def bridged(model: Any) -> bool:
    """True where `model` is a bridge whose attention is posprobe's T5-bias component (live score hooks)."""
    blocks = getattr(model, "blocks", None)
    return bool(blocks) and type(blocks[0].attn).__name__ == "T5BiasAttentionBridge"


def bucket_ids(rel: torch.Tensor, cfg: Any) -> torch.Tensor:
    """T5's causal bucket (int64, same shape) of each key-minus-query offset `rel` (tokens; integers), by the
    model's own function with its config's bucket count and largest distance: HF's `_relative_position_bucket`."""
    from transformers.models.pix2struct.modeling_pix2struct import Pix2StructTextAttention

    return Pix2StructTextAttention._relative_position_bucket(
        rel.to(torch.long), bidirectional=False, num_buckets=int(cfg.relative_attention_num_buckets),
        max_distance=int(cfg.relative_attention_max_distance))


def bias_table(hf_model: Any) -> torch.Tensor:
    """The learned bias per bucket and head, `[bucket, head]` (score units), as the model holds it."""
    module = hf_model.get_submodule(BIAS_MODULE)
    module = getattr(module, "original_component", None) or module  # the bridge wraps it in place
    return module.weight


def _adapter_class() -> type:
    from transformer_lens.model_bridge.architecture_adapter import ArchitectureAdapter

    attention = _attention_class()

    class Pix2StructTextAdapter(ArchitectureAdapter):
        """TransformerLens adapter for `Pix2StructTextModel` (posprobe's; see the module docstring)."""

        def __init__(self, cfg: Any) -> None:
            super().__init__(cfg)
            self.supports_fold_ln = False  # T5's RMSNorm scale stays where HF keeps it: weights are used as loaded
            self.weight_processing_conversions = {}
            _configure(self.cfg)
            self.component_mapping = _components(self.cfg, attention)

    return Pix2StructTextAdapter


def _configure(cfg: Any) -> None:
    # What the adapter tells TransformerLens about the model (read at every boot, not once per process).
    cfg.normalization_type = "RMS"
    cfg.positional_embedding_type = relative.TL_NAME
    cfg.final_rms = True
    cfg.gated_mlp = True
    cfg.attn_only = False
    cfg.uses_rms_norm = True  # T5's norm is RMSNorm by another name: otherwise TL's hook_scale centres its input


def _components(cfg: Any, attention: type) -> dict[str, Any]:
    # Where each TransformerLens component sits in Pix2StructTextModel (module names relative to the model).
    from transformer_lens.model_bridge.generalized_components import (
        BlockBridge,
        EmbeddingBridge,
        GatedMLPBridge,
        LinearBridge,
        PosEmbedBridge,
        RMSNormalizationBridge,
        UnembeddingBridge,
    )

    return {
        "embed": EmbeddingBridge(name="embed_tokens"),
        "pos_embed": PosEmbedBridge(name=BIAS_MODULE),
        "blocks": BlockBridge(name="layer", submodules={
            "ln1": RMSNormalizationBridge(name="self_attention.layer_norm", config=cfg),
            "attn": attention(name="self_attention.attention", config=cfg, submodules={
                "q": LinearBridge(name="query"), "k": LinearBridge(name="key"),
                "v": LinearBridge(name="value"), "o": LinearBridge(name="output")}),
            "ln2": RMSNormalizationBridge(name="mlp.layer_norm", config=cfg),
            "mlp": GatedMLPBridge(name="mlp.DenseReluDense", config=cfg, submodules={
                "gate": LinearBridge(name="wi_0"), "in": LinearBridge(name="wi_1"), "out": LinearBridge(name="wo")}),
        }),
        "ln_final": RMSNormalizationBridge(name="final_layer_norm", config=cfg),
        "unembed": UnembeddingBridge(name="lm_head", config=cfg),
    }


def _attention_class() -> type:
    from transformer_lens.model_bridge.generalized_components import AttentionBridge

    class T5BiasAttentionBridge(AttentionBridge):
        """Self-attention with T5's bucket bias, computed here so every hook on the way is live."""

        def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None = None,
                    key_value_states: torch.Tensor | None = None, position_bias: torch.Tensor | None = None,
                    cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if key_value_states is not None:
                # Cross-attention reads an encoder's states: a decoder-only model has none.
                raise NotImplementedError("posprobe's T5-bias attention bridge runs self-attention only")
            return _attend(self, hidden_states, mask, position_bias, cache)

    return T5BiasAttentionBridge


def _attend(component: Any, hidden_states: torch.Tensor, mask: torch.Tensor | None,
            position_bias: torch.Tensor | None, cache: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # HF's eager recipe through the bridge's own q/k/v/o components and hook points: (output, the position bias
    # every later layer reuses, the attention weights). With HF's cache (the class's default use_cache=True) keys and
    # values of earlier steps join as HF's own forward joins them; the new queries sit after them.
    hf: Any = component.original_component
    hidden_states = component.hook_in(hidden_states)
    batch, n = hidden_states.shape[:2]
    d = hf.key_value_proj_dim

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, n, -1, d).transpose(1, 2)

    q, k, v = (heads(proj(hidden_states)) for proj in (component.q, component.k, component.v))
    past = 0
    if cache is not None:
        cache = getattr(cache, "self_attention_cache", cache)  # an encoder-decoder cache holds the decoder's inside
        past = int(cache.get_seq_length(hf.layer_idx))
        k, v = cache.update(k, v, hf.layer_idx)
    if position_bias is None:
        # Only layer 0 is handed none: it owns the table, and HF's compute_bias reads it through the bridged module
        # (pos_embed hooks); every later layer gets layer 0's bias from HF's stack.
        position_bias = hf.compute_bias(n, k.shape[-2], device=q.device, past_seen_tokens=past)
    scores = torch.matmul(q, k.transpose(2, 3)) * hf.scaling + position_bias
    scores = component.hook_attn_scores(_masked(scores, mask))
    pattern = component.hook_pattern(torch.softmax(scores, dim=-1))
    z = torch.matmul(pattern, v).transpose(1, 2).reshape(batch, n, -1)
    return component.hook_out(component.o(z)), position_bias, pattern


def _masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # HF hands eager attention an additive float mask (the dtype's minimum where a pair is dropped), SDPA a boolean
    # one or None for plain causal attention (the text decoder is always causal): each reproduces the eager recipe.
    n_q, n_k = scores.shape[-2:]
    if mask is None:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device).tril(n_k - n_q)
        return scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    mask = mask[:, :, :, :n_k]
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores + mask
