"""Learned absolute positions: a trained table row added to each token's embedding (GPT-2, GPT-Neo, OPT, BERT,
RoBERTa). Quirks live here: OPT reads its table from row 2 (`offset`), RoBERTa numbers real tokens from
`padding_idx + 1`. Position control sets position ids; the layer-0 scores split exactly into word/position terms."""

from __future__ import annotations

from typing import Any

from posprobe.backend.families.base import Family

_KIND = "learned_absolute"


def _detect_hf(cfg: Any, row_family: Family | None) -> bool:
    # BERT's relative_key variants carry a learned table too, but score with it in a way posprobe does not analyse.
    pet = str(cfg.get("position_embedding_type") or "").lower()
    if pet.startswith("relative"):
        return False
    return pet == "absolute" or (row_family is not None and row_family.kind == _KIND)


FAMILY = Family(
    kind=_KIND,
    label="learned absolute",
    tl_names=frozenset({"standard"}),
    learned_table=True,
    detect_hf=_detect_hf,
    phrase="learned absolute (added to the embedding)",
    control="position ids",
    bounded_by_table=True,
    decompositions=("exact-layer0", "data-driven"),
    not_applicable={
        "frequency": "per-frequency RoPE usage needs rotary positions; learned positions have no bands",
        "retrieval": "retrieval heads are read through the long-context engine, which rotates q and k",
    },
    gguf_archs=frozenset({"gpt2", "starcoder", "bert"}),
)


def first_row(embedding: Any) -> int:
    """The row of a Hugging Face position-embedding module that position 0 reads: OPT's `offset` (2); for a table
    with a `padding_idx` (RoBERTa) the row after it, since real tokens are numbered from padding_idx + 1."""
    offset = getattr(embedding, "offset", None)
    if offset is None and getattr(embedding, "padding_idx", None) is not None:
        offset = int(embedding.padding_idx) + 1
    return int(offset or 0)
