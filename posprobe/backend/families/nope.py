"""No positional encoding (NoPE): a layer (SmolLM3 every 4th, Cohere 2, Llama 4) or a whole model whose scores
see no position at all. Order reaches them only through the causal mask and earlier layers' output."""

from __future__ import annotations

from posprobe.backend.families.base import Family

_NONE = "the model has no positional encoding"

FAMILY = Family(
    kind="nope",
    phrase="NoPE (no positional encoding)",
    control=None,
    why_no_control=_NONE,
    decompositions=("data-driven",),
    not_applicable={s: _NONE for s in ("frequency", "geometry", "shift", "retrieval")},
)
