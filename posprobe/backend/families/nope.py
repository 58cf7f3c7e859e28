"""No positional encoding (NoPE): a layer (SmolLM3 every 4th, Cohere 2, Llama 4) or a whole model whose scores
see no position at all. Order reaches them only through the causal mask and earlier layers' output."""

from __future__ import annotations

from typing import Any, Mapping

from posprobe.backend.families.base import Family
from posprobe.backend.families.rotary import uses_rotary


def _detect_hf(cfg: Mapping[str, Any], row_family: Family | None) -> bool:
    # SmolLM3 / Llama 4 mark rotary layers 1 and NoPE layers 0: a rotary architecture with every flag 0 has no
    # positions at all.
    flags = cfg.get("no_rope_layers")
    return uses_rotary(cfg) and isinstance(flags, list) and bool(flags) and not any(flags)


_NONE = "the model has no positional encoding"

FAMILY = Family(
    kind="nope",
    label="NoPE",
    shift_invariant=True,
    detect_hf=_detect_hf,
    phrase="NoPE (no positional encoding)",
    control=None,
    why_no_control=_NONE,
    decompositions=("data-driven",),
    not_applicable={s: _NONE for s in ("frequency", "geometry", "shift", "retrieval")},
)
