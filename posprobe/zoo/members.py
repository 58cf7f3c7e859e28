"""The zoo's members: one small causal LM per positional family, built from stock Hugging Face classes.

Two blocks carry the families, because no stock class carries all of them:
- "gpt" (pre-LayerNorm, GELU MLP of 4 x width, biases, tied embeddings): learned absolute (GPT-2), fixed
  sinusoidal (XGLM), ALiBi (BLOOM), rotary and partial rotary (GPT-NeoX, sequential residual);
- "llama" (pre-RMSNorm, SwiGLU MLP of 8/3 x width, no biases, tied embeddings): rotary, NoPE and the RoPE/NoPE
  hybrid (SmolLM3's `no_rope_layers`), p-RoPE (Llama's "proportional" rope type), T5's relative bias
  (Pix2Struct's text decoder, its gate set to SiLU: the same block, with T5's conventions stated per member).
Rotary exists in both blocks, so the block's own effect is measured (rope vs rope-llama) beside the seed spread.
Remaining differences within a block, stated in `Member.differences`: BLOOM normalises the embedding (LayerNorm
before block 0), XGLM scales token embeddings by sqrt(d_model) as sinusoidal models do (Vaswani et al.),
GPT-2 and GPT-NeoX fuse q/k/v into one projection (same parameters). Widths, depth,
heads, MLP parameter count, vocabulary, dropout (none) and initialisation (posprobe's, `init_weights`) are equal.

A member is one row of `MEMBERS`, its HF config builder on the row (`build`: a module function, with the member's
own setting bound by `functools.partial`, so the builder runs when a config is asked for, not at import). Torch-free at
import (configs are built inside `hf_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from posprobe.backend.architectures import Architecture, lookup
from posprobe.backend.families import ALIBI, LEARNED, NOPE, RELATIVE, ROTARY, SINUSOIDAL

__all__ = ["Member", "MEMBERS", "Widths", "member", "member_names"]


@dataclass(frozen=True)
class Widths:
    """The shape every member shares: width, depth, heads, training length L (tokens) and vocabulary size."""

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    length: int = 128
    vocab_size: int = 512


@dataclass(frozen=True)
class Member:
    """One zoo member: its name, positional family (posprobe's kind), block, HF model type and what it changes."""

    name: str
    family: str
    block: str
    model_type: str
    positions: str
    differences: str = ""
    #: Its Hugging Face config at widths w: (Widths, the token ids and tying every member shares) -> config.
    build: Callable[[Widths, dict], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def architecture(self) -> Architecture:
        """The row of its HF model type (`backend.architectures`): what the class itself does that the loop must
        know (whether its loss shifts the labels, which of its weights a decoder-only forward never uses)."""
        return lookup(self.model_type)

    def hf_config(self, w: Widths, *, pad_id: int, bos_id: int) -> Any:
        """The member's Hugging Face config at widths `w` (eager attention, no dropout, tied embeddings)."""
        return self.build(w, dict(pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=bos_id,
                                            tie_word_embeddings=True))


def _gpt2(w: Widths, ids: dict) -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=w.vocab_size, n_positions=w.length, n_embd=w.d_model, n_layer=w.n_layers,
                      n_head=w.n_heads, n_inner=4 * w.d_model, activation_function="gelu_pytorch_tanh", resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, **ids)


def _xglm(w: Widths, ids: dict) -> Any:
    from transformers import XGLMConfig

    return XGLMConfig(vocab_size=w.vocab_size, max_position_embeddings=w.length, d_model=w.d_model,
                      num_layers=w.n_layers, attention_heads=w.n_heads, ffn_dim=4 * w.d_model,
                      activation_function="gelu_pytorch_tanh", dropout=0.0, attention_dropout=0.0,
                      activation_dropout=0.0, layerdrop=0.0, scale_embedding=True, **ids)


def _bloom(w: Widths, ids: dict) -> Any:
    from transformers import BloomConfig

    return BloomConfig(vocab_size=w.vocab_size, hidden_size=w.d_model, n_layer=w.n_layers, n_head=w.n_heads,
                       hidden_dropout=0.0, attention_dropout=0.0, **ids)


def _neox(w: Widths, ids: dict, *, share: float) -> Any:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=w.vocab_size, hidden_size=w.d_model, num_hidden_layers=w.n_layers,
                         num_attention_heads=w.n_heads, intermediate_size=4 * w.d_model,
                         hidden_act="gelu_pytorch_tanh", max_position_embeddings=w.length,
                         use_parallel_residual=False, attention_dropout=0.0, hidden_dropout=0.0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": share}, **ids)


def _swiglu_width(w: Widths) -> int:
    # Three d x f matrices hold as many parameters as the GELU block's two d x 4d ones at f = 8d/3.
    return int(round(8 * w.d_model / 3))


def _smollm3(w: Widths, ids: dict, *, rope_every: int | None) -> Any:
    from transformers import SmolLM3Config

    # SmolLM3's convention: 1 = rotary layer, 0 = NoPE layer.
    if rope_every is None:
        pattern = [1] * w.n_layers
    elif rope_every == 0:
        pattern = [0] * w.n_layers
    else:
        pattern = [int((i + 1) % rope_every != 0) for i in range(w.n_layers)]
    return SmolLM3Config(vocab_size=w.vocab_size, hidden_size=w.d_model, num_hidden_layers=w.n_layers,
                         num_attention_heads=w.n_heads, num_key_value_heads=w.n_heads,
                         intermediate_size=_swiglu_width(w), max_position_embeddings=w.length,
                         no_rope_layers=pattern, use_sliding_window=False, attention_dropout=0.0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **ids)


def _p_rope(w: Widths, ids: dict) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=w.vocab_size, hidden_size=w.d_model, num_hidden_layers=w.n_layers,
                       num_attention_heads=w.n_heads, num_key_value_heads=w.n_heads,
                       intermediate_size=_swiglu_width(w), max_position_embeddings=w.length, attention_dropout=0.0,
                       rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.25}, **ids)


def _t5(w: Widths, ids: dict) -> Any:
    from transformers import Pix2StructTextConfig

    # T5's bucket defaults (Raffel et al.): 32 buckets, offsets beyond 128 share the last. dense_act_fn "silu"
    # makes T5's gated MLP the llama block's SwiGLU; initializer_range is read by HF's init (posprobe's replaces it).
    return Pix2StructTextConfig(vocab_size=w.vocab_size, hidden_size=w.d_model, d_kv=w.d_model // w.n_heads,
                                d_ff=_swiglu_width(w), num_layers=w.n_layers, num_heads=w.n_heads,
                                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                                dropout_rate=0.0, dense_act_fn="silu", is_decoder=True, initializer_range=0.02,
                                decoder_start_token_id=ids["pad_token_id"], use_cache=False, **ids)


_GPT = "gpt"
_LLAMA = "llama"

MEMBERS: dict[str, Member] = {m.name: m for m in (
    Member("learned", LEARNED, _GPT, "gpt2", "a learned table of L rows added to the embedding",
           "GPT-2's fused q/k/v projection", build=_gpt2),
    Member("sinusoidal", SINUSOIDAL, _GPT, "xglm", "fixed sinusoids added to the embedding",
           "token embeddings scaled by sqrt(d_model) before the sinusoids are added (Vaswani et al.; unscaled, the "
           "sinusoids' unit amplitude drowns the 0.02-scale tokens); table read from row 2 (padding offset)",
           build=_xglm),
    Member("alibi", ALIBI, _GPT, "bloom", "ALiBi distance bias, Press et al.'s slopes",
           "BLOOM adds a LayerNorm on the embedding before block 0", build=_bloom),
    Member("rope", ROTARY, _GPT, "gpt_neox", "rotary on 100% of head dims (half-split), base 10000",
           "GPT-NeoX's per-head fused q/k/v projection", build=partial(_neox, share=1.0)),
    Member("partial", ROTARY, _GPT, "gpt_neox", "rotary on 25% of head dims (half-split), base 10000",
           "GPT-NeoX's per-head fused q/k/v projection", build=partial(_neox, share=0.25)),
    Member("rope-llama", ROTARY, _LLAMA, "smollm3", "rotary on 100% of head dims (half-split), base 10000",
           build=partial(_smollm3, rope_every=None)),
    Member("nope", NOPE, _LLAMA, "smollm3", "no positional encoding in any layer",
           build=partial(_smollm3, rope_every=0)),
    Member("hybrid", ROTARY, _LLAMA, "smollm3", "rotary, every 4th layer NoPE (SmolLM3's pattern)",
           build=partial(_smollm3, rope_every=4)),
    Member("p-rope", ROTARY, _LLAMA, "llama",
           "p-RoPE: rotary with the slowest 75% of frequencies removed (Llama's 'proportional' type)", build=_p_rope),
    Member("t5", RELATIVE, _LLAMA, "pix2struct_text_model",
           "T5 relative bias: a learned bias per head and bucket of the key-query offset (32 causal buckets, "
           "exact below 16, logarithmic to 128), computed once in layer 0 and added in every layer",
           "scores are not scaled by 1/sqrt(d_head) (T5's convention, fixed in Pix2Struct's attention); the bias "
           "table adds 32 x heads parameters; the class carries cross-attention weights a decoder-only forward "
           "never uses (left out of the parameter count)", build=_t5),
)}


def member_names() -> tuple[str, ...]:
    """Every member's name, in the zoo's order."""
    return tuple(MEMBERS)


def member(name: str) -> Member:
    """The member called `name`; ValueError naming the known members otherwise."""
    if name not in MEMBERS:
        raise ValueError(f"unknown zoo member {name!r}; known: {', '.join(MEMBERS)}")
    return MEMBERS[name]


