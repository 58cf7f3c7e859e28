"""Check 1 of `posprobe conform`: an engine's declared rotary positions against Hugging Face's, per layer type.

The engine's per-band inverse frequencies and cos/sin multiplier (`posprobe.backend.engines.rope.engine_table`, its
own formulas on what it read: a GGUF file's metadata and the engine options in force) are compared band by band with
HF's rotary module for the model's config (`posprobe.backend.engines.reference`). A mismatch is named by the bug
class it matches, each from the engines' reported failures (vLLM #41236, #48621; sglang #33558; llama.cpp #17945,
#14367; mlx-vlm #1709):

- `rotated dims`: the engine rotates another number of bands (partial rotary applied twice, or not at all);
- `attention factor missing` / `attention factor doubled` / `attention factor off`: cos/sin multiplier 1 where HF
  has m, m^2 where HF has m, or another value;
- `base off`: log(engine / HF) linear in the band index through 0 (the engine's base b' = b exp(-slope n_rot / 2),
  reported with its relative error);
- `scale off`: every band off by one factor c (a linear factor / freq_scale wrong);
- `layer types swapped`: the engine's table for one layer type is HF's table of another (Gemma 3's global settings on
  its local layers, or the reverse); `scaling on every layer type`: a scale off on one layer type by the factor
  another layer type rightly has (Gemma 3's linear x8 of its global layers applied to its local ones);
- `ramp off`: only some bands differ, the others equal (YaRN's original context or betas);
- `frequencies off`: any other difference.
Relative tolerance `TOLERANCE` (float32 tables agree to ~1e-7). Torch-free."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["TOLERANCE", "declared_tables", "diagnose"]

#: Relative difference of a band's frequency or of the multiplier under which engine and HF agree (HF builds its
#: tables in float32: ~6e-8 relative; 1e-6 leaves room for the pow and still sees a base 1e-5 off in a fast band).
TOLERANCE = 1e-6


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= TOLERANCE * np.abs(b)))


def diagnose(engine: tuple[np.ndarray, float], hf: tuple[np.ndarray, float],
             others: dict[str, tuple[np.ndarray, float]] | None = None) -> tuple[str, str]:
    """(bug class, one sentence with the numbers) for an engine table against HF's for the same layer type, ("ok",
    "") when they agree; `others`: HF's tables of the model's other layer types (for `layer types swapped`)."""
    e, em = engine
    h, hm = hf
    if e.shape != h.shape:
        return "rotated dims", (f"the engine rotates {e.shape[0]} bands ({2 * e.shape[0]} dims) where HF rotates "
                                f"{h.shape[0]} ({2 * h.shape[0]} dims): a partial-rotary factor applied twice or not "
                                "at all")
    same_bands = _close(e, h)
    if not same_bands:
        for name, (oh, om) in (others or {}).items():
            if _close(e, oh) and math.isclose(em, om, rel_tol=TOLERANCE):
                return "layer types swapped", (f"the engine rotates this layer type with HF's {name} table (bases "
                                               f"differ by x{h[1] / oh[1] if len(h) > 1 else float('nan'):.4g} at "
                                               "band 1): one layer type's settings applied to another")
        return _bands(e, h)
    if math.isclose(em, hm, rel_tol=TOLERANCE):
        return "ok", ""
    if math.isclose(em, 1.0, rel_tol=TOLERANCE) and hm != 1.0:
        return "attention factor missing", (f"cos/sin multiplier 1 where HF has {hm:.6g}: scores "
                                            f"{(1 - 1 / hm ** 2) * 100:.1f}% too small on the rotated dims")
    if math.isclose(em, hm * hm, rel_tol=1e-4):
        return "attention factor doubled", (f"cos/sin multiplier {em:.6g} = HF's {hm:.6g} squared: applied twice "
                                            f"(scores x{em ** 2 / hm ** 2:.4g} on the rotated dims)")
    return "attention factor off", f"cos/sin multiplier {em:.6g} where HF has {hm:.6g}"


def _bands(e: np.ndarray, h: np.ndarray) -> tuple[str, str]:
    # Which shape the per-band log ratio has: constant (a scale), linear through 0 (a base), partial (a ramp).
    turning = (h > 0) & (e > 0)
    if not np.array_equal(h > 0, e > 0):
        return "frequencies off", (f"the engine turns {int((e > 0).sum())} bands where HF turns {int((h > 0).sum())} "
                                   "(p-RoPE's removed bands differ)")
    r = np.log(e[turning] / h[turning])  # log ratio per turning band (~relative difference)
    j = np.flatnonzero(turning).astype(np.float64)
    off = np.abs(r) > TOLERANCE
    n_rot = 2 * len(h)
    if len(r) > 1 and float(np.ptp(r)) <= 2 * TOLERANCE:
        c = float(np.exp(r[0]))
        return "scale off", (f"every band turns x{c:.6g} of HF's rate: a linear factor / freq_scale off (engine "
                             f"interpolates by {1 / c:.6g} where HF does not, or the reverse)")
    if len(r) > 2 and off.sum() > 1:
        slope = float(np.dot(j, r) / np.dot(j, j))
        if np.allclose(r, slope * j, rtol=0, atol=2 * TOLERANCE):
            ratio = math.exp(-slope * n_rot / 2)  # b_engine / b_hf
            return "base off", (f"the engine's base is x{ratio:.6g} HF's ({(ratio - 1) * 100:+.3g}%): band j turns "
                                f"(b'/b)^(-2j/{n_rot}) of HF's rate")
    if off.any() and not off.all():
        idx = np.flatnonzero(off)
        return "ramp off", (f"bands {int(idx[0])}..{int(idx[-1])} of {len(r)} differ (largest x"
                            f"{float(np.exp(r[idx]).max()):.4g} / x{float(np.exp(r[idx]).min()):.4g}), the rest "
                            "agree: a YaRN ramp boundary (its original context or betas)")
    return "frequencies off", (f"bands differ by x{float(np.exp(r).min()):.4g} .. x{float(np.exp(r).max()):.4g} "
                               "with no single base or scale")


def declared_tables(engine: dict[str, Any], reference: dict[str, tuple[np.ndarray, float]]
                    ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per layer type: the verdict, its bug class and sentence, base/scale/multiplier both sides; per layer type and
    band: the two frequencies in rad/token and their ratio) for the engine's `EngineRope` per layer type against
    HF's tables (`hf_rope_tables`). A layer type only one side has is a row with bug class `layer types differ`."""
    from posprobe.backend.engines.rope import engine_table

    rows, bands = [], []
    for lt in dict.fromkeys([*reference, *engine]):
        if lt not in engine or lt not in reference:
            rows.append({"layer_type": lt, "verdict": "differs", "bug_class": "layer types differ",
                         "why": f"only {'HF' if lt in reference else 'the engine'} has layer type {lt!r}"})
            continue
        rope = engine[lt]
        e, em = engine_table(rope)
        h, hm = reference[lt]
        others = {k: v for k, v in reference.items() if k != lt}
        bug, why = diagnose((e, em), (h, hm), others)
        if bug == "base off":
            hf_base = rope.base / float(np.exp(np.log(e[1] / h[1]) * -len(e))) if len(e) > 1 else float("nan")
            why = f"engine base {rope.base:g}, HF's {hf_base:.6g}: {why}"
        spread = [k for k, r in engine.items() if k != lt and r.freq_scale == rope.freq_scale != 1.0]
        if bug == "scale off" and spread:
            bug, why = "scaling on every layer type", (f"the engine interpolates {lt} layers by {rope.freq_scale:.6g} "
                                                       f"as it does {', '.join(spread)} layers, where HF scales only "
                                                       f"the latter: {why}")
        n = min(len(e), len(h))
        diff = np.abs(e[:n] - h[:n])
        rel = np.where(h[:n] > 0, diff / np.where(h[:n] > 0, h[:n], 1.0), diff) if n else np.array([0.0])
        rows.append({"layer_type": lt, "verdict": "conforms" if bug == "ok" else "differs", "bug_class": bug,
                     "why": why, "engine_bands": len(e), "hf_bands": len(h), "engine_base": rope.base,
                     "engine_freq_scale": rope.freq_scale, "engine_ext_factor": rope.ext_factor,
                     "engine_multiplier": em, "hf_multiplier": hm, "max_rel_diff": float(rel.max()),
                     "source": rope.source})
        bands += [{"layer_type": lt, "band": i, "engine_inv_freq": float(e[i]), "hf_inv_freq": float(h[i]),
                   "ratio": float(e[i] / h[i]) if h[i] > 0 else float("nan")} for i in range(n)]
    return pd.DataFrame(rows), pd.DataFrame(bands, columns=["layer_type", "band", "engine_inv_freq", "hf_inv_freq",
                                                            "ratio"])
