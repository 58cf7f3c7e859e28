"""The RoPE theory of one model, per group of rotary layers that rotate alike: Liu's critical dimension, Xu's first
negative rotation sum, Chen's B(s) and bound ratio, and, for a target length, each scaling method's per-band factors
(`posprobe.rope_theory` holds the formulas; this module reads the model's own frequencies and tabulates them).

Examples:
    >>> from posprobe import load_model
    >>> table = rope_theory_table(load_model("tiny-rope"), context=256, target=1024)
    >>> int(table.set_index("quantity").loc["critical dimension (Liu et al. 2024)", "value"])
    8
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from posprobe import rope_theory as T
from posprobe.backend.facts import ModelFacts, WrongModelKind, model_facts
from posprobe.rope import RotarySpec

__all__ = ["rope_theory_table"]

#: Distances up to this many times the context are searched for Xu et al.'s first negative rotation sum.
XU_SEARCH = 4


def _groups(facts: ModelFacts) -> list[tuple[list[int], RotarySpec]]:
    # Layers sharing one rotation (Gemma 3's local and global bases are two groups), in layer order.
    out: dict[RotarySpec, list[int]] = {}
    for layer, spec in enumerate(facts.rotary or ()):
        if spec is not None:
            out.setdefault(spec, []).append(layer)
    return [(layers, spec) for spec, layers in out.items()]


def _layers(layers: list[int]) -> str:
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
    return ",".join(map(str, layers))


def rope_theory_table(model: Any, *, context: int | None = None, target: int | None = None) -> pd.DataFrame:
    """The RoPE theory table of `model`. WrongModelKind for a model without rotary layers; ValueError for a bad
    length, or for a scaling projection on a layer whose rope type already rescaled its table.

    Args:
        model: a loaded model or its ModelFacts.
        context: the trained length L in tokens (default: the model's context; >= 2).
        target: a length L' > L in tokens: rows for PI, NTK-aware and YaRN at s = L'/L are added (None: none).

    Returns:
        A DataFrame with one row per (layer group, quantity) and columns layers, rotary_dim, base, quantity,
            value, unit, note.
    """
    facts = model if isinstance(model, ModelFacts) else model_facts(model)
    groups = _groups(facts) if facts.is_rotary else []
    if not groups:
        raise WrongModelKind(f"RoPE theory needs rotary layers; {facts.name} uses {facts.positional_kind} positions "
                             "(no rotary frequencies)")
    length = int(context or facts.n_ctx)
    if length < 2:
        raise ValueError(f"the context must be >= 2 tokens; got {length}")
    if target is not None and target <= length:
        raise ValueError(f"the target length ({target}) must exceed the context L = {length}")
    if target is not None:
        for _, spec in groups:
            T.check_plain(spec, "the scaling projection (--target)")
    rows: list[dict] = []
    for layers, spec in groups:
        def add(quantity: str, value: float, unit: str, note: str = "") -> None:
            rows.append(dict(layers=_layers(layers), rotary_dim=spec.rotary_dim, base=spec.base, quantity=quantity,
                             value=float(value), unit=unit, note=note))

        periods = T.band_periods(spec)
        crit = T.critical_dimension(spec, length)
        add("context L", length, "tokens", "the trained length the bounds refer to")
        add("bands completing a period within L", int(np.sum(periods <= length)), "bands",
            f"of {spec.n_bands}; the slowest has a period of {periods[np.isfinite(periods)].max():,.0f} tokens")
        add("critical dimension (Liu et al. 2024)", crit, "dims",
            f"of {spec.rotary_dim}; the other {spec.rotary_dim - crit} see angles past L never seen in training")
        limit = XU_SEARCH * length
        first = T.first_negative_sum(spec, limit)
        add("first m with sum cos(m theta) < 0 (Xu et al. 2024)", first if first is not None else math.nan, "tokens",
            (f"{'inside' if first <= length else 'beyond'} L: retrieval across distances past it predicted to be "
             "superficial") if first is not None else f"none up to {limit:,} tokens (4L)")
        for s in (1, length // 2, length):
            add(f"B(s)/d at s = {s} (Chen et al. 2023)", T.chen_B(spec, [s])[0] / spec.rotary_dim, "ratio")
        add("min B(s)/d over s = 1..L", (T.chen_B(spec, np.arange(1, length + 1)) / spec.rotary_dim).min(), "ratio",
            "the extrapolation bound's amplification is at least this")
        add("extrapolation / interpolation bound at s = L", T.chen_bound_ratio(spec, [length])[0], "ratio",
            "64 ln(base) B(L) / d, independent of the head's h_j")
        if target is not None:
            s = target / length
            gamma = T.yarn_gamma(spec, length, ramp="band")
            add("target L'", target, "tokens", f"scale s = L'/L = {s:g}")
            add("PI frequency factor, every band", T.pi_factors(spec, s)[0], "x theta")
            add("NTK-aware base", T.ntk_aware_base(spec, s), "base", f"b s^(d/(d-2)) from {spec.base:g}")
            add("YaRN bands kept (gamma = 1)", int(np.sum(gamma == 1)), "bands", "turn > 32 times within L")
            add("YaRN bands interpolated (gamma = 0)", int(np.sum(gamma == 0)), "bands", "turn < 1 time within L")
            add("YaRN bands on the ramp", int(np.sum((gamma > 0) & (gamma < 1))), "bands",
                "HF's yarn rope type: linear in band index")
            add("YaRN temperature sqrt(1/t)", T.yarn_temperature(s), "x q and k", "0.1 ln s + 1")
            add("YaRN gamma per band", math.nan, "gamma", "band 0 (fastest) first: "
                + " ".join(f"{g:.2g}" for g in gamma))
    return pd.DataFrame(rows)
