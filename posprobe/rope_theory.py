"""RoPE theory from a layer's own rotary frequencies: the published bounds that say why rotary models extrapolate or
fail, computed for a given model rather than for the papers' Llama.

Every function takes a `RotarySpec` (the frequencies after the model's rope type: HF's `inv_freq`, partial rotary,
removed bands) and works in float64. Units: positions and lengths in tokens, frequencies in radians per token.

- Liu et al. 2024, critical dimension: the dims whose period 2*pi/theta_j fits in the training length L
  (2*ceil((d/2) log_b(L / 2pi)) for plain RoPE; Llama-2 at 4,096: 92 of 128).
- Xu (Men) et al. 2024, base bound: B_m = sum_j cos(m theta_j) must stay >= 0 for every distance m a model must
  retrieve across; past the first negative m a model keeps low perplexity but retrieves only superficially.
- Chen et al. 2023 (Position Interpolation), Theorem 2.1: for a(s) = Re sum_j h_j e^{i s theta_j}, interpolation
  between integer positions errs by at most d max|h_j| / (32 ln b); extrapolation is bounded only by
  2 max|h_j| B(s) with B(s) = sum_{k=1}^{d/2} |sum_{j<k} e^{i s theta_j}| (B(s)/d ~ 15.8 at s = 1, d = 128, b = 1e4).
- The scaling methods' per-band factors for a target length: PI (every frequency / s), NTK-aware (base b s^{d/(d-2)}),
  YaRN (per-band ramp between the bands that turn beta and alpha times within L, temperature 0.1 ln s + 1).

Examples:
    >>> from posprobe.rope import RotarySpec
    >>> llama2 = RotarySpec(rotary_dim=128, base=10_000.0)
    >>> critical_dimension(llama2, 4096)
    92
    >>> round(float(chen_B(llama2, [1.0])[0]) / 128, 1)
    15.8
    >>> first_negative_sum(RotarySpec(rotary_dim=64, base=100_000.0), 20_000)  # SmolLM2-135M
    3616
    >>> round(yarn_temperature(8.0), 3)
    1.208
"""

from __future__ import annotations

import math
from typing import Callable, Literal, Sequence

import numpy as np

from posprobe.rope import RotarySpec, angular_frequency

__all__ = ["band_periods", "chen_B", "chen_bound_ratio", "check_plain", "critical_dimension", "extrapolation_bound",
           "first_negative_sum", "interpolation_bound", "ntk_aware_base", "pi_factors", "rotation_sum",
           "score_by_distance", "score_range", "yarn_gamma", "yarn_temperature"]


def _theta(spec: RotarySpec) -> np.ndarray:
    return np.asarray(angular_frequency(spec), dtype=np.float64)


def band_periods(spec: RotarySpec) -> np.ndarray:
    """Each band's period 2*pi/theta_j in tokens (inf for a band that never turns), band 0 the fastest."""
    theta = _theta(spec)
    with np.errstate(divide="ignore"):
        return np.where(theta > 0, 2 * math.pi / theta, np.inf)


def critical_dimension(spec: RotarySpec, length: int) -> int:
    """Liu et al.'s critical dimension for training length `length` (tokens): the number of head dims (2 per band)
    whose band completes a full period within `length`; the other dims see angles past L never seen in training."""
    return 2 * int(np.sum(band_periods(spec) <= length))


def _in_blocks(distances: Sequence[float] | np.ndarray, per_block: Callable[[np.ndarray], np.ndarray],
               block: int = 4096) -> np.ndarray:
    # A sum over bands at each distance, evaluated `block` distances at a time: memory stays at block x bands
    # however long the context (a 1M-token context at once would hold gigabytes of complex partial sums).
    flat = np.asarray(distances, dtype=np.float64).reshape(-1)
    out = np.empty(flat.size, dtype=np.float64)
    for i in range(0, flat.size, block):
        out[i:i + block] = per_block(flat[i:i + block])
    return out


def rotation_sum(spec: RotarySpec, distances: Sequence[int] | np.ndarray) -> np.ndarray:
    """Xu et al.'s B_m = sum_j cos(m theta_j) over the rotary bands at each distance m (tokens): the expected score
    of a query and key that agree in every band, up to their norms."""
    theta = _theta(spec)
    sums = _in_blocks(distances, lambda m: np.cos(np.outer(m, theta)).sum(axis=1))
    return sums.reshape(np.shape(distances))


def first_negative_sum(spec: RotarySpec, limit: int) -> int | None:
    """The first distance m in 1..limit (tokens) with sum_j cos(m theta_j) < 0 (Xu et al.'s bound on the context
    a base supports for retrieval), or None if the sum stays >= 0 up to `limit`."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1; got {limit}")
    for start in range(1, limit + 1, 65536):
        m = np.arange(start, min(start + 65536, limit + 1))
        neg = np.flatnonzero(rotation_sum(spec, m) < 0)
        if len(neg):
            return int(m[neg[0]])
    return None


def score_by_distance(h: np.ndarray, theta: Sequence[float] | np.ndarray,
                      distances: Sequence[float] | np.ndarray) -> np.ndarray:
    """Chen et al.'s a(s) = Re sum_j h_j e^{i s theta_j} for each row of complex `h` [..., band] at each distance s
    (tokens; theta in radians per token): the score of a query and key whose unrotated band pairs give the products
    h_j = q_j conj(k_j), placed s apart. Returns [..., distance] in the units of h."""
    h = np.asarray(h, dtype=np.complex128)
    theta = np.asarray(theta, dtype=np.float64)
    rows = h.reshape(-1, theta.size)
    s = np.asarray(distances, dtype=np.float64).reshape(-1)
    out = np.empty((rows.shape[0], s.size), dtype=np.float64)
    for i in range(0, s.size, 4096):  # bands x 4,096 distances at a time, whatever the context
        out[:, i:i + 4096] = (rows @ np.exp(1j * np.outer(theta, s[i:i + 4096]))).real
    return out.reshape(h.shape[:-1] + np.shape(distances))


def score_range(h: np.ndarray, theta: Sequence[float] | np.ndarray, start: int, stop: int) -> tuple[np.ndarray, ...]:
    """(min, max) over the integer distances start..stop-1 of a(s) (`score_by_distance`) for each row of `h`, computed
    4,096 distances at a time (a 1M-token range never holds more)."""
    if stop <= start:
        raise ValueError(f"empty distance range {start}..{stop - 1}")
    h = np.asarray(h, dtype=np.complex128)
    lo = np.full(h.shape[:-1], np.inf)
    hi = np.full(h.shape[:-1], -np.inf)
    for a in range(start, stop, 4096):
        v = score_by_distance(h, theta, np.arange(a, min(a + 4096, stop)))
        lo, hi = np.minimum(lo, v.min(-1)), np.maximum(hi, v.max(-1))
    return lo, hi


def chen_B(spec: RotarySpec, distances: Sequence[float] | np.ndarray) -> np.ndarray:
    """Chen et al.'s B(s) = sum_{k=1}^{n_bands} |A_k(s)|, A_k(s) = sum_{j<k} e^{i s theta_j}, at each distance s
    (tokens): the factor by which max|h_j| can be amplified when extrapolating to s (dimensionless)."""
    theta = _theta(spec)
    return _in_blocks(distances, lambda s: np.abs(np.cumsum(np.exp(1j * np.outer(s, theta)), axis=1)).sum(axis=1))


def interpolation_bound(spec: RotarySpec, h_max: float = 1.0) -> float:
    """Chen et al.'s Theorem 2.1 bound on |a(s) - linear interpolation of a| between two integer positions:
    d max|h_j| / (32 ln b), d the rotary dims, b the base (score units of h)."""
    return spec.rotary_dim * h_max / (32 * math.log(spec.base))


def extrapolation_bound(spec: RotarySpec, distances: Sequence[float] | np.ndarray, h_max: float = 1.0) -> np.ndarray:
    """Chen et al.'s bound on |a(s)| at each distance s when extrapolating: 2 max|h_j| B(s) (score units of h)."""
    return 2 * h_max * chen_B(spec, distances)


def chen_bound_ratio(spec: RotarySpec, distances: Sequence[float] | np.ndarray) -> np.ndarray:
    """Extrapolation bound / interpolation bound at each s, independent of h: 64 ln b B(s) / d."""
    return extrapolation_bound(spec, distances) / interpolation_bound(spec)


def check_plain(spec: RotarySpec, method: str) -> None:
    """ValueError unless `spec` is a plain RoPE table (no per-band rescaling, no removed bands): the scaling methods'
    projections start from b^(-2j/d), and a table already rescaled by its rope type would be scaled twice."""
    if spec.freq_scale is not None or spec.removed:
        raise ValueError(f"{method} projects from a plain RoPE table; this layer's table is already rescaled or has "
                         "bands removed by its rope type, so the projection would scale it twice")


def pi_factors(spec: RotarySpec, scale: float) -> np.ndarray:
    """Position Interpolation's factor on each band's frequency for context scale s = L'/L: 1/s for every band."""
    return np.full(spec.n_bands, 1.0 / scale)


def ntk_aware_base(spec: RotarySpec, scale: float) -> float:
    """The NTK-aware base b' = b s^{d/(d-2)} (bloc97) for context scale s, d the rotary dims."""
    d = spec.rotary_dim
    return spec.base * scale ** (d / (d - 2))


def yarn_temperature(scale: float) -> float:
    """YaRN's sqrt(1/t) = 0.1 ln s + 1 for s > 1 (1 otherwise): q and k (HF: cos and sin) are multiplied by it, so
    the scores by its square."""
    return 0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0


def yarn_gamma(spec: RotarySpec, length: int, *, alpha: float = 1.0, beta: float = 32.0,
               ramp: Literal["turns", "band"] = "turns", truncate: bool = True) -> np.ndarray:
    """YaRN's gamma per band for training length `length` (tokens), from the plain RoPE frequencies b^(-2j/d):
    1 keeps the band as trained (more than `beta` turns within L), 0 interpolates it fully by 1/s (fewer than
    `alpha`); a band's new frequency is ((1 - gamma)/s + gamma) theta.

    ramp="turns": the paper's ramp (Peng et al. 2023, Eqs. 17-20), linear in the band's turns r = L theta / 2pi
    (posprobe's `yarn` preset). ramp="band": the reference code's and Hugging Face's `yarn` rope type, linear in the
    band index between the bands that turn `beta` and `alpha` times (rounded outwards with `truncate`, HF's default);
    the two agree outside the ramp."""
    d, base = spec.rotary_dim, spec.base
    j = np.arange(spec.n_bands, dtype=np.float64)
    if ramp == "turns":
        r = length / (2 * math.pi * base ** (2 * j / d))
        return np.clip((r - alpha) / (beta - alpha), 0.0, 1.0)

    def band_with_turns(turns: float) -> float:
        return d * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = band_with_turns(beta), band_with_turns(alpha)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as the reference code: a one-band ramp instead of a division by zero
    return 1.0 - np.clip((j - low) / (high - low), 0.0, 1.0)
