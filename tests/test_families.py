"""Positional families beyond the first proven ones: each is right or refused with one message before any work.

Before this gate, on these tiny random models: GPT-NeoX's frequency report 'succeeded' with share 0.0 in every
band (its rotation hooks never fired; now they are made to, and partial rotary is proven below), GPT-J crashed in
model_facts and ALiBi (BLOOM) had no notion at all. OPT's identity plan moved the logits by 0.52 (its position table
is read at an offset of 2), GPT-Neo's decomposition wrote a result 1.04 off the scores and SmolLM3's NoPE layers were
reported as rotary: those are now right or refused cell by cell in the support matrix
(tests/test_support_matrix.py), and the nets below catch such cases.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch
from conftest import skip_or_fail_in_ci
from families import ADJACENT, ALL_FAMILIES, FAMILIES, PARTIAL, tiny_family
from hf_util import complex_rotate

from posprobe.analyses.configs import DecomposeConfig, FrequencyConfig
from posprobe.backend.facts import model_facts
from posprobe.rope import RotarySpec

#: A user's older transformers may lack GPT-J's attention interface; CI's .ci/setup resolves transformers 5.24.0 in
#: both environments (TL 4.3.0 and TL 3.9.0 require only >= 5.9.0), so there the skip fails.
GPTJ_OLD_TRANSFORMERS = (f"transformers {version('transformers')}'s GPT-J computes its scores itself (the attention "
                         "interface came in 5.24)")

REFUSAL = {
    "olmo": "clips q/k/v",
}
LAYERS = {
    "cohere": "rotary 100% of head dim, adjacent pairing",
    "cohere2": "layers 0-2: rotary 100% of head dim, adjacent pairing, base 10000, sliding window",
    "glm": "rotary 50% of head dim, adjacent pairing",
    "gpt_neox": "rotary 25% of head dim, half-split pairing",
    "phi3": "rotary 50% of head dim, half-split pairing",
    "phi": "rotary 50% of head dim",
    "stablelm": "rotary 25% of head dim",
    "smollm3": "layer 3: NoPE",
    "bloom": "ALiBi",
    "xglm": "fixed sinusoidal (added to the embedding)",
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    bridge, hf = tiny_family(request.param)
    return request.param, bridge, hf


def test_smollm3_nope_layers_are_facts_and_stay_unrotated():
    # Were reported as rotary. Position control moves the rotary layers only; HF's position_ids agree, on HF's own
    # forward of an independent copy (tiny_family's reference). Positions 5, 7, 9, ...: spaced, not just shifted (a
    # shift turns q and k alike: at positions 5..16 a plan that did nothing matched HF to 2e-6, so did not show).
    # float32 on CPU: measured max |diff| 3.7e-6; tolerance 1e-5.
    from posprobe.core.positions import PositionPlan, rope_positions

    bridge, hf = tiny_family("smollm3")
    f = model_facts(bridge)
    assert f.unsupported is None and f.rotary_layers == (0, 1, 2) and f.rotary[3] is None
    assert "layer 3: NoPE" in " | ".join(f.summary()["layer_positions"])
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12) * 2 + 5
    p = pos.double()
    with torch.no_grad(), rope_positions(bridge, PositionPlan(p, p.clone())):
        got = bridge(ids)
    with torch.no_grad():
        want = hf(ids, position_ids=pos[None]).logits
        own = bridge(ids)
    err = (got - want).abs().max()
    assert err <= 1e-5, f"plan vs HF position_ids: max |diff| {err:.3g}"
    assert (own - want).abs().max() > 1e-3  # the positions mattered
    with pytest.raises(ValueError, match="layer 3 of smollm3 apply no positional encoding"):
        from posprobe.analyses.frequency import frequency_usage

        frequency_usage(bridge, ids.repeat(2, 1), layers=[3], progress=False)


@pytest.mark.parametrize("name", ["opt", "roberta"])
def test_offset_tables_identity_plan_is_the_models_own_forward(name):
    # Was 0.52 off: OPT reads its position table 2 rows in; RoBERTa numbers tokens from padding_idx + 1 (and was
    # refused). Bit-equal now, on tokens that are not RoBERTa's pad id (which HF would give the pad row).
    from posprobe.core.positions import learned_positions

    bridge, _ = tiny_family(name)
    ids = torch.randint(2, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = bridge(ids)
        with learned_positions(bridge, torch.arange(12)[None]):
            assert torch.equal(bridge(ids), own)


@pytest.mark.parametrize("name", [f for f in ALL_FAMILIES if f not in ("falcon_rw", "t5")])
def test_the_bridge_is_the_hf_model(name):
    # Against HF's own forward on an independent copy of the weights (tiny_family's reference; the model the bridge
    # wraps would be the bridge itself: diff 0.0, a check that cannot fail). float32 on CPU: measured max |diff|
    # 0 (Gemma 2, XGLM: TL hands the whole layer to HF) to 4.7e-6 (Gemma 3), ~1e-6 typical; tolerance 1e-5.
    # Where posprobe refuses the bridge's forward (backend.forward_unsupported), the refusal must be earned: the
    # logits really differ (Cohere / Cohere 2 under TL 3.9: 0.042 / 0.070). Should TL fix it, this fails and the
    # refusal can go.
    from posprobe.backend.dispatch import ops

    bridge, hf = tiny_family(name)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (bridge(ids) - hf(ids).logits).abs().max()
    refused = ops(bridge).forward_unsupported(bridge)
    if refused is not None:
        assert err > 1e-3, f"{name}: refused ({refused}) though the bridge matches HF to {err:.3g}"
        with pytest.raises(NotImplementedError, match="does not reproduce"):
            model_facts(bridge)
        return
    assert err <= 1e-5, f"{name}: bridge vs HF max |diff| {err:.3g}"


@pytest.mark.parametrize("name", ["llama", "gpt2", "bloom"])
def test_the_hf_reference_is_independent_of_the_bridge(name):
    # The net under the identities above: the reference shares no module or storage with the bridge, and a bridge
    # whose weights move by 1e-3 (or whose residual stream is nudged by a hook) no longer matches it while the
    # reference's logits stay bit-equal. Fails if tiny_family ever hands back the wrapped (rewired) model again.
    from hf_util import shares_storage

    from posprobe.backend.hooks import hooked

    bridge, hf = tiny_family(name)
    assert hf is not bridge.original_model and not shares_storage(hf, bridge)
    assert not shares_storage(hf, bridge.original_model)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        assert (bridge(ids) - want).abs().max() <= 1e-5
        nudge = 1e-3 * torch.randn(32, generator=torch.Generator().manual_seed(2))  # LayerNorm removes a constant
        with hooked(bridge, [("blocks.0.hook_resid_post", lambda x, hook: x + nudge)]):
            assert (bridge(ids) - want).abs().max() > 1e-5
        assert torch.equal(hf(ids).logits, want)
        w = bridge.original_model.get_input_embeddings().weight  # random: a constant shift is what LayerNorm removes
        kept = w.clone()
        w.add_(1e-3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
        try:
            assert (bridge(ids) - want).abs().max() > 1e-5
            assert torch.equal(hf(ids).logits, want)
        finally:
            w.copy_(kept)


def test_facts_name_the_family_per_layer_and_why_it_is_refused(family):
    name, bridge, _ = family
    f = model_facts(bridge)  # never crashes (GPT-J used to)
    assert f.unsupported is not None and REFUSAL[name] in f.unsupported
    text = " | ".join(f.summary()["layer_positions"])
    assert LAYERS.get(name, "") in text


def test_position_analyses_refuse_before_any_forward(family, monkeypatch):
    from posprobe.analyses.decompose import run_decompose
    from posprobe.analyses.frequency import run_frequency
    from posprobe.core.positions import learned_positions, rope_positions

    name, bridge, _ = family
    calls = []
    monkeypatch.setattr(type(bridge), "forward", lambda *a, **k: calls.append(1))
    f = model_facts(bridge)
    with pytest.raises((NotImplementedError, ValueError), match=REFUSAL[name] if f.is_rotary else ".") as e:
        run_frequency(bridge, "some text " * 50, FrequencyConfig(window=16, max_windows=1, progress=False))
    if f.is_rotary:
        with pytest.raises(NotImplementedError, match=REFUSAL[name]):
            with rope_positions(bridge, q_pos=torch.arange(8.0), k_pos=torch.arange(8.0)):
                pass
    if f.has_w_pos:
        with pytest.raises(NotImplementedError, match=REFUSAL[name]):
            with learned_positions(bridge, torch.arange(8)[None]):
                pass
    with pytest.raises((NotImplementedError, ValueError)) as e:
        run_decompose(bridge, DecomposeConfig(progress=False))
    assert REFUSAL[name] in str(e.value) or "positions" in str(e.value)
    assert calls == []


def test_heads_and_probes_still_run_and_the_atlas_skips_what_is_refused(family):
    from posprobe.analyses.atlas import applicable

    name, bridge, _ = family
    sections = applicable(model_facts(bridge), None)
    assert "heads" in sections and "probes" in sections
    assert not {"frequency", "geometry", "shift"} & set(sections)


def test_a_rotation_hook_that_never_fires_raises(monkeypatch):
    # The nets under the gate. GPT-NeoX's hook_rot_q/k never fire in TL's joint-QKV rotary attention unless posprobe
    # routes the rotation through them (bridge_ops._expose_joint_qkv); with that switched off, as before it, a
    # capture must not return nothing and position control must raise during the forward instead of returning the
    # model's own-position logits.
    import posprobe.backend.bridge_ops as B
    from posprobe.core.capture import capture
    from posprobe.core.positions import PositionPlan, rope_positions

    bridge, _ = tiny_family("gpt_neox", seed=1)  # a fresh bridge: the routing is installed once per module
    monkeypatch.setattr(B, "_expose_joint_qkv", lambda model: None)
    ids = torch.randint(0, 256, (1, 10))
    with pytest.raises(RuntimeError, match="never fired"):
        capture(bridge, ids, ["rot_q"], layers=[0])
    p = torch.arange(10, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="layer 0's rotation hooks never fired"):
        with torch.no_grad(), rope_positions(bridge, PositionPlan(p + 3, p)):
            bridge(ids)


@pytest.mark.parametrize("name", PARTIAL + ADJACENT)
def test_partial_and_adjacent_rotary_queries_and_keys_at_different_positions(name):
    # Only the rotary dims move, paired as the model pairs them. Queries at p + 5, keys at p / 2: layer 0's scores
    # equal plain torch on HF's own q and k before rotation (caught at its modeling module), turned as complex
    # numbers, dotted and scaled. Cohere was read as half-split before (its TL flag is rotary_interleaved_cos_sin).

    from posprobe.backend.bridge import plain_hf_model
    from posprobe.backend.hooks import hooked
    from posprobe.core.positions import PositionPlan, rope_positions

    bridge, _ = tiny_family(name)
    hf = plain_hf_model(bridge)  # HF's own modules (the bridge runs TL's reconstruction of the attention)
    if name.startswith("cohere") and not version("transformer-lens").startswith("4"):
        # TL 3.9's bridge rotates Cohere as half-split pairs (its logits are off too): refused there, naming the
        # version.
        with pytest.raises(NotImplementedError, match=version("transformer-lens")):
            model_facts(bridge)
        return
    f = model_facts(bridge)
    assert f.unsupported is None and LAYERS[name] in " | ".join(f.summary()["layer_positions"])
    from matrix_cells import hf_rope_io

    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    ins, _, proj, _ = hf_rope_io(hf, ids, 0)
    hd = hf.config.hidden_size // hf.config.num_attention_heads
    q, k = (t.transpose(1, 2) for t in ins)  # batch pos head d
    if q.shape[-1] < hd:  # Phi / StableLM hand over the rotated slice: the full heads are q_proj's
        q, k = (proj[w].view(1, 12, -1, hd) for w in "qk")
    # The rotation as HF's config states it (rope_parameters: theta, the rotated fraction of the head), not
    # posprobe's reading of it; posprobe's reading must agree.
    rope = hf.config.rope_parameters
    head_dim = getattr(hf.config, "head_dim", None) or hd
    spec = RotarySpec(rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
                      base=float(rope["rope_theta"]), adjacent=name in ADJACENT)
    assert f.rotary[0] == spec
    adjacent = name in ADJACENT
    assert spec.adjacent == adjacent and (adjacent or spec.rotary_dim < f.d_head)
    p = torch.arange(12, dtype=torch.float64)
    qr = complex_rotate(q.double(), p + 5, spec)[0]
    kr = complex_rotate(k.double(), p / 2, spec)[0]
    kr = kr.repeat_interleave(qr.shape[1] // kr.shape[1], dim=1)
    want = torch.einsum("qhd,khd->hqk", qr, kr) / hd ** 0.5
    got = {}
    with torch.no_grad(), rope_positions(bridge, PositionPlan(p + 5, p / 2)):
        with hooked(bridge, [("blocks.0.attn.hook_attn_scores", lambda s, hook: got.setdefault("s", s))]):
            bridge(ids)
    # The pairs the layer keeps: causal, within Cohere 2's sliding window of 8 (layer 0) where it has one.
    kept = got["s"][0] > torch.finfo(got["s"].dtype).min
    window = 8 if name == "cohere2" else 12
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    assert torch.equal(kept, ((j <= i) & (j > i - window)).expand_as(kept))
    err = (got["s"][0].double() - want)[kept].abs().max()
    assert err <= 1e-5, f"{name}: scores under the plan vs plain torch, max |diff| {err:.3g}"
    assert (want - _own_scores(bridge, ids))[kept].abs().max() > 1e-2  # positions mattered


def _own_scores(bridge, ids):
    from posprobe.backend.hooks import hooked

    got = {}
    with torch.no_grad(), hooked(bridge, [("blocks.0.attn.hook_attn_scores", lambda s, hook: got.setdefault("s", s))]):
        bridge(ids)
    return got["s"][0].double()


def test_a_decomposition_that_does_not_sum_to_the_scores_raises(monkeypatch):
    # The other net: with the up-front checks switched off (as before them), GPT-Neo's terms miss the values of its
    # hook_attn_scores by ~1 (they carry the pattern, not q.k), and the decomposition refuses to return them.
    import posprobe.analyses.decompose as D

    bridge, _ = tiny_family("gpt_neo")
    monkeypatch.setattr(D, "require_supported", lambda facts, what: None)
    monkeypatch.setattr(D, "scores_not_bilinear", lambda model: None)
    monkeypatch.setattr(D, "scores_hook_is_pattern", lambda model: False)
    with pytest.raises(RuntimeError, match="differ from the model's layer-0 scores"):
        D.decompose_layer0(bridge, torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_alibi_slopes_are_measured_and_equal_hfs_own_bias(name):
    # Measured from the model's scores (hook_attn_scores - scale q.k), never from the formula; here checked against
    # the bias tensor HF's own model builds (per head: its step from one key position to the next).
    bridge, hf = tiny_family(name)
    f = model_facts(bridge)
    base = hf.base_model
    if name == "bloom":
        bias = base.build_alibi_tensor(torch.ones(1, 8, dtype=torch.long), 4, torch.float32)[:, 0]
    else:
        bias = base.build_mpt_alibi_tensor(4, 8)[:, 0]
    step = (bias[:, 1:] - bias[:, :-1]).mean(1)
    for layer in f.alibi_slopes:
        assert torch.allclose(torch.tensor(layer, dtype=torch.float64), step.double(), atol=1e-6)
    assert "ALiBi (slopes 2^-2 … 2^-8, measured)" in f.summary()["layer_positions"][0]


@pytest.mark.parametrize("preset", ["pi:scale=2", "yarn:scale=4,original=16", "self-extend:group=3,window=4",
                                    "streaming:sink=2,window=5", "rerope:window=4"])
def test_long_context_engine_leaves_nope_layers_unrotated(preset):
    # Was refused: SmolLM3's NoPE layer (3) must rotate nothing and keep its own score scale while the rotary layers
    # take the preset; eviction applies everywhere. The chunked engine (rotates inside HF's attention interface) and
    # hook surgery on the bridge each equal the paper's rule applied pair by pair over HF's own modules
    # (tests/paper_rules.py), with HF's config naming the NoPE layers (no_rope_layers[l] == 0), per token.
    from paper_rules import pairwise_logits, preset_reference
    from paper_rules import token_nll as reference_nll

    from posprobe.backend.bridge import plain_hf_model
    from posprobe.core import long_engine as LA
    from posprobe.core.generation import logits_under, token_logprobs
    from posprobe.core.presets import preset_pairs, preset_plan

    bridge, ref = tiny_family("smollm3")
    hf = plain_hf_model(bridge)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2))
    cfg = ref.config
    assert 0 in cfg.no_rope_layers and 1 in cfg.no_rope_layers  # NoPE and rotary layers both present
    rel, freqs, factor = preset_reference(preset, len(ids), cfg)
    rotates = [bool(r) for r in cfg.no_rope_layers]
    want = reference_nll(pairwise_logits(ref, ids, rel, freqs=lambda l: freqs if rotates[l] else None,
                                         score_factor=lambda l: factor if rotates[l] else 1.0), ids)
    got = LA.token_nll(hf, ids, preset_pairs(preset), chunk=5)
    assert (got.double() - want).abs().max() <= 1e-5
    plan = -token_logprobs(logits_under(bridge, ids[None], preset_plan(preset, bridge, len(ids))), ids[None])[0]
    assert (plan.double() - want).abs().max() <= 1e-5
    own = LA.token_nll(hf, ids, preset_pairs("none"), chunk=5)
    assert (got - own).abs().max() > 1e-4  # the preset mattered


def test_falcon_with_alibi_is_refused_because_the_bridge_is_not_hf():
    # TransformerLens 4.3's bridge of Falcon-RW (ALiBi) is not HF's forward: every analysis is refused at the facts.
    # Should TL fix it, the first assertion fails and the refusal (bridge_ops.forward_unsupported) can go.
    from posprobe.backend.bridge import plain_hf_model

    bridge, _ = tiny_family("falcon_rw")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (bridge(ids) - plain_hf_model(bridge)(ids).logits).abs().max() > 0.05
    with pytest.raises(NotImplementedError, match="does not reproduce Hugging Face's forward for Falcon with ALiBi"):
        model_facts(bridge)


@pytest.mark.parametrize("name", [f for f in ALL_FAMILIES if f not in ("bert", "roberta", "falcon_rw", "t5")])
def test_residual_to_logits_is_the_models_own_head(name):
    # The logit lens's last step on the final residual equals HF's logits: final norm, unembedding and what each
    # family's forward does after it (Granite's logits_scaling, Cohere's logit_scale, Gemma's soft-cap). Cohere's
    # logit_scale was missing (2.9 off).
    from posprobe.backend.bridge import plain_hf_model
    from posprobe.backend.dispatch import ops
    from posprobe.backend.model import residual_to_logits
    from posprobe.core.capture import capture

    bridge, _ = tiny_family(name)
    if ops(bridge).forward_unsupported(bridge) is not None:  # Cohere under TL 3.9: refused as a whole
        with pytest.raises(NotImplementedError, match="does not reproduce"):
            model_facts(bridge)
        return
    ids = torch.randint(2, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    last = model_facts(bridge).n_layers - 1
    resid = capture(bridge, ids, ["resid_post"], layers=[last])[("resid_post", last)]
    with torch.no_grad():
        want = plain_hf_model(bridge)(ids).logits
    assert (residual_to_logits(bridge, resid) - want).abs().max() <= 1e-4


@pytest.mark.parametrize("route", ["intercepted", "pre-rotation"])
def test_gptj_queries_and_keys_at_different_positions_inside_hfs_own_attention(route, monkeypatch):
    # GPT-J rotates inside HF's GPTJAttention (TL 4 delegates to it; TL fires no hook_rot_q/k). Two routes: where HF's
    # module hands its rotated q/k to the attention interface (transformers >= 5.24) posprobe intercepts them there
    # and fires hook_rot_q/k; otherwise it turns hook_q / hook_k ahead of the model's rotation (forced here by
    # switching the interceptor off). Queries at p + 5, keys at p / 2: layer 0's attention output per head equals
    # plain torch on HF's own q/k/v projections, turned as complex numbers (adjacent pairs, first rotary_dim dims).
    import posprobe.backend.bridge_ops as B
    from posprobe.backend import hf as HF
    from posprobe.backend.bridge import plain_hf_model
    from posprobe.backend.hooks import hooked
    from posprobe.core.positions import PositionPlan, rope_positions

    bridge, _ = tiny_family("gptj")
    hf = plain_hf_model(bridge)
    if route == "intercepted":
        if not HF.uses_attention_interface(hf.transformer.h[0].attn):
            skip_or_fail_in_ci(GPTJ_OLD_TRANSFORMERS)
        assert model_facts(bridge).rotation_unhooked is None
    else:
        monkeypatch.setattr(B, "_intercepts_rotation", lambda model: False)
        assert model_facts(bridge).rotation_unhooked is not None
    attn = [m for m in hf.modules() if type(m).__name__ == "GPTJAttention"][0]
    proj = {}
    handles = [getattr(attn, f"{w}_proj").register_forward_hook(lambda m, i, o, w=w: proj.__setitem__(w, o))
               for w in "qkv"]
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        for h in handles:
            h.remove()
    hd = hf.config.n_embd // hf.config.n_head
    q, k, v = (proj[w][0].view(12, -1, hd).double() for w in "qkv")
    p = torch.arange(12, dtype=torch.float64)
    rd = hf.config.rotary_dim
    spec = RotarySpec(rotary_dim=rd, base=10000.0, adjacent=True)
    qr, kr = complex_rotate(q[None], p + 5, spec)[0], complex_rotate(k[None], p / 2, spec)[0]
    s = torch.einsum("qhd,khd->hqk", qr, kr) / hd ** 0.5
    s = s.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    got = {}
    with torch.no_grad(), rope_positions(bridge, PositionPlan(p + 5, p / 2)):
        with hooked(bridge, [("blocks.0.attn.hook_z", lambda z, hook: got.setdefault("z", z))]):
            bridge(ids)
    assert (got["z"][0].double() - want).abs().max() <= 1e-5
    with torch.no_grad(), hooked(bridge, [("blocks.0.attn.hook_z", lambda z, hook: got.__setitem__("own", z))]):
        bridge(ids)
    assert (got["own"][0].double() - want).abs().max() > 1e-3  # positions mattered
    with torch.no_grad():
        own = bridge(ids)
        with rope_positions(bridge, PositionPlan(p, p.clone())):
            assert torch.equal(bridge(ids), own)  # the identity plan turns by 0: bit-equal


def test_t5_is_refused_as_a_whole_before_any_forward(monkeypatch):
    # T5 booted as a bridge has encoder_blocks / decoder_blocks and no `blocks`: model_facts crashed on it with an
    # AttributeError. Every analysis now refuses it with one message, probes included, before any forward.
    from posprobe.analyses.configs import ProbeConfig
    from posprobe.analyses.probes import run_probes

    bridge, _ = tiny_family("t5")
    calls = []
    monkeypatch.setattr(type(bridge), "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        model_facts(bridge)
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        run_probes(bridge, "some text " * 20, ProbeConfig(window=8, max_windows=2, progress=False))
    assert calls == []


@pytest.mark.parametrize("name", ["gpt_neo", "opt", "gptj"])
def test_decomposition_on_attention_tl_hands_to_hf(name):
    # Was refused (GPT-Neo's terms had been written 1.04 off): TL runs these layers inside HF's own module and fires
    # hook_attn_scores with the pattern, after the fact. The scores are rebuilt from hook_q / hook_k (turned to their
    # positions on GPT-J) with the layer's causal and local masks; layer 1 of GPT-Neo is local (window 16 < 102
    # tokens). Softmax of the summed terms = HF's attention weights.
    from matrix_cells import TEXT, _hf_attention_weights

    from posprobe.analyses.decompose import decompose_heads

    bridge, _ = tiny_family(name)
    sentence = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun near the river bank."
    dec, _ = decompose_heads(bridge, DecomposeConfig(layer=1, text=TEXT, sentence=sentence, max_windows=2,
                                                     progress=False))
    assert dec.tokens.shape[1] > 16
    att = _hf_attention_weights(bridge, dec.tokens, 1)
    assert (torch.softmax(dec.reconstructed(), -1).double() - att.double()).abs().max() <= 1e-5


def test_xglm_sinusoidal_positions_are_named_and_set_as_hf_sets_them():
    # TL calls XGLM's fixed sinusoidal table "standard" (learned) and its bridge has no pos_embed: posprobe called it
    # learned absolute and crashed reading W_pos, then named it and refused. Now position ids reach HF's own sinusoidal
    # module: positions +5 and a batch of two different plans equal HF's forward with those position_ids; the
    # identity plan is bit-equal; ids past the context or of the wrong length raise (the latter during the forward).
    from posprobe.backend.bridge import plain_hf_model
    from posprobe.core.positions import PositionError, learned_positions

    bridge, _ = tiny_family("xglm")
    hf = plain_hf_model(bridge)
    f = model_facts(bridge)
    assert f.positional_kind == "sinusoidal" and not f.has_w_pos and f.unsupported is None
    assert LAYERS["xglm"] in " | ".join(f.summary()["layer_positions"])
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.stack([torch.arange(12) + 5, torch.arange(12) * 3])
    with torch.no_grad():
        want = hf(ids, position_ids=pos).logits
        own = bridge(ids)
        with learned_positions(bridge, pos):
            got = bridge(ids)
        with learned_positions(bridge, torch.arange(12)):
            same = bridge(ids)
    assert (got - want).abs().max() <= 1e-5
    assert (own - want).abs().max() > 1e-3  # positions mattered
    assert torch.equal(same, own)
    with pytest.raises(PositionError, match="past the model's context"):
        with learned_positions(bridge, torch.arange(12) + f.n_ctx):
            pass
    with pytest.raises(ValueError, match="5 position ids given for a sequence of 12 tokens"):
        with torch.no_grad(), learned_positions(bridge, torch.arange(5)):
            bridge(ids)


def test_gptj_rotated_qk_are_hfs_own_and_the_interceptor_leaves_nothing_behind():
    # hook_rot_q/k on GPT-J fire from posprobe's interceptor in HF's attention interface: the captured values are the
    # q/k HF's apply_rotary_pos_emb returned (caught independently inside HF's own forward); afterwards, also after an
    # error inside the block, the model runs its own attention implementation again and no interceptor is left.
    from matrix_cells import _hf_rotated_qk

    from posprobe.backend import hf as HF
    from posprobe.backend.bridge import plain_hf_model
    from posprobe.core.capture import capture

    bridge, _ = tiny_family("gptj")
    hf = plain_hf_model(bridge)
    if not HF.uses_attention_interface(hf.transformer.h[0].attn):
        skip_or_fail_in_ci(GPTJ_OLD_TRANSFORMERS)
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    before = bridge.original_model.config._attn_implementation
    got = capture(bridge, ids, ["rot_q", "rot_k"], layers=[0, 1])
    for layer in (0, 1):
        q, k = _hf_rotated_qk(hf, ids, layer)
        assert (got[("rot_q", layer)] - q).abs().max() <= 1e-5
        assert (got[("rot_k", layer)] - k).abs().max() <= 1e-5
    assert bridge.original_model.config._attn_implementation == before and not HF._INTERCEPT

    def boom(x, hook):
        raise KeyError("inside")

    from posprobe.backend.hooks import hooked

    with pytest.raises(KeyError, match="inside"), torch.no_grad(), hooked(bridge, [("blocks.1.attn.hook_rot_k", boom)]):
        bridge(ids)
    assert bridge.original_model.config._attn_implementation == before and not HF._INTERCEPT
    assert "_posprobe_intercepting" not in bridge.__dict__
