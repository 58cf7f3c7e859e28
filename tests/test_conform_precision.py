"""`posprobe conform`, check 4 (precision): rotary phases per dtype against float64, tested against the formats'
own facts (bf16 holds 8 significant bits, fp16 11: integers are exact up to 2^(bits) and 2^bits + 1 rounds to
2^bits, the "256 vs 257" of transformers #29285), a plain scalar loop of ggml's float32 running product, and the
bf16 cos/sin rounding bound.

Planted bugs seen failing (each by editing posprobe/, running this file, then reverting):
- the bfloat16 mode computed in float32: test_neighbours_merge_where_the_format_runs_out_of_bits fails (none found).
- ggml's running product replaced by float32 powers per band: test_llama_cpps_phases_are_ggmls_running_product.
- the identical-rotation scan off by one past the first block (`+ 1` always): the block-size check fails.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from posprobe.analyses.conform_precision import MODES, dtype_phases, precision_tables
from posprobe.backend.engines.llama_cpp import phases
from posprobe.backend.engines.rope import EngineRope, engine_table


def _table(base: float = 10000.0, dim: int = 64) -> dict:
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # band 0 turns 1 rad/token: exact in every dtype
    return {"all": (inv, 1.0)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_neighbours_merge_where_the_format_runs_out_of_bits(dtype):
    bits = 1 - int(np.log2(torch.finfo(dtype).eps))  # significant bits: bf16 8, fp16 11
    expected = 2 ** bits + 1  # the first integer the format rounds onto its predecessor
    s, _ = precision_tables(_table(), context=4096, end=4096)
    row = s.set_index("mode").loc[str(dtype).removeprefix("torch.")]
    assert row["first_identical_position"] == expected
    assert row["first_fast_neighbour_position"] == expected  # band 0 is off by a whole token there
    assert float(dtype_phases(_table()["all"][0], np.array([expected]), str(dtype)[6:])[0, 0]) == expected - 1
    for block in (100, expected, expected - 1):  # the scan across blocks: the same first positions
        again = precision_tables(_table(), context=4096, end=4096, block=block)[0]
        pd.testing.assert_frame_equal(again, s)


def test_float32_keeps_every_position_apart_and_its_error_is_float32_rounding():
    s, curve = precision_tables(_table(), context=8192, end=32768)
    row = s.set_index("mode").loc["float32"]
    assert pd.isna(row["first_identical_position"]) and pd.isna(row["first_fast_neighbour_position"])
    # p * theta rounded to float32: at most half an ulp of 32768 * 1 rad = 2^-9 rad, plus theta's own rounding
    assert 0 < row["max_phase_error"] <= 32768 * 2 ** -24 + 2 ** -9
    assert set(curve["mode"]) == set(MODES)
    assert all(g["position"].is_monotonic_increasing and g["position"].max() == 32768 for _, g in curve.groupby("mode"))


def test_bf16_cos_sin_move_the_angle_by_their_rounding_only():
    s, _ = precision_tables(_table(), context=2048)
    row = s.set_index("mode").loc["float32 phases, bfloat16 cos/sin"]
    # cos and sin each rounded to 8 significant bits: the angle moves by at most ~2^-8 rad, at any position
    assert 1e-4 < row["max_phase_error"] < 2 ** -7 and pd.isna(row["first_fast_neighbour_position"])


def test_llama_cpps_phases_are_ggmls_running_product():
    rope = EngineRope("all", n_rot=64, base=100000.0)
    pos = np.array([0, 1, 255, 4097, 8191, 123457])
    got = phases(rope)(pos)
    s = np.float32(100000.0) ** np.float32(-2.0 / 64)
    for i, p in enumerate(pos):  # a scalar loop in float32, band by band, as ggml_rope_cache_init runs
        theta = np.float32(p)
        for j in range(32):
            assert got[i, j] == np.float32(np.float32(1.0) * theta), (p, j)
            theta = np.float32(theta * s)
    exact = pos[:, None] * engine_table(rope)[0][None, :]
    err = np.abs(got - exact)
    assert err.max() > 0 and err[pos < 8192].max() < 1e-2  # float32 noise, growing with the position


def test_the_engines_own_row_and_yarns_mix():
    rope = EngineRope("all", n_rot=64, base=100000.0, freq_scale=0.5, ext_factor=1.0, orig_ctx=8192)
    got = phases(rope)(np.array([1.0]))[0]
    # position 1: the phases are the frequencies, up to the running product's float32 rounding (~2^-24 per band)
    np.testing.assert_allclose(got, engine_table(rope)[0], rtol=32 * 2 ** -24)
    s, _ = precision_tables(_table(100000.0), context=8192, engine={"all": (engine_table(rope)[0], phases(rope))},
                            engine_name="llama.cpp")
    mine = s[s["mode"] == "llama.cpp (its own)"].iloc[0]
    assert pd.isna(mine["first_fast_neighbour_position"]) and mine["max_phase_error_in_context"] < 1e-2


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError, match="end >= context"):
        precision_tables(_table(), context=100, end=50)
    with pytest.raises(ValueError, match="unknown precision mode"):
        dtype_phases(np.ones(2), np.arange(3.0), "int8")
