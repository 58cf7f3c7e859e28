"""What posprobe knows about each Hugging Face `model_type`: one row per architecture, one table.

A row says which positional family the architecture belongs to where its config does not name it, how far posprobe
has proven it against Hugging Face (position handling, attention pattern, the long-context engine), how its rotary
code pairs dims, what its forward does after the LM head or to its scores that the config alone does not say,
which layers carry no rotation, whether it is an encoder, the TransformerLens defects measured on it, and what its
HF class does that a caller must know (a loss that does not shift labels, weights a decoder-only forward never
uses, a whole LM named like a backbone, a config flag that makes it causal). Every list the backend consults
(proven types, adjacent pairing, encoders, the long-context engine's types) is read from here, and so does the
zoo's training loop (`Member.architecture`: label shifting, the parameter count).

Adding an architecture, counted honestly (issue #50):
- where TransformerLens's bridge has an adapter for the class and its family is known: one row in `_ROWS` (or
  `register(row)` at run time). Tests: `tests/test_architectures.py` (a row reaches peek, the facts and `posprobe
  info`; the class facts of Pix2Struct's row), and to claim a proof level, a tiny model of it in
  `tests/families.py` with the support matrix regenerated (`tests/test_support_matrix.py::
  test_the_generated_matrix_is_the_committed_one`);
- where the bridge has none (Pix2Struct's text decoder): the row plus an adapter module like `backend.t5_decoder`,
  whose `register()` `bridge.boot` calls (one line there; `register_auto_class()` where the zoo builds or loads
  such a model). A second T5-style decoder today also touches `bridge_ops._RMS_CALLED_LAYERNORM` if its norm is
  an RMSNorm called LayerNorm, and `t5_decoder`'s bucket readers (`bias_table`, `bucket_ids`, `bridged`), which
  know Pix2Struct's module paths. Tests: `tests/test_t5_decoder.py` holds the bridge to an independent HF copy.

Torch-free: `peek` reads it before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from posprobe.backend.families import alibi, learned, relative, sinusoidal
from posprobe.backend.families.base import Family

#: Proof levels. POSITIONS: position plans, score decomposition, frequency bands and head signatures equal HF's on
#: the bridge. PATTERN: hook_pattern equals HF's attention weights (pattern analyses: heads, sinks). LONG: the
#: chunked long-context engine reproduces HF's attention (its rotation passes q/k to the attention interface).
POSITIONS, PATTERN, LONG = "positions", "pattern", "long"
LEVELS = (POSITIONS, PATTERN, LONG)


@dataclass(frozen=True)
class Defect:
    """A measured way TransformerLens's bridge departs from Hugging Face's forward for an architecture.

    `why` is a format string with {tl} (TransformerLens's version) and {arch} (the HF class name). The defect holds
    below TransformerLens major `tl_below` (None: every version) and only where the config sets `config_flag`."""

    why: str
    tl_below: int | None = None
    config_flag: str | None = None

    def holds(self, tl_major: int, cfg: Any) -> bool:
        """True where this defect applies to a model with HF config `cfg` on TransformerLens major `tl_major`."""
        if self.tl_below is not None and tl_major >= self.tl_below:
            return False
        return self.config_flag is None or bool(getattr(cfg, self.config_flag, False))


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face `model_type` as posprobe knows it."""

    model_type: str
    #: The positional family where the config names none outright (rotary models are read from their rope keys, so
    #: they leave this None).
    family: Family | None = None
    #: Which of LEVELS posprobe has proven for this architecture (the support matrix's rows).
    proven: frozenset[str] = frozenset()
    #: Rotary pairing: "half" (dims b and b + rotary_dim/2, `rotate_half`) or "adjacent" (dims 2b and 2b+1).
    pairing: str = "half"
    #: Multiplies its logits by the config's `logit_scale` after the LM head (Cohere); other families' key of that
    #: name (CLIP's) is not an LM head's.
    logit_scale: bool = False
    #: Layers of this `layer_types` value carry no rotation (Cohere 2's full-attention layers); None: only the
    #: config's `no_rope_layers` marks NoPE layers.
    nope_layer_type: str | None = None
    #: Scores are not scaled by 1/sqrt(d_head) (GPT-Neo), where the attention module holds no scaling of its own.
    unscaled_scores: bool = False
    encoder: bool = False
    defects: tuple[Defect, ...] = ()
    #: Its HF class is a whole language model (LM head included) though its name ends in "Model", as bare
    #: backbones' names do (Pix2Struct's text decoder, `Pix2StructTextModel`).
    whole_lm: bool = False
    #: The config flag that makes its attention causal (Pix2Struct's `is_decoder`); a model whose config sets it
    #: false attends both ways and is refused (`not_causal`). None: the class is causal or an `encoder` as it is.
    causal_flag: str | None = None
    #: Whether its `labels` loss shifts the labels one token itself (every HF *ForCausalLM does). Pix2Struct's text
    #: decoder scores logits[t] against labels[t], so a training loop gives it labels already shifted.
    shifts_labels: bool = True
    #: A parameter-name fragment of weights its decoder-only forward never uses (Pix2Struct's cross-attention,
    #: "encoder_decoder_attention"): they receive no gradient, stay at their initial values and are left out of
    #: parameter counts. None: every weight is used.
    unused_weights: str | None = None

    def not_causal(self, arch: str, cfg: Any) -> str | None:
        """Refusal for HF class `arch` with config `cfg` where its `causal_flag` is set false (bidirectional
        attention, which posprobe's causal readings — perplexity, masks, position control — would misreport)."""
        if self.causal_flag is None or getattr(cfg, self.causal_flag, True):
            return None
        return (f"{arch} is configured with {self.causal_flag}=False (bidirectional attention); posprobe reads "
                f"{arch} only as a causal decoder")


_ALL = frozenset(LEVELS)
_BRIDGE = frozenset({POSITIONS, PATTERN})
_COHERE_TL3 = Defect(
    "TransformerLens {tl}'s bridge does not reproduce Hugging Face's forward for {arch} (logits 0.04-0.07 apart on "
    "tiny random models; it rotates q/k as half-split pairs where Cohere interleaves them; TransformerLens >= 4 "
    "matches)", tl_below=4)


def _row(model_type: str, **kw: Any) -> Architecture:
    return Architecture(model_type, **kw)


# Measured facts behind the rows: Cohere / Cohere 2 on TL 3.9 against HF's forward on an independent copy of the
# weights (logits 0.042 / 0.070 apart); Falcon with ALiBi on TL 4.3 / transformers 5.23 (logits 0.1-0.9 apart in
# every config tried; Falcon with rotary matches to 1e-6). Order: the order proven types are listed in messages.
_ROWS: tuple[Architecture, ...] = (
    *(_row(mt, proven=_ALL) for mt in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")),
    _row("gemma3", proven=_BRIDGE),
    _row("granite", proven=_ALL),
    _row("olmo", proven=frozenset({PATTERN, LONG})),
    *(_row(mt, proven=_ALL) for mt in ("olmo2", "smollm3", "starcoder2", "gpt_neox", "phi", "phi3", "stablelm")),
    _row("cohere", proven=_ALL, pairing="adjacent", logit_scale=True, defects=(_COHERE_TL3,)),
    _row("cohere2", proven=_ALL, pairing="adjacent", logit_scale=True, nope_layer_type="full_attention",
         defects=(_COHERE_TL3,)),
    _row("glm", proven=_ALL, pairing="adjacent"),
    _row("gptj", proven=_ALL, pairing="adjacent"),
    _row("codegen", pairing="adjacent"),
    _row("gpt2", family=learned.FAMILY, proven=_BRIDGE),
    _row("gpt_neo", family=learned.FAMILY, proven=_BRIDGE, unscaled_scores=True),
    _row("opt", family=learned.FAMILY, proven=_BRIDGE),
    _row("bert", family=learned.FAMILY, proven=_BRIDGE, encoder=True),
    _row("roberta", family=learned.FAMILY, proven=_BRIDGE, encoder=True),
    *(_row(mt, family=learned.FAMILY, encoder=True) for mt in ("xlm-roberta", "distilbert", "electra", "camembert")),
    *(_row(mt, family=learned.FAMILY) for mt in ("biogpt", "gpt_bigcode", "bart", "whisper")),
    *(_row(mt, encoder=True) for mt in ("albert", "deberta", "deberta-v2", "nomic_bert", "modernbert")),
    _row("mpt", family=alibi.FAMILY, proven=_BRIDGE),
    _row("bloom", family=alibi.FAMILY, proven=_BRIDGE),
    _row("falcon", proven=_BRIDGE, defects=(Defect(
        "TransformerLens {tl}'s bridge does not reproduce Hugging Face's forward for Falcon with ALiBi (Falcon-RW; "
        "logits 0.1-0.9 apart on tiny random models), so no hook value can be trusted", config_flag="alibi"),)),
    _row("xglm", family=sinusoidal.FAMILY, proven=_BRIDGE),
    *(_row(mt, family=relative.FAMILY) for mt in ("t5", "mt5", "umt5", "longt5")),
    # Decoder-only T5 bias (the zoo's member), through posprobe's own bridge adapter (backend.t5_decoder). The class
    # carries a cross-attention its decoder-only forward never calls, and its loss does not shift labels.
    _row("pix2struct_text_model", family=relative.FAMILY, proven=_BRIDGE, whole_lm=True, causal_flag="is_decoder",
         shifts_labels=False, unused_weights="encoder_decoder_attention"),
)

#: Every architecture posprobe knows, by HF `model_type`, in the order above.
ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in _ROWS}
_UNKNOWN = Architecture("")


def lookup(model_type: str | None) -> Architecture:
    """The row of `model_type` (case-insensitive), or an empty row (nothing proven, no family) for one posprobe
    does not know."""
    return ARCHITECTURES.get(str(model_type or "").lower(), _UNKNOWN)


def of_config(cfg: Any) -> Architecture:
    """The row of an HF config object or config dict (its `model_type`)."""
    mt = cfg.get("model_type") if isinstance(cfg, Mapping) else getattr(cfg, "model_type", None)
    return lookup(mt)


def proven(level: str) -> tuple[str, ...]:
    """Model types proven at `level` (one of LEVELS), in the table's order."""
    if level not in LEVELS:
        raise KeyError(f"No proof level {level!r} (known: {', '.join(LEVELS)})")
    return tuple(mt for mt, a in ARCHITECTURES.items() if level in a.proven)


def register(row: Architecture) -> None:
    """Add (or replace) the row of `row.model_type`: the one place a new architecture is declared."""
    ARCHITECTURES[row.model_type.lower()] = row


def unregister(model_type: str) -> None:
    """Remove a row (tests that register a dummy architecture restore the table with this)."""
    ARCHITECTURES.pop(model_type.lower(), None)


__all__ = ["ARCHITECTURES", "Architecture", "Defect", "LEVELS", "LONG", "PATTERN", "POSITIONS", "lookup",
           "of_config", "proven", "register", "unregister"]
