"""The one registry of q/k surgery presets: name, typed parameters with defaults and bounds, and both forms.

Each `Preset` builds a per-query `PositionPlan` (hook-based surgery on a TL model: `plan(model, n, params)`)
and a per-pair `PairRule` (the chunked long-context engine: `pairs(params)`); tests check that both forms
give the same relative position for every (query, key) pair. CLI help, parsing and validation of a spec such
as "yarn:scale=4,original=2048" are generated from the registry.

Where a new preset lands (counted on the code): three places in two files — its `register(Preset(...))` entry
here and its two builders in `core/surgery.py` (the per-query plan and the per-pair rule) — plus, for a preset with
a paper, the paper's rule in `tests/paper_rules.py` (and its name in `PAPERS` of `tests/test_presets.py`).
`tests/test_presets.py::test_both_forms_of_every_preset_agree` runs every registered preset in both forms;
`test_every_preset_with_a_paper_is_its_papers_rule` checks each against the paper's integers.

This module imports no torch: `posprobe --help` and the checks that run before a model loads stay fast; the
builders import `posprobe.core.surgery` when called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

__all__ = ["Param", "Preset", "PRESETS", "register", "unregister", "parse", "parse_with", "help_text", "is_identity",
           "preset_plan", "preset_pairs"]


@dataclass(frozen=True)
class Param:
    """One preset parameter: `kind` int or float; `default` None = required; bounds `low`/`high` inclusive
    unless `low_open` (strictly greater than `low`). `metavar` stands for the value in the help text."""

    name: str
    kind: type = float
    default: float | None = None
    metavar: str = "X"
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    help: str = ""

    def check(self, value: float, spec: str) -> float | int:
        """`value` converted to `kind`, or ValueError naming the spec and the rule broken."""
        if not math.isfinite(value):
            raise ValueError(f"{self.name} in preset {spec!r} must be finite; got {value}")
        if self.kind is int:
            if not float(value).is_integer():
                raise ValueError(f"{self.name} in preset {spec!r} must be a whole number; got {value:g}")
            value = int(value)
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            raise ValueError(f"{self.name} in preset {spec!r} must be {'>' if self.low_open else '>='} {self.low:g}; "
                             f"got {value:g}")
        if self.high is not None and value > self.high:
            raise ValueError(f"{self.name} in preset {spec!r} must be <= {self.high:g}; got {value:g}")
        return value


@dataclass(frozen=True)
class Preset:
    """A surgery preset. `plan(model, n, params)` -> PositionPlan over n tokens; `pairs(params)` -> PairRule.
    `params` maps each Param name to its checked value (defaults filled in)."""

    name: str
    summary: str
    params: tuple[Param, ...]
    plan: Callable[[Any, int, dict], Any]
    pairs: Callable[[dict], Any]
    example: str = ""  # a valid spec, for docs and for the tests that loop over the registry

    @property
    def usage(self) -> str:
        """The spec grammar of this preset, e.g. "yarn:scale=S,original=L[,beta_fast=32,beta_slow=1]"."""
        need = [f"{p.name}={p.metavar}" for p in self.params if p.default is None]
        opt = [f"{p.name}={p.default:g}" for p in self.params if p.default is not None]
        text = self.name + (":" + ",".join(need) if need else "")
        if opt:
            text += "[" + ("," if need else ":") + ",".join(opt) + "]"
        return text


PRESETS: dict[str, Preset] = {}


def register(preset: Preset) -> Preset:
    """Add `preset` to the registry (a name already taken raises); returns it."""
    if preset.name in PRESETS:
        raise ValueError(f"a preset named {preset.name!r} is already registered")
    if not preset.example:
        preset = replace(preset, example=preset.usage.partition("[")[0])  # valid when nothing is required
    parse_with(preset, preset.example)  # the example must parse: a registry entry documents itself
    PRESETS[preset.name] = preset
    return preset


def unregister(name: str) -> None:
    """Remove a preset from the registry (tests that register one of their own)."""
    PRESETS.pop(name, None)


def help_text() -> str:
    """Every preset's grammar, " | "-separated (the CLI's --preset help)."""
    return " | ".join(p.usage for p in PRESETS.values())


def canonical(spec: str) -> str:
    """`spec` with HF's spelling of a config-time scaling preset, "hf:<rope_type>,key=value,...", written as
    "hf-<rope_type>:key=value,..."; any other spec unchanged."""
    name, colon, rest = spec.partition(":")
    if name.strip().lower() != "hf" or not colon:
        return spec
    kind, _, params = rest.partition(",")
    return f"hf-{kind.strip().lower()}" + (f":{params}" if params.strip() else "")


def parse(spec: str) -> tuple[Preset, dict[str, float | int]]:
    """(preset, checked parameters) of a spec "name:key=value,...": unknown names or keys, values that are
    not numbers, missing required parameters and values out of bounds raise ValueError with the grammar."""
    spec = canonical(spec)
    name = spec.partition(":")[0].strip().lower()
    preset = PRESETS.get(name)
    if preset is None:
        raise ValueError(f"unknown preset {name!r} in {spec!r}; presets: {help_text()}")
    return preset, parse_with(preset, spec)


def parse_with(preset: Preset, spec: str) -> dict[str, float | int]:
    """The checked parameters of `spec` for `preset` (see `parse`)."""
    name, rest = preset.name, spec.partition(":")[2]
    given: dict[str, float] = {}
    known = {p.name: p for p in preset.params}
    for part in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        try:
            number = float(value)
        except ValueError:
            eq = ""
        if not eq or not key:
            raise ValueError(f"preset argument {part!r} in {spec!r} must look like key=number; {preset.usage}")
        if key not in known:
            raise ValueError(f"preset {name!r} has no argument {key!r} (in {spec!r}); {preset.usage}")
        given[key] = number
    out: dict[str, float | int] = {}
    for p in preset.params:
        if p.name not in given and p.default is None:
            raise ValueError(f"preset {spec!r} needs argument {p.name!r}; {preset.usage}")
        out[p.name] = p.check(given.get(p.name, p.default), spec)  # type: ignore[arg-type]
    return out


def preset_plan(spec: str, model: Any, n: int) -> Any:
    """The per-query `PositionPlan` of a preset spec over `n` tokens of `model`, labelled with the spec.

    Args:
        spec: a preset spec such as "yarn:scale=4,original=64".
        model: the model the plan is for (presets that change frequencies read the model's rotary facts).
        n: the number of tokens the plan covers.

    Returns:
        The `PositionPlan`, labelled with the spec's canonical form ("none" for the identity preset).
    """
    preset, params = parse(spec)
    return replace(preset.plan(model, n, params), label=canonical(spec) if preset.name != "none" else "none")


def preset_pairs(spec: str) -> Any:
    """The per-pair `PairRule` of a preset spec (the long-context engine's form), labelled with the spec.

    Args:
        spec: a preset spec such as "none", "pi:scale=2" or "yarn:scale=4,original=64".

    Returns:
        The `PairRule`, labelled with the spec's canonical form ("none" for the identity preset).
    """
    preset, params = parse(spec)
    return replace(preset.pairs(params), label=canonical(spec) if preset.name != "none" else "none")


def is_identity(spec: str) -> bool:
    """True for the preset that changes nothing ("none")."""
    return spec.partition(":")[0].strip().lower() == "none"


# ---- the presets ------------------------------------------------------------------------------------------

def _s() -> Any:
    from posprobe.core import surgery

    return surgery


_SCALE = Param("scale", float, metavar="S", low=0.0, low_open=True, help="context extension factor")

register(Preset("none", "the model as it is", (),
                plan=lambda model, n, a: _s().identity_plan(n),
                pairs=lambda a: _s().identity_pairs()))
register(Preset("shift", "q = k = i + k for every token (a RoPE model is invariant to it)",
                (Param("k", float, metavar="K", help="positions added (tokens)"),),
                plan=lambda model, n, a: _s().shift(n, a["k"]),
                pairs=lambda a: _s().shift_pairs(a["k"]),
                example="shift:k=100"))
register(Preset("pi", "Position Interpolation (Chen et al. 2023): q = k = i / s", (_SCALE,),
                plan=lambda model, n, a: _s().position_interpolation(n, a["scale"]),
                pairs=lambda a: _s().pi_pairs(a["scale"]),
                example="pi:scale=2"))
register(Preset("ntk", "NTK-aware base change: base' = base * s ** (d / (d - 2))", (_SCALE,),
                plan=lambda model, n, a: _s().ntk_aware(model, n, a["scale"]),
                pairs=lambda a: _s().ntk_pairs(a["scale"]),
                example="ntk:scale=2"))
register(Preset("yarn", "YaRN (Peng et al. 2023): per-band interpolation ramp + attention temperature",
                (_SCALE, Param("original", int, metavar="L", low=1.0, help="trained context (tokens)"),
                 Param("beta_fast", float, default=32.0), Param("beta_slow", float, default=1.0)),
                plan=lambda model, n, a: _s().yarn(model, n, a["scale"], a["original"], beta_fast=a["beta_fast"],
                                                   beta_slow=a["beta_slow"]),
                pairs=lambda a: _s().yarn_pairs(a["scale"], a["original"], a["beta_fast"], a["beta_slow"]),
                example="yarn:scale=2,original=16"))
register(Preset("self-extend", "Self-Extend (Jin et al. 2024): neighbours exact, far keys grouped by G",
                (Param("group", int, metavar="G", low=1.0), Param("window", int, metavar="W", low=1.0)),
                plan=lambda model, n, a: _s().self_extend(n, a["group"], a["window"]),
                pairs=lambda a: _s().self_extend_pairs(a["group"], a["window"]),
                example="self-extend:group=2,window=6"))
register(Preset("rerope", "ReRoPE (Su 2023): relative positions clipped at W",
                (Param("window", int, metavar="W", low=1.0),),
                plan=lambda model, n, a: _s().rerope(n, a["window"]),
                pairs=lambda a: _s().rerope_pairs(a["window"]),
                example="rerope:window=5"))
register(Preset("string", "STRING (An et al. 2025): distances >= S reuse the trained ones from W on (i - j - S + W)",
                (Param("offset", int, metavar="S", low=1.0, help="shifted offset (tokens; paper: 0.25-0.4 x context)"),
                 Param("window", int, default=128, low=0.0, help="local window kept (tokens)")),
                plan=lambda model, n, a: _s().string(n, a["offset"], a["window"]),
                pairs=lambda a: _s().string_pairs(a["offset"], a["window"]),
                example="string:offset=12,window=4"))
register(Preset("streaming", "StreamingLLM (Xiao et al. 2023): S sink keys + the last W keys",
                (Param("sink", int, metavar="S", low=0.0), Param("window", int, metavar="W", low=1.0)),
                plan=lambda model, n, a: _s().streaming(n, a["sink"], a["window"]),
                pairs=lambda a: _s().streaming_pairs(a["sink"], a["window"]),
                example="streaming:sink=2,window=6"))
register(Preset("p-rope", "p-RoPE (Barbero et al. 2024): keep the fraction p fastest bands",
                (Param("p", float, metavar="P", low=0.0, high=1.0),),
                plan=lambda model, n, a: _s().p_rope(model, n, a["p"]),
                pairs=lambda a: _s().p_rope_pairs(a["p"]),
                example="p-rope:p=0.5"))
register(Preset("drop", "remove the `lowest` slowest and `highest` fastest bands in every layer",
                (Param("lowest", int, default=0, low=0.0), Param("highest", int, default=0, low=0.0)),
                plan=lambda model, n, a: _s().drop_frequencies(model, n, lowest=a["lowest"], highest=a["highest"]),
                pairs=lambda a: _s().drop_pairs(a["lowest"], a["highest"]),
                example="drop:lowest=2,highest=1"))


# HF's own config-time scaling, applied to a loaded model (the same weights, one table beside posprobe's paper-form
# PI / NTK / YaRN). Parameter names are HF's, `original` standing for original_max_position_embeddings; an optional
# parameter left at 0 is not set (HF's default rule applies).
_FACTOR = Param("factor", float, metavar="F", low=0.0, low_open=True, help="HF's rope scaling factor")
_ORIGINAL = Param("original", int, metavar="L", low=1.0, help="original_max_position_embeddings (tokens)")
_HF_NAMES = {"original": "original_max_position_embeddings", "p": "partial_rotary_factor"}


def _hf_params(kind: str, a: dict) -> dict:
    out: dict = {"rope_type": kind}
    for k, v in a.items():
        if v or k in ("factor", "original", "p"):
            out[_HF_NAMES.get(k, k)] = float(v) if k != "original" else int(v)
    return out


def _hf(kind: str, summary: str, params: tuple[Param, ...], example: str) -> Preset:
    return Preset(f"hf-{kind}", summary, params,
                  plan=lambda model, n, a: _s().hf_scaled(model, n, _hf_params(kind, a)),
                  pairs=lambda a: _s().hf_scaled_pairs(_hf_params(kind, a)), example=example)


register(_hf("linear", "HF's linear scaling (PI) from the config", (_FACTOR,), "hf-linear:factor=2"))
register(_hf("dynamic", "HF's dynamic NTK: the base grows with inputs past max_position_embeddings", (_FACTOR,),
             "hf-dynamic:factor=2"))
register(_hf("yarn", "HF's YaRN: ramp, attention factor (0.1 ln s + 1, or mscale ratio, or given)",
             (_FACTOR, _ORIGINAL, Param("beta_fast", float, default=32.0), Param("beta_slow", float, default=1.0),
              Param("attention_factor", float, default=0.0, low=0.0), Param("mscale", float, default=0.0, low=0.0),
              Param("mscale_all_dim", float, default=0.0, low=0.0)), "hf-yarn:factor=2,original=16"))
register(_hf("llama3", "HF's Llama 3.1 scaling: bands by wavelength between low and high frequency factors",
             (_FACTOR, _ORIGINAL, Param("low_freq_factor", float, default=1.0, low=0.0, low_open=True),
              Param("high_freq_factor", float, default=4.0, low=0.0, low_open=True)), "hf-llama3:factor=2,original=16"))
register(_hf("proportional", "HF's proportional RoPE (Gemma 4): the fraction p of bands turns, over the full head",
             (Param("p", float, metavar="P", low=0.0, high=1.0, help="fraction of the head's bands that rotate"),
              Param("factor", float, default=1.0, low=0.0, low_open=True)), "hf-proportional:p=0.5"))
