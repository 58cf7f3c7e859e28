"""One adapter per positional mechanism: rotary, learned absolute, ALiBi, T5 relative buckets, fixed sinusoidal,
none (NoPE). Each module holds its family's `FAMILY` (how positions enter a layer, how a plan is honoured, which
score terms exist, which analyses apply and why not) and the family's quirks (OPT's table offset, ALiBi's measured
slopes, the sinusoidal module, T5's refusal).

Adding a family, counted honestly (issue #50):
- its module here, with `FAMILY` (detection, phrase, control, `not_applicable`; a family that adds a term to the
  scores, such as FIRE or Kerple, sets `score_term` and `score_bias`, and the score decomposition uses it with no
  edit: it asks the family through `backend.hooks.score_bias`);
- three lines in this file: the import, the `FAMILIES` tuple, its place in `DETECTION_ORDER`;
- its position control, if it needs a new one: a function and an entry of the control table in `core/positions.py`
  (and its name in `base.CONTROLS`);
- a reader in the backend (`bridge_ops`, `legacy_ops`, the `hooks` façade) only where it needs something of the
  model that no reader gives yet (ALiBi's `alibi_slopes`, T5's `bucket_bias`), since this package reads no model;
- tests: `tests/test_family_adapters.py::test_every_family_module_registers_one_family` counts the modules (raise
  its count) and checks each answer's vocabulary (a `score_term` without `score_bias` fails there);
  `tests/test_architectures.py::test_no_positional_kind_literal_outside_the_families` keeps its name in here; a tiny
  model in `tests/families.py` puts it in the support matrix (`tests/test_support_matrix.py`), and a biased family's
  term meets the decomposition's sum check (`tests/test_decompose.py`, as the ALiBi and T5 cases there do).
So: one module and three lines here, plus a control and a reader where it has a new one.

Torch-free at import: `peek` reads the families' config vocabularies before any model loads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from posprobe.backend.families import alibi, learned, nope, relative, rotary, sinusoidal
from posprobe.backend.families.base import (
    BUCKET_BIAS,
    CONTROLS,
    POSITION_IDS,
    POSITION_SECTIONS,
    QK_ROTATION,
    SCORE_BIAS,
    Family,
)

if TYPE_CHECKING:  # torch-free at import: peek runs before torch loads
    from posprobe.rope import RotarySpec

#: Every family by `kind`. "none" (a whole model without positions) is the NoPE family too.
FAMILIES: dict[str, Family] = {m.FAMILY.kind: m.FAMILY for m in (rotary, learned, alibi, relative, sinusoidal, nope)}
_ALIASES = {"none": "nope"}
#: The order families are asked whether a spec names them: ALiBi first (Falcon-RW's config sets `alibi` beside the
#: rope_theta every Falcon config carries), NoPE before rotary (an all-NoPE rotary config), then the families an
#: architecture row names, learned last (BERT's `absolute` is the default value).
DETECTION_ORDER: tuple[Family, ...] = (alibi.FAMILY, nope.FAMILY, rotary.FAMILY, relative.FAMILY, sinusoidal.FAMILY,
                                       learned.FAMILY)
#: What a spec says where it names no family posprobe knows.
UNKNOWN = "unknown"
#: Kinds by name, for code outside this package that must name one (the zoo's members, posprobe's own tiny specs).
ROTARY, LEARNED, ALIBI, SINUSOIDAL, NOPE, RELATIVE = (rotary.FAMILY.kind, learned.FAMILY.kind, alibi.FAMILY.kind,
                                                      sinusoidal.FAMILY.kind, nope.FAMILY.kind, relative.FAMILY.kind)


def from_hf_config(cfg: Mapping[str, Any], row_family: Family | None) -> str:
    """The positional kind an HF config dict names (`row_family`: the family its architecture row lists), or
    UNKNOWN: the first family in DETECTION_ORDER whose detector accepts it."""
    return next((f.kind for f in DETECTION_ORDER if f.detect_hf is not None and f.detect_hf(cfg, row_family)),
                UNKNOWN)


def from_gguf(arch: str, meta: Mapping[str, Any]) -> str:
    """The positional kind a GGUF header names (`general.architecture` `arch`, key/values `meta`), or UNKNOWN."""
    return next((f.kind for f in DETECTION_ORDER if f.detect_gguf(arch, meta)), UNKNOWN)


def from_tl(positional_embedding_type: str) -> str:
    """posprobe's kind for a TransformerLens `positional_embedding_type` ("standard" -> "learned_absolute"); a name
    no family claims (TL's "shortformer") is returned as it is."""
    return next((f.kind for f in DETECTION_ORDER if positional_embedding_type in f.tl_names),
                positional_embedding_type)


def tl_name(kind: str) -> str:
    """TransformerLens's `positional_embedding_type` for posprobe kind `kind` (for building TL configs)."""
    return min(family(kind).tl_names)


def label(kind: str) -> str:
    """A short name for `kind` in sentences ("RoPE", "ALiBi", ...); the kind itself where no family has it."""
    fam = find(kind)
    return kind if fam is None or not fam.label else fam.label


def find(kind: str) -> Family | None:
    """The adapter of positional kind `kind` (a `ModelFacts.positional_kind` or per-layer kind), or None for a kind
    posprobe has no adapter for."""
    return FAMILIES.get(_ALIASES.get(kind, kind))


def family(kind: str) -> Family:
    """`find(kind)`, or KeyError naming the known kinds."""
    fam = find(kind)
    if fam is None:
        raise KeyError(f"No positional family {kind!r} (known: {', '.join(FAMILIES)})")
    return fam


def control(kind: str) -> str | None:
    """How a position plan reaches a model of positional kind `kind` (one of CONTROLS), None where posprobe cannot
    move its positions (no positions, T5 buckets, an unknown kind)."""
    fam = find(kind)
    return None if fam is None else fam.control


def not_applicable(kind: str, section: str) -> str | None:
    """Why atlas section / analysis `section` does not apply to positional kind `kind`, or None where it does. An
    unknown kind has no adapter, so no position analysis (POSITION_SECTIONS) applies to it."""
    fam = find(kind)
    if fam is None:
        return f"posprobe has no adapter for {kind} positions" if section in POSITION_SECTIONS else None
    return fam.applies(section)


def describe_layers(kinds: tuple[str, ...], rotary_specs: tuple[RotarySpec | None, ...] | None, d_head: int,
                    attn_types: tuple[str, ...], extra: str = "",
                    alibi_slopes: tuple[tuple[float, ...], ...] | None = None,
                    length_rules: tuple[str | None, ...] | None = None) -> tuple[str, ...]:
    """One phrase per layer saying how positions enter it, from per-layer kinds ("rotary", "nope", ...), each
    family's own wording (rotary share / pairing / base; measured ALiBi slopes)."""
    out = []
    for l, kind in enumerate(kinds):
        if kind == "rotary" and rotary_specs is not None and rotary_specs[l] is not None:
            text = rotary.phrase(rotary_specs[l], d_head)
        elif kind == "alibi" and alibi_slopes is not None:
            text = alibi.phrase(alibi_slopes[l])
        else:
            fam = find(kind)
            text = kind if fam is None else fam.phrase
        if l < len(attn_types) and attn_types[l] == "local":
            text += ", sliding window"
        if length_rules and kind == "rotary" and length_rules[l]:
            text += f" ({length_rules[l]})"
        out.append(text + extra)
    return tuple(out)


__all__ = ["ALIBI", "BUCKET_BIAS", "CONTROLS", "DETECTION_ORDER", "FAMILIES", "LEARNED", "NOPE", "POSITION_IDS",
           "POSITION_SECTIONS", "QK_ROTATION", "RELATIVE", "ROTARY", "SCORE_BIAS", "SINUSOIDAL", "UNKNOWN", "Family",
           "alibi", "control", "describe_layers", "family", "find", "from_gguf", "from_hf_config", "from_tl", "label",
           "learned", "nope", "not_applicable", "relative", "rotary", "sinusoidal", "tl_name"]
