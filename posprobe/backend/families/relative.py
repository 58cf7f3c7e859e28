"""T5-style relative position buckets: a learned bias per (head, bucket of the query-key offset), added to the
scores (T5, mT5, UMT5, LongT5). TransformerLens bridges these as encoder-decoders; posprobe walks one stack of
blocks and does not read or control the buckets yet, so every position analysis refuses them."""

from __future__ import annotations

from posprobe.backend.families.base import Family, listed

_NOT_YET = "posprobe has no adapter for T5-style relative position buckets yet"

FAMILY = Family(
    kind="relative_bias",
    label="T5 relative buckets",
    tl_names=frozenset({"relative_positional_bias", "relative_bias"}),
    shift_invariant=True,
    hf_position_ids=False,
    detect_hf=listed("relative_bias"),
    phrase="relative position buckets (T5)",
    control=None,
    why_no_control=_NOT_YET,
    not_applicable={s: _NOT_YET for s in ("frequency", "geometry", "shift", "retrieval")},
)


def unsupported(arch: str) -> str:
    """Refusal for a model with relative position buckets."""
    return f"{arch} uses T5-style relative position buckets, which posprobe has no adapter for yet"


def encoder_decoder(arch: str) -> str:
    """Refusal for an encoder-decoder bridge (T5): every analysis walks one stack of blocks."""
    return (f"TransformerLens bridges {arch} as an encoder-decoder (encoder_blocks, decoder_blocks); posprobe reads "
            "one stack of blocks and does not analyse encoder-decoder models (T5's relative position buckets) yet")
