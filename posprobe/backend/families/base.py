"""The shape every positional-family adapter fills in: one `Family` per way positions enter attention.

Torch-free, so `peek` (which runs before any model loads) can read the families' config vocabularies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

#: How a position plan reaches each family's model (`Family.control`).
CONTROLS = ("position ids", "q/k rotation", "score bias")
#: Atlas sections that exist for some positional families only (the rest read attention or hidden states alone).
POSITION_SECTIONS = ("frequency", "geometry", "shift", "retrieval")


@dataclass(frozen=True)
class Family:
    """One positional mechanism: what posprobe knows about it, independent of the model that carries it."""

    #: posprobe's name for the mechanism ("rotary", "learned_absolute", "alibi", ...): `ModelFacts.positional_kind`.
    kind: str
    #: How positions enter a layer, when nothing more specific is known (the rotary adapter adds share and base).
    phrase: str
    #: How a position plan is honoured (one of CONTROLS), or None where posprobe cannot move this family's
    #: positions (then `why_no_control` says why).
    control: str | None
    why_no_control: str = ""
    #: The decompose methods whose score terms exist for this family ("exact-layer0": word/position pair terms of
    #: the embedding; "data-driven": positional/context/remainder terms of the residual stream).
    decompositions: tuple[str, ...] = ()
    #: Atlas sections (and the analyses behind them) that do not apply to the family, each with the reason; a
    #: section not named here applies once the model's family is proven (`ModelFacts.unsupported` is None).
    not_applicable: Mapping[str, str] = field(default_factory=dict)
    #: Whether positions past the model's table cannot be computed at all (a learned table has a last row), so an
    #: evaluation longer than the context is reported as "cannot run" rather than measured or raised.
    bounded_by_table: bool = False
    #: Hugging Face model types of this family whose configs carry no positional key that names it outright.
    hf_model_types: frozenset[str] = frozenset()
    #: GGUF `general.architecture` values of this family (rotary is read from `<arch>.rope.*` keys instead).
    gguf_archs: frozenset[str] = frozenset()

    def applies(self, section: str) -> str | None:
        """None where `section` applies to this family, else the reason it does not."""
        return self.not_applicable.get(section)
