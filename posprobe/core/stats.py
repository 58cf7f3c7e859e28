"""Small statistics used across analyses: bootstrap and Wilson intervals and the exact McNemar test."""

from __future__ import annotations

import numpy as np


def bootstrap_ci(values: np.ndarray, *, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (resampling items with replacement)."""
    values = np.asarray(values, dtype=float)
    if values.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    # Resample in chunks so 1000 x 67000 pairs never materialises at once.
    means = np.empty(n_boot)
    chunk = max(1, 2_000_000 // values.size)
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, values.size, size=(stop - start, values.size))
        means[start:stop] = values[idx].mean(1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


def wilson_ci(successes: int, n: int, *, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion: `successes` out of `n` trials.

    With p = successes / n and z the standard normal quantile at 1 - (1 - level) / 2, the interval is
    centre +- half, where centre = (p + z^2 / (2n)) / (1 + z^2 / n) and
    half = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2)). Unlike a percentile bootstrap it does not
    collapse to a point at p = 0 or 1 (3 of 3 gives [0.438, 1] at 95%). (NaN, NaN) for n = 0."""
    from statistics import NormalDist

    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within [0, n]; got {successes} of {n}")
    if n == 0:
        return float("nan"), float("nan")
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * float(np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)))
    # At p = 0 (p = 1) the lower (upper) end is exactly 0 (1); rounding can leave centre - half a hair on either
    # side of it, which would exclude the observed proportion, so the closed form is returned there.
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for discordant counts b (right->wrong) and c (wrong->right)."""
    from scipy.stats import binomtest

    n = b + c
    if n == 0:
        return 1.0
    return float(binomtest(min(b, c), n, 0.5, alternative="two-sided").pvalue)
