"""Tests written to kill the mutants benchmarks/mutation.py found alive (issue #36).

Each checks posprobe against an independent computation written here (plain torch / numpy loops, hand-computed
cases, Hugging Face's own modules), never against posprobe itself. All run on tiny inputs in well under a second.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from posprobe.backend import families as fams
from posprobe.backend.families import alibi, learned, rotary, sinusoidal
from posprobe.rope import RotarySpec

# ---------------------------------------------------------------------------------------------------------------
# posprobe/backend/families


def test_alibi_distance_bias_is_minus_slope_times_distance_by_hand():
    slopes = (0.5, 0.125)
    got = alibi.distance_bias(slopes, n_q=2, n_k=5)
    assert got.dtype == torch.float64 and got.shape == (2, 2, 5)
    for h, s in enumerate(slopes):
        for qi, i in enumerate((3, 4)):  # the last two of five positions
            for j in range(5):
                assert got[h, qi, j].item() == -s * (i - j)


def _bias(slopes, n):
    """A causal ALiBi-like bias [head, query, key] built by loops: slope * j on and below the diagonal, plus a
    per-row constant (softmax ignores it), zero above."""
    b = torch.zeros(len(slopes), n, n, dtype=torch.float64)
    for h, s in enumerate(slopes):
        for i in range(n):
            for j in range(i + 1):
                b[h, i, j] = s * j + 0.1 * i
    return b


def _fit_error(b):
    """Least squares (numpy) of bias[i, j] = slope * j + c_i over the causal entries of one head: max |residual|."""
    n = b.shape[-1]
    rows, ys = [], []
    for i in range(n):
        for j in range(i + 1):
            rows.append([j] + [1.0 if r == i else 0.0 for r in range(n)])
            ys.append(float(b[i, j]))
    a, y = np.array(rows), np.array(ys)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    return float(np.abs(a @ coef - y).max())


def test_alibi_fit_tolerance_scales_with_the_bias_size():
    # A steep bias (max |entry| 250) with a small wiggle: relative to its size the wiggle is below the 1e-4
    # tolerance, so the slope is accepted and recovered.
    b = _bias((50.0,), 6)
    b[0, 5, 2] += 1e-3
    err = _fit_error(b[0])
    assert 1e-6 < err < 1e-4 * float(b.abs().max())
    (slope,) = alibi.fit_slopes(b, "steep")
    assert slope == pytest.approx(50.0, abs=1e-3)


def test_alibi_fit_refuses_an_error_above_1e_4_on_a_unit_scale_bias():
    b = _bias((0.1, 0.05), 4)
    assert float(b.abs().max()) < 1.0
    b[1, 3, 3] += 3.3e-4
    err = _fit_error(b[1])
    assert 1e-4 < err < 2e-4  # above the tolerance (1e-4 x max(1, size)), within twice it
    with pytest.raises(NotImplementedError, match="not linear"):
        alibi.fit_slopes(b, "wiggly")
    # Exactly linear: the slopes come back.
    assert alibi.fit_slopes(_bias((0.1, 0.05), 4), "ok") == pytest.approx((0.1, 0.05), abs=1e-12)


def test_alibi_phrase_by_hand():
    assert alibi.phrase((0.5, 0.25, 0.125)) == "ALiBi (slopes 2^-1 … 2^-3, measured)"
    assert alibi.phrase((0.3, 0.25)) == "ALiBi (slopes 0.3 … 2^-2, measured)"
    assert alibi.phrase(()) == "ALiBi (no heads)"


def test_family_reasons_are_the_documented_table():
    assert fams.family("nope").applies("shift") == "the model has no positional encoding"
    assert fams.family("rotary").applies("frequency") is None
    assert "learned position table" in fams.family("rotary").applies("geometry")
    assert "distance alone" in fams.family("alibi").applies("shift")


def test_control_per_kind_by_hand():
    assert fams.control("rotary") == "q/k rotation"
    assert fams.control("learned_absolute") == "position ids"
    assert fams.control("sinusoidal") == "position ids"
    assert fams.control("alibi") == "score bias"
    assert fams.control("nope") is None and fams.control("none") is None
    assert fams.control("relative_bias") == "bucket bias"
    assert fams.control("no-such-kind") is None


def test_not_applicable_by_hand():
    assert fams.not_applicable("no-such-kind", "shift") == "posprobe has no adapter for no-such-kind positions"
    assert fams.not_applicable("no-such-kind", "sinks") is None  # not a position section
    assert fams.not_applicable("rotary", "frequency") is None
    assert fams.not_applicable("rotary", "geometry") is not None
    assert fams.not_applicable("learned_absolute", "geometry") is None
    assert fams.not_applicable("none", "retrieval") == "the model has no positional encoding"


def test_first_row_of_position_tables():
    assert learned.first_row(types.SimpleNamespace(offset=2)) == 2  # OPT
    assert learned.first_row(torch.nn.Embedding(10, 4, padding_idx=1)) == 2  # RoBERTa: padding_idx + 1
    assert learned.first_row(torch.nn.Embedding(10, 4)) == 0  # GPT-2: no offset, no padding
    assert learned.first_row(types.SimpleNamespace()) == 0  # a module without either attribute


def test_rotary_phrase_by_hand():
    spec = RotarySpec(rotary_dim=8, base=10000.0, freq_scale=(1.0, 1.0, 0.5, 0.5), removed=frozenset({3}),
                      attention_factor=1.5)
    assert rotary.phrase(spec, 16) == ("rotary 50% of head dim, half-split pairing, base 10000, scaled frequencies, "
                                       "3 of 4 bands rotate, cos/sin x1.5")
    assert rotary.phrase(RotarySpec(rotary_dim=4, base=500.0, adjacent=True), 0) == (
        "rotary 100% of head dim, adjacent pairing, base 500")
    assert rotary.phrase(RotarySpec(rotary_dim=4, base=500.0, attention_factor=2.0), 4) == (
        "rotary 100% of head dim, half-split pairing, base 500, cos/sin x2")


class _FakeSinusoidalPositionalEmbedding(torch.nn.Module):
    def forward(self, position_ids, past_key_values_length=0):
        return position_ids


class _OtherSinusoidalPositionalEmbedding(torch.nn.Module):
    def forward(self, input_ids):
        return input_ids


def test_sinusoidal_known_only_for_a_position_ids_first_module():
    with_ids = torch.nn.Sequential(torch.nn.Linear(2, 2), _FakeSinusoidalPositionalEmbedding())
    other = torch.nn.Sequential(_OtherSinusoidalPositionalEmbedding())
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert sinusoidal.known(with_ids) and sinusoidal.detect(with_ids)
    assert not sinusoidal.known(other) and sinusoidal.detect(other)
    assert not sinusoidal.known(plain) and not sinusoidal.detect(plain)


def test_describe_layers_by_hand():
    got = fams.describe_layers(("rotary", "nope", "rotary"), None, 8, ("local",),
                               length_rules=("yarn x4", "yarn x4", None))
    assert got == ("rotary, sliding window (yarn x4)", "NoPE (no positional encoding)", "rotary")
    assert fams.describe_layers(("alibi",), None, 8, ("global",), extra="; x",
                                alibi_slopes=((0.5, 0.25),)) == ("ALiBi (slopes 2^-1 … 2^-2, measured); x",)


# ---------------------------------------------------------------------------------------------------------------
# posprobe/analyses/massive.py


def test_massive_reducer_keeps_each_entrys_largest_instance_with_its_corpus_row():
    # Two batches (rows 0-1, then row 2) of [batch, pos=2, d=2] activations, top 2, worked out by hand: per
    # (position, dimension) the largest |value| over the corpus with the row it came from; per sequence the lower
    # median of its four |values| (torch.median's convention).
    from posprobe.analyses.massive import _reducer

    red = _reducer(1, top=2)
    x1 = torch.tensor([[[1.0, 0.125], [0.25, 0.375]],
                       [[0.5, 0.4375], [0.0625, 5.0]]])
    x2 = torch.tensor([[[-3.0, 0.25], [0.0625, 0.125]]])
    red.fn("resid_post", 0, x1, red.state)
    assert red.state[0]["cands"] == [(5.0, 1, 1, 1), (1.0, 0, 0, 0)]  # (0, 0): row 0's 1.0 beats row 1's 0.5
    red.fn("resid_post", 0, x2, red.state)
    assert red.state[0]["cands"] == [(5.0, 1, 1, 1), (3.0, 2, 0, 0)]  # row 2 is the corpus's third row
    assert red.state[0]["rows"] == 3
    assert red.state[0]["median_sum"] == pytest.approx(0.25 + 0.4375 + 0.125)


def test_massive_edit_threshold_is_strict_and_in_the_activations_dtype():
    from posprobe.analyses.massive import massive_edit

    # |values| 0.5, 1, 1, 4 and 0.5, 1, 1, 4.5: lower median 1, so with ratio 4 the entry 4 is not above the bar
    # (equal to it) and 4.5 is.
    x = torch.tensor([[[1.0, 0.5], [4.0, 1.0]], [[1.0, 0.5], [4.5, 1.0]]])
    out = massive_edit([0], 4.0, "zero")(x)
    want = x.clone()
    want[1, 1, 0] = 0.0
    assert torch.equal(out, want)
    means = torch.tensor([-2.0])
    out = massive_edit([0], 4.0, "mean", means)(x)
    want[1, 1, 0] = -2.0
    assert torch.equal(out, want)
    # float64: the median (a float32 number, 0.1 rounded) times 3 in float64 is 0.30000000447...; the entry
    # 0.300000008 lies above it (and below the product rounded to float32, 0.30000001192...).
    m = float(np.float32(0.1))
    e = 0.300000008
    assert 3 * m < e < float(np.float32(3 * np.float32(m)))
    x = torch.tensor([[[m, e, 1e-3]]], dtype=torch.float64)
    out = massive_edit([1], 3.0, "zero")(x)
    assert out[0, 0, 1].item() == 0.0 and out[0, 0, 0].item() == m


# ---------------------------------------------------------------------------------------------------------------
# posprobe/rope.py


def test_angular_frequency_and_wavelength_by_hand_in_float64():
    from posprobe.rope import angular_frequency, wavelength

    spec = RotarySpec(rotary_dim=8, base=10000.0, removed=frozenset({3}))
    want = [1.0 / 10000.0 ** (b / 4) for b in range(3)] + [0.0]
    got = angular_frequency(spec)
    assert got[3] == 0.0
    assert got == pytest.approx(want, rel=1e-14, abs=0)  # float64: float32 tables are ~1e-8 off
    wl = wavelength(spec)
    assert wl[:3] == pytest.approx([2 * math.pi * 10000.0 ** (b / 4) for b in range(3)], rel=1e-14)
    assert wl[3] == math.inf


def test_band_dims_by_hand():
    from posprobe.rope import band_dims

    adjacent = RotarySpec(rotary_dim=8, base=10000.0, adjacent=True)
    half = RotarySpec(rotary_dim=8, base=10000.0)
    assert [band_dims(adjacent, b) for b in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [band_dims(half, b) for b in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_expand_kv_repeats_each_key_head_for_its_query_group():
    from posprobe.rope import expand_kv

    k = torch.randn(1, 3, 2, 4, generator=torch.Generator().manual_seed(0))  # d_head 4 = n_heads: no confusion
    got = expand_kv(k, 4)
    want = torch.stack([k[:, :, 0], k[:, :, 0], k[:, :, 1], k[:, :, 1]], dim=2)
    assert torch.equal(got, want)
    assert torch.equal(expand_kv(k, 2), k)


@pytest.mark.parametrize("n_q", [4, 3])
def test_band_contributions_and_remainder_equal_plain_dot_products(n_q):
    # Partial rotary (4 of 6 dims), 4 query heads on 2 key heads, 4 queries = rotary_dim = heads (so no axis can
    # stand in for another): every band's term and the remainder written as loops over plain dot products.
    from posprobe.rope import band_contributions

    g = torch.Generator().manual_seed(1)
    spec = RotarySpec(rotary_dim=4, base=100.0)
    q = torch.randn(2, n_q, 4, 6, generator=g, dtype=torch.float64)
    k = torch.randn(2, 5, 2, 6, generator=g, dtype=torch.float64)
    scale = 2.5
    bands, rest = band_contributions(q, k, spec, scale)
    assert bands.shape == (2, 4, 2, n_q, 5) and rest.shape == (2, 4, n_q, 5)
    for b in range(2):
        for h in range(4):
            kv = h // 2
            for i in range(n_q):
                for j in range(5):
                    for band, (d0, d1) in enumerate(((0, 2), (1, 3))):
                        want = (q[b, i, h, d0] * k[b, j, kv, d0] + q[b, i, h, d1] * k[b, j, kv, d1]) / scale
                        assert abs(float(bands[b, h, band, i, j] - want)) < 1e-12
                    want = float(q[b, i, h, 4:] @ k[b, j, kv, 4:]) / scale
                    assert abs(float(rest[b, h, i, j]) - want) < 1e-12
    full = RotarySpec(rotary_dim=6, base=100.0)
    _, zero = band_contributions(q, k, full, scale)
    assert zero.shape == (2, 4, n_q, 5) and not zero.any()


def _tl_sin_cos(pos, rotary_dim, base, dtype, adjacent):
    """TransformerLens's recipe for its rotary tables, written out: angles pos / base^(b / (rotary_dim/2)) in
    float32 (float64 for a float64 model), each band's angle on both of its dims, sin and cos cast to `dtype`."""
    hp = torch.float64 if dtype == torch.float64 else torch.float32
    dim = torch.arange(rotary_dim // 2, dtype=hp)
    freq = base ** (dim / (rotary_dim / 2))
    freq = freq.repeat_interleave(2) if adjacent else torch.cat([freq, freq])
    angles = pos.to(hp)[:, None] / freq[None, :]
    return torch.sin(angles).to(dtype), torch.cos(angles).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("adjacent", [False, True])
def test_sin_cos_is_tls_recipe_bit_for_bit(dtype, adjacent):
    from posprobe.rope import sin_cos

    pos = torch.tensor([0.0, 1.0, 7.0, 1000.5, 12345.0, 40961.25], dtype=torch.float64)  # float64 positions
    spec = RotarySpec(rotary_dim=8, base=777.0, adjacent=adjacent)
    sin, cos = sin_cos(pos, spec, dtype)
    want_sin, want_cos = _tl_sin_cos(pos, 8, 777.0, dtype, adjacent)
    assert sin.dtype == dtype and cos.dtype == dtype
    assert torch.equal(sin, want_sin) and torch.equal(cos, want_cos)


def test_sin_cos_removed_bands_and_attention_factor():
    from posprobe.rope import sin_cos

    pos = torch.tensor([3.0, 50.0], dtype=torch.float64)
    for adjacent, dims in ((False, [1, 5]), (True, [2, 3])):  # band 1's two dims in either layout
        spec = RotarySpec(rotary_dim=8, base=313.0, adjacent=adjacent, removed=frozenset({1}), attention_factor=2.0)
        sin, cos = sin_cos(pos, spec, torch.float64)
        want_sin, want_cos = _tl_sin_cos(pos, 8, 313.0, torch.float64, adjacent)
        want_sin[:, dims], want_cos[:, dims] = 0.0, 1.0
        assert torch.equal(sin, 2.0 * want_sin) and torch.equal(cos, 2.0 * want_cos)


def test_grouped_band_products_fill_the_given_buffer():
    from posprobe.rope import _grouped_band_products

    g = torch.Generator().manual_seed(3)
    spec = RotarySpec(rotary_dim=4, base=100.0)
    q = torch.randn(1, 3, 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 5, 1, 4, generator=g, dtype=torch.float64)
    out = torch.full((1, 1, 2, 2 * 3, 5), float("nan"), dtype=torch.float64)
    got = _grouped_band_products(q, k, spec, 2.0, out=out)
    for h in range(2):
        for i in range(3):
            for band, (d0, d1) in enumerate(((0, 2), (1, 3))):
                want = (q[0, i, h, d0] * k[0, :, 0, d0] + q[0, i, h, d1] * k[0, :, 0, d1]) / 2.0
                assert torch.allclose(out[0, 0, band, h * 3 + i], want, rtol=0, atol=1e-12)
    assert torch.equal(got, out)


def test_hf_cos_sin_is_hfs_recipe():
    # HF (Llama, GPT-NeoX): freqs = position * inv_freq in float32, emb = cat(freqs, freqs) (half-split); GPT-J /
    # GLM: each band's angle on two adjacent dims. cos and sin times the attention scaling.
    from posprobe.rope import hf_cos_sin

    pos = torch.tensor([[0, 3, 1000]])
    inv = torch.tensor([1.0, 0.1, 0.01], dtype=torch.float64)
    freqs = pos.float()[..., None] * inv.float()
    cos, sin = hf_cos_sin(pos, inv)  # the defaults: half-split, scaling 1
    half = torch.cat([freqs, freqs], -1)
    assert torch.equal(cos, half.cos()) and torch.equal(sin, half.sin())
    cos, sin = hf_cos_sin(pos, inv, adjacent=True, scaling=0.5)
    adj = torch.stack([freqs, freqs], -1).flatten(-2)  # angle b on dims 2b and 2b+1
    assert cos.shape == (1, 3, 6)
    assert torch.equal(cos, adj.cos() * 0.5) and torch.equal(sin, adj.sin() * 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_rotate_equals_hfs_own_apply_rotary_pos_emb(dtype):
    # HF's own functions: GLM's (adjacent pairs, partial rotary: 4 of 6 dims) and Llama's (half-split, full head).
    from transformers.models.glm.modeling_glm import apply_rotary_pos_emb as glm_apply
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply

    from posprobe.rope import hf_rotate

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 5, 6, generator=g).to(dtype)  # [batch, head, pos, d_head]
    freqs = torch.arange(5.0)[None, :, None] * torch.tensor([1.0, 0.05])  # [batch, pos, band]
    full = torch.cat([freqs, freqs], -1)  # HF's cos/sin layout before GLM interleaves it
    want, _ = glm_apply(q, q, full.cos(), full.sin())
    adj = freqs.repeat_interleave(2, -1)
    got = hf_rotate(q, adj.cos()[:, None], adj.sin()[:, None], adjacent=True)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), rtol=0, atol=1e-6 if dtype == torch.float32 else 2e-2)
    q4 = q[..., :4]
    want, _ = llama_apply(q4, q4, full.cos().to(dtype), full.sin().to(dtype))
    got = hf_rotate(q4, full.cos()[:, None], full.sin()[:, None])  # the default: half-split
    assert got.dtype == dtype and torch.equal(got, want)


def test_inv_freq_of_is_the_float64_table_inverted_then_rounded_to_float32():
    from posprobe.rope import inv_freq_of, inv_freq_table

    scale = (1.0, 1.0, 0.1, 0.1, 7.0, 7.0)  # 0.1: not a float32 number, so the scale is applied in float64
    spec = RotarySpec(rotary_dim=12, base=12345.6, freq_scale=scale, removed=frozenset({5}))
    want64 = [12345.6 ** (b / 6) * scale[b] for b in range(6)]
    assert inv_freq_table(spec, torch.float64).tolist() == pytest.approx(want64, rel=1e-15)
    want = torch.tensor([1.0 / f for f in want64[:5]] + [0.0], dtype=torch.float64).float()
    got = inv_freq_of(spec)
    assert got.dtype == torch.float32 and torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------------
# posprobe/analyses/sinks.py


def _hf_alphas(ref, rows, position_ids=None):
    """Gu et al.'s alpha_1 per (row, layer, head) from Hugging Face's own attention weights: attention on key 0,
    averaged over every query."""
    with torch.no_grad():
        out = ref(rows, position_ids=position_ids, output_attentions=True)
    return torch.stack([a[..., 0].mean(-1).double() for a in out.attentions], 1)  # [row, layer, head]


def test_sink_control_variants_equal_hf_with_the_same_tokens_and_position_ids():
    from families import tiny_family

    from posprobe.analyses.sinks import SinksConfig, _control

    bridge, ref = tiny_family("llama")
    ref.config._attn_implementation = "eager"  # HF returns attention weights from its eager path
    rows = torch.randint(3, 250, (3, 10), generator=torch.Generator().manual_seed(5))
    moved, swapped = torch.arange(10), torch.arange(10)
    moved[0] = 5
    swapped[0], swapped[1] = 1, 0
    the = rows.clone()
    the[:, 0] = bridge.tokenizer("the", add_special_tokens=False)["input_ids"][0]
    newline = rows.clone()
    newline[:, 0] = bridge.tokenizer("\n", add_special_tokens=False)["input_ids"][0]
    variants = {"as is": (rows, None), "first token at position 5": (rows, moved[None]),
                "second token at position 0": (rows, swapped[None]), "'the' first": (the, None),
                "newline first": (newline, None)}
    alphas = {v: _hf_alphas(ref, t, p) for v, (t, p) in variants.items()}
    # A threshold in the widest gap between alphas near their median: no alpha within float noise of it.
    flat = torch.cat([a.flatten() for a in alphas.values()]).sort().values
    mid = len(flat) // 2
    gaps = flat[mid - 10:mid + 10].diff()
    i = int(gaps.argmax())
    eps = float(flat[mid - 10 + i] + flat[mid - 10 + i + 1]) / 2
    assert float(gaps[i]) > 1e-5 and eps != SinksConfig().epsilon
    got = _control(bridge, rows, SinksConfig(length=10, epsilon=eps, batch_size=2, progress=False))
    got = got.set_index(["variant", "metric"])
    assert list(dict.fromkeys(got.index.get_level_values(0))) == list(variants)
    for v, a in alphas.items():
        share = float((a > eps).double().mean((0, 2)).mean())  # per layer over (row, head), then over layers
        assert got.loc[(v, "sink_share"), "value"] == pytest.approx(share, abs=1e-12), v
        assert got.loc[(v, "first_attention"), "value"] == pytest.approx(float(a.mean()), abs=1e-5), v
        assert got.loc[(v, "sink_share"), "count"] == 3 and got.loc[(v, "first_attention"), "count"] == 3


def test_random_rows_are_framed_by_the_encoders_special_tokens_at_the_requested_length():
    from families import tiny_family

    from posprobe.analyses.sinks import SinksConfig, _random_rows

    bridge, _ = tiny_family("bert")
    cls, sep = bridge.tokenizer.cls_token_id, bridge.tokenizer.sep_token_id  # [CLS] body [SEP]
    for length in (3, 7):  # 3: one random token between the two
        rows = _random_rows(bridge, SinksConfig(length=length, random_samples=2, progress=False))
        assert rows.shape == (2, length)
        assert rows[:, 0].tolist() == [cls, cls] and rows[:, -1].tolist() == [sep, sep]
        assert not torch.isin(rows[:, 1:-1], torch.tensor([cls, sep])).any()
    with pytest.raises(ValueError, match="no room"):
        _random_rows(bridge, SinksConfig(length=2, random_samples=2, progress=False))


def test_control_variants_by_hand():
    from families import tiny_family

    from posprobe.analyses.sinks import control_variants

    bridge, _ = tiny_family("llama")
    rows = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(6))
    got = control_variants(bridge, rows)
    assert list(got) == ["as is", "first token at position 4", "second token at position 0", "'the' first",
                         "newline first"]
    assert got["as is"][0] is rows and got["as is"][1] is None
    assert got["first token at position 4"][1].tolist() == [4, 1, 2, 3, 4, 5, 6, 7, 8]
    assert got["second token at position 0"][1].tolist() == [1, 0, 2, 3, 4, 5, 6, 7, 8]
    for label, char in (("'the' first", "t"), ("newline first", "\n")):  # the byte tokenizer: one id per byte
        toks, pos = got[label]
        assert pos is None and torch.equal(toks[:, 1:], rows[:, 1:])
        assert [bridge.tokenizer.decode([int(t)]) for t in toks[:, 0]] == [char, char]
    # A fixed-sinusoidal model (XGLM): posprobe sets its positions too, so the control moves them as on any family
    # with a position control.
    xglm, _ = tiny_family("xglm")
    assert list(control_variants(xglm, rows)) == list(got)
    assert control_variants(xglm, rows)["first token at position 4"][1].tolist() == [4, 1, 2, 3, 4, 5, 6, 7, 8]


def test_run_sinks_frames_text_windows_as_the_encoder_expects_and_takes_the_full_context():
    import hashlib

    from families import tiny_family

    from posprobe.analyses.sinks import SinksConfig, run_sinks

    bridge, ref = tiny_family("bert")
    ref.config._attn_implementation = "eager"
    text = "abcdefghijklmnopqrstuvwxyz"
    ids = [bridge.tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in text]
    cls, sep = bridge.tokenizer.cls_token_id, bridge.tokenizer.sep_token_id
    rows = torch.tensor([[cls] + ids[0:6] + [sep], [cls] + ids[6:12] + [sep]])  # [CLS] 6 letters [SEP], twice
    alphas = _hf_alphas(ref, rows)  # [row, layer, head]
    flat = alphas.flatten().sort().values
    i = int(flat.diff().argmax())
    eps = float(flat[i] + flat[i + 1]) / 2  # in the widest gap: no alpha within float noise of the threshold
    assert not torch.equal(alphas > eps, alphas > SinksConfig().epsilon)  # the default would count other heads
    cfg = SinksConfig(length=8, epsilon=eps, random_samples=0, max_windows=2, control=False, massive_top=0,
                      ablate_heads=0, progress=False)
    res = run_sinks(bridge, text, cfg)
    heads = res.tables["sink_heads"]
    first = heads[(heads.condition == "text") & (heads.metric == "first_attention")].sort_values(["layer", "head"])
    assert np.allclose(first.value.to_numpy(), alphas.mean(0).flatten().numpy(), rtol=0, atol=1e-5)
    share = res.tables["sink_share"].sort_values("layer").value.to_numpy()
    assert np.allclose(share, (alphas > eps).double().mean((0, 2)).numpy(), rtol=0, atol=1e-12)
    assert res.meta["data"]["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert "skipped" in res.meta["control"]  # control off
    llama, _ = tiny_family("llama")
    n_ctx = llama.cfg.n_ctx
    full = run_sinks(llama, None, SinksConfig(length=n_ctx, random_samples=1, max_windows=1, control=False,
                                              massive_top=0, ablate_heads=0, progress=False))
    assert set(full.tables["sink_share"]["count"]) == {1}
    for name in ("sink_heads", "sink_share"):  # two conditions, one table: rows numbered 0..n-1
        df = full.tables[name]
        assert set(df.condition) == {"random", "text"} and df.index.tolist() == list(range(len(df)))


def test_first_delimiters_by_hand():
    from families import tiny_family

    from posprobe.analyses.sinks import first_delimiters

    bridge, _ = tiny_family("llama")
    rows = torch.tensor([[ord(c) for c in r] for r in ("a.b,", "abcd", ".a.b", "ab?!")])
    assert bridge.tokenizer.decode(rows[0].tolist()) == "a.b,"  # the byte tokenizer: id = byte value
    assert first_delimiters(bridge, rows).tolist() == [1, -1, 2, 2]  # position 0 never counts


def test_run_sinks_meta_by_hand():
    import hashlib

    from families import tiny_family

    from posprobe.analyses.sinks import SinksConfig, run_sinks
    from posprobe.data import BUILTIN_TEXT

    llama, ref = tiny_family("llama")
    ref.config._attn_implementation = "eager"
    off = dict(control=False, massive_top=0, ablate_heads=0, progress=False)
    # [bos] + 7 text tokens per window; the first delimiter of each window at 7 (the last position: left out), at 1,
    # and at 6.
    text = "abcdef." + ".bcdefg" + "abcde,g"
    res = run_sinks(llama, text, SinksConfig(length=8, random_samples=2, max_windows=3, **off))
    # The delimiter metrics from HF's attention weights: windows 2 and 3 (delimiter at 1 and 6), the queries after it.
    win = [[llama.tokenizer.bos_token_id] + [ord(c) for c in text[i:i + 7]] for i in (0, 7, 14)]
    assert llama.tokenizer.decode(win[1][1:]) == ".bcdefg"  # the byte tokenizer: id = byte value
    with torch.no_grad():
        att = ref(torch.tensor(win), output_attentions=True).attentions  # per layer [row, head, q, k]
    want = torch.stack([(a[1, :, 2:, 1].mean(-1) + a[2, :, 7:, 6].mean(-1)) / 2 for a in att])  # [layer, head]
    heads = res.tables["sink_heads"]
    got = heads[(heads.condition == "text") & (heads.metric == "delim_attention")].sort_values(["layer", "head"])
    assert np.allclose(got.value.to_numpy(), want.flatten().double().numpy(), rtol=0, atol=1e-5)
    assert res.meta["delimiter_sequences"] == {"random": res.meta["delimiter_sequences"]["random"], "text": 2}
    assert res.meta["delimiters"] == [".", ",", "\n", ";", ":", "!", "?"]
    assert res.meta["data"] == {"source": "text", "sha256": hashlib.sha256(text.encode()).hexdigest(), "n_items": 5,
                                "unit": "sequences"}
    assert res.meta["sequences"] == {"random": 2, "text": 3}
    for key in ("control", "ablation", "massive"):
        assert "skipped" in res.meta[key], key
    for df in res.tables.values():
        assert list(df.columns)[0] == "model" and set(df.model) == {llama.cfg.model_name}
    share = res.tables["sink_share"]
    assert res.meta["sink_share"] == {c: pytest.approx(float(share[share.condition == c].value.mean()), abs=1e-15)
                                      for c in ("random", "text")}
    builtin = run_sinks(llama, None, SinksConfig(length=8, random_samples=0, max_windows=1, **off))
    assert builtin.meta["data"]["source"] == "built-in text"
    assert builtin.meta["data"]["sha256"] == hashlib.sha256(BUILTIN_TEXT.encode()).hexdigest()
    named = run_sinks(llama, None, SinksConfig(length=8, random_samples=1, max_windows=0, **off), source="mine")
    assert named.meta["data"] == {"source": "mine", "sha256": None, "n_items": 1, "unit": "sequences"}


# ---------------------------------------------------------------------------------------------------------------
# posprobe/core/positions.py


def test_extended_batch_plan_with_a_view_by_hand():
    from posprobe.core.positions import KeyView, PositionPlan

    q = torch.tensor([[0.0, 1.0, 2.0], [5.0, 6.0, 9.0]])
    k = torch.tensor([[0.0, 1.0, 1.5], [5.0, 5.0, 9.0]])
    view = KeyView(torch.tensor([[True, False, True], [False, False, True]]), torch.tensor([[7.0, 7.0, 7.0]] * 2))
    got = PositionPlan(q, k, views=(view,)).extended(5)
    assert got.q_pos.tolist() == [[0, 1, 2, 3, 4], [5, 6, 9, 10, 11]]  # new tokens: after the last query, step 1
    assert got.k_pos.tolist() == [[0, 1, 1.5, 3, 4], [5, 5, 9, 10, 11]]
    (v,) = got.views
    assert v.queries.dtype == torch.bool
    assert v.queries.tolist() == [[True, False, True, False, False], [False, False, True, False, False]]
    assert v.k_pos.tolist() == [[7, 7, 7, 3, 4], [7, 7, 7, 10, 11]]


def test_token_positions_on_a_learned_model_equal_hfs_position_ids():
    from families import tiny_family

    from posprobe.core.positions import token_positions

    bridge, ref = tiny_family("gpt2")
    ids = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(7))
    pos = torch.tensor([3, 4, 5, 9, 10, 11])
    with token_positions(bridge, pos):
        got = bridge(ids)
    want = ref(ids, position_ids=pos[None].expand(2, -1)).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-4)
    assert not torch.allclose(bridge(ids), want, rtol=0, atol=1e-2)  # the positions matter
