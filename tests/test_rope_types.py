"""Every rope type a shipped model uses (issue 24): dynamic NTK, LongRoPE, YaRN with its attention factor / mscale,
proportional (Gemma 4's p-RoPE), and the refusal of 3-D axial positions.

The independent side is written here from the papers' formulas (float64) and checked against HF's own
`ROPE_INIT_FUNCTIONS`; the model side is HF's forward. Tolerances (CPU, float32 models): tables 1e-6 relative;
identity plans bit-equal; scores under a plan 1e-5 (float32 rotation vs float64 complex numbers); NLL through the
long-context engine 1e-5 nats (angle rounding)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers as T
from hf_util import independent_hf, shares_storage
from matrix_cells import hf_rope_io

from posprobe.backend import hf as door
from posprobe.backend.facts import model_facts
from posprobe.backend.tiny import byte_tokenizer, randomize_
from posprobe.rope import inv_freq_of

_C = dict(vocab_size=259, bos_token_id=256, eos_token_id=257, pad_token_id=258, initializer_range=0.8 / 32**0.5)
_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              **_C)
_PHI3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             **_C)
THRESHOLD = 32  # max_position_embeddings (dynamic) / original_max_position_embeddings (longrope, yarn)


def _cases() -> dict:
    long_short = dict(short_factor=[1.0, 1.3, 1.7, 2.0], long_factor=[2.0, 3.0, 5.0, 9.0])
    return {
        "llama-dynamic": (T.LlamaConfig(max_position_embeddings=THRESHOLD, **_LLAMA, rope_parameters={
            "rope_type": "dynamic", "factor": 2.0, "rope_theta": 100.0}), T.LlamaForCausalLM),
        "stablelm-dynamic-partial": (T.StableLmConfig(max_position_embeddings=THRESHOLD, **_PHI3, rope_parameters={
            "rope_type": "dynamic", "factor": 3.0, "rope_theta": 100.0, "partial_rotary_factor": 0.5}),
            T.StableLmForCausalLM),
        "llama-longrope": (T.LlamaConfig(max_position_embeddings=128, **_LLAMA, rope_parameters={
            "rope_type": "longrope", "rope_theta": 100.0, "original_max_position_embeddings": THRESHOLD,
            **long_short}), T.LlamaForCausalLM),
        "phi3-longrope-partial": (T.Phi3Config(max_position_embeddings=128, original_max_position_embeddings=THRESHOLD,
                                               **_PHI3, rope_parameters={
            "rope_type": "longrope", "rope_theta": 100.0, "original_max_position_embeddings": THRESHOLD,
            "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.5], "long_factor": [2.0, 7.0]}), T.Phi3ForCausalLM),
        "llama-yarn-mscale": (T.LlamaConfig(max_position_embeddings=128, **_LLAMA, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 100.0, "original_max_position_embeddings": THRESHOLD,
            "mscale": 0.707, "mscale_all_dim": 1.0}), T.LlamaForCausalLM),
        "stablelm-yarn-partial": (T.StableLmConfig(max_position_embeddings=128, **_PHI3, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 100.0, "original_max_position_embeddings": THRESHOLD,
            "partial_rotary_factor": 0.5, "attention_factor": 1.3}), T.StableLmForCausalLM),
    }


CASES = tuple(_cases())


def _hf(name: str):
    cfg, cls = _cases()[name]
    cfg.architectures = [cls.__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(cfg).eval()
    randomize_(model, 0)
    return model


def _bridge(hf):
    from transformer_lens.model_bridge import TransformerBridge

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = TransformerBridge.boot_transformers("posprobe-tiny-rope", hf_model=hf, tokenizer=byte_tokenizer())
    bridge.cfg.model_name = "tiny-rope-types"
    return bridge.eval()


def reference_table(rp: dict, head_dim: int, max_pos: int, length: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [band] in rad/token, cos/sin factor) for an input of `length` tokens, float64, from the
    papers: dynamic NTK (bloc97/emozilla), LongRoPE (Ding et al. 2024; factor = max / original when not given),
    YaRN (Peng et al. 2023, with DeepSeek's mscale ratio), proportional (Gemma 4)."""
    kind, base = rp.get("rope_type", "default"), float(rp["rope_theta"])
    prf = rp.get("partial_rotary_factor", 1.0)
    if kind == "proportional":
        turn = int(prf * head_dim // 2)
        inv = torch.tensor([base ** (-2 * b / head_dim) if b < turn else 0.0 for b in range(head_dim // 2)],
                           dtype=torch.float64)
        return inv / rp.get("factor", 1.0), 1.0
    d = int(head_dim * prf)
    b = torch.arange(d // 2, dtype=torch.float64)
    if kind == "dynamic":
        if length > max_pos:
            base = base * (rp["factor"] * length / max_pos - (rp["factor"] - 1)) ** (d / (d - 2))
        return base ** (-2 * b / d), 1.0
    orig = rp["original_max_position_embeddings"]
    if kind == "longrope":
        f = rp.get("factor") or max_pos / orig
        ext = torch.tensor(rp["long_factor"] if length > orig else rp["short_factor"], dtype=torch.float64)
        af = rp.get("attention_factor") or (1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(orig)))
        return 1.0 / (ext * base ** (2 * b / d)), af
    assert kind == "yarn"
    f = rp["factor"]

    def dim_of(turns: float) -> float:  # the band index whose wavelength fits `turns` times into the trained context
        return d * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dim_of(rp.get("beta_fast") or 32)), 0), min(math.ceil(dim_of(rp.get("beta_slow") or 1)),
                                                                          d - 1)
    ramp = ((b - low) / max(high - low, 1e-3)).clamp(0, 1)  # 0: keep (fast bands), 1: interpolate by f
    inv = base ** (-2 * b / d)
    inv = inv * (1 - ramp) + inv / f * ramp

    def m(s: float, k: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * k * math.log(s) + 1.0

    af = rp.get("attention_factor")
    if af is None:
        af = m(f, rp["mscale"]) / m(f, rp["mscale_all_dim"]) if rp.get("mscale") and rp.get("mscale_all_dim") else m(f)
    return inv, af


def _gemma4():
    cfg = T.Gemma4TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=8,
                             max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"], **_C)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return T.Gemma4ForCausalLM(cfg).eval()


@pytest.mark.parametrize("length", [20, THRESHOLD, THRESHOLD + 1, 60])
@pytest.mark.parametrize("name", CASES + ("gemma4-proportional",))
def test_tables_equal_the_papers_and_hfs_rope_init_functions(name, length):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = _gemma4() if name == "gemma4-proportional" else _hf(name)
    layer = 1 if name == "gemma4-proportional" else 0  # Gemma 4's full-attention layer is the proportional one
    rp = door.rope_parameters(hf, layer)
    cfg = door.text_config(hf)
    want, want_af = reference_table(rp, door.head_dim(hf), cfg.max_position_embeddings, length)
    spec = door.rotary_spec(hf, layer, length=length)
    got = inv_freq_of(spec).double()
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-6, atol=0), (got, want)
    assert spec.attention_factor == pytest.approx(want_af, rel=1e-9)
    assert spec.rotary_dim == 2 * want.numel() and spec.removed == frozenset(int(i) for i in (want == 0).nonzero())
    # HF's own function at the same length (proportional / yarn ignore it; dynamic / longrope switch on it)
    lt = door.layer_type(hf, layer) if isinstance(cfg.rope_parameters.get(door.layer_type(hf, layer) or ""), dict) \
        else None
    hf_inv, hf_af = ROPE_INIT_FUNCTIONS[rp["rope_type"]](cfg, "cpu", seq_len=length,
                                                         **({"layer_type": lt} if lt else {}))
    assert torch.allclose(hf_inv.double(), want, rtol=1e-6, atol=0) and hf_af == pytest.approx(want_af, rel=1e-9)
    if name.split("-")[1] in ("dynamic", "longrope"):  # the table really switches at the threshold
        below, _ = reference_table(rp, door.head_dim(hf), cfg.max_position_embeddings, THRESHOLD)
        assert torch.equal(want, below) == (length <= THRESHOLD)


@pytest.mark.parametrize("name", CASES)
def test_identity_plan_is_hfs_own_forward_below_and_above_the_threshold(name):
    from posprobe.core.positions import PositionPlan, rope_positions

    # Against HF's own forward on an independent copy of the weights, made before the bridge boots (the model the
    # bridge wraps is rewired in place: calling it runs the bridge, bit-equal, a check that cannot fail). float32 on
    # CPU: measured max |diff| 1.3e-6 to 2.4e-6 (llama-longrope, 20 tokens); tolerance 1e-5.
    # The identity plan on the bridge itself is bit-equal to the bridge's own forward.
    hf = _hf(name)
    ref = independent_hf(hf)
    bridge = _bridge(hf)
    assert not shares_storage(ref, bridge)  # the reference is not the bridge (hf_util.independent_hf)
    facts = model_facts(bridge)
    assert facts.unsupported is None, facts.unsupported
    for n in (20, 60):
        ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n))
        door.fresh_rope_state(hf)
        door.fresh_rope_state(ref)
        with torch.no_grad():
            want = ref(ids).logits
            own = bridge(ids)
            with rope_positions(bridge, PositionPlan.default(n)):
                got = bridge(ids)
        assert torch.equal(got, own), f"{name} at {n}: identity plan vs the bridge, {(got - own).abs().max():.3g}"
        err = (got - want).abs().max()
        assert err <= 1e-5, f"{name} at {n}: bridge vs HF max |diff| {err:.3g}"


@pytest.mark.parametrize("name", CASES)
def test_queries_and_keys_at_other_positions_use_the_inputs_table_and_attention_factor(name):
    # Above the threshold (60 tokens > 32): queries at p + 5, keys at p / 2. Layer 0's scores equal plain torch on
    # HF's own q and k before rotation, turned as complex numbers by the paper's table for 60 tokens, each scaled by
    # the attention factor (scores by its square).
    from posprobe.backend.hooks import hooked
    from posprobe.core.positions import PositionPlan, rope_positions

    n = 60
    hf = _hf(name)
    ref = independent_hf(hf)  # HF's own modules on a copy of the weights, made before the bridge rewires `hf`
    bridge = _bridge(hf)
    ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(0))
    ins, _, proj, _ = hf_rope_io(ref, ids, 0)
    q, k = (t.transpose(1, 2).double() for t in ins)  # batch pos head d
    hd = door.head_dim(hf)
    if q.shape[-1] < hd:  # StableLM hands over the rotated slice only: the full heads are q_proj's
        q, k = (proj[w].view(1, n, -1, hd).double() for w in "qk")
    inv, af = reference_table(door.rope_parameters(hf, 0), hd, hf.config.max_position_embeddings, n)
    p = torch.arange(n, dtype=torch.float64)

    def turn(x, pos):  # half-split pairs (b, b + r/2) of the first r = 2 * bands dims, times the factor
        h = inv.numel()
        w = torch.polar(torch.ones((), dtype=torch.float64), pos[:, None, None] * inv)
        z = torch.complex(x[..., :h], x[..., h:2 * h]) * w * af
        return torch.cat([z.real, z.imag, x[..., 2 * h:]], dim=-1)

    qr, kr = turn(q[0], p + 5), turn(k[0], p / 2)
    kr = kr.repeat_interleave(qr.shape[1] // kr.shape[1], dim=1)
    want = torch.einsum("qhd,khd->hqk", qr, kr) / hd ** 0.5
    got = {}
    with torch.no_grad(), rope_positions(bridge, PositionPlan(p + 5, p / 2)):
        with hooked(bridge, [("blocks.0.attn.hook_attn_scores", lambda s, hook: got.setdefault("s", s))]):
            bridge(ids)
    kept = torch.ones(n, n, dtype=torch.bool).tril()
    err = (got["s"][0].double() - want)[:, kept].abs().max()
    assert err <= 1e-5, f"{name}: scores under the plan vs plain torch, max |diff| {err:.3g}"
    # The short table would have been wrong past the threshold where the type switches tables.
    short, _ = reference_table(door.rope_parameters(hf, 0), hd, hf.config.max_position_embeddings, THRESHOLD)
    assert torch.equal(short, inv) == (name.split("-")[1] == "yarn")


@pytest.mark.parametrize("name", CASES)
def test_long_context_engine_keeps_the_models_table_and_factor(name):
    # The engine (HF's forward at position ids 0, rotation redone by posprobe) under a preset that moves nothing
    # equals the model's own forward, below and above the threshold.
    from posprobe.core import long_engine as LA
    from posprobe.core.presets import preset_pairs

    hf = _hf(name)
    for n in (20, 60):
        ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))
        own = LA.token_nll(hf, ids, preset_pairs("none"))
        got = LA.token_nll(hf, ids, preset_pairs("shift:k=0"))
        assert (got - own).abs().max() <= 1e-5, f"{name} at {n}: {(got - own).abs().max():.3g}"
        moved = LA.token_nll(hf, ids, preset_pairs("pi:scale=2"))
        assert (moved - own).abs().max() > 1e-3  # the engine's positions reach the scores


def test_dynamic_rope_does_not_remember_a_longer_input(monkeypatch):
    # HF's dynamic module keeps the table of the longest input seen while later inputs stay past the threshold; the
    # long-context harness resets it per input, so a window's NLL does not depend on the windows before it.
    from posprobe.core import long_engine as LA
    from posprobe.core.presets import preset_pairs

    hf = _hf("llama-dynamic")
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(3))
    fresh = LA.token_nll(hf, ids[:40], preset_pairs("none"))
    LA.token_nll(hf, ids, preset_pairs("none"))
    assert torch.equal(LA.token_nll(hf, ids[:40], preset_pairs("none")), fresh)
    monkeypatch.setattr(door, "fresh_rope_state", lambda model: None)
    LA.token_nll(hf, ids, preset_pairs("none"))
    assert (LA.token_nll(hf, ids[:40], preset_pairs("none")) - fresh).abs().max() > 1e-4  # the net can fail


def test_facts_say_how_the_table_changes():
    facts = {n: " | ".join(model_facts(_bridge(_hf(n))).layer_positions) for n in
             ("llama-dynamic", "phi3-longrope-partial", "llama-yarn-mscale")}
    assert "dynamic NTK: the base grows with inputs past 32 tokens" in facts["llama-dynamic"]
    assert "LongRoPE: long factors for inputs past 32 tokens" in facts["phi3-longrope-partial"]
    assert "cos/sin x1.18322" in facts["phi3-longrope-partial"]  # sqrt(1 + ln 4 / ln 32)
    assert "cos/sin x0.964327" in facts["llama-yarn-mscale"]
    g4 = door.rotary_spec(_gemma4(), 1)
    assert len(g4.removed) == 6 and g4.n_bands == 8  # p = 0.25 of 8 bands turn (int(0.25 * 16 // 2) = 2)


def test_axial_positions_are_refused_with_one_message():
    hf = _hf("llama-dynamic")
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 1, 1]}
    with pytest.raises(NotImplementedError, match=r"3-D \(axial\) positions split by mrope_section"):
        door.rotary_spec(hf, 0)
    from posprobe.core import long_engine as LA

    with pytest.raises(NotImplementedError, match="axial"):
        LA.require_supported(hf)


def test_frequency_tables_quote_the_frequencies_of_the_windows_length_and_band_ablation_refuses():
    from posprobe.analyses.frequency import frequency_usage
    from posprobe.analyses.frequency_ablation import BandAblation, ablate_bands

    hf = _hf("llama-longrope")  # context 128, long factors past 32 tokens
    bridge = _bridge(hf)
    rp = door.rope_parameters(hf, 0)
    for n in (20, 60):
        rows = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(n))
        bands = frequency_usage(bridge, rows, batch_size=2, progress=False).tables["bands"]
        got = bands[bands.layer == 0].drop_duplicates("band").sort_values("band")["frequency"].to_numpy()
        want, _ = reference_table(rp, door.head_dim(hf), 128, n)
        assert torch.allclose(torch.tensor(got), want, rtol=1e-6, atol=0), (n, got, want)
    with pytest.raises(NotImplementedError, match="changes with the input's length"):
        with ablate_bands(bridge, BandAblation(name="fast", bands=frozenset({0}))):
            pass


HF_SCALINGS = {
    "hf-linear:factor=2.5": {"rope_type": "linear", "factor": 2.5},
    "hf-dynamic:factor=2": {"rope_type": "dynamic", "factor": 2.0},
    "hf-yarn:factor=4,original=16": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "hf-yarn:factor=4,original=16,mscale=0.707,mscale_all_dim=1": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
        "mscale_all_dim": 1.0},
    "hf:yarn,factor=4,original=16,attention_factor=1.2,beta_fast=8": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.2,
        "beta_fast": 8.0},
    "hf-llama3:factor=8,original=16,high_freq_factor=2": {
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
        "high_freq_factor": 2.0},
    "hf-proportional:p=0.5": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 1.0},
}


def _plain_default(partial: bool):
    # A model whose own rope is the default one, and the same weights under a config that sets `rope`.
    if partial:
        cfg = T.StableLmConfig(max_position_embeddings=THRESHOLD, **_PHI3, rope_parameters={
            "rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5})
        cls = T.StableLmForCausalLM
    else:
        cfg = T.LlamaConfig(max_position_embeddings=THRESHOLD, **_LLAMA, rope_parameters={
            "rope_type": "default", "rope_theta": 100.0})
        cls = T.LlamaForCausalLM
    cfg.architectures = [cls.__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(cfg).eval()
    randomize_(model, 0)

    def configured(rope: dict):
        import copy

        c = copy.deepcopy(cfg)
        c.rope_parameters = {"rope_theta": 100.0, **({"partial_rotary_factor": 0.5} if partial else {}), **rope}
        other = cls(c).eval()
        other.load_state_dict(model.state_dict())
        return other

    return model, configured


@pytest.mark.parametrize("partial", [False, True], ids=["llama", "stablelm-partial"])
@pytest.mark.parametrize("spec", list(HF_SCALINGS))
def test_hf_presets_equal_hfs_config_time_scaling_on_the_same_weights(spec, partial):
    # Two routes to the same number: posprobe's preset on the model as loaded (the long-context engine on the plain
    # model, the hook surgery on a bridge over it), and HF's own forward of a model whose config sets the scaling.
    from posprobe.core import long_engine as LA
    from posprobe.core.generation import logits_under, token_logprobs
    from posprobe.core.presets import preset_pairs, preset_plan

    model, configured = _plain_default(partial)
    if partial and "proportional" in spec:  # HF's own StableLM cannot run it either (its cos/sin cover the full head)
        with pytest.raises(NotImplementedError, match="partial rotary"):
            LA.token_nll(model, torch.arange(40), preset_pairs(spec))
        return
    want_model = configured(HF_SCALINGS[spec])
    n = 48  # past max_position_embeddings (32): dynamic's base has grown
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(5))
    want = LA.token_nll(want_model, ids, preset_pairs("none"))
    got = LA.token_nll(model, ids, preset_pairs(spec))
    assert (got - want).abs().max() <= 1e-6, f"engine {spec}: {(got - want).abs().max():.3g}"
    assert (want - LA.token_nll(model, ids, preset_pairs("none"))).abs().max() > 1e-3  # the scaling mattered
    bridge = _bridge(model)
    hooked_nll = -token_logprobs(logits_under(bridge, ids[None], preset_plan(spec, bridge, n)), ids[None])[0]
    err = (hooked_nll.float() - want).abs().max()
    assert err <= 1e-5, f"hooks {spec}: {err:.3g}"


def test_string_is_the_papers_relative_position_matrix():
    # An et al. (ICLR 2025), their figure: P[i][j] = i - j below the offset S; from S on the diagonal restarts at the
    # local window W (P - S + W). Both forms of posprobe's preset, against the matrix written out here.
    from posprobe.core.presets import preset_pairs

    n, S, W = 40, 12, 4
    i = torch.arange(n, dtype=torch.float64)
    P = i[:, None] - i[None, :]
    want = torch.where(P >= S, P - S + W, P)
    causal = P >= 0
    got = preset_pairs(f"string:offset={S},window={W}").relative(i, i)
    assert torch.equal(got[causal], want[causal])
    assert want[S, 0] == W and want[S - 1, 0] == S - 1 and want[n - 1, 0] == n - 1 - S + W
    with pytest.raises(ValueError, match="window <= offset"):
        preset_pairs("string:offset=4,window=8")


def test_decomposition_uses_the_table_of_its_windows_length():
    # A longrope model past its threshold (a sentence of > 32 tokens): the terms must be rotated with the long
    # factors, or they would not sum to the scores (and _checked would refuse to write them; it did, 4.74 off, before
    # the decomposition asked for the table of its length). The softmax of their sum equals HF's eager weights.
    from matrix_cells import _hf_attention_weights

    from posprobe.analyses.configs import DecomposeConfig
    from posprobe.analyses.decompose import decompose_heads

    bridge = _bridge(_hf("llama-longrope"))
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
    sentence = "A sentence of more than thirty-two bytes, so tokens."
    dec, _ = decompose_heads(bridge, DecomposeConfig(layer=1, text=text, sentence=sentence, max_windows=2,
                                                     progress=False))
    assert dec.tokens.shape[1] > THRESHOLD
    att = _hf_attention_weights(bridge, dec.tokens, 1)
    err = (torch.softmax(dec.reconstructed(), dim=-1).double() - att.double()).abs().max()
    assert err <= 1e-5, f"softmax of the summed terms vs HF's attention weights: {err:.3g}"


@pytest.mark.parametrize("name", ["llama-dynamic", "phi3-longrope-partial"])
def test_hf_scoring_of_a_length_rule_model_does_not_depend_on_batch_or_history(name):
    # HF's dynamic NTK / LongRoPE pick the table from max(position_ids) + 1 of the whole batch, and dynamic NTK keeps
    # the largest table it has built. The shift test's HF path scores such a model one row per forward from a fresh
    # table: a sequence's log-probs are those of a forward on it alone, whatever was scored with it or before it.
    from posprobe.core.scoring import HFScorer, Positioned

    hf = _hf(name)

    class Tok:
        pad_token_id = 0

    ids = tuple(int(t) for t in torch.randint(1, 50, (10,), generator=torch.Generator().manual_seed(3)))
    long = Positioned(ids, tuple(range(24, 34)))  # past the threshold (32) ...
    short = Positioned(ids[:6], tuple(range(24, 30)))  # ... within it; the same start: one batch

    def alone(item, model=None):
        model = model or _hf(name)  # a model that has never seen a longer input
        with torch.no_grad():
            logits = model(torch.tensor([item.ids]), position_ids=torch.tensor([item.positions])).logits[0].double()
        return torch.log_softmax(logits, -1)[torch.arange(len(item.ids) - 1), torch.tensor(item.ids[1:])]

    scorer = HFScorer(hf, Tok())
    assert scorer.one_row_per_forward
    got_long, got_short = scorer.token_logprobs([long, short], batch_size=8)
    assert (got_long - alone(long)).abs().max() <= 1e-5 and (got_short - alone(short)).abs().max() <= 1e-5
    # Not vacuous: in one HF forward with the long row (padded as the scorer pads), the short row gets other numbers.
    with torch.no_grad():
        x = torch.tensor([ids, ids[:6] + (0,) * 4])
        batch = _hf(name)(x, position_ids=torch.arange(24, 34).repeat(2, 1)).logits[1, :5].double()
    lp = torch.log_softmax(batch, -1)[torch.arange(5), torch.tensor(ids[1:6])]
    assert (lp - alone(short)).abs().max() > 1e-3
