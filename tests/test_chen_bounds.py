"""Chen et al.'s Theorem 2.1 per head (issue 51): the frequency pass's h_j, a(s) and bounds against Hugging Face.

The independent side is HF's own forward (q and k caught where its modeling module hands them to
apply_rotary_pos_emb, before rotation: after any q/k norm, the rotated slice only under partial rotary) and HF's own
rotary embedding (its cos/sin carry YaRN's attention factor). From those, the test places every query token s
positions after every key token and takes the mean score over all those pairs (positions >= 1, the rotated dims,
divided by the attention module's own `scaling`): by definition the a(s) of the head's mean pair. No posprobe
rotation, derotation or h_j is used on that side. Tolerance 1e-5 relative to the head's largest |a(s)| (float32
rotation vs float64 complex sums).

Plants seen failing: h_j = conj(q_j) k_j (a(s) mirrored to a(-s)); the mean pair over positions 0..n-2 instead of
1..n-1; the score scale left out of h_j; the pairs turned back by +p theta instead of -p theta; B(s) maximised over
0..L' instead of L..L'; the range inside L taken over 1..L-1.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from hf_util import independent_hf
from matrix_cells import hf_rope_io
from test_rope_types import _bridge, _hf

from posprobe.analyses.chen_bounds import TOLERANCE, head_bounds
from posprobe.analyses.frequency import frequency_usage
from posprobe.backend.facts import model_facts
from posprobe.rope_theory import score_by_distance

CONTEXT, TARGET, WINDOW = 40, 160, 40


def _reference(hf, rows: torch.Tensor, layer: int, distances: np.ndarray, p: int = 3) -> dict:
    """HF-side a(s) of each head's mean pair at `distances` (query at p + s, key at p), h_typical per head, rotary dim
    and the layer's inverse frequencies, all from HF's forward and rotary embedding."""
    (q, k), (q_rot, k_rot), _, attn = hf_rope_io(hf, rows, layer)  # [batch, head, pos, rotary dims]
    rd = q.shape[-1]
    H, kv = q.shape[1], k.shape[1]
    mod = sys.modules[type(attn).__module__]
    rope = hf.model.rotary_emb
    Q = q[:, :, 1:].double().permute(1, 0, 2, 3).reshape(1, H, -1, rd)  # every query token, positions >= 1
    K = k[:, :, 1:].double().permute(1, 0, 2, 3).reshape(1, kv, -1, rd)
    n_q, n_k = Q.shape[2], K.shape[2]
    out = np.zeros((H, len(distances)))
    for i, s in enumerate(distances):
        cq, sq = rope(Q.float(), torch.full((1, n_q), p + int(s)))
        ck, sk = rope(K.float(), torch.full((1, n_k), p))
        qr, _ = mod.apply_rotary_pos_emb(Q, Q, cq.double(), sq.double())
        _, kr = mod.apply_rotary_pos_emb(K, K, ck.double(), sk.double())
        for h in range(H):
            out[h, i] = float((qr[0, h] @ kr[0, h // (H // kv)].T).mean() * attn.scaling)
    half = rd // 2
    norm = lambda x: torch.hypot(x[..., :half].double(), x[..., half:].double()).mean((0, 2))  # noqa: E731
    qn, kn = norm(q_rot), norm(k_rot)  # [head, band]: the rotated vectors' band norms (attention factor included)
    typical = torch.stack([qn[h] * kn[h // (H // kv)] for h in range(H)]).max(1).values * attn.scaling
    return dict(a=out, typical=typical.numpy(), rd=rd, inv_freq=rope.inv_freq.double().numpy())


def _chen_B(theta: np.ndarray, s: np.ndarray) -> np.ndarray:
    # B(s) = sum_{k=1}^{d/2} |sum_{j<k} e^{i s theta_j}| (Chen et al. 2023, Theorem 2.1), written out.
    return np.array([sum(abs(np.exp(1j * x * theta[:k]).sum()) for k in range(1, len(theta) + 1)) for x in s])


@pytest.mark.parametrize("case", ["llama-yarn-mscale", "stablelm-yarn-partial"])
def test_head_bounds_equal_hf_brute_force(case):
    hf = _hf(case)
    ref_model = independent_hf(hf)
    bridge = _bridge(hf)
    rows = torch.randint(0, 256, (2, WINDOW), generator=torch.Generator().manual_seed(7))
    usage = frequency_usage(bridge, rows, batch_size=2, progress=False, context=CONTEXT, target=TARGET)
    bands, theory = usage.tables["bands"], usage.tables["theory"]
    for layer in (0, 1):
        some = np.array([0, 1, 2, 7, CONTEXT - 1, CONTEXT, 97, TARGET - 1])
        ref = _reference(ref_model, rows, layer, some)
        every = _reference(ref_model, rows, layer, np.arange(TARGET))["a"]
        d = bands[(bands.layer == layer) & (bands.band >= 0)]
        wide = d.pivot_table(index="head", columns=["metric", "band"], values="value")
        h = wide["h_re"].to_numpy() + 1j * wide["h_im"].to_numpy()
        theta = d.drop_duplicates("band").sort_values("band").frequency.to_numpy()
        got = score_by_distance(h, theta, some)
        scale = np.abs(ref["a"]).max(1, keepdims=True)
        assert np.abs(got - ref["a"]).max() <= 1e-5 * scale.max(), (case, layer, got, ref["a"])
        t = theory[theory.layer == layer].set_index("head").sort_index()
        for col, want in (("a_in_min", every[:, :CONTEXT].min(1)), ("a_in_max", every[:, :CONTEXT].max(1)),
                          ("a_out_min", every[:, CONTEXT:].min(1)), ("a_out_max", every[:, CONTEXT:].max(1))):
            assert np.allclose(t[col].to_numpy(), want, rtol=0, atol=1e-5 * scale.max()), (case, layer, col)
        excess = np.maximum(np.maximum(every[:, CONTEXT:].max(1) - every[:, :CONTEXT].max(1),
                                       every[:, :CONTEXT].min(1) - every[:, CONTEXT:].min(1)), 0)
        assert np.allclose(t.excess.to_numpy(), excess, atol=1e-5 * scale.max())
        assert np.allclose(t.h_max_typical.to_numpy(), ref["typical"], rtol=1e-5)
        base = hf.config.rope_parameters["rope_theta"]
        interp = ref["rd"] * ref["typical"] / (32 * math.log(base))
        assert np.allclose(t.interpolation_bound.to_numpy(), interp, rtol=1e-5)
        B = _chen_B(ref["inv_freq"], np.arange(CONTEXT, TARGET)).max()
        assert np.allclose(t.extrapolation_bound.to_numpy(), 2 * ref["typical"] * B, rtol=1e-5)
        assert (t.interpolation_safe == (interp <= TOLERANCE)).all()
        assert (t.extrapolation_leaves_range == (excess > TOLERANCE)).all()
        # The report's a(s) figure draws the same curves (its x: distances up to L'-1, log-spaced)
        from posprobe.report.frequency import score_by_distance_figure

        fig = score_by_distance_figure(bands, theory, [(layer, 0), (layer, 1)])
        for head, trace in enumerate(fig.data):
            x = np.asarray(trace.x, dtype=int)
            assert x.max() == TARGET - 1 and trace.name == f"L{layer}H{head}"
            assert np.allclose(trace.y, every[head, x], atol=1e-5 * scale.max())
        # Chen's theorem itself, on the measured h: |a(s)| <= 2 max|h_j| B(s) at every s beyond L
        B_s = _chen_B(ref["inv_freq"], np.arange(CONTEXT, TARGET))
        assert (np.abs(every[:, CONTEXT:]) <= 2 * t.h_max.to_numpy()[:, None] * B_s + 1e-9).all()


def test_head_bounds_refuse_a_table_of_another_rotation():
    hf = _hf("llama-yarn-mscale")
    bridge = _bridge(hf)
    rows = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    bands = frequency_usage(bridge, rows, batch_size=2, progress=False, context=24).tables["bands"]
    other = bands.assign(frequency=bands.frequency * 1.5)
    with pytest.raises(ValueError, match="not this model's rotation"):
        head_bounds(other, model_facts(bridge), context=24)
    with pytest.raises(ValueError, match="target L' > L"):
        frequency_usage(bridge, rows, batch_size=2, progress=False, context=24, target=24)


def test_score_by_distance_and_its_range_follow_the_definition():
    from posprobe.rope_theory import score_range

    rng = np.random.default_rng(0)
    h = rng.normal(size=(3, 5)) + 1j * rng.normal(size=(3, 5))
    theta = 10_000.0 ** (-np.arange(5) / 5)
    s = np.arange(0, 9000)  # across the 4,096-distance blocks
    want = np.array([[sum((h[r, j] * np.exp(1j * x * theta[j])).real for j in range(5)) for x in s[::97]]
                     for r in range(3)])
    assert np.allclose(score_by_distance(h, theta, s[::97]), want, rtol=0, atol=1e-12)
    full = np.array([[(h[r] * np.exp(1j * x * theta)).real.sum() for x in s] for r in range(3)])
    lo, hi = score_range(h, theta, 5, 9000)
    assert np.allclose(lo, full[:, 5:].min(1)) and np.allclose(hi, full[:, 5:].max(1))
    with pytest.raises(ValueError, match="empty distance range"):
        score_range(h, theta, 10, 10)


def test_frequency_headline_and_sentence_come_from_the_theory_table():
    from posprobe.report.frequency import headline_numbers, summary_text

    hf = _hf("llama-yarn-mscale")
    bridge = _bridge(hf)
    rows = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    usage = frequency_usage(bridge, rows, batch_size=2, progress=False, context=24, target=100)
    t = usage.tables["theory"]
    got = dict(headline_numbers(usage))
    assert got["max_interpolation_bound"] == pytest.approx(max(t.interpolation_bound))
    assert got["max_extrapolation_excess"] == pytest.approx(max(t.excess))
    assert got["heads_leaving_range"] == sum(e > TOLERANCE for e in t.excess)
    assert (got["theory_context"], got["theory_target"]) == (24, 100)
    text = summary_text(usage)
    assert f"at most {max(t.interpolation_bound):.3g} logits" in text and "s = 24..100 tokens" in text
