"""posprobe/core/surgery.py against the papers' formulas (tests/paper_rules.py; issue #36's mutation testing).

Every preset builder is checked whole against a hand-built expectation: positions (values and float64), each
KeyView (rows, key positions, name), label and meta (they name the preset in every table and report), rotary
overrides from the published formulas (NTK-aware base change, YaRN's ramp, p-RoPE's removed bands, HF's linear
scaling), and the per-pair rules against per-(query, key) loops of the same formulas. `apply_plan`'s score edits are
checked against Hugging Face's own forward with the query projection scaled (temperature) and against the eviction
rule written as a loop. No expectation here is computed by posprobe.
"""

from __future__ import annotations

import math

import pytest
import torch
from hf_util import hf_of, independent_hf
from paper_rules import plan_relative, rope_of
from paper_rules import rerope as _rerope
from paper_rules import self_extend as _self_extend
from paper_rules import streaming as _streaming
from paper_rules import string as _string
from paper_rules import yarn_multiplier as _yarn_multiplier

from posprobe.backend.peek import WrongModelKind
from posprobe.core import surgery as S
from posprobe.core.positions import KeyView, PositionError, PositionPlan
from posprobe.rope import RotarySpec

F64 = torch.float64


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _assert_plan(plan: PositionPlan, q, k, *, label: str, meta: dict, views=(), rotary=None) -> None:
    """The whole plan equals the expectation: positions bit for bit in float64, views, label, meta, rotary."""
    assert plan.q_pos.dtype == F64 and plan.k_pos.dtype == F64
    assert torch.equal(plan.q_pos, _t(q)), plan.q_pos
    assert torch.equal(plan.k_pos, _t(k)), plan.k_pos
    assert plan.label == label
    assert dict(plan.meta) == meta
    assert len(plan.views) == len(views)
    for got, (rows, k_view, name) in zip(plan.views, views):
        assert got.queries.dtype == torch.bool and got.queries.tolist() == rows
        assert got.k_pos.dtype == F64 and torch.equal(got.k_pos, _t(k_view)), got.k_pos
        assert got.name == name
    assert (plan.rotary or None) == rotary
    assert plan.layers is None


# ---- position presets ----------------------------------------------------------------------------------------

def test_a_plan_needs_one_token_and_one_is_enough():
    with pytest.raises(PositionError, match="at least one token; got n=0"):
        S.shift(0, 1.0)
    _assert_plan(S.shift(1, 3.0), [3.0], [3.0], label="shift:3", meta={"preset": "shift", "k": 3.0})
    _assert_plan(S.position_interpolation(1, 2.0), [0.0], [0.0], label="pi:2", meta={"preset": "pi", "scale": 2.0})


def test_shift_and_query_only_shift_by_hand():
    _assert_plan(S.shift(3, 2.5), [2.5, 3.5, 4.5], [2.5, 3.5, 4.5], label="shift:2.5",
                 meta={"preset": "shift", "k": 2.5})
    _assert_plan(S.shift(3, 4.0, q_only=True), [4, 5, 6], [0, 1, 2], label="shift-q:4",
                 meta={"preset": "shift", "k": 4.0, "q_only": True})


def test_identity_plan_by_hand():
    _assert_plan(S.identity_plan(4), [0, 1, 2, 3], [0, 1, 2, 3], label="none", meta={})


def test_position_interpolation_by_hand_and_its_bounds():
    _assert_plan(S.position_interpolation(4, 4.0), [0, 0.25, 0.5, 0.75], [0, 0.25, 0.5, 0.75], label="pi:4",
                 meta={"preset": "pi", "scale": 4.0})
    _assert_plan(S.position_interpolation(2, 0.5), [0, 2], [0, 2], label="pi:0.5",
                 meta={"preset": "pi", "scale": 0.5})
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="scale must be > 0"):
            S.position_interpolation(3, bad)


def test_key_squish_cache_variant_by_hand():
    # Tokens 0..7, keys 2..4 squished to position 0; span queries read the span at its own positions.
    plan = S.key_squish(8, (2, 5))
    _assert_plan(plan, [0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 0, 0, 0, 5, 6, 7], label="squish-cache:to 0",
                 meta={"preset": "key_squish", "variant": "cache", "span": [2, 5], "squish": "to 0",
                       "query_start": 5.0},
                 views=[([False, False, True, True, True, False, False, False], [0, 1, 2, 3, 4, 5, 6, 7],
                         "span-sees-itself")])


def test_key_squish_keys_variant_with_a_moved_query_start_by_hand():
    plan = S.key_squish(7, (1, 3), to=-2.5, query_start=10.0, variant="keys")
    _assert_plan(plan, [0, 1, 2, 10, 11, 12, 13], [0, -2.5, -2.5, 10, 11, 12, 13], label="squish-keys:to -2.5",
                 meta={"preset": "key_squish", "variant": "keys", "span": [1, 3], "squish": "to -2.5",
                       "query_start": 10.0})


def test_key_squish_to_is_a_float64_position():
    plan = S.key_squish(4, (1, 3), to=0.1, variant="keys")  # 0.1 differs in float32
    assert plan.k_pos.tolist() == [0.0, 0.1, 0.1, 3.0]


def test_key_squish_range_is_linear_in_float64_and_wins_over_to():
    lo, hi = 0.1, 1000.3  # not exact in float32: a float32 ramp differs in the last bits
    plan = S.key_squish(9, (2, 9), to=5.0, range_=(lo, hi), variant="keys")
    want = [float(lo + (j - 2) * (hi - lo) / 6) for j in range(2, 9)]
    assert plan.k_pos[2:].tolist() == pytest.approx(want, rel=0, abs=1e-12)
    assert plan.k_pos[:2].tolist() == [0.0, 1.0] and plan.q_pos.tolist() == list(map(float, range(9)))
    assert plan.label == "squish-keys:range[0.1,1000.3]" and plan.meta["squish"] == "range[0.1,1000.3]"
    # one span token: the ramp is its low end (no division by zero)
    one = S.key_squish(3, (1, 2), range_=(7.0, 9.0), variant="keys")
    assert one.k_pos.tolist() == [0.0, 7.0, 2.0]
    # a span of two: its ends
    two = S.key_squish(4, (1, 3), range_=(-1.0, 3.0), variant="keys")
    assert two.k_pos.tolist() == [0.0, -1.0, 3.0, 3.0]


def test_key_squish_spans_at_the_edges_and_refusals():
    whole = S.key_squish(3, (0, 3), variant="keys")  # the whole sequence, from token 0 to the end
    assert whole.k_pos.tolist() == [0.0, 0.0, 0.0] and whole.meta["query_start"] == 3.0
    for span in ((-1, 2), (2, 2), (3, 2), (0, 4)):
        with pytest.raises(PositionError, match=r"must satisfy 0 <= start < end <= 3"):
            S.key_squish(3, span)
    with pytest.raises(ValueError, match="variant must be one of"):
        S.key_squish(3, (0, 1), variant="both")
    with pytest.raises(ValueError, match="give `to`"):
        S.key_squish(3, (0, 1), to=None)
    assert S.key_squish(3, (0, 1), to=None, range_=(1.0, 2.0)).k_pos[0] == 1.0


# ---- per-query relative rules (Self-Extend, ReRoPE, STRING, StreamingLLM) -----------------------------------

def _relative(plan: PositionPlan) -> list[list[float]]:
    """rel[i][j] = q_i - k_j for j <= i, each query through the last view listing it."""
    rel = plan_relative(plan.q_pos, plan.k_pos, plan.views)
    return [rel[i, :i + 1].tolist() for i in range(len(plan))]


@pytest.mark.parametrize("g,w", [(2, 4), (3, 5), (1, 3), (4, 1)])
def test_self_extend_relative_positions_are_the_papers(g, w):
    n = 14
    plan = S.self_extend(n, g, w)
    assert _relative(plan) == [[float(_self_extend(i, j, g, w)) for j in range(i + 1)] for i in range(n)]
    assert plan.label == f"self-extend:G{g},W{w}" and dict(plan.meta) == {"preset": "self_extend", "group": g,
                                                                          "window": w}
    assert [v.name for v in plan.views] == [f"q{i}" for i in range(w, n)]  # one view per query from W on
    assert all(v.queries.dtype == torch.bool and v.k_pos.dtype == F64 for v in plan.views)
    assert plan.q_pos.tolist() == plan.k_pos.tolist() == list(map(float, range(n)))
    rule = S.self_extend_pairs(g, w)
    i = torch.arange(n, dtype=F64)
    rel = rule.relative(i, i)
    assert all(rel[a, b].item() == _self_extend(a, b, g, w) for a in range(n) for b in range(a + 1))
    assert rule.label == plan.label and rule.meta == dict(plan.meta)


@pytest.mark.parametrize("w", [1, 3, 6])
def test_rerope_relative_positions_are_the_papers(w):
    n = 11
    plan = S.rerope(n, w)
    assert _relative(plan) == [[float(_rerope(i, j, w)) for j in range(i + 1)] for i in range(n)]
    assert plan.label == f"rerope:{w}" and dict(plan.meta) == {"preset": "rerope", "window": w}
    assert [v.name for v in plan.views] == [f"q{i}" for i in range(w + 1, n)]
    rule = S.rerope_pairs(w)
    i = torch.arange(n, dtype=F64)
    rel = rule.relative(i, i)
    assert all(rel[a, b].item() == _rerope(a, b, w) for a in range(n) for b in range(a + 1))
    assert rule.label == plan.label and rule.meta == dict(plan.meta)


@pytest.mark.parametrize("s,w", [(5, 2), (4, 0), (3, 3), (1, 1)])
def test_string_relative_positions_are_the_papers(s, w):
    n = 12
    plan = S.string(n, s, w)
    assert _relative(plan) == [[float(_string(i, j, s, w)) for j in range(i + 1)] for i in range(n)]
    assert plan.label == f"string:S{s},W{w}" and dict(plan.meta) == {"preset": "string", "offset": s, "window": w}
    assert [v.name for v in plan.views] == [f"q{i}" for i in range(s, n)]
    rule = S.string_pairs(s, w)
    i = torch.arange(n, dtype=F64)
    rel = rule.relative(i, i)
    assert all(rel[a, b].item() == _string(a, b, s, w) for a in range(n) for b in range(a + 1))
    assert rule.label == plan.label and rule.meta == dict(plan.meta)
    assert S.string_pairs(200).meta == {"preset": "string", "offset": 200, "window": 128}  # W defaults to 128
    assert S.string(3, 200).meta == {"preset": "string", "offset": 200, "window": 128}


@pytest.mark.parametrize("offset,window", [(0, 0), (-1, 0), (3, -1), (3, 4)])
def test_string_refuses_an_offset_below_one_or_a_window_outside_0_to_offset(offset, window):
    for build in (lambda: S.string(10, offset, window), lambda: S.string_pairs(offset, window)):
        with pytest.raises(ValueError, match="STRING needs offset >= 1 and 0 <= window <= offset"):
            build()


@pytest.mark.parametrize("sink,w", [(2, 3), (0, 4), (1, 1), (3, 2)])
def test_streaming_relative_positions_and_eviction_are_the_papers(sink, w):
    n = 12
    plan = S.streaming(n, sink, w)
    assert dict(plan.meta) == {"preset": "streaming", "sink": sink, "window": w, "keep": [sink, w]}
    assert plan.label == f"streaming:S{sink},W{w}"
    assert [v.name for v in plan.views] == [f"q{i}" for i in range(sink + w, n)]
    rel = _relative(plan)
    for i in range(n):
        for j in range(i + 1):
            want = _streaming(i, j, sink, w)
            if want is not None:  # kept keys at the paper's cache positions
                assert rel[i][j] == want, (i, j)
    idx = torch.arange(n)
    gone = S.evicted(idx, idx, sink, w)
    assert gone.dtype == torch.bool and gone.shape == (n, n)
    assert gone.tolist() == [[sink <= j <= i - w for j in range(n)] for i in range(n)]
    rule = S.streaming_pairs(sink, w)
    r = rule.relative(idx.to(F64), idx.to(F64))
    for i in range(n):
        for j in range(i + 1):
            want = _streaming(i, j, sink, w)
            assert (math.isnan(r[i, j].item()) if want is None else r[i, j].item() == want), (i, j)
    assert rule.label == plan.label and rule.meta == {"preset": "streaming", "sink": sink, "window": w}


def test_window_and_group_bounds():
    for bad in ((0, 2), (2, 0)):
        for build in (S.self_extend, lambda n, g, w: S.self_extend_pairs(g, w)):
            with pytest.raises(ValueError, match="group and window must be >= 1"):
                build(5, *bad)
    assert len(S.self_extend(3, 1, 1).views) == 2  # 1 and 1 are allowed
    for build in (lambda: S.rerope(5, 0), lambda: S.rerope_pairs(0)):
        with pytest.raises(ValueError, match="window must be >= 1"):
            build()
    assert S.rerope_pairs(1).label == "rerope:1"
    for bad in ((-1, 2), (0, 0)):
        for build in (lambda: S.streaming(5, *bad), lambda: S.streaming_pairs(*bad)):
            with pytest.raises(ValueError, match="need sink >= 0 and window >= 1"):
                build()
    assert S.streaming_pairs(0, 1).meta["sink"] == 0


def test_per_query_plan_views_start_at_first_and_move_keys_only():
    plan = S.per_query_plan(4, lambda i, j: (i - j) * 2.0, "double", {"preset": "x"}, first=2)
    _assert_plan(plan, [0, 1, 2, 3], [0, 1, 2, 3], label="double", meta={"preset": "x"},
                 views=[([False, False, True, False], [-2, 0, 2, 4], "q2"),
                        ([False, False, False, True], [-3, -1, 1, 3], "q3")])


# ---- pairwise rules by hand ------------------------------------------------------------------------------------

def test_position_only_pair_rules_by_hand():
    i = torch.tensor([3.0, 5.0], dtype=F64)
    j = torch.tensor([0.0, 1.0, 4.0], dtype=F64)
    pi = S.pi_pairs(4.0)
    assert pi.relative(i, j).tolist() == [[0.75, 0.5, -0.25], [1.25, 1.0, 0.25]]
    assert [f(torch.tensor([2.0], dtype=F64)).item() for f in pi.views[0]] == [0.5, 0.5]
    assert pi.label == "pi:4" and pi.meta == {"preset": "pi", "scale": 4.0} and pi.select is None
    sh = S.shift_pairs(7.0)
    assert [f(torch.tensor([2.0], dtype=F64)).item() for f in sh.views[0]] == [9.0, 9.0]
    assert sh.label == "shift:7" and sh.meta == {"preset": "shift", "k": 7.0}
    for bad in (0.0, -2.0):
        for build in (S.pi_pairs, S.ntk_pairs, lambda s: S.yarn_pairs(s, 16)):
            with pytest.raises(ValueError, match="scale must be > 0"):
                build(bad)
    for build in (S.pi_pairs, S.ntk_pairs, lambda s: S.yarn_pairs(s, 16)):
        assert build(0.5).meta["scale"] == 0.5  # compression below one is a valid scale
    none = S.identity_pairs()
    assert none.identity and none.label == "none" and none.meta == {"preset": "none"}
    assert none.relative(i, j).tolist() == [[3.0, 2.0, -1.0], [5.0, 4.0, 1.0]]
    assert not S.pi_pairs(2.0).identity and S.pi_pairs(2.0).score_scale == 1.0


def test_pair_rule_relative_selects_views_and_marks_dropped_pairs_nan():
    rule = S.PairRule("t", ((lambda p: p, lambda p: p), (lambda p: p * 0 + 10.0, lambda p: p * 0)),
                      select=lambda i, j: torch.tensor([[0, 1], [-1, 1]]))
    i = torch.tensor([2, 3])  # integer input: relative works in float64
    got = rule.relative(i, torch.tensor([0, 1]))
    assert got.dtype == F64
    assert got[0].tolist() == [2.0, 10.0] and math.isnan(got[1, 0].item()) and got[1, 1].item() == 10.0
    assert S.PairRule("u").relative(torch.tensor([1.5]), torch.tensor([0.25])).tolist() == [[1.25]]
    ints = S.PairRule("u").relative(torch.tensor([3]), torch.tensor([1]))  # integer indices: float64 positions
    assert ints.dtype == F64 and ints.tolist() == [[2.0]]


def test_plan_pairs_reads_the_plan_and_its_views_by_hand():
    plan = S.key_squish(6, (1, 3))  # cache: queries 1, 2 read keys at their own positions
    rule = S.plan_pairs(plan)
    i = torch.arange(6, dtype=F64)
    rel = rule.relative(i, i)
    k = [0, 0, 0, 3, 4, 5]
    for a in range(6):
        for b in range(a + 1):
            want = a - b if a in (1, 2) else a - k[b]
            assert rel[a, b].item() == want, (a, b)
    assert rule.label == plan.label and rule.meta == dict(plan.meta)  # the plan's own preset names it
    assert S.plan_pairs(PositionPlan.default(2)).meta == {"preset": "plan"}
    plain = S.plan_pairs(S.position_interpolation(4, 2.0))
    assert plain.select is None and len(plain.views) == 1
    assert plain.relative(i[:4], i[:4])[3].tolist() == [1.5, 1.0, 0.5, 0.0]
    # two views listing the same query: the last wins, as in rope_positions
    rows = torch.tensor([False, True, True])
    two = PositionPlan(_t([0, 1, 2]), _t([0, 1, 2]), views=(KeyView(rows, _t([5, 5, 5]), "a"),
                                                           KeyView(torch.tensor([False, False, True]),
                                                                   _t([9, 9, 9]), "b")))
    r = S.plan_pairs(two).relative(_t([0, 1, 2]), _t([0, 1, 2]))
    assert r[1, 0].item() == 1 - 5 and r[2, 0].item() == 2 - 9 and r[0, 0].item() == 0


def test_plan_pairs_refusals():
    base = PositionPlan.default(3)
    for plan in (PositionPlan(base.q_pos, base.k_pos, layers=frozenset({0})),
                 PositionPlan(base.q_pos, base.k_pos, rotary={0: RotarySpec(4, 10.0)})):
        with pytest.raises(ValueError, match="limits layers or overrides frequencies"):
            S.plan_pairs(plan)
    batched = PositionPlan(base.q_pos.repeat(2, 1), base.k_pos.repeat(2, 1))
    with pytest.raises(ValueError, match=r"is batched \(\(2, 3\)\)"):
        S.plan_pairs(batched)


# ---- rotary overrides from the published formulas ------------------------------------------------------------

SPEC = RotarySpec(rotary_dim=8, base=10000.0)


def test_ntk_base_change_by_hand():
    assert S.ntk_rotary(SPEC, 2.0) == RotarySpec(8, 10000.0 * 2.0 ** (8 / 6))
    rule = S.ntk_pairs(3.0)
    assert rule.rotary(SPEC) == RotarySpec(8, 10000.0 * 3.0 ** (8 / 6))
    assert rule.label == "ntk:3" and rule.meta == {"preset": "ntk", "scale": 3.0} and len(rule.views) == 1


@pytest.mark.parametrize("s,L,fast,slow", [(4.0, 64, 32.0, 1.0), (2.0, 1000, 8.0, 2.0), (8.0, 5, 32.0, 1.0)])
def test_yarn_factors_are_the_papers_ramp(s, L, fast, slow):
    want = tuple(_yarn_multiplier(b, 8, 10000.0, s, L, fast, slow) for b in range(4))
    got = S.yarn_factors(SPEC, s, L, fast, slow)
    assert got == pytest.approx(want, rel=1e-13, abs=0)
    assert len({round(x, 9) for x in got}) > 1 or L < 2 * math.pi  # flat only where every band is interpolated
    # a layer that already scales its bands (or drops one) keeps that and gets the ramp on top of its raw bands
    pre = RotarySpec(8, 10000.0, freq_scale=(2.0, 1.0, 0.5, 1.0), removed=frozenset({0}))
    got = S.yarn_rotary(pre, s, L, fast, slow)
    assert got.freq_scale == pytest.approx(tuple(p * w for p, w in zip(pre.freq_scale, want)), rel=1e-13, abs=0)
    assert got.removed == frozenset({0}) and got.base == 10000.0
    assert S.yarn_rotary(SPEC, s, L, fast, slow).freq_scale == pytest.approx(want, rel=1e-13, abs=0)


@pytest.mark.parametrize("L", [10, 205])  # band 0's r = L / 2pi: 1.59 (just above beta_slow) / 32.6 (above beta_fast)
def test_yarn_defaults_are_the_papers_alpha_1_beta_32(L):
    want = tuple(_yarn_multiplier(b, 8, 1e4, 4.0, L, 32.0, 1.0) for b in range(4))
    assert S.yarn_factors(SPEC, 4.0, L) == pytest.approx(want, rel=1e-13, abs=0)
    assert S.yarn_rotary(SPEC, 4.0, L).freq_scale == pytest.approx(want, rel=1e-13, abs=0)


def test_yarn_ramp_edges_by_hand():
    # r = L / lambda exactly at beta_slow / beta_fast: gamma 0 / 1 (no interpolation / full interpolation)
    lam0 = 2 * math.pi  # band 0's wavelength at any base
    assert S.yarn_factors(RotarySpec(2, 10.0), 4.0, 1, beta_fast=32.0, beta_slow=1 / lam0)[0] == pytest.approx(4.0)
    assert S.yarn_factors(RotarySpec(2, 10.0), 4.0, 1, beta_fast=1 / lam0, beta_slow=0.0)[0] == pytest.approx(1.0)
    assert S.yarn_factors(RotarySpec(2, 10.0), 4.0, 1)[0] == 4.0  # r = 0.159 < 1: interpolated by s


def test_yarn_temperature_by_hand():
    assert S.yarn_score_scale(4.0) == pytest.approx((0.1 * math.log(4.0) + 1) ** 2, rel=1e-15)
    assert S.yarn_score_scale(1.0) == 1.0 and S.yarn_score_scale(0.5) == 1.0
    assert S.yarn_score_scale(1.5) == pytest.approx((0.1 * math.log(1.5) + 1) ** 2, rel=1e-15)
    rule = S.yarn_pairs(4.0, 64)
    assert rule.score_scale == pytest.approx(1.0 + 0.2 * math.log(4.0) + 0.01 * math.log(4.0) ** 2, rel=1e-15)
    assert rule.rotary(SPEC).freq_scale == pytest.approx([_yarn_multiplier(b, 8, 1e4, 4.0, 64, 32.0, 1.0)
                                                          for b in range(4)], rel=1e-13)
    assert rule.label == "yarn:4" and rule.meta == {"preset": "yarn", "scale": 4.0, "original_ctx": 64,
                                                    "beta_fast": 32.0, "beta_slow": 1.0}
    custom = S.yarn_pairs(2.0, 100, beta_fast=8.0, beta_slow=2.0)
    assert custom.rotary(SPEC).freq_scale == pytest.approx([_yarn_multiplier(b, 8, 1e4, 2.0, 100, 8.0, 2.0)
                                                            for b in range(4)], rel=1e-13)


def test_drop_and_p_rope_bands_by_hand():
    assert S.drop_rotary(SPEC, 1, 2).removed == frozenset({0, 1, 3})  # band 0 fastest, band 3 slowest
    assert S.drop_rotary(SPEC, 4, 0).removed == frozenset({0, 1, 2, 3})
    assert S.drop_rotary(SPEC, 0, 0) == SPEC
    assert S.drop_rotary(RotarySpec(8, 1e4, removed=frozenset({1})), 1, 0).removed == frozenset({1, 3})
    for lowest, highest in ((-1, 0), (0, -1), (3, 2), (5, 0)):
        with pytest.raises(ValueError, match=f"cannot drop {lowest} \\+ {highest} of 4 bands"):
            S.drop_rotary(SPEC, lowest, highest)
    assert S.p_rope_rotary(SPEC, 0.25).removed == frozenset({1, 2, 3})  # keep the fastest quarter
    assert S.p_rope_rotary(SPEC, 1.0).removed == frozenset()
    assert S.p_rope_rotary(SPEC, 0.0).removed == frozenset({0, 1, 2, 3})
    for bad in (-0.1, 1.1):
        for build in (lambda p: S.p_rope_rotary(SPEC, p), S.p_rope_pairs):
            with pytest.raises(ValueError, match="p must be in \\[0, 1\\]"):
                build(bad)
    for p, gone in ((0.0, {0, 1, 2, 3}), (1.0, set())):  # both ends of [0, 1] are valid
        assert S.p_rope_pairs(p).rotary(SPEC).removed == frozenset(gone)
    rule = S.p_rope_pairs(0.5)
    assert rule.rotary(SPEC).removed == frozenset({2, 3})
    assert rule.label == "p-rope:0.5" and rule.meta == {"preset": "p_rope", "p": 0.5}
    drop = S.drop_pairs(1, 1)
    assert drop.rotary(SPEC).removed == frozenset({0, 3})
    assert drop.label == "drop:low1,high1" and drop.meta == {"preset": "drop_frequencies", "lowest": 1,
                                                             "highest": 1}


# ---- presets on a model: every rotary layer, HF's own scaling ---------------------------------------------------

def _hf_spec(model, layer):
    """The layer's rotation read from HF's config (no posprobe): rotary dims = head dim, base = rope_theta."""
    theta, d = rope_of(hf_of(model).config)
    return RotarySpec(d, theta)


def test_model_presets_override_every_rotary_layer_by_hand(tiny_rope):
    n = 5
    specs = {l: _hf_spec(tiny_rope, l) for l in range(hf_of(tiny_rope).config.num_hidden_layers)}
    d = specs[0].rotary_dim
    pos = list(range(n))
    _assert_plan(S.ntk_aware(tiny_rope, n, 2.0), pos, pos, label="ntk:2", meta={"preset": "ntk", "scale": 2.0},
                 rotary={l: RotarySpec(d, s.base * 2.0 ** (d / (d - 2))) for l, s in specs.items()})
    plan = S.yarn(tiny_rope, n, 4.0, 16, beta_fast=16.0, beta_slow=2.0)
    want = tuple(_yarn_multiplier(b, d, specs[0].base, 4.0, 16, 16.0, 2.0) for b in range(d // 2))
    assert set(plan.rotary) == set(specs)
    for spec in plan.rotary.values():
        assert spec.freq_scale == pytest.approx(want, rel=1e-13, abs=0) and spec.base == specs[0].base
    assert plan.label == "yarn:4" and plan.meta == {"preset": "yarn", "scale": 4.0, "original_ctx": 16,
                                                    "beta_fast": 16.0, "beta_slow": 2.0,
                                                    "score_scale": (0.1 * math.log(4.0) + 1) ** 2}
    assert plan.q_pos.tolist() == plan.k_pos.tolist() == list(map(float, pos))
    _assert_plan(S.drop_frequencies(tiny_rope, n, lowest=2, highest=1), pos, pos, label="drop:low2,high1",
                 meta={"preset": "drop_frequencies", "lowest": 2, "highest": 1},
                 rotary={l: RotarySpec(d, s.base, removed=frozenset({0, d // 2 - 2, d // 2 - 1}))
                         for l, s in specs.items()})
    bands = d // 2
    _assert_plan(S.p_rope(tiny_rope, n, 0.25), pos, pos, label="p-rope:0.25",
                 meta={"preset": "p_rope", "p": 0.25, "lowest": round(0.75 * bands), "highest": 0},
                 rotary={l: RotarySpec(d, s.base, removed=frozenset(range(bands - round(0.75 * bands), bands)))
                         for l, s in specs.items()})
    for bad in (-0.5, 1.5):
        with pytest.raises(ValueError, match="p must be in"):
            S.p_rope(tiny_rope, n, bad)
    assert S.p_rope(tiny_rope, n, 0.0).rotary[0].removed == frozenset(range(bands))
    assert S.p_rope(tiny_rope, n, 1.0).rotary[0].removed == frozenset()
    assert S.drop_frequencies(tiny_rope, n, highest=1).meta == {"preset": "drop_frequencies", "lowest": 0,
                                                                "highest": 1}
    assert S.drop_frequencies(tiny_rope, n).label == "drop:low0,high0"
    for build in (S.ntk_aware, lambda m, n, s: S.yarn(m, n, s, 16)):
        for bad in (0.0, -1.0):
            with pytest.raises(ValueError, match="scale must be > 0"):
                build(tiny_rope, n, bad)


def test_hf_linear_scaling_plan_is_hfs_own_table(tiny_rope):
    # HF's "linear" rope type divides every inverse frequency by the factor: angle = (pos / factor) * inv_freq
    from posprobe.rope import angular_frequency

    n = 6
    plan = S.hf_scaled(tiny_rope, n, {"rope_type": "linear", "factor": 2.0})
    spec0 = _hf_spec(tiny_rope, 0)
    want = [1.0 / spec0.base ** (2 * b / spec0.rotary_dim) / 2.0 for b in range(spec0.n_bands)]
    assert set(plan.rotary) == {0, 1}
    for spec in plan.rotary.values():
        assert angular_frequency(spec) == pytest.approx(want, rel=1e-6)
    assert plan.label == "hf-linear" and plan.meta == {"preset": "hf-linear", "rope_type": "linear", "factor": 2.0}
    assert plan.q_pos.tolist() == list(map(float, range(n)))
    rule = S.hf_scaled_pairs({"rope_type": "linear", "factor": 2.0})
    assert rule.hf_rope == (("factor", 2.0), ("rope_type", "linear")) and rule.label == "hf-linear"
    assert rule.meta == {"preset": "hf-linear", "rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("build,what", [
    (lambda m: S.ntk_aware(m, 4, 2.0), "Frequency surgery"),
    (lambda m: S.yarn(m, 4, 2.0, 16), "Frequency surgery"),
    (lambda m: S.drop_frequencies(m, 4, lowest=1), "Frequency surgery"),
    (lambda m: S.hf_scaled(m, 4, {"rope_type": "linear", "factor": 2.0}), "Hugging Face rope scaling"),
])
def test_frequency_presets_refuse_a_learned_position_model_naming_the_surgery(tiny_ape, build, what):
    with pytest.raises(WrongModelKind, match=f"^{what} needs a RoPE model"):
        build(tiny_ape)


# ---- apply_plan's score edits against HF's own forward -----------------------------------------------------------

def _hf_logits_with_q_scaled(model, ids, factors: dict[int, float]) -> torch.Tensor:
    """HF's forward on an independent copy of the weights with layer l's q_proj (bias included) times factors[l]:
    every score of that layer times the factor, a temperature on the pre-softmax scores. The copy shares no tensor
    with the bridge (plain_hf_model only unwraps TransformerLens's modules)."""
    from posprobe.backend.bridge import plain_hf_model

    ref = independent_hf(plain_hf_model(model))
    with torch.no_grad():
        for layer, f in factors.items():
            q_proj = ref.model.layers[layer].self_attn.q_proj
            q_proj.weight.mul_(f)
            if q_proj.bias is not None:  # the tiny model's attention has biases
                q_proj.bias.mul_(f)
        return ref(ids).logits


@pytest.mark.parametrize("layers", [None, frozenset({1})])
def test_apply_plan_score_scale_equals_hf_with_scaled_queries(tiny_rope, layers):
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(12, dtype=F64)
    plan = PositionPlan(pos, pos.clone(), layers=layers, meta={"score_scale": 1.7})
    with torch.no_grad(), S.apply_plan(tiny_rope, plan) as used:
        got = tiny_rope(ids)
    assert used is plan
    want = _hf_logits_with_q_scaled(tiny_rope, ids, {l: 1.7 for l in (layers or (0, 1))})
    plain = _hf_logits_with_q_scaled(tiny_rope, ids, {})
    assert (got - want).abs().max() <= 1e-5  # float32, CPU
    assert (got - plain).abs().max() > 1e-3  # the temperature moved the logits: the check is not vacuous


def test_apply_plan_eviction_masks_exactly_the_papers_evicted_keys(tiny_rope):
    n, sink, window = 10, 2, 3
    ids = torch.randint(0, 200, (1, n), generator=torch.Generator().manual_seed(4))
    plan = S.streaming(n, sink, window)
    seen = {}

    def keep(pattern, hook):
        seen[hook.name] = pattern.detach().clone()

    from posprobe.backend.hooks import hook_name

    names = [hook_name("pattern", l) for l in range(2)]
    with torch.no_grad(), S.apply_plan(tiny_rope, plan):
        tiny_rope.run_with_hooks(ids, fwd_hooks=[(nm, keep) for nm in names])
    for nm in names:
        p = seen[nm][0]  # head query key
        for i in range(n):
            for j in range(n):
                dropped = j > i or sink <= j <= i - window
                assert (p[:, i, j] == 0).all() if dropped else (p[:, i, j] > 0).all(), (nm, i, j)
        assert torch.allclose(p.sum(-1), torch.ones_like(p.sum(-1)), atol=1e-6)


def test_frequency_presets_change_each_layer_from_its_own_base():
    # Gemma 3 rotates sliding layers with base 1e4 and full layers with 1e6 (HF's rope_parameters per layer type):
    # a preset must start from each layer's own rotation, not one layer's for all.
    from families import tiny_family

    bridge, ref = tiny_family("gemma3")
    bases = [ref.config.rope_parameters[t]["rope_theta"] for t in ref.config.layer_types]
    assert len(set(bases)) == 2
    d = ref.config.head_dim
    ntk = S.ntk_aware(bridge, 4, 2.0)
    assert {l: s.base for l, s in ntk.rotary.items()} == pytest.approx(
        {l: b * 2.0 ** (d / (d - 2)) for l, b in enumerate(bases)}, rel=1e-15)
    hf = S.hf_scaled(bridge, 4, {"rope_type": "linear", "factor": 2.0})
    from posprobe.rope import angular_frequency

    for layer, base in enumerate(bases):
        want = [1.0 / base ** (2 * b / d) / 2.0 for b in range(d // 2)]
        assert angular_frequency(hf.rotary[layer]) == pytest.approx(want, rel=1e-6), layer
