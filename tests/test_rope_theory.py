"""RoPE theory (`posprobe.rope_theory`, `posprobe info --theory`) against the papers' own printed numbers, their
formulas written out here in plain Python, and Hugging Face's rope tables: Liu's critical dimension, Xu's first
negative rotation sum, Chen's B(s) and both bounds (checked as bounds on random h), and the scaling methods' per-band
factors against `ROPE_INIT_FUNCTIONS`."""

from __future__ import annotations

import cmath
import doctest
import json
import math

import numpy as np
import pytest

import posprobe.rope_theory as T
from posprobe.rope import RotarySpec


def test_docstring_examples_run():
    """The module's >>> examples (the papers' numbers) run and print what they say."""
    failed, tried = doctest.testmod(T, verbose=False)
    assert tried >= 4 and failed == 0


@pytest.mark.parametrize(("d", "base", "length"), [(128, 1e4, 4096), (64, 1e5, 8192), (32, 1e4, 128), (256, 1e6, 32768),
                                                   (128, 5e5, 2048), (16, 1e4, 256)])
def test_critical_dimension_is_liu_et_al_closed_form(d, base, length):
    """Liu et al. 2024: 2 ceil((d/2) log_b(L / 2pi)), and Llama-2 at 4,096 tokens: 92 of 128 (their printed number).
    Catches: counting bands instead of dims (46 for 92)."""
    liu = 2 * math.ceil(d / 2 * math.log(length / (2 * math.pi), base))
    assert T.critical_dimension(RotarySpec(rotary_dim=d, base=base), length) == min(liu, d)
    assert T.critical_dimension(RotarySpec(rotary_dim=128, base=1e4), 4096) == 92


def _xu_loop(d: int, base: float, limit: int) -> int | None:
    # Xu et al. 2024, written out: B_m = sum_{i<d/2} cos(m base^(-2i/d)); the first m with B_m < 0.
    thetas = [base ** (-2 * i / d) for i in range(d // 2)]
    for m in range(1, limit + 1):
        if sum(math.cos(m * t) for t in thetas) < 0:
            return m
    return None


@pytest.mark.parametrize(("d", "base", "expected"), [(64, 1e5, 3616), (32, 1e4, 474)])
def test_first_negative_sum_is_xu_et_al_crossing(d, base, expected):
    """SmolLM2 (d 64, base 1e5): near 3.6k as the issue quotes Xu's rule; the zoo's rotary members (d 32, base 1e4):
    ~474. Catches: a sum over dims (each band twice, shifted) instead of bands."""
    assert _xu_loop(d, base, 5000) == expected
    spec = RotarySpec(rotary_dim=d, base=base)
    assert T.first_negative_sum(spec, 5000) == expected
    assert T.first_negative_sum(spec, expected - 1) is None
    m = np.array([1, 17, expected - 1, expected])
    ref = [sum(math.cos(k * base ** (-2 * i / d)) for i in range(d // 2)) for k in m]
    assert np.allclose(T.rotation_sum(spec, m), ref, rtol=0, atol=1e-9)


def _chen_B_loop(d: int, base: float, s: float) -> float:
    # Chen et al. 2023, Thm 2.1: B(s) = sum_{k=0}^{d/2-1} |A_{k+1}(s)|, A_k(s) = sum_{j=0}^{k-1} e^{i s theta_j}.
    thetas = [base ** (-2 * j / d) for j in range(d // 2)]
    return sum(abs(sum(cmath.exp(1j * s * t) for t in thetas[:k + 1])) for k in range(d // 2))


def test_chen_B_matches_the_paper():
    """B(s)/d ~ 14-16 near s = 1 for d = 128, base 1e4, and >= 1 for every s <= 2,048 (Chen et al.: 'almost every');
    the bound ratio is then >= 64 ln c (~590). Catches: |sum| for sum of |.|, a partial sum missing its own term."""
    spec = RotarySpec(rotary_dim=128, base=1e4)
    s = np.array([0.5, 1.0, 1.5, 7.0, 100.0, 2048.0])
    assert np.allclose(T.chen_B(spec, s), [_chen_B_loop(128, 1e4, x) for x in s], rtol=1e-12)
    assert 14 <= T.chen_B(spec, [1.0])[0] / 128 <= 16
    ratio = T.chen_B(spec, np.arange(1, 2049)) / 128
    assert ratio.min() >= 1
    assert T.chen_bound_ratio(spec, [1.0])[0] == pytest.approx(64 * math.log(1e4) * T.chen_B(spec, [1.0])[0] / 128)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chen_bounds_hold_for_random_h(seed):
    """Both bounds are bounds: for random complex h_j, |a(s)| <= 2 max|h| B(s) at every s, and a(s) between two
    integer positions stays within d max|h| / (32 ln c) of the straight line joining them. Catches: a factor of 2
    or 32 lost, B(s) without its absolute values (then the bound fails for some h)."""
    rng = np.random.default_rng(seed)
    d, base = 32, 1e4
    spec = RotarySpec(rotary_dim=d, base=base)
    h = rng.normal(size=d // 2) + 1j * rng.normal(size=d // 2)
    theta = base ** (-np.arange(0, d, 2) / d)

    def a(s):
        return np.real(np.exp(1j * np.outer(s, theta)) @ h)

    s = np.arange(0, 4000, 0.37)
    assert np.all(np.abs(a(s)) <= T.extrapolation_bound(spec, s, np.abs(h).max()) + 1e-9)
    left = np.arange(0, 300)
    frac = np.linspace(0, 1, 21)
    inside = left[:, None] + frac[None, :]
    line = a(left)[:, None] * (1 - frac) + a(left + 1)[:, None] * frac
    err = np.abs(a(inside.ravel()).reshape(inside.shape) - line).max()
    assert err <= T.interpolation_bound(spec, np.abs(h).max())


def _hf_table(rope: dict, d: int, base: float, length: int, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=d * 2, num_attention_heads=2, head_dim=d, max_position_embeddings=length,
                      rope_parameters={"rope_theta": base, **rope})
    inv, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu", seq_len=seq_len)
    return inv.double().numpy(), float(factor)


@pytest.mark.parametrize(("d", "base", "length", "scale"), [(64, 1e4, 2048, 4.0), (128, 5e5, 4096, 8.0),
                                                             (32, 1e4, 128, 4.0), (64, 1e5, 8192, 2.0),
                                                             # the ramp's ends clipped to the bands / collapsed
                                                             (16, 10.0, 4096, 4.0), (8, 1e4, 16, 2.0),
                                                             (8, 1e6, 1 << 20, 3.0)])
def test_scaling_factors_equal_hugging_face_rope_types(d, base, length, scale):
    """PI = HF `linear`; NTK-aware base = HF `dynamic` (factor 1) at s L tokens; YaRN's band ramp and temperature =
    HF `yarn` (truncated and not), <= 1e-6 relative on the frequencies; the paper's ramp (linear in turns) agrees with
    it outside the ramp. Catches: d/(d-2) inverted, ramp ends swapped (alpha/beta), the temperature squared."""
    spec = RotarySpec(rotary_dim=d, base=base)
    theta = base ** (-np.arange(0, d, 2) / d)
    hf_pi, _ = _hf_table({"rope_type": "linear", "factor": scale}, d, base, length)
    assert np.allclose(theta * T.pi_factors(spec, scale), hf_pi, rtol=1e-6)
    hf_ntk, _ = _hf_table({"rope_type": "dynamic", "factor": 1.0}, d, base, length, seq_len=int(scale * length))
    ntk = T.ntk_aware_base(spec, scale) ** (-np.arange(0, d, 2) / d)
    assert np.allclose(ntk, hf_ntk, rtol=1e-6)
    for truncate in (True, False):
        hf_yarn, hf_t = _hf_table({"rope_type": "yarn", "factor": scale, "original_max_position_embeddings": length,
                                   "truncate": truncate}, d, base, length)
        g = T.yarn_gamma(spec, length, ramp="band", truncate=truncate)
        assert np.allclose(theta * ((1 - g) / scale + g), hf_yarn, rtol=1e-6), truncate
        assert hf_t == pytest.approx(T.yarn_temperature(scale), rel=1e-9)
    paper = T.yarn_gamma(spec, length, ramp="turns")
    turns = length * theta / (2 * math.pi)
    assert np.all(paper[turns > 32] == 1) and np.all(paper[turns < 1] == 0)
    inside = (turns >= 1) & (turns <= 32)
    assert np.allclose(paper[inside], (turns[inside] - 1) / 31)
    hf = T.yarn_gamma(spec, length, ramp="band", truncate=False)
    assert np.all(hf[turns > 32] == 1) and np.all(hf[turns < 1] == 0)


def test_yarn_temperature_is_the_papers():
    """Peng et al.: sqrt(1/t) = 0.1 ln s + 1, 1.208 at s = 8 (their printed value); 1 for s <= 1."""
    assert round(T.yarn_temperature(8.0), 3) == 1.208 and T.yarn_temperature(1.0) == 1.0


def test_a_rescaled_table_is_refused_for_projections():
    """Catches: YaRN projected on a table its rope type already rescaled (scaled twice, silently)."""
    T.check_plain(RotarySpec(rotary_dim=32, base=1e4), "YaRN")
    with pytest.raises(ValueError, match="already rescaled"):
        T.check_plain(RotarySpec(rotary_dim=32, base=1e4, freq_scale=(1.0,) * 16), "YaRN")
    with pytest.raises(ValueError, match="already rescaled"):
        T.check_plain(RotarySpec(rotary_dim=32, base=1e4, removed=frozenset({15})), "YaRN")


# ---- a model's own table: `rope_theory_table(model)` and `posprobe info --theory` ------------------------------------


def _from_inv_freq(inv: np.ndarray, length: int) -> tuple[int, int | None]:
    # Liu's count and Xu's first crossing by brute force over a Hugging Face model's own inv_freq buffer.
    crit = 2 * sum(2 * math.pi / t <= length for t in inv)
    sums = np.cos(np.outer(np.arange(1, 4 * length + 1), inv)).sum(axis=1)
    neg = np.flatnonzero(sums < 0)
    return crit, (int(neg[0]) + 1 if len(neg) else None)


def test_each_layer_group_reads_its_own_frequencies():
    """Gemma 3's sliding (base 1e4) and full (1e6) layers are two groups, each with the numbers of Hugging Face's
    own per-layer-type inv_freq. Catches: one base for every layer (the bridge's config has one), groups merged."""
    from families import tiny_family

    from posprobe.analyses.rope_tables import rope_theory_table

    bridge, ref = tiny_family("gemma3")
    table = rope_theory_table(bridge, context=128)
    buffers = dict(ref.named_buffers())
    groups = {"0-1": "sliding_attention", "2": "full_attention"}
    assert set(table["layers"]) == set(groups)
    for layers, kind in groups.items():
        inv = buffers[f"model.rotary_emb.{kind}_inv_freq"].double().numpy()
        rows = table[table["layers"] == layers].set_index("quantity")["value"]
        crit, first = _from_inv_freq(inv, 128)
        assert rows["critical dimension (Liu et al. 2024)"] == crit
        got = rows["first m with sum cos(m theta) < 0 (Xu et al. 2024)"]
        assert (math.isnan(got) and first is None) or got == first
        assert table[table["layers"] == layers]["base"].iloc[0] == ref.config.rope_parameters[kind]["rope_theta"]


@pytest.mark.real
def test_smollm2_theory_from_its_config(smollm2, capsys):
    """SmolLM2-135M: the numbers from its converted config (head dim 64, base 1e5, context 8,192) by the papers'
    formulas: Liu 2 ceil(32 log_1e5(8192 / 2pi)) = 40 dims, Xu's crossing 3,616 tokens (inside its context: a
    falsifiable prediction), and with --target 32768 the NTK base 1e5 4^(64/62)."""
    from posprobe.analyses.rope_tables import rope_theory_table
    from posprobe.backend.sources import gguf_cache_path, resolve

    # The config Hugging Face wrote when it converted the GGUF (the fixture loaded it), not posprobe's reading of it.
    cfg = json.loads((gguf_cache_path(resolve("smollm2").path) / "config.json").read_text())
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    length = cfg["max_position_embeddings"]
    rows = rope_theory_table(smollm2, target=4 * length).set_index("quantity")["value"]
    assert rows["critical dimension (Liu et al. 2024)"] == 2 * math.ceil(d / 2 * math.log(length / (2 * math.pi), base))
    assert rows["first m with sum cos(m theta) < 0 (Xu et al. 2024)"] == _xu_loop(d, base, length) == 3616
    assert rows["NTK-aware base"] == pytest.approx(base * 4 ** (d / (d - 2)))


def test_info_theory_cli(capsys):
    """`info --theory`: a table for a rotary model; for a learned-position model one sentence naming its positions
    while the rest of `info` prints (exit 0); lengths refused before loading; --json carries the rows."""
    from posprobe.cli import main

    assert main(["info", "tiny-rope", "--theory", "--target", "1024", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rope_theory"]
    by = {r["quantity"]: r for r in rows}
    assert by["critical dimension (Liu et al. 2024)"]["unit"] == "dims" and by["target L'"]["value"] == 1024
    assert main(["info", "tiny-ape", "--theory"]) == 0
    out = capsys.readouterr().out
    assert "rope_theory  not applicable" in out and "learned_absolute positions" in out and "n_ctx" in out
    for argv, needle in ((["--theory", "--target", "256"], "must exceed the context L = 256"),
                         (["--target", "512"], "go with --theory"), (["--theory", "--context", "1"], ">= 2")):
        assert main(["info", "tiny-rope", *argv]) == 2
        assert needle in capsys.readouterr().err


def test_a_yarn_scaled_model_is_refused_a_scaling_projection():
    """A model whose rope type already rescaled its table (HF yarn) gets its own numbers, but no projection on top.
    Catches: YaRN projected onto a YaRN table (the factors applied twice, silently)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posprobe.analyses.rope_tables import rope_theory_table
    from posprobe.backend.facts import hf_facts

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      max_position_embeddings=256, vocab_size=300,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                       "original_max_position_embeddings": 128})
    model = hf_facts(LlamaForCausalLM(cfg))
    assert len(rope_theory_table(model, context=128))
    with pytest.raises(ValueError, match="already rescaled"):
        rope_theory_table(model, context=128, target=512)


def test_theory_docstring_example_runs():
    import posprobe.analyses.rope_tables as A

    failed, tried = doctest.testmod(A, verbose=False)
    assert tried >= 2 and failed == 0


def test_every_row_of_the_theory_table_written_out():
    """Every row a user reads (quantity, value, unit, and the numbers in its note) for tiny-rope at L = 256, L2 = 1024,
    recomputed here: loops for Liu, Xu and Chen, HF's `yarn` table for YaRN's kept / ramp / interpolated bands,
    gamma and temperature. Catches: a row's label, unit or number changed, s = L/2 for L, the ramp counts swapped."""
    from posprobe.analyses.rope_tables import rope_theory_table
    from posprobe.backend.loading import load_model

    d, base, length, target = 16, 1e4, 256, 1024
    s = target / length
    theta = [base ** (-2 * j / d) for j in range(d // 2)]
    periods = [2 * math.pi / t for t in theta]
    inside = sum(p <= length for p in periods)
    hf_yarn, hf_t = _hf_table({"rope_type": "yarn", "factor": s, "original_max_position_embeddings": length},
                              d, base, length)
    gamma = [(h / t - 1 / s) / (1 - 1 / s) for h, t in zip(hf_yarn, theta)]
    kept = sum(abs(g - 1) < 1e-6 for g in gamma)
    interp = sum(abs(g) < 1e-6 for g in gamma)
    B = [_chen_B_loop(d, base, x) / d for x in range(1, length + 1)]
    expected = [
        ("context L", length, "tokens"), ("bands completing a period within L", inside, "bands"),
        ("critical dimension (Liu et al. 2024)", 2 * inside, "dims"),
        ("first m with sum cos(m theta) < 0 (Xu et al. 2024)", _xu_loop(d, base, 4 * length), "tokens"),
        ("B(s)/d at s = 1 (Chen et al. 2023)", B[0], "ratio"),
        (f"B(s)/d at s = {length // 2} (Chen et al. 2023)", B[length // 2 - 1], "ratio"),
        (f"B(s)/d at s = {length} (Chen et al. 2023)", B[length - 1], "ratio"),
        ("min B(s)/d over s = 1..L", min(B), "ratio"),
        ("extrapolation / interpolation bound at s = L", 64 * math.log(base) * B[length - 1], "ratio"),
        ("target L'", target, "tokens"), ("PI frequency factor, every band", 1 / s, "x theta"),
        ("NTK-aware base", base * s ** (d / (d - 2)), "base"),
        ("YaRN bands kept (gamma = 1)", kept, "bands"), ("YaRN bands interpolated (gamma = 0)", interp, "bands"),
        ("YaRN bands on the ramp", d // 2 - kept - interp, "bands"), ("YaRN temperature sqrt(1/t)", hf_t, "x q and k"),
        ("YaRN gamma per band", math.nan, "gamma")]
    table = rope_theory_table(load_model("tiny-rope"), context=length, target=target)
    assert [(q, u) for q, _, u in expected] == list(zip(table["quantity"], table["unit"]))
    for (q, value, _), got in zip(expected, table["value"]):
        assert (math.isnan(value) and math.isnan(got)) or got == pytest.approx(value, rel=1e-6), q
    assert set(table["layers"]) == {"0-1"} and set(table["rotary_dim"]) == {d} and set(table["base"]) == {base}
    notes = dict(zip(table["quantity"], table["note"]))
    assert notes["bands completing a period within L"] == (f"of {d // 2}; the slowest has a period of "
                                                           f"{max(periods):,.0f} tokens")
    assert notes["critical dimension (Liu et al. 2024)"].startswith(f"of {d}; the other {d - 2 * inside} ")
    assert notes["first m with sum cos(m theta) < 0 (Xu et al. 2024)"].startswith("inside L")
    assert notes["target L'"] == "scale s = L'/L = 4"
    assert notes["YaRN gamma per band"].endswith(" ".join(f"{abs(round(g, 6)):.2g}" for g in gamma))  # float32 HF table


def test_layer_groups_are_named_as_runs_or_lists():
    from posprobe.analyses.rope_tables import _layers

    assert (_layers([0, 1, 2]), _layers([3]), _layers([0, 1, 2, 4]), _layers([5, 11, 17])) == (
        "0-2", "3", "0,1,2,4", "5,11,17")


def test_first_negative_sum_past_one_search_block():
    """Gemma 3's global layers (d 256, base 1e6) cross at 71,627 tokens, past the search's first block of 65,536
    distances. Catches: the block loop searching only its first block, or restarting at 1."""
    spec = RotarySpec(rotary_dim=256, base=1e6)
    theta = 1e6 ** (-np.arange(0, 256, 2) / 256)
    m = np.arange(60_000, 80_000)
    ref = m[np.flatnonzero(np.cos(np.outer(m, theta)).sum(axis=1) < 0)[0]]
    assert T.first_negative_sum(spec, 100_000) == ref == 71_627
    with pytest.raises(ValueError, match=">= 1"):
        T.first_negative_sum(spec, 0)
