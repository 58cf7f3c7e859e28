"""An engine's declared rotation for one layer type, as one record (`EngineRope`), and the per-band frequencies and
cos/sin multiplier it gives by ggml's rope (llama.cpp's; also what every GGUF engine built on ggml runs):

- band j of n_rot/2 turns theta_j = base^(-2j/n_rot) per token before scaling (n_rot = rope.dimension_count: the
  rotated dims; a partial-rotary model rotates fewer than its head);
- `freq_scale` (1/factor for linear or YaRN scaling) interpolates: theta_j * freq_scale;
- YaRN (ext_factor != 0) mixes the two per band: mix_j = ramp_j * ext_factor, theta_j * (freq_scale (1 - mix_j) +
  mix_j), where ramp_j = 1 - clamp((j - low) / max(0.001, high - low), 0, 1) and low/high are the bands that turn
  beta_fast / beta_slow times within the original context, floored/ceiled and clipped to [0, n_rot - 1]
  (`ggml_rope_yarn_corr_dims`); the cos/sin multiplier becomes attn_factor (1 + 0.1 ln(1/freq_scale));
- without YaRN the multiplier is attn_factor;
- per-band `freq_factors` (a GGUF's `rope_freqs` tensor: Llama 3.1's scaling, LongRoPE's factors) divide theta_j
  before everything else.
Computed in float64 (the comparison's tolerance is the float32 rounding of a table). Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["EngineRope", "engine_table", "yarn_mix"]


@dataclass(frozen=True)
class EngineRope:
    """What an engine rotates one layer type with: rotated dims `n_rot`, `base`, `freq_scale` (1 = none),
    `ext_factor` (YaRN's mix, 0 = off), `attn_factor` (cos/sin multiplier before YaRN's own), YaRN's `beta_fast`,
    `beta_slow` and original context `orig_ctx` (tokens), its `scaling` as the engine names it, and `source`: where
    each value came from (the file's metadata, an engine option, the engine's default)."""

    layer_type: str
    n_rot: int
    base: float
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    orig_ctx: int = 0
    scaling: str = "none"
    freq_factors: tuple[float, ...] | None = None
    source: str = ""


def _corr_dim(n_rot: int, orig_ctx: int, turns: float, base: float) -> float:
    return n_rot * math.log(orig_ctx / (turns * 2 * math.pi)) / (2 * math.log(base))


def engine_table(rope: EngineRope) -> tuple[np.ndarray, float]:
    """(inverse frequencies `[n_rot / 2]` in rad/token, cos/sin multiplier) that `rope` rotates with, by ggml's
    formulas (module docstring)."""
    j = np.arange(rope.n_rot // 2, dtype=np.float64)
    theta = rope.base ** (-2.0 * j / rope.n_rot)
    if rope.freq_factors is not None:
        theta = theta / np.asarray(rope.freq_factors, dtype=np.float64)
    if rope.ext_factor == 0:
        return theta * rope.freq_scale, float(rope.attn_factor)
    mix = yarn_mix(rope)
    mscale = rope.attn_factor * (1.0 + 0.1 * math.log(1.0 / rope.freq_scale))
    return theta * (rope.freq_scale * (1 - mix) + mix), float(mscale)


def yarn_mix(rope: EngineRope) -> np.ndarray:
    """YaRN's per-band mix `[n_rot / 2]` (1: the band keeps its unscaled frequency, 0: fully interpolated) of
    `rope`, ext_factor times ggml's ramp between the bands that turn beta_fast and beta_slow times within the original
    context; zeros without YaRN."""
    j = np.arange(rope.n_rot // 2, dtype=np.float64)
    if rope.ext_factor == 0:
        return np.zeros_like(j)
    low = max(0.0, math.floor(_corr_dim(rope.n_rot, rope.orig_ctx, rope.beta_fast, rope.base)))
    high = min(rope.n_rot - 1.0, math.ceil(_corr_dim(rope.n_rot, rope.orig_ctx, rope.beta_slow, rope.base)))
    return (1.0 - np.clip((j - low) / max(0.001, high - low), 0.0, 1.0)) * rope.ext_factor
