"""Positional families beyond the proven ones: each is right or refused with one message before any work.

Before this gate, on these tiny random models: GPT-NeoX's frequency report 'succeeded' with share 0.0 in every
band (its rotation hooks never fire), GPT-J crashed in model_facts and ALiBi (BLOOM) had no notion at all. OPT's
identity plan moved the logits by 0.52 (its position table is read at an offset of 2), GPT-Neo's decomposition
wrote a result 1.04 off the scores and SmolLM3's NoPE layers were reported as rotary: those three are now right
or refused cell by cell in the support matrix (tests/test_support_matrix.py), and the nets below catch such cases.
"""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES, tiny_family

from posprobe.analyses.configs import DecomposeConfig, FrequencyConfig
from posprobe.backend.facts import model_facts

REFUSAL = {
    "gpt_neox": "partial rotary",
    "gptj": "without a rotary-embedding module",
    "bloom": "not been proven against Hugging Face",
    "phi3": "partial rotary",
    "phi": "partial rotary",
}
LAYERS = {
    "gpt_neox": "rotary 25% of head dim, half-split pairing",
    "phi3": "rotary 50% of head dim, half-split pairing",
    "smollm3": "layer 3: NoPE",
    "bloom": "ALiBi",
    "phi": "rotary 50% of head dim",
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    bridge, hf = tiny_family(request.param)
    return request.param, bridge, hf


def test_smollm3_nope_layers_are_facts_and_stay_unrotated():
    # Were reported as rotary. Position control moves the rotary layers only; HF's position_ids agree.
    from posprobe.core.positions import PositionPlan, rope_positions

    bridge, hf = tiny_family("smollm3")
    f = model_facts(bridge)
    assert f.unsupported is None and f.rotary_layers == (0, 1, 2) and f.rotary[3] is None
    assert "layer 3: NoPE" in " | ".join(f.summary()["layer_positions"])
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    p = torch.arange(12, dtype=torch.float64) + 5
    with torch.no_grad(), rope_positions(bridge, PositionPlan(p, p.clone())):
        got = bridge(ids)
    with torch.no_grad():
        want = hf(ids, position_ids=(torch.arange(12) + 5)[None]).logits
    assert (got - want).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="layer 3 of smollm3 apply no positional encoding"):
        from posprobe.analyses.frequency import frequency_usage

        frequency_usage(bridge, ids.repeat(2, 1), layers=[3], progress=False)


def test_opt_identity_plan_is_the_models_own_forward():
    # Was 0.52 off: OPT reads its position table 2 rows in. Bit-equal now.
    from posprobe.core.positions import learned_positions

    bridge, _ = tiny_family("opt")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = bridge(ids)
        with learned_positions(bridge, torch.arange(12)[None]):
            assert torch.equal(bridge(ids), own)


def test_the_bridge_is_the_hf_model(family):
    name, bridge, hf = family
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (bridge(ids) - hf(ids).logits).abs().max() <= 1e-5


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


def test_a_rotation_hook_that_never_fires_raises():
    # The net under the gate: GPT-NeoX's hook_rot_q exists but never fires; a capture must not return nothing.
    from posprobe.core.capture import capture

    bridge, _ = tiny_family("gpt_neox")
    with pytest.raises(RuntimeError, match="never fired"):
        capture(bridge, torch.randint(0, 256, (1, 10)), ["rot_q"], layers=[0])


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
