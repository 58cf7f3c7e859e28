"""T5-style relative position buckets: a learned bias per (head, bucket of the key-query offset), added to the
scores (T5, mT5, UMT5, LongT5; decoder-only: Pix2Struct's text decoder, the zoo's T5-bias member). Offsets below
half the buckets get one bucket each, longer ones share logarithmic buckets up to a largest distance, beyond which
all share the last; the bias is computed once in layer 0 and added in every layer.

posprobe reads and controls the buckets on the decoder-only class (`backend.t5_decoder`): position control adds,
per layer, the table's value at the planned offset's bucket minus its value at the real one, so the identity plan
changes nothing, bit for bit. TransformerLens bridges T5 itself as an encoder-decoder, which posprobe refuses."""

from __future__ import annotations

from typing import Any

from posprobe.backend.families.base import BUCKET_BIAS, Family, listed

_KIND = "relative_bias"
#: TransformerLens's `positional_embedding_type` for T5's buckets (its T5 adapters set this one of the two names).
TL_NAME = "relative_positional_bias"

FAMILY = Family(
    kind=_KIND,
    label="T5 relative buckets",
    score_term="relative_bias",
    score_bias=lambda read, model, layer, scores, qk: score_bias(read.bucket_bias, model, scores),
    tl_names=frozenset({TL_NAME, "relative_bias"}),
    shift_invariant=True,
    hf_position_ids=False,
    detect_hf=listed(_KIND),
    phrase="T5 relative buckets (layer 0's bias table, shared by every layer)",
    control=BUCKET_BIAS,
    decompositions=("data-driven",),  # with the bucket bias as its own term ("relative_bias")
    not_applicable={
        "frequency": "per-frequency RoPE usage needs rotary positions; T5's buckets have no bands",
        "geometry": "position geometry reads a learned position table added to the embedding; T5's bias has none",
        "shift": "T5's bias depends on the key-query offset alone, so shifting every position changes nothing by "
                 "construction",
        "retrieval": "retrieval heads are read through the long-context engine, which rotates q and k",
    },
)


def score_bias(bucket_bias: Any, model: Any, scores: Any) -> Any:
    """T5's score term: the learned bias of each (query, key) pair's offset bucket, float64 `[batch, head_index,
    query_pos, key_pos]` on the CPU, from the model's own table (`bucket_bias(model, rel)`, the backend's reader).
    Nothing is taken from the scores (the same in every layer: layer 0's table), so the decomposition's sum check
    proves the table and q.k explain them exactly."""
    import torch

    n_q, n_k = scores.shape[-2:]
    idx = torch.arange(n_k)
    rel = idx[None, :] - idx[n_k - n_q:, None]
    return bucket_bias(model, rel).detach().to("cpu", torch.float64).expand(scores.shape[0], -1, -1, -1)


def unsupported(arch: str) -> str:
    """Refusal for a model with relative position buckets in a class posprobe has no adapter for."""
    return (f"{arch} uses T5-style relative position buckets, which posprobe reads only on Hugging Face's "
            "decoder-only T5-bias class (Pix2StructTextModel) so far")


def encoder_decoder(arch: str) -> str:
    """Refusal for an encoder-decoder bridge (T5): every analysis walks one stack of blocks."""
    return (f"TransformerLens bridges {arch} as an encoder-decoder (encoder_blocks, decoder_blocks); posprobe reads "
            "one stack of blocks and does not analyse encoder-decoder models (T5's relative position buckets) yet")
