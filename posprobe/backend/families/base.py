"""The shape every positional-family adapter fills in: one `Family` per way positions enter attention.

Torch-free, so `peek` (which runs before any model loads) can read the families' config vocabularies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

#: How a position plan reaches each family's model (`Family.control`).
CONTROLS = POSITION_IDS, QK_ROTATION, SCORE_BIAS, BUCKET_BIAS = ("position ids", "q/k rotation", "score bias",
                                                                 "bucket bias")
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
    #: The score term this family adds to q.k (ALiBi's distance bias, "alibi"), "" where it adds none.
    score_term: str = ""
    #: That term's value on one layer, set exactly where `score_term` is: called as
    #: `score_bias(read, model, layer, scores, qk)` by `backend.hooks.score_bias` (the only caller), with `read` the
    #: backend's model reader for `model` (`dispatch.ops(model)`: `alibi_slopes`, `bucket_bias`, ...; passed in, so
    #: this package imports nothing above it), the layer's captured `hook_attn_scores` `[batch, head_index,
    #: query_pos, key_pos]` and the q.k part of them already explained (float64, same shape). Returns the term,
    #: float64 on the CPU, same shape; the score decomposition adds it as pseudo-part "a" and checks the sum.
    score_bias: Callable[[Any, Any, int, Any, Any], Any] | None = None
    #: A short name for sentences ("RoPE", "ALiBi", ...).
    label: str = ""
    #: TransformerLens's `positional_embedding_type` values for this family ("standard" is learned absolute; TL also
    #: calls XGLM's fixed sinusoids "standard", which `sinusoidal.detect` tells apart after loading).
    tl_names: frozenset[str] = frozenset()
    #: Whether scores depend on query-key offsets alone, so moving every position by k changes nothing by
    #: construction (the shift test is then an invariance control).
    shift_invariant: bool = False
    #: Whether Hugging Face's forward places tokens through `position_ids` (ALiBi computes its bias without them).
    hf_position_ids: bool = True
    #: A trained position table added to the embedding (W_pos): geometry's table view, the exact layer-0 split.
    learned_table: bool = False
    #: A table fixed by its formula inside a Hugging Face module (sinusoids), set through that module.
    fixed_table: bool = False
    #: GGUF `general.architecture` values of this family.
    gguf_archs: frozenset[str] = frozenset()
    #: A GGUF key prefix (after `<arch>.`) whose presence names the family (rotary: "rope.").
    gguf_key_prefix: str = ""
    #: Whether an HF config dict names this family: called with the config and the family its architecture row
    #: lists (`backend.architectures`, None where the row names none). Families are asked in `DETECTION_ORDER`.
    detect_hf: Callable[[Mapping[str, Any], Family | None], bool] | None = None

    def applies(self, section: str) -> str | None:
        """None where `section` applies to this family, else the reason it does not."""
        return self.not_applicable.get(section)

    def detect_gguf(self, arch: str, meta: Mapping[str, Any]) -> bool:
        """True where a GGUF header (`general.architecture` `arch`, key/value `meta`) names this family."""
        if self.gguf_key_prefix and any(k.startswith(f"{arch}.{self.gguf_key_prefix}") for k in meta):
            return True
        return arch in self.gguf_archs


def listed(kind: str) -> Callable[[Mapping[str, Any], Family | None], bool]:
    """The detector of a family that only its architecture row names (`kind`: the family's own)."""
    return lambda cfg, row_family: row_family is not None and row_family.kind == kind
