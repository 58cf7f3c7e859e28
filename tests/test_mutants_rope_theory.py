"""Tests written to kill the mutants benchmarks/mutation.py found alive in posprobe/rope_theory.py and
posprobe/analyses/rope_tables.py (#53). Each against the papers' formulas written out here with loops; pure numpy and
the tiny random models' facts; well under a second each."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from posprobe import rope_theory as T
from posprobe.rope import RotarySpec


def _theta(d, base):
    return [base ** (-2 * j / d) for j in range(d // 2)]


def _B(d, base, s):
    """Chen et al.'s B(s) = sum_k |sum_{j<k} e^{i s theta_j}| by loops."""
    total, acc = 0.0, 0j
    for t in _theta(d, base):
        acc += complex(math.cos(s * t), math.sin(s * t))
        total += abs(acc)
    return total


def test_extrapolation_bound_scales_with_h_max():
    spec = RotarySpec(rotary_dim=8, base=100.0)
    got = T.extrapolation_bound(spec, [3.0, 40.0], h_max=2.5)
    assert got == pytest.approx([2 * 2.5 * _B(8, 100.0, 3.0), 2 * 2.5 * _B(8, 100.0, 40.0)], rel=1e-12)
    assert T.interpolation_bound(spec, h_max=2.5) == pytest.approx(8 * 2.5 / (32 * math.log(100.0)), rel=1e-12)
    # chen_B of a 2-D distance array keeps its shape; rotation_sum too
    s = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert T.chen_B(spec, s).reshape(-1) == pytest.approx([_B(8, 100.0, x) for x in s.reshape(-1)], rel=1e-12)
    rs = T.rotation_sum(spec, s)
    assert rs.shape == (2, 2)
    assert rs[1, 0] == pytest.approx(sum(math.cos(3.0 * t) for t in _theta(8, 100.0)), rel=1e-12)


def test_first_negative_sum_limits_at_the_crossing():
    spec = RotarySpec(rotary_dim=16, base=1e4)
    theta = _theta(16, 1e4)
    first = next(m for m in range(1, 100_000) if sum(math.cos(m * t) for t in theta) < 0)
    assert T.first_negative_sum(spec, first) == first  # the limit itself is searched
    assert T.first_negative_sum(spec, first - 1) is None
    assert T.first_negative_sum(spec, 1) is None  # one distance is a valid search
    # a band turning by more than pi/2 per token: negative already at m = 1
    fast = RotarySpec(rotary_dim=2, base=10.0, freq_scale=(1 / 2.0,))  # theta = 2 rad per token
    assert T.first_negative_sum(fast, 5) == 1 == int(math.cos(2.0) < 0)


def test_band_periods_of_a_removed_band_is_infinite_without_a_warning():
    spec = RotarySpec(rotary_dim=8, base=100.0, removed=frozenset({3}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a divide-by-zero RuntimeWarning fails
        periods = T.band_periods(spec)
    assert periods[3] == np.inf
    assert periods[:3] == pytest.approx([2 * math.pi / t for t in _theta(8, 100.0)[:3]], rel=1e-12)


def test_yarn_gamma_default_ramp_is_the_papers_turns():
    spec = RotarySpec(rotary_dim=16, base=1e4)
    length, alpha, beta = 512, 1.0, 32.0
    want = []
    for t in _theta(16, 1e4):
        r = length * t / (2 * math.pi)  # turns within L
        want.append(min(1.0, max(0.0, (r - alpha) / (beta - alpha))))
    assert T.yarn_gamma(spec, length) == pytest.approx(want, abs=1e-12)
    assert T.yarn_gamma(spec, length).dtype == np.float64


def test_yarn_band_ramp_clipped_at_the_last_band():
    """HF's yarn: low/high bands clipped to [0, d - 1] (its `find_correction_range`), written out here."""
    d, base, length = 16, 100.0, 100_000  # the band turning once within L lies past the last band
    spec = RotarySpec(rotary_dim=d, base=base)

    def band(turns):
        return d * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(band(32.0)), 0), min(math.ceil(band(1.0)), d - 1)
    assert math.ceil(band(1.0)) > d - 1  # the clip is in play
    want = [1 - min(1.0, max(0.0, (j - low) / (high - low))) for j in range(d // 2)]
    assert T.yarn_gamma(spec, length, ramp="band") == pytest.approx(want, abs=1e-12)


def test_theory_table_lengths_notes_and_messages(tiny_rope):
    from posprobe.analyses.rope_tables import _layers, rope_theory_table

    t = rope_theory_table(tiny_rope, context=2)  # the shortest context allowed
    assert t.set_index("quantity").loc["context L", "value"] == 2
    with pytest.raises(ValueError, match="must exceed"):
        rope_theory_table(tiny_rope, context=64, target=64)
    table = rope_theory_table(tiny_rope, context=256, target=1024)
    notes = dict(zip(table.quantity, table.note))
    for q in ("B(s)/d at s = 1 (Chen et al. 2023)", "B(s)/d at s = 128 (Chen et al. 2023)",
              "PI frequency factor, every band"):
        assert notes[q] == ""  # rows without a note carry an empty one
    assert notes["context L"] == "the trained length the bounds refer to"
    assert notes["NTK-aware base"] == "b s^(d/(d-2)) from 10000"
    assert notes["YaRN bands kept (gamma = 1)"] == "turn > 32 times within L"
    assert notes["YaRN bands interpolated (gamma = 0)"] == "turn < 1 time within L"
    assert notes["YaRN bands on the ramp"] == "HF's yarn rope type: linear in band index"
    assert notes["YaRN temperature sqrt(1/t)"] == "0.1 ln s + 1"
    assert notes["min B(s)/d over s = 1..L"] == "the extrapolation bound's amplification is at least this"
    assert notes["extrapolation / interpolation bound at s = L"] == (
        "64 ln(base) B(L) / d, independent of the head's h_j")
    assert notes["first m with sum cos(m theta) < 0 (Xu et al. 2024)"] == (
        "inside L: retrieval across distances past it predicted to be superficial")
    assert notes["YaRN gamma per band"].startswith("band 0 (fastest) first: ")
    assert _layers([2, 3, 4]) == "2-4" and _layers([1, 2]) == "1-2"


def test_theory_table_crossing_beyond_l_and_none(tiny_rope):
    from posprobe.analyses.rope_tables import rope_theory_table

    spec = RotarySpec(rotary_dim=16, base=1e4)
    first = T.first_negative_sum(spec, 10_000)
    theta = _theta(16, 1e4)
    assert first == next(m for m in range(1, 10_000) if sum(math.cos(m * t) for t in theta) < 0)
    at = rope_theory_table(tiny_rope, context=first).set_index("quantity")
    assert at.loc["first m with sum cos(m theta) < 0 (Xu et al. 2024)", "note"].startswith("inside L")  # m = L
    before = rope_theory_table(tiny_rope, context=first - 1).set_index("quantity")
    assert before.loc["first m with sum cos(m theta) < 0 (Xu et al. 2024)", "note"] == (
        "beyond L: retrieval across distances past it predicted to be superficial")
    short = rope_theory_table(tiny_rope, context=3).set_index("quantity")  # searched up to 4L = 12: none
    row = short.loc["first m with sum cos(m theta) < 0 (Xu et al. 2024)"]
    assert math.isnan(row.value) and row.note == "none up to 12 tokens (4L)"
    # min over s = 1..L exactly (loops)
    assert short.loc["min B(s)/d over s = 1..L", "value"] == pytest.approx(min(_B(16, 1e4, s) for s in (1, 2, 3)) / 16,
                                                                         rel=1e-12)
