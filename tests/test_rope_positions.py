"""RoPE maths and position-control identities (ARCHITECTURE.md), against plain-torch computations."""

from __future__ import annotations

import math

import pytest
import torch
from hf_util import complex_rotate, hf_of, masked

from posprobe.backend.facts import WrongModelKind
from posprobe.backend.hooks import hook_name, hooked, live_hook_count
from posprobe.core.positions import (
    KeyView,
    PositionError,
    PositionPlan,
    learned_positions,
    rope_positions,
    shifted_plan,
)
from posprobe.rope import RotarySpec, band_contributions, rotate, wavelength

TEXT = "The quick brown fox jumps over the lazy dog near the river bank."


def _complex_rotate(x: torch.Tensor, pos: torch.Tensor, base: float, adjacent: bool) -> torch.Tensor:
    # Independent formulation (tests/hf_util.complex_rotate): each band a complex number times exp(i * pos * theta_b).
    return complex_rotate(x, pos, RotarySpec(rotary_dim=x.shape[-1], base=base, adjacent=adjacent))


@pytest.mark.parametrize("adjacent", [False, True])
def test_rotate_matches_complex_multiplication(adjacent):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, generator=g)
    pos = torch.tensor([0.0, 1.0, 2.5, 100.0, -3.0], dtype=torch.float64)
    spec = RotarySpec(rotary_dim=8, base=10000.0, adjacent=adjacent)
    torch.testing.assert_close(rotate(x, pos, spec), _complex_rotate(x, pos, 10000.0, adjacent), atol=1e-12, rtol=0)


def test_rotations_compose_and_partial_dims_pass_through():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 2, 12, dtype=torch.float64, generator=g)
    spec = RotarySpec(rotary_dim=8, base=500.0)
    a, b = torch.tensor([1.0, 7.0, 30.0, 2.0]), torch.tensor([3.0, -2.0, 11.5, 0.0])
    torch.testing.assert_close(rotate(rotate(x, a, spec), b, spec), rotate(x, a + b, spec), atol=1e-12, rtol=0)
    assert torch.equal(rotate(x, a, spec)[..., 8:], x[..., 8:])


def test_band_scores_sum_to_rotated_dot_product_and_depend_on_relative_position():
    g = torch.Generator().manual_seed(2)
    q, k = (
        torch.randn(1, 6, 2, 8, dtype=torch.float64, generator=g),
        torch.randn(1, 6, 2, 8, dtype=torch.float64, generator=g),
    )
    spec = RotarySpec(rotary_dim=8, base=100.0)
    pos = torch.arange(6, dtype=torch.float64)
    qr, kr = rotate(q, pos, spec), rotate(k, pos, spec)
    full = torch.einsum("bqhd,bkhd->bhqk", qr, kr) / 2.0
    bands, rest = band_contributions(qr, kr, spec, 2.0)
    torch.testing.assert_close(bands.sum(2) + rest, full, atol=1e-12, rtol=0)
    shifted = torch.einsum("bqhd,bkhd->bhqk", rotate(q, pos + 50, spec), rotate(k, pos + 50, spec)) / 2.0
    torch.testing.assert_close(shifted, full, atol=1e-10, rtol=0)
    assert wavelength(spec)[0] == pytest.approx(2 * math.pi)


def test_default_plan_is_bit_equal_to_no_surgery(tiny_rope):
    toks = tiny_rope.to_tokens(TEXT)
    base = tiny_rope(toks)
    with rope_positions(tiny_rope, PositionPlan.default(toks.shape[1])):
        out = tiny_rope(toks)
    assert torch.equal(out, base)


def test_common_shift_is_invariant_and_query_only_shift_is_not(tiny_rope, tiny_rope64):
    toks = tiny_rope.to_tokens(TEXT)
    n = toks.shape[1]
    base = tiny_rope(toks)
    with rope_positions(tiny_rope, shifted_plan(n, 100)):
        shifted = tiny_rope(toks)
    assert (shifted - base).abs().max() <= 1e-4
    with rope_positions(tiny_rope, shifted_plan(n, 100, q_only=True)):
        q_only = tiny_rope(toks)
    assert (q_only - base).abs().max() > 1e-2
    base64 = tiny_rope64(toks)
    # Not 1e-10: HF (the bridge) computes RoPE angles and RMSNorm in float32 even for float64 weights, so at
    # position ~12k the angles carry float32 rounding (measured 1.3e-4 on the logits; the q-only shift moves
    # them >1e-2).
    with rope_positions(tiny_rope64, shifted_plan(n, 12345.5)):
        assert (tiny_rope64(toks) - base64).abs().max() <= 1e-3


def test_plan_scores_match_plain_torch_rotation(tiny_rope64):
    """Scores under an arbitrary plan equal q.k of hook_q/hook_k rotated independently."""
    model = tiny_rope64
    toks = model.to_tokens(TEXT)
    n = toks.shape[1]
    g = torch.Generator().manual_seed(3)
    q_pos, k_pos = (
        torch.rand(n, generator=g, dtype=torch.float64) * 50,
        torch.rand(n, generator=g, dtype=torch.float64) * 50,
    )
    seen = {}
    hooks = [(hook_name(p, 1), lambda x, hook, p=p: seen.__setitem__(p, x.clone())) for p in ("q", "k", "scores")]
    with rope_positions(model, PositionPlan(q_pos, k_pos)), hooked(model, hooks):
        model(toks)
    q = _complex_rotate(seen["q"], q_pos, 10000.0, False)
    k = _complex_rotate(seen["k"], k_pos, 10000.0, False).repeat_interleave(2, dim=2)
    expected = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(16)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    # atol 1e-5, not 1e-10: the model's own rotation (HF, replayed by posprobe) takes float32 angles whatever
    # the dtype (measured 3.2e-6 at positions up to 50); the reference rotates in float64.
    torch.testing.assert_close(seen["scores"][..., causal], expected[..., causal], atol=1e-5, rtol=0)
    assert masked(seen["scores"][..., ~causal]).all()


def test_key_view_changes_only_selected_query_rows(tiny_rope64):
    model = tiny_rope64
    toks = model.to_tokens(TEXT)
    n = toks.shape[1]
    plain = {}
    with hooked(model, [(hook_name("scores", 0), lambda x, hook: plain.__setitem__("s", x.clone()))]):
        model(toks)
    rows = torch.zeros(n, dtype=torch.bool)
    rows[6:] = True
    squished = torch.arange(n, dtype=torch.float64)
    squished[:6] = 0.0
    default = torch.arange(n, dtype=torch.float64)
    plan = PositionPlan(default, default.clone(), views=(KeyView(rows, squished, "cache"),))
    got = {}
    with (
        rope_positions(model, plan),
        hooked(model, [(hook_name("scores", 0), lambda x, hook: got.__setitem__("s", x.clone()))]),
    ):
        model(toks)
    torch.testing.assert_close(got["s"][:, :, :6], plain["s"][:, :, :6], atol=1e-12, rtol=0)
    assert (got["s"][:, :, 6:, :6] - plain["s"][:, :, 6:, :6]).abs().max() > 1e-3


def test_generation_with_kv_cache_under_a_plan_matches_full_forward(tiny_rope):
    from posprobe.backend.model import forward_cached, new_kv_cache

    toks = tiny_rope.to_tokens(TEXT)
    n = toks.shape[1]
    plan = PositionPlan(torch.arange(n) * 0.5 + 3, torch.arange(n) * 0.5 + 3)
    with rope_positions(tiny_rope, plan):
        full = tiny_rope(toks)
        cache = new_kv_cache(tiny_rope, 1)
        parts = [forward_cached(tiny_rope, toks[:, :7], cache)]
        parts += [forward_cached(tiny_rope, toks[:, i : i + 1], cache) for i in range(7, n)]
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5


def test_plan_errors(tiny_rope, tiny_ape):
    toks = tiny_rope.to_tokens(TEXT)
    with pytest.raises(PositionError, match=r"covers 5 tokens but the sequence has"):
        with rope_positions(tiny_rope, PositionPlan.default(5)):
            tiny_rope(toks)
    assert live_hook_count(tiny_rope) == 0
    with pytest.raises(WrongModelKind, match="needs a RoPE model"):
        with rope_positions(tiny_ape, PositionPlan.default(5)):
            pass
    with pytest.raises(PositionError, match="shape"):
        PositionPlan(torch.zeros(3), torch.zeros(4))


def test_learned_shift_zero_is_bit_equal_and_shift_matches_manual_embedding(tiny_ape):
    toks = tiny_ape.to_tokens(TEXT)
    n = toks.shape[1]
    base = tiny_ape(toks)
    with learned_positions(tiny_ape, torch.arange(n)):
        assert torch.equal(tiny_ape(toks), base)
    k = 40
    with learned_positions(tiny_ape, torch.arange(n) + k):
        shifted = tiny_ape(toks)
    # Independent: the wrapped HF GPT-2 given the shifted position ids itself.
    manual = hf_of(tiny_ape)(toks, position_ids=torch.arange(n)[None] + k).logits
    torch.testing.assert_close(shifted, manual, atol=1e-5, rtol=0)
    assert (shifted - base).abs().max() > 1e-3


def test_learned_positions_past_context_raise_before_any_forward(tiny_ape, tiny_rope):
    calls = []
    toks = tiny_ape.to_tokens(TEXT)
    n = toks.shape[1]
    with hooked(tiny_ape, [("hook_embed", lambda x, hook: calls.append(1))]):
        with pytest.raises(PositionError, match=r"past the model's context.*n_ctx=256"):
            with learned_positions(tiny_ape, torch.arange(n) + 256 - n + 1):
                tiny_ape(toks)
        with pytest.raises(PositionError, match=">= 0"):
            with learned_positions(tiny_ape, torch.arange(n) - 1):
                tiny_ape(toks)
    assert calls == []
    with pytest.raises(WrongModelKind):
        with learned_positions(tiny_rope, torch.arange(3)):
            pass


def test_hooks_removed_on_error(tiny_rope, tiny_ape):
    toks = tiny_rope.to_tokens(TEXT)
    with pytest.raises(RuntimeError, match="boom"):
        with rope_positions(tiny_rope, shifted_plan(toks.shape[1], 3)):
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        with learned_positions(tiny_ape, torch.arange(4)):
            raise RuntimeError("boom")
    assert live_hook_count(tiny_rope) == 0 and live_hook_count(tiny_ape) == 0
