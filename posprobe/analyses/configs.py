"""The analyses' options: one frozen, keyword-only Config per analysis, each field with its help text.

Torch-free on purpose: the CLI builds its flags from these classes (`posprobe --help` stays instant)
and checks them before any weights load. Each analysis module re-exports its own Config.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Iterator, Literal, Mapping, NamedTuple, Sequence, get_args, get_origin, get_type_hints

from posprobe.core import presets, variants
from posprobe.core.config import at_least, option
from posprobe.data.needles import TASKS as NEEDLE_TASKS
from posprobe.data.needles import task_names as needle_task_names


class SectionEntry(NamedTuple):
    """One atlas section's entry: the module that declares it (`analyses.sections.AtlasSection`), what it measures
    (for --help), and the atlases it belongs to: the atlas of one model (`posprobe atlas`), the atlas over many models
    (`posprobe zoo atlas`), or both."""

    module: str
    help: str
    one: bool = True
    many: bool = False


#: Every atlas section, in report order, one line each: name -> SectionEntry. A section in both atlases is one line
#: here, one `AtlasSection` in its module (its runner for one model, its slim tables for many) and its paragraph and
#: side-by-side figure in its report module.
SECTIONS: dict[str, SectionEntry] = {
    "facts": SectionEntry("posprobe.analyses.atlas", "positional facts"),
    "training": SectionEntry("posprobe.analyses.atlas_many", "the zoo's training loss curves", one=False, many=True),
    "extrapolation": SectionEntry("posprobe.analyses.extrapolation", "perplexity from L to 8L (Press et al.)",
                                  one=False, many=True),
    "passkey": SectionEntry("posprobe.analyses.passkey", "passkey success by distance and Chen et al.'s effective "
                                                         "window (members trained with --passkey)",
                            one=False, many=True),
    "heads": SectionEntry("posprobe.analyses.heads", "head signatures (sink, previous-token, induction...)", many=True),
    "similarity": SectionEntry("posprobe.analyses.head_similarity", "nearest heads across models (Jensen-Shannon)",
                               one=False, many=True),
    "sinks": SectionEntry("posprobe.analyses.sinks", "attention sinks (share, position-vs-token control, massive "
                                                     "activations)", many=True),
    "frequency": SectionEntry("posprobe.analyses.frequency", "RoPE frequency usage", many=True),
    "geometry": SectionEntry("posprobe.analyses.geometry", "learned-position geometry", many=True),
    "decomposition": SectionEntry("posprobe.analyses.decompose", "layer-0 score decomposition", one=False, many=True),
    "probes": SectionEntry("posprobe.analyses.probes", "position probes", many=True),
    "shift": SectionEntry("posprobe.analyses.shift", "the shift test", many=True),
    "retrieval": SectionEntry("posprobe.analyses.retrieval", "retrieval heads (needle answers with them masked)"),
}


class _SectionView(Mapping[str, SectionEntry]):
    # The sections of one atlas, read live from SECTIONS (a section added there appears here at once), in its order.
    def __init__(self, many: bool):
        self._many = many

    def _names(self) -> list[str]:
        return [n for n, e in SECTIONS.items() if (e.many if self._many else e.one)]

    def __getitem__(self, name: str) -> SectionEntry:
        if name not in self._names():
            raise KeyError(name)
        return SECTIONS[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


#: The one-model atlas's sections (`posprobe atlas`), in report order: name -> SectionEntry.
ATLAS_SECTIONS: Mapping[str, SectionEntry] = _SectionView(many=False)
#: The atlas over many models (`posprobe zoo atlas`), in report order: name -> SectionEntry.
ZOO_ATLAS_SECTIONS: Mapping[str, SectionEntry] = _SectionView(many=True)

#: Residual-stream capture points a position probe can read.
RESIDUAL_POINTS = ("resid_pre", "resid_mid", "resid_post")


class ShiftError(ValueError):
    """A shift test that cannot run as asked (k past the context, negative k, no data)."""


def _check_choices(cfg: object) -> None:
    # Literal-typed fields only take their listed values (a notebook user gets the CLI's check).
    hints = get_type_hints(type(cfg))
    for f in fields(cfg):  # type: ignore[arg-type]
        if get_origin(hints[f.name]) is Literal and getattr(cfg, f.name) not in get_args(hints[f.name]):
            raise ValueError(f"{f.name} must be one of {get_args(hints[f.name])}, got {getattr(cfg, f.name)!r}")


def _preset_help() -> str:
    return f"surgery presets to compare (repeatable): {presets.help_text()}"


@dataclass(frozen=True, kw_only=True)
class ShiftConfig:
    """Options of the shift test (Sinha et al. 2022). `ks` always gains 0, the baseline."""

    ks: tuple[int, ...] = option((0, 100), "start positions k to test (0 is always added)", flag="--k")
    prefix: Literal["auto", "bos", "eot", "none"] = option(
        "auto", "token before each sentence: auto = <|endoftext|> if the vocabulary has it, else BOS; "
                "none leaves the first token unscored")
    prefix_position: Literal["with-sentence", "zero"] = option(
        "with-sentence", "under a shift, the prefix moves to k with the sentence, or stays at position 0")
    batch_size: int = option(32, "sequences per forward pass")
    n_bootstrap: int = option(1000, "bootstrap resamples for the 95% CIs", flag="--bootstrap")
    seed: int = option(0, "seed of the pair sample and the bootstrap")
    window: int = option(64, "tokens per text window (perplexity, --text)")
    max_windows: int = option(32, "text windows to score")
    allow_beyond_context: bool = option(False, "RoPE only: allow positions past the trained context (extrapolation)")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        _check_choices(self)
        at_least(self, 1, "batch_size", "n_bootstrap", "max_windows")
        at_least(self, 2, "window")

    def all_ks(self) -> list[int]:
        """Sorted distinct k values including the baseline 0."""
        bad = [k for k in self.ks if int(k) != k or k < 0]
        if bad:
            raise ShiftError(f"k must be a whole number >= 0; got {bad}")
        return sorted({0, *map(int, self.ks)})


@dataclass(frozen=True, kw_only=True)
class FrequencyConfig:
    """Options of per-frequency RoPE usage (`run_frequency`, `posprobe freq-report`)."""

    window: int = option(128, "tokens per window, incl. BOS")
    max_windows: int = option(8, "windows cut from the text")
    batch_size: int = option(4, "windows per forward pass")
    queries: int | None = option(64, "score statistics from the last N query positions of each window, with all "
                                     "their keys (0: every causal entry, exact but slower)")
    ablate: bool = option(True, "also run band ablations (model-wide p sweep + the top heads) and report loss changes")
    ablate_windows: int = option(2, "windows used for the ablations")
    top_heads: int = option(4, "heads given their own report section and ablations")
    layers: tuple[int, ...] | None = option(None, "layers to measure (default: all)")
    theory_context: int | None = option(None, "trained length L in tokens for Chen et al.'s per-head bounds "
                                              "(default: the model's context)")
    theory_target: int | None = option(None, "a(s) beyond L is evaluated up to this length in tokens (default 4L)")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        at_least(self, 1, "window", "max_windows", "batch_size", "ablate_windows", "top_heads")
        at_least(self, 2, "theory_context")
        if self.theory_target is not None and self.theory_context is not None \
                and self.theory_target <= self.theory_context:
            raise ValueError(f"theory_target ({self.theory_target}) must exceed theory_context "
                             f"({self.theory_context})")
        at_least(self, 0, "queries")
        if self.queries == 0:  # "every query", as the flag documents
            object.__setattr__(self, "queries", None)


@dataclass(frozen=True, kw_only=True)
class DecomposeConfig:
    """What to decompose (`run_decompose`, `posprobe decompose`). `text` is the corpus for positional
    means (default: posprobe's built-in text; the CLI reads it from --text)."""

    layer: int = option(0, "layer whose attention scores are split")
    method: Literal["auto", "exact", "data"] = option(
        "auto", "exact layer-0 split (learned positions) or data-driven split; auto picks exact where it applies")
    text: str | None = option(None, "", cli=False)
    sentence: str | None = option(None, "sentence to decompose (default: the corpus's first sentence)")
    head: int | None = option(None, "head shown in the heatmaps (default: the most positional head)")
    max_windows: int = option(32, "corpus windows for the positional mean")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        _check_choices(self)
        at_least(self, 0, "layer", "head")
        at_least(self, 1, "max_windows")


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """Position probes (`position_probes`, `run_probes`, `posprobe probe`).

    `classifier`: "ridge" (one-vs-rest least squares on +-1 targets, shares the regression's solve;
    fast) or "logistic" (multinomial logistic regression with inverse regularisation `C`; slower).
    The ridge penalty (on standardised features) is picked from `alphas` per outer fold by an inner
    GroupKFold over the training rows (`inner_splits`), separately for MAE and for accuracy.
    `max_tokens` bounds memory: that many (row, pos) tokens are drawn once (seeded) and the same
    tokens are used at every layer, so layers are comparable. `memory_mb` bounds the captured
    activations held at once; more layers than fit are captured in further passes over the corpus.
    """

    points: tuple[str, ...] = option(RESIDUAL_POINTS, "residual points to probe")
    layers: tuple[int, ...] | None = option(None, "layers to probe (default: all)")
    n_buckets: int = option(8, "position buckets for the classifier")
    n_splits: int = option(4, "GroupKFold splits over token rows", flag="--folds")
    alphas: tuple[float, ...] = option((0.1, 1.0, 10.0, 100.0, 1e3, 1e4, 1e5), "ridge penalties to choose from")
    inner_splits: int = option(3, "inner GroupKFold splits that pick the penalty")
    classifier: Literal["ridge", "logistic"] = option("ridge", "bucket classifier")
    C: float = option(1.0, "inverse regularisation of the logistic classifier")
    max_tokens: int = option(2000, "tokens sampled (seeded) for the probes")
    skip_first: int = option(0, "leave out the first N positions (e.g. 1 for BOS)")
    batch_size: int = option(8, "rows per forward pass")
    memory_mb: float = option(256.0, "activations held at once (MiB); more layers take more passes")
    seed: int = option(0, "seed of the token sample, folds and shuffled control")
    window: int = option(64, "tokens per row, incl. BOS/CLS if the tokenizer has one")
    max_windows: int | None = option(32, "at most this many rows")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        _check_choices(self)
        # "resid_pre,resid_mid" given as one item splits like the space-separated form.
        points = tuple(p.strip() for item in self.points for p in item.split(",") if p.strip())
        object.__setattr__(self, "points", points)
        bad = [p for p in self.points if p not in RESIDUAL_POINTS]
        if bad or not self.points:
            raise ValueError(f"Unknown or no residual points {bad}; choose from {RESIDUAL_POINTS}")
        if (self.n_splits < 2 or self.inner_splits < 2 or self.max_tokens < self.n_splits
                or min(self.alphas, default=0) <= 0 or self.batch_size < 1):
            raise ValueError(
                "Need n_splits >= 2, inner_splits >= 2, max_tokens >= n_splits, alphas > 0, batch_size >= 1"
            )
        at_least(self, 0, "skip_first")
        at_least(self, 2, "window")
        at_least(self, 1, "max_windows")


@dataclass(frozen=True, kw_only=True)
class GeometryConfig:
    """Position geometry (`run_geometry`, `posprobe geometry`): W_pos (learned positions) and the
    per-position mean of the residual stream."""

    layers: tuple[int, ...] | None = option(None, "layers of the residual view (default: first, middle, last)")
    point: Literal["resid_pre", "resid_mid", "resid_post"] = option("resid_post", "residual point of the residual view")
    skip_first: int = option(1, "leave out the first N positions of the residual view (BOS/CLS outliers)")
    components: int = option(6, "principal components to report")
    max_pos: int | None = option(None, "W_pos rows to analyse (default: all)")
    window: int = option(64, "tokens per row, incl. BOS/CLS if the tokenizer has one")
    max_windows: int = option(32, "at most this many rows")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        _check_choices(self)
        at_least(self, 0, "skip_first")
        at_least(self, 1, "components", "max_pos", "max_windows")
        at_least(self, 2, "window")


@dataclass(frozen=True, kw_only=True)
class SquishConfig:
    """Key squishing of an instruction span during generation (`squish_generate`, `posprobe squish`)."""

    to: float | None = option(None, "put every span key at this position (default 0)", flag="--squish-to")
    range_: tuple[float, ...] | None = option(None, "spread the span keys linearly over LO HI", flag="--squish-range")
    query_start: float | None = option(None, "position of the first token after the span (default: unchanged)")
    variant: Literal["cache", "keys", "qk"] = option(
        "cache", "cache: the span reads itself at its own positions, later tokens see its keys squished; keys: every "
        "query, the span's own included, sees its keys squished (its queries keep their positions); qk: the span's "
        "queries and keys both squished (Hugging Face position_ids)")
    max_new_tokens: int = option(8, "tokens to generate")
    temperature: float = option(0.0, "sampling temperature; 0 = greedy")
    top_k: int | None = option(None, "sample from the k most likely tokens")
    seed: int = option(0, "sampling seed")
    reference: str | None = option(None, "a reference continuation to score (nats/token)")
    chat: bool | None = option(None, "use the tokenizer's chat template (default: when it has one)")

    def __post_init__(self) -> None:
        if self.variant == "global":
            raise ValueError(f"--variant: {variants.RENAMED_VARIANT}")
        _check_choices(self)
        if self.to is not None and self.range_ is not None:
            raise ValueError("give --squish-to or --squish-range, not both")
        if self.range_ is not None and len(self.range_) != 2:
            raise ValueError(f"--squish-range takes two positions LO HI, got {len(self.range_)}")
        at_least(self, 1, "max_new_tokens", "top_k")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")


#: Key-squishing study conditions: their spelling and meaning (`SquishStudyConfig.conditions`).
STUDY_CONDITIONS = {
    "none": "no instruction (the control every other condition is compared with for KL)",
    "normal": "the instruction at its own positions (the reference for the paired test)",
    "squish:TO": "the instruction encoded at its own positions, later tokens see its keys at position TO (cache)",
    "squish:TO:keys": "the instruction's keys at TO for every query, its own included; its queries keep their "
                      "positions",
    "squish:TO:qk": "the instruction's queries and keys all at TO (Hugging Face position_ids = TO on its tokens)",
    "range:LO:HI[:keys|:qk]": "the instruction's keys (with :qk also its queries) spread linearly over LO..HI",
    "moved:D[:keys|:qk]": "the instruction's keys at 0 and every later token moved out by D positions (the "
                          "practitioner's recipe)",
    "preset:SPEC": "a surgery preset on the whole prompt (one prompt at a time; see surgery-eval's presets)",
}


def parse_condition(spec: str) -> dict:
    """One study condition as a dict: kind ("none", "normal", "squish", "preset"), and for squish `to` or `range_`,
    `moved` (positions added to every token after the span) and `variant` ("cache": the span is encoded normally and
    later tokens see its keys squished; "keys": the span's own queries see its keys squished too, its queries stay;
    "qk": the span's queries and keys both squished). ValueError names the spec; the old variant `:global` is
    refused with the two names it could have meant."""
    s = spec.strip()
    if s in ("none", "normal"):
        return {"kind": s, "name": s}
    head, _, rest = s.partition(":")
    if head == "preset" and rest:
        presets.parse(rest)
        return {"kind": "preset", "name": s, "preset": rest}
    parts = rest.split(":") if rest else []
    if parts and parts[-1] == "global":
        stem = ":".join([head, *parts[:-1]])
        raise ValueError(f"study condition {spec!r}: {variants.RENAMED_VARIANT} ({stem}:keys or {stem}:qk)")
    variant = "cache"
    if parts and parts[-1] in variants.SQUISH_VARIANTS:
        variant = parts.pop()
    try:
        nums = [float(x) for x in parts]
    except ValueError:
        nums = []
    shapes = {"squish": 1, "range": 2, "moved": 1}
    if head not in shapes or len(nums) != shapes[head] or (head == "moved" and nums[0] < 0):
        raise ValueError(f"unknown study condition {spec!r}; conditions: " + "; ".join(
            f"{k} = {v}" for k, v in STUDY_CONDITIONS.items()))
    out = {"kind": "squish", "name": s, "variant": variant, "to": 0.0, "range_": None, "moved": 0.0}
    if head == "squish":
        out["to"] = nums[0]
    elif head == "range":
        out["range_"], out["to"] = (nums[0], nums[1]), None
    else:
        out["moved"] = nums[0]
    return out


@dataclass(frozen=True, kw_only=True)
class SquishStudyConfig:
    """The key-squishing study (`run_squish_study`, `posprobe squish-study`): checkable instructions x questions x
    placements x distances x conditions, greedy answers scored by each instruction's checker."""

    instructions: tuple[str, ...] = option(
        ("french", "spanish", "persona", "french_cooking"),
        "built-in instructions to test (repeatable; 'all' for the whole suite); the default: those SmolLM2-135M "
        "follows at all at normal positions, and the topic instruction", flag="--instruction")
    questions: int = option(24, "built-in questions per cell (the first N; at most the built-in count)")
    placements: tuple[Literal["system", "user"], ...] = option(
        ("system",), "where the instruction goes: the system message, or the start of the (first) user turn",
        flag="--placement")
    distances: tuple[int, ...] = option((0, 4), "filler conversation turns between the instruction and the "
                                        "question (repeatable)", flag="--distance")
    conditions: tuple[str, ...] = option(("none", "normal", "squish:0", "moved:1000", "squish:0:keys"),
                                         "conditions (repeatable): " + "; ".join(
                                             f"{k} = {v}" for k, v in STUDY_CONDITIONS.items()), flag="--condition")
    max_new_tokens: int = option(32, "greedy answer tokens per prompt")
    batch_size: int = option(16, "prompts per batch")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        _check_choices(self)
        at_least(self, 1, "questions", "max_new_tokens", "batch_size")
        if not self.conditions or not self.placements or not self.distances:
            raise ValueError("give at least one condition, placement and distance")
        if any(d < 0 for d in self.distances):
            raise ValueError(f"distances must be >= 0 filler turns; got {list(self.distances)}")
        names = [parse_condition(c)["name"] for c in self.conditions]
        if len(set(names)) != len(names):
            raise ValueError(f"a condition is listed twice: {names}")
        if "normal" not in names:
            raise ValueError("the conditions must include 'normal' (the paired reference of every squished one)")


@dataclass(frozen=True, kw_only=True)
class SurgeryEvalConfig:
    """Loss by position under surgery presets (`run_surgery_eval`, `posprobe surgery-eval`)."""

    presets: tuple[str, ...] = option(("none",), _preset_help,
                                      flag="--preset")
    window: int = option(256, "tokens per window")
    max_windows: int = option(4, "windows cut from the text")

    def __post_init__(self) -> None:
        at_least(self, 2, "window")
        at_least(self, 1, "max_windows")
        if not self.presets:
            raise ValueError("give at least one preset")
        for spec in self.presets:
            presets.parse(spec)  # every preset's name, arguments and bounds, before any model loads


@dataclass(frozen=True, kw_only=True)
class HeadsConfig:
    """Head signatures (`run_heads`, `posprobe heads`): attention-pattern statistics per layer and head
    over text windows, an induction pass on repeated random tokens, and classes by written-out rules."""

    window: int = option(128, "tokens per window, incl. BOS/CLS")
    max_windows: int = option(16, "windows cut from the text")
    batch_size: int = option(4, "windows per forward pass")
    first_k: int = option(4, "the 'first few' tokens of first_k_mass")
    max_offset: int = option(32, "longest relative offset reported in the offset profile")
    induction_len: int = option(24, "length of the random sequence repeated for the induction score (0: skip)")
    induction_batch: int = option(8, "repeated random sequences for the induction score")
    seed: int = option(0, "seed of the random induction sequences")
    sink_threshold: float = option(0.3, "sink head: attention sink score (Gu et al. 2025) above this")
    prev_threshold: float = option(0.4, "previous-token head: mean attention to i-1 above this")
    self_threshold: float = option(0.4, "current-token head: mean attention to i above this")
    offset_threshold: float = option(0.4, "fixed-offset head: mean attention at one offset >= 2 above this")
    induction_threshold: float = option(0.3, "induction head: induction score above this")
    relative_r2: float = option(0.8, "relative-position head: R^2 of the pattern fitted by offset alone above this")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        at_least(self, 2, "window")
        at_least(self, 1, "max_windows", "batch_size", "first_k", "max_offset", "induction_batch")
        at_least(self, 0, "induction_len")
        for name in ("sink_threshold", "prev_threshold", "self_threshold", "offset_threshold",
                     "induction_threshold", "relative_r2"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class SinksConfig:
    """Attention sinks (`run_sinks`, `posprobe sinks`): the share of heads that sink on the first token (Gu et al.
    2025, Sink_1^epsilon with per-sample thresholding) on random-token sequences and on text, and per head what sets
    the first token apart (its key and value norms, the cosine of queries to its key)."""

    length: int = option(64, "tokens per sequence, incl. BOS/CLS (Gu et al.: T = 64)")
    random_samples: int = option(32, "random-token sequences (seeded; 0: skip the random condition)")
    max_windows: int = option(16, "text windows (0: skip the text condition)")
    epsilon: float = option(0.3, "a head sinks on a sample when its mean attention on the first token exceeds this")
    first: Literal["model", "random"] = option(
        "model", "first token of the random sequences: model = as the model expects (BOS where its tokenizer adds "
                 "one), random = a random token like the rest")
    control: bool = option(True, "position-vs-token control on the text windows: the first token moved to position "
                                 "length // 2, or replaced by 'the' / a newline")
    ablate_heads: int = option(12, "heads with the most attention on the first token, zeroed one at a time and "
                                   "labelled by what that does to the text loss: low-effect / loss-rises / "
                                   "loss-falls (0: skip)")
    ablate_attention: float = option(0.8, "a head is zeroed when it puts at least this share of its attention on the "
                                          "first token")
    ablate_delta: float = option(0.005, "a zeroed head is low-effect when the text loss changes by less than this "
                                        "(nats/token), else loss-rises / loss-falls")
    massive_top: int = option(3, "largest |residual activations| kept per layer (Sun et al. 2024; 0: skip)")
    massive_ratio: float = option(1000.0, "an activation is massive above this multiple of its sequence's median "
                                          "|activation| (Sun et al. 2024: about 1000) and above --massive-abs; the "
                                          "first layer with one is where they are zeroed / averaged")
    massive_abs: float = option(100.0, "... and above this |activation| (Sun et al. 2024: 100)")
    batch_size: int = option(8, "sequences per forward pass")
    seed: int = option(0, "seed of the random sequences")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        _check_choices(self)
        at_least(self, 0, "massive_top", "ablate_heads")
        if not 0 <= self.ablate_attention <= 1 or self.ablate_delta < 0:
            raise ValueError("ablate_attention must be within [0, 1] and ablate_delta >= 0")
        if self.massive_ratio <= 1 or not self.massive_abs >= 0:
            raise ValueError(f"massive_ratio must be > 1 and massive_abs >= 0, got {self.massive_ratio} and "
                             f"{self.massive_abs}")
        at_least(self, 2, "length")
        at_least(self, 1, "batch_size")
        at_least(self, 0, "random_samples", "max_windows")
        if not 0 <= self.epsilon <= 1:
            raise ValueError(f"epsilon must be within [0, 1], got {self.epsilon}")
        if self.random_samples == 0 and self.max_windows == 0:
            raise ValueError("nothing to measure: random_samples and max_windows are both 0")


@dataclass(frozen=True, kw_only=True)
class AtlasConfig:
    """`posprobe atlas`: every positional analysis that applies to the model, with bounded defaults
    (about 3 minutes on a 2-core CPU for a 135M model; `quick`: about 30 s), in one report."""

    #: Defaults of the window and probe tokens: the full atlas and the short tour.
    WINDOW: ClassVar[int] = 512
    QUICK_WINDOW: ClassVar[int] = 64
    PROBE_TOKENS: ClassVar[int] = 3000
    QUICK_PROBE_TOKENS: ClassVar[int] = 600

    window: int | None = option(None, "tokens per text window of the heads, frequency, geometry and probe sections "
                                      "(default: 512, at most the model's context; 64 with --quick)")
    max_windows: int = option(6, "text windows per section")
    ks: tuple[int, ...] = option((0, 100, 400), "shift-test start positions", flag="--k")
    max_pairs: int = option(10, "built-in minimal pairs per paradigm for the shift test")
    probe_tokens: int | None = option(None, "tokens sampled for the position probes (default: 3,000; 600 with --quick)")
    quick: bool = option(False, "the short tour (about 30 s for a 135M model on a 2-core CPU): 64-token windows, "
                                "600 probe tokens, no retrieval section unless --sections names it")
    induction_len: int = option(24, "repeated random sequence length for the induction score")
    sections: tuple[str, ...] | None = option(None, f"run only these sections ({', '.join(ATLAS_SECTIONS)}; default: "
                                                    "all that apply; with several models also "
                                                    + ", ".join(s for s in ZOO_ATLAS_SECTIONS
                                                                if s not in ATLAS_SECTIONS) + ")")
    needle_length: int = option(1024, "retrieval section: needle prompt length (tokens; at most the context)")
    ablate_heads: int = option(12, "when the sinks and retrieval sections both run: the sink heads zeroed one at a "
                                   "time (text loss), so that a head with a low effect on that loss but a retrieval "
                                   "head is flagged (0: skip)")
    seed: int = option(0, "seed of every sampled piece")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        at_least(self, 2, "window")
        at_least(self, 1, "max_windows", "max_pairs", "probe_tokens")
        at_least(self, 0, "induction_len", "ablate_heads")
        bad = sorted(set(self.sections or ()) - set(SECTIONS))
        if bad:
            raise ValueError(f"unknown atlas sections {bad}; choose from {sorted(ATLAS_SECTIONS)} (with several "
                             f"models also {sorted(set(ZOO_ATLAS_SECTIONS) - set(ATLAS_SECTIONS))})")

    def check_one_model(self) -> None:
        """ValueError where a section named runs only over several models (head similarity, the zoo's training
        curves, extrapolation and decomposition side by side): the atlas of one model cannot run it."""
        many = [s for s in self.sections or () if s not in ATLAS_SECTIONS]
        if many:
            raise ValueError(f"section(s) {many} compare several models: name more models (posprobe atlas A B ...) "
                             "or use posprobe zoo atlas")

    def window_for(self, n_ctx: int) -> int:
        """Tokens per text window on a model with `n_ctx` positions."""
        return min(self.window or (self.QUICK_WINDOW if self.quick else self.WINDOW), n_ctx)

    def probe_tokens_used(self) -> int:
        """Tokens the probe section samples."""
        return self.probe_tokens or (self.QUICK_PROBE_TOKENS if self.quick else self.PROBE_TOKENS)


@dataclass(frozen=True, kw_only=True)
class LongContextConfig:
    """Long-context harness (`run_long_context`, `posprobe long-context`): loss by position past the trained
    context per surgery preset, and passkey retrieval by length x depth."""

    lengths: tuple[int, ...] = option((2048,), "sequence lengths to evaluate (tokens; repeatable)", flag="--length",
                                      aliases=("--lengths",))
    presets: tuple[str, ...] = option(("none",), _preset_help,
                                      flag="--preset")
    max_windows: int = option(1, "text windows per length (fewer if the text is short)")
    bin_size: int = option(256, "query positions per loss bin (tokens)")
    warmup: int = option(512, "break position: search bins from this position on, against the mean loss over "
                              "[warmup, trained context) (tokens)")
    margin: float = option(0.5, "break position: first bin from which the mean loss over --break-span positions "
                                "exceeds that mean by this (nats/token)")
    break_span: int = option(1024, "break position: query positions the excess is averaged over (tokens)")
    trained_ctx: int | None = option(None, "trained context (tokens; default: the model config's)")
    passkey_lengths: tuple[int, ...] | None = option(None, "passkey prompt lengths (tokens; default: no passkey test)",
                                              flag="--passkey-length", aliases=("--passkey-lengths",))
    depths: tuple[float, ...] = option((0.0, 0.25, 0.5, 0.75, 1.0), "passkey depths: fraction of the filler "
                                       "before the needle (0 = start, 1 = end)", flag="--depth")
    tasks: tuple[str, ...] = option(("passkey",), "needle tasks at the passkey lengths x depths (repeatable): "
                                    "passkey, " + ", ".join(needle_task_names()), flag="--task")
    trials: int = option(1, "passkeys per length x depth x preset")
    new_tokens: int = option(8, "greedy tokens decoded for a passkey answer")
    needle_tokens: int | None = option(None, "greedy tokens decoded for a needle-task answer (default: per task, "
                                             "enough for its values; decoding stops once all have appeared)")
    seed: int = option(0, "seed of the passkeys")
    chunk: int = option(256, "query rows per attention chunk (memory grows with chunk x length)")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        at_least(self, 2, "bin_size")
        at_least(self, 1, "max_windows", "trials", "new_tokens", "chunk", "trained_ctx", "break_span", "needle_tokens")
        at_least(self, 0, "warmup")
        if not self.presets:
            raise ValueError("give at least one preset")
        for spec in self.presets:
            presets.parse(spec)  # every preset's name, arguments and bounds, before any model loads
        if not self.lengths:
            raise ValueError("give at least one length")
        bad = [x for x in (*self.lengths, *(self.passkey_lengths or ())) if x < 2]
        if bad:
            raise ValueError(f"lengths must be >= 2 tokens; got {bad}")
        if any(not 0 <= d <= 1 for d in self.depths):
            raise ValueError(f"depths must be within [0, 1]; got {list(self.depths)}")
        bad_tasks = [t for t in self.tasks if t != "passkey" and t not in needle_task_names()]
        if bad_tasks or not self.tasks:
            raise ValueError(f"unknown needle task {bad_tasks[0] if bad_tasks else None!r}; tasks: passkey, "
                             + ", ".join(needle_task_names()))
        if self.passkey_lengths and not self.depths:
            raise ValueError("give at least one --depth for the passkey test")
        needles = [t for t in self.tasks if t != "passkey"]
        if needles and not self.passkey_lengths:
            # Needle tasks run only at the passkey lengths: without one they would silently not run.
            raise ValueError(f"the needle task {needles[0]} runs at the passkey lengths: add --passkey-length N "
                             "(passkey_lengths)")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0; got {self.margin}")


@dataclass(frozen=True, kw_only=True)
class RetrievalConfig:
    """Retrieval heads (`run_retrieval`, `posprobe retrieval`): Wu et al.'s retrieval score per head while the model
    answers needle prompts, the attention mass on the needle and on the first token, under each surgery preset; and
    the needle accuracy with the top-k retrieval heads masked against k random heads."""

    lengths: tuple[int, ...] = option((1024,), "prompt lengths (tokens; repeatable)", flag="--length")
    depths: tuple[float, ...] = option((0.1, 0.3, 0.5, 0.7, 0.9), "needle depths: fraction of the haystack before "
                                       "the needle", flag="--depth")
    tasks: tuple[str, ...] = option(("niah_single_2",), "needle tasks (repeatable): " + ", ".join(needle_task_names()),
                                    flag="--task")
    trials: int = option(1, "prompts per task x length x depth (seeded)")
    presets: tuple[str, ...] = option(("none",), _preset_help, flag="--preset")
    threshold: float = option(0.1, "a retrieval head's mean retrieval score exceeds this (Wu et al.: 0.1)")
    mask_k: tuple[int, ...] = option((5, 20), "masking: numbers of heads masked (repeatable; 0: skip masking)",
                                     flag="--mask-k")
    random_draws: int = option(3, "masking: random head sets per k (seeded)")
    bootstrap: int = option(1000, "bootstrap resamples of the accuracy intervals where scores are fractional "
                                  "(multi-value tasks; scores of 0 or 1 get Wilson intervals)")
    needle_tokens: int | None = option(None, "greedy tokens per answer (default: per task, enough for its values)")
    seed: int = option(0, "seed of the needles and of the random heads")
    chunk: int = option(256, "query rows per attention chunk (memory grows with chunk x length)")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        at_least(self, 1, "trials", "random_draws", "bootstrap", "chunk", "needle_tokens")
        if not self.presets or not self.tasks or not self.lengths or not self.depths:
            raise ValueError("give at least one preset, task, length and depth")
        for spec in self.presets:
            presets.parse(spec)
        bad = [t for t in self.tasks if t not in needle_task_names()]
        if bad:
            raise ValueError(f"unknown needle task {bad[0]!r}; tasks: {', '.join(needle_task_names())}")
        if any(not 0 <= d <= 1 for d in self.depths):
            raise ValueError(f"depths must be within [0, 1]; got {list(self.depths)}")
        if any(k < 0 for k in self.mask_k):
            raise ValueError(f"mask_k must be >= 0; got {list(self.mask_k)}")
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"threshold must be within [0, 1]; got {self.threshold}")

    def check_heads(self, n_layers: int, n_heads: int) -> None:
        """Refuse a mask_k the model cannot serve: the random control draws k heads from those outside the top k,
        so 2k must not exceed the n_layers x n_heads heads."""
        total = n_layers * n_heads
        bad = [k for k in self.mask_k if 2 * k > total]
        if bad:
            raise ValueError(f"--mask-k {max(bad)} is too large for {total} heads ({n_layers} layers x {n_heads}): "
                             f"the random control needs k heads outside the top k, so k is at most {total // 2}")

    @property
    def binary_scores(self) -> bool:
        """True where every task asks for one value, so every answer scores exactly 0 or 1."""
        return all(NEEDLE_TASKS[t].answers == 1 for t in self.tasks)


#: Protocols of the length-extrapolation evaluation (Press et al. 2022): non-overlapping chunks, or the same
#: targets scored with growing context.
PROTOCOLS = ("chunks", "sliding")


@dataclass(frozen=True, kw_only=True)
class ExtrapolationConfig:
    """Options of the length-extrapolation evaluation (`run_extrapolation`, `posprobe zoo eval`)."""

    train_length: int | None = option(None, "training length L in tokens (default: a zoo member's own L, else the "
                                            "model's context)")
    factors: tuple[float, ...] = option((1, 2, 4, 8), "evaluation lengths as multiples of L (repeatable)",
                                        flag="--factor")
    protocols: tuple[str, ...] = option(PROTOCOLS, "chunks (non-overlapping sequences) and/or sliding (the same "
                                                   "targets with growing context) (repeatable)", flag="--protocol")
    max_tokens: int = option(8192, "evaluation tokens: the text prefix cut into chunks, and the sliding "
                                    "protocol's target tokens")
    stride: int | None = option(None, "sliding protocol: targets scored per window, the window's last tokens "
                                      "(default: L / 2)")
    batch_size: int = option(8, "sequences per forward pass")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        bad = [p for p in self.protocols if p not in PROTOCOLS]
        if bad or not self.protocols:
            raise ValueError(f"protocols must be among {PROTOCOLS}; got {self.protocols}")
        if not self.factors or any(f <= 0 for f in self.factors):
            raise ValueError(f"factors must be > 0; got {self.factors}")
        for name in ("max_tokens", "batch_size", "train_length", "stride"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")


# ---- key-position brittleness by distance (posprobe.analyses.brittleness) ----------------------------------

BRITTLENESS_SIGMAS = (0.0, 1.0, 2.0, 4.0, 8.0)
BRITTLENESS_BUCKETS = ("near:1", "near:4", "near:16", "near:64", "far:256")

_BUCKET_RE = re.compile(r"(near|far):(\d+)")

#: Window w of a brittleness run draws its noise with seed * stride + w: runs with different seeds share no draws.
BRITTLENESS_SEED_STRIDE = 1000


@dataclass(frozen=True)
class Bucket:
    """A distance bucket: `near` K (1 <= i - j <= K) or `far` D (i - j > D), in tokens."""

    kind: str
    distance: int

    @property
    def spec(self) -> str:
        """The bucket as written: "near:K" or "far:D"."""
        return f"{self.kind}:{self.distance}"

    @property
    def min_length(self) -> int:
        """Shortest sequence (tokens) in which the bucket holds a pair whose query's prediction is scored.

        Query i predicts token i + 1, so the last scored query is n - 2: far:D needs n - 2 > D; near needs query 1
        (key 0) scored, n >= 3."""
        return self.distance + 3 if self.kind == "far" else 3


def parse_bucket(spec: str) -> Bucket:
    """The Bucket of "near:K" or "far:D" (K, D whole numbers >= 1); ValueError naming the spec otherwise."""
    m = _BUCKET_RE.fullmatch(str(spec).strip())
    if m is None:
        raise ValueError(f"bucket {spec!r}: write near:K (the K nearest earlier keys) or far:D (keys more than D "
                         "tokens back), K and D whole numbers >= 1")
    value = int(m.group(2))
    if value < 1:
        raise ValueError(f"bucket {spec!r}: the distance must be >= 1; got {value}")
    return Bucket(m.group(1), value)


def min_length(buckets: Sequence[str | Bucket]) -> int:
    """Shortest window (tokens) in which every bucket holds a pair whose query's prediction is scored."""
    return max((b if isinstance(b, Bucket) else parse_bucket(b)).min_length for b in buckets)


def check_length(length: int, buckets: Sequence[str | Bucket], what: str = "a window") -> None:
    """ValueError when `length` tokens are too short for a bucket (no scored query would see a jittered pair)."""
    parsed = [b if isinstance(b, Bucket) else parse_bucket(b) for b in buckets]
    need = min_length(parsed)
    if length < need:
        worst = max(parsed, key=lambda b: b.min_length)
        why = (f"a pair more than {worst.distance} tokens apart whose query's prediction is scored"
               if worst.kind == "far" else "a scored query with an earlier key")
        raise ValueError(f"{what} of {length} tokens is too short for bucket {worst.spec}: it needs at least {need} "
                         f"tokens ({why})")


def check_sigma(sigma: float) -> float:
    """`sigma` as a float; ValueError unless finite and >= 0 (tokens)."""
    s = float(sigma)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"sigma must be a finite number >= 0 (tokens); got {sigma}")
    return s


@dataclass(frozen=True, kw_only=True)
class BrittlenessConfig:
    """Key-position brittleness by distance (`run_brittleness`, `posprobe brittleness`). Sigma 0, the baseline, is
    always added; sigmas are sorted; buckets may also be given comma-separated (duplicates dropped). Whether the
    windows are long enough for the buckets (`min_length`) is checked against the windows themselves."""

    sigmas: tuple[float, ...] = option(BRITTLENESS_SIGMAS, "standard deviations of the Gaussian noise on the jittered "
                                       "keys' positions (tokens; repeatable; 0 is always added)",
                                       aliases=("--sigma",))
    buckets: tuple[str, ...] = option(BRITTLENESS_BUCKETS, "distance buckets whose (query, key) pairs are jittered "
                                      "(repeatable): near:K = the K nearest earlier keys of each query, far:D = keys "
                                      "more than D tokens back", aliases=("--bucket",))
    window: int = option(512, "tokens per text window (every window the same length)")
    max_windows: int = option(8, "text windows cut from the text (fewer if the text is short)")
    seed: int = option(0, f"seed of the noise (window w draws with seed * {BRITTLENESS_SEED_STRIDE} + w) and of the "
                          "bootstrap")
    n_bootstrap: int = option(1000, "bootstrap resamples (over windows) of the 95% interval of the loss increase",
                              flag="--bootstrap")
    chunk: int = option(256, "query rows per attention chunk (memory grows with chunk x window)")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        for name in ("window", "max_windows", "n_bootstrap", "chunk"):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"{name} must be >= 1; got {v}")
        if self.max_windows > BRITTLENESS_SEED_STRIDE:
            raise ValueError(f"max_windows must be <= {BRITTLENESS_SEED_STRIDE} (window w draws its noise with seed * "
                             f"{BRITTLENESS_SEED_STRIDE} + w); got {self.max_windows}")
        if not self.sigmas:
            raise ValueError("give at least one sigma")
        sigmas = sorted({0.0, *(check_sigma(s) for s in self.sigmas)})
        object.__setattr__(self, "sigmas", tuple(sigmas))
        specs = [s.strip() for item in self.buckets for s in str(item).split(",") if s.strip()]
        if not specs:
            raise ValueError("give at least one bucket (near:K or far:D)")
        buckets = [parse_bucket(s) for s in specs]
        object.__setattr__(self, "buckets", tuple(dict.fromkeys(b.spec for b in buckets)))


@dataclass(frozen=True, kw_only=True)
class ZooAtlasConfig:
    """`posprobe zoo atlas`: the atlas's analyses on every member of a zoo, with the same data and bounds (about
    5 minutes for the CPU tier's 18 members on a 2-core CPU)."""

    sections: tuple[str, ...] | None = option(None, f"run only these sections ({', '.join(ZOO_ATLAS_SECTIONS)}; "
                                                    "default: all; --section is the same flag, as "
                                                    "before)", flag="--sections", aliases=("--section",))
    window: int = option(64, "tokens per text window of the heads, similarity, sinks, geometry, probe, decomposition "
                             "and frequency sections (at most each model's context)")
    max_windows: int = option(8, "text windows per section")
    ks: tuple[int, ...] = option((0, 16, 32, 64), "shift-test start positions (those that do not fit a model's "
                                                  "context with the shift window are left out for it)", flag="--k")
    shift_window: int = option(32, "tokens per text window of the shift test")
    max_pairs: int = option(10, "built-in minimal pairs per paradigm for the shift test")
    probe_tokens: int = option(2000, "tokens sampled for the position probes")
    similarity_windows: int = option(16, "text windows every model reads for the head similarity")
    # The same default as `zoo eval` (ExtrapolationConfig.max_tokens): "ppl at L" is one number in both commands.
    extrapolation_tokens: int = option(8192, "scored tokens per length of the extrapolation section (as zoo eval)")
    factors: tuple[float, ...] = option((1, 2, 4, 8), "extrapolation lengths as multiples of L", flag="--factor")
    passkey_trials: int = option(10, "passkey section: prompts per distance, distances every L/8 up to prompts of "
                                     "the longest factor x L (members trained with zoo train --passkey)")
    sink_samples: int = option(8, "sinks section: random-token sequences of 64 tokens per model (Gu et al.: 100)")
    seed: int = option(0, "seed of every sampled piece")
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        at_least(self, 2, "window", "shift_window")
        at_least(self, 1, "max_windows", "max_pairs", "probe_tokens", "similarity_windows", "extrapolation_tokens",
                 "passkey_trials", "sink_samples")
        bad = sorted(set(self.sections or ()) - set(ZOO_ATLAS_SECTIONS))
        if bad:
            raise ValueError(f"unknown zoo atlas sections {bad}; choose from {list(ZOO_ATLAS_SECTIONS)}")
        if any(int(k) != k or k < 0 for k in self.ks):
            raise ValueError(f"k must be a whole number >= 0; got {self.ks}")

    def wanted(self) -> list[str]:
        """The sections to run, in report order."""
        return [s for s in ZOO_ATLAS_SECTIONS if self.sections is None or s in self.sections]

    @classmethod
    def from_atlas(cls, atlas: AtlasConfig, **overrides: Any) -> ZooAtlasConfig:
        """The atlas over many models that `posprobe atlas A B ...` runs for an AtlasConfig: the knobs the two share
        (sections, window, windows, shift distances, pairs, probe tokens, seed) carried over, the rest at the many-
        model defaults (`overrides` on top). ValueError for a named section only the one-model atlas has."""
        only_one = [s for s in atlas.sections or () if s not in ZOO_ATLAS_SECTIONS and s != "facts"]
        if only_one:
            raise ValueError(f"section(s) {only_one} run on one model at a time; with several models choose from "
                             f"{list(ZOO_ATLAS_SECTIONS)}")
        shared: dict[str, Any] = dict(max_windows=atlas.max_windows, ks=atlas.ks, max_pairs=atlas.max_pairs,
                                      seed=atlas.seed, progress=atlas.progress)
        # Default: the sections both atlases have, and the head similarity (the comparison itself); the zoo's training
        # curves, extrapolation (scored up to 8x each model's context) and decomposition when named.
        both = [s for s in ZOO_ATLAS_SECTIONS if s in ATLAS_SECTIONS or s == "similarity"]
        shared["sections"] = tuple(s for s in (atlas.sections or both) if s in ZOO_ATLAS_SECTIONS)
        if atlas.window is not None:
            shared["window"] = atlas.window
        if atlas.probe_tokens is not None:
            shared["probe_tokens"] = atlas.probe_tokens
        return cls(**{**shared, **overrides})


# ---- an engine's positions against the proven reference (posprobe.analyses.conform) ----------------------------

#: The checks of `posprobe conform`: declared positions, behaviour against position, cache boundaries, precision.
CONFORM_CHECKS = ("declared", "behaviour", "cache", "precision")
#: The checks that run the engine (need its package; the scaling under test in the engine's own options).
ENGINE_RUNS = ("behaviour", "cache")

#: The atlas sections whose numbers the emergence table reads, in report order.
EMERGENCE_SECTIONS = ("shift", "heads", "sinks")


@dataclass(frozen=True, kw_only=True)
class EmergenceConfig(ZooAtlasConfig):
    """`posprobe zoo emergence`: the atlas over many models' options (the same windows, shift distances, seeds), its
    sections limited to those the emergence table reads, with Gu et al.'s 100 sequences of 64 tokens for the sink
    rate, and the tokens per step of models named as `MODEL@step<N>` (zoo checkpoints carry their own)."""

    sections: tuple[str, ...] | None = option(EMERGENCE_SECTIONS, "sections measured at every checkpoint "
                                              f"({', '.join(EMERGENCE_SECTIONS)}; default: all)",
                                              flag="--sections", aliases=("--section",))
    max_windows: int = option(100, "text windows per section (Gu et al. measure sinks on 100 training-text "
                                   "sequences of 64 tokens)")
    sink_samples: int = option(100, "random-token sequences of 64 tokens for the sink rate on random tokens")
    tokens_per_step: float | None = option(None, "training tokens per optimiser step of the models named as "
                                                 "MODEL@step<N> (Pythia: 2097152, 1,024 x 2,048); zoo checkpoints "
                                                 "carry their own")

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = sorted(set(self.sections or ()) - set(EMERGENCE_SECTIONS))
        if bad:
            raise ValueError(f"the emergence table reads the sections {list(EMERGENCE_SECTIONS)}; not {bad}")
        if self.tokens_per_step is not None and not self.tokens_per_step > 0:
            raise ValueError(f"tokens_per_step must be > 0, got {self.tokens_per_step}")


@dataclass(frozen=True, kw_only=True)
class ConformConfig:
    """Options of `posprobe conform` (`run_conform`): an engine's rotary positions for a model checked against
    Hugging Face's, which posprobe proves."""

    engine: str = option("llama.cpp", "the engine whose positions are checked (llama.cpp, transformer-lens; "
                                      "posprobe.backend.engines.ENGINES lists them)")
    engine_options: tuple[str, ...] = option((), "an engine option in force, KEY=VALUE (repeatable; llama.cpp: "
                                                 "llama-cpp-python's rope keywords rope_freq_base, rope_freq_scale, "
                                                 "rope_scaling_type, yarn_ext_factor, yarn_attn_factor, "
                                                 "yarn_beta_fast, yarn_beta_slow, yarn_orig_ctx; transformer-lens: "
                                                 "backend=bridge or backend=hooked)",
                                             flag="--engine-option")
    checks: tuple[str, ...] = option(CONFORM_CHECKS, f"checks to run ({', '.join(CONFORM_CHECKS)})",
                                     flag="--check")
    lengths: tuple[int, ...] = option((2048,), "behaviour: input lengths in tokens, each one pass through the engine "
                                               "and the reference (repeatable)", flag="--length")
    bins: int = option(16, "behaviour: position bins per length in the table and the figure")
    threads: int | None = option(None, "behaviour: the engine's CPU threads (default: llama-cpp-python's)",
                                 flag="--engine-threads")
    cache_at: int | None = option(None, "cache: the position checked around (positions at-4 .. at+4, at+16, at+64; "
                                        "default: the switch of a length-dependent scaling under test, HF's "
                                        "dynamic or longrope, else the longest --length)")
    cache_chunk: int = option(1, "cache: tokens per cached step after the prefill (1: decoding one token at a time; "
                                 "more: chunked prefill)")
    precision_end: int | None = option(None, "precision: scan positions 0 .. this (default 4 x the model's context)")
    rope_scaling: dict | None = option(None, "", cli=False)  # the CLI's --rope-scaling JSON

    def __post_init__(self) -> None:
        from posprobe.backend.engines import engine_module

        engine = engine_module(self.engine)  # an unknown engine is refused naming the known ones
        bad = [c for c in self.checks if c not in CONFORM_CHECKS]
        if bad or not self.checks:
            raise ValueError(f"unknown checks {bad}; choose from {', '.join(CONFORM_CHECKS)}")
        object.__setattr__(self, "checks", tuple(dict.fromkeys(self.checks)))
        engine.parse_options(self.engine_options)  # a bad KEY=VALUE is refused with the config
        at_least(self, 2, "bins")
        if not self.lengths or min(self.lengths) < 4 * self.bins:
            raise ValueError(f"lengths must be >= 4 x bins ({4 * self.bins} tokens); got {self.lengths}")
        object.__setattr__(self, "lengths", tuple(sorted(set(int(n) for n in self.lengths))))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError("rope_scaling must be a JSON object of HF rope_parameters fields")
        at_least(self, 1, "cache_chunk")
        if self.cache_at is not None and self.cache_at < 8:
            raise ValueError(f"cache_at must be >= 8 (a prefill of at-4 tokens, then the positions around it); got "
                             f"{self.cache_at}")
        if self.precision_end is not None and self.precision_end < 16:
            raise ValueError(f"precision_end must be >= 16 positions; got {self.precision_end}")
