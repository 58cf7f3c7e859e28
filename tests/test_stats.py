"""posprobe.core.stats against independent references (issue 36): the percentile bootstrap against
scipy.stats.bootstrap(method="percentile") given the same generator, the Wilson interval against
scipy.stats.binomtest(...).proportion_ci(method="wilson") and its closed forms at 0 of n and n of n."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as scipy_stats  # a hard dependency of posprobe: never a skip

from posprobe.core.stats import bootstrap_ci, wilson_ci


@pytest.mark.parametrize("n, n_boot", [(7, 999), (50, 2000), (5000, 1000)])  # 5000: posprobe resamples in chunks
def test_bootstrap_ci_equals_scipys_percentile_bootstrap_with_the_same_generator(n, n_boot):
    # scipy draws every resample as rng.integers(0, n, (n_resamples, n)) from the generator it is given and takes
    # linear-interpolated quantiles at (1 - level) / 2 and 1 - (1 - level) / 2 of the resampled means: the published
    # percentile bootstrap. posprobe's default_rng(seed) stream is the same draw, so the ends agree to rounding.
    x = np.random.default_rng(n).exponential(size=n)  # skewed: the percentile interval is not symmetric
    for level in (0.95, 0.8):
        ref = scipy_stats.bootstrap((x,), np.mean, n_resamples=n_boot, method="percentile", confidence_level=level,
                                    rng=np.random.default_rng(3), vectorized=True).confidence_interval
        lo, hi = bootstrap_ci(x, n_boot=n_boot, seed=3, level=level)
        assert lo == pytest.approx(float(ref.low), rel=1e-12, abs=1e-15), (n, level)
        assert hi == pytest.approx(float(ref.high), rel=1e-12, abs=1e-15), (n, level)
        assert lo < x.mean() < hi and hi - x.mean() != pytest.approx(x.mean() - lo, rel=1e-3)  # skew reaches it


def test_bootstrap_ci_of_constant_and_empty_samples():
    assert bootstrap_ci(np.full(9, 0.25), n_boot=50) == (0.25, 0.25)  # every resample has the same mean
    lo, hi = bootstrap_ci(np.array([]), n_boot=50)
    assert math.isnan(lo) and math.isnan(hi)


@pytest.mark.parametrize("k, n", [(0, 1), (1, 1), (0, 5), (5, 5), (3, 10), (1, 3), (17, 40), (0, 200), (199, 200)])
def test_wilson_ci_equals_scipys_wilson_interval(k, n):
    for level in (0.95, 0.9):
        ref = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
        lo, hi = wilson_ci(k, n, level=level)
        assert lo == pytest.approx(float(ref.low), abs=1e-12) and hi == pytest.approx(float(ref.high), abs=1e-12)
        assert 0.0 <= lo <= k / n <= hi <= 1.0


def test_wilson_ci_edges_have_their_closed_forms():
    # p = 0: centre = half, so the interval is [0, z^2 / (n + z^2)]; p = 1 mirrors it: [n / (n + z^2), 1].
    z2 = 1.959963984540054 ** 2
    for n in (1, 3, 10, 1000):
        assert wilson_ci(0, n) == pytest.approx((0.0, z2 / (n + z2)), abs=1e-12)
        assert wilson_ci(0, n)[0] == 0.0 and wilson_ci(n, n)[1] == 1.0  # clamped exactly, never a hair outside
        assert wilson_ci(n, n) == pytest.approx((n / (n + z2), 1.0), abs=1e-12)
    lo, hi = wilson_ci(0, 0)  # no trials: no interval
    assert math.isnan(lo) and math.isnan(hi)
    for bad in ((-1, 3), (4, 3), (1, 0)):
        with pytest.raises(ValueError, match="within"):
            wilson_ci(*bad)
