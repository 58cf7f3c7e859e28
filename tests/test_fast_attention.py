"""Fused attention inside a TransformerBridge (backend/fast_attention.py), against plain Hugging Face models
with their default SDPA attention on identical weights, and against the bridge's own step-by-step attention."""

from __future__ import annotations

import copy

import pytest
import torch
from test_long_context import _gemma3

from posprobe.backend.fast_attention import sdpa_attention, sdpa_usable
from posprobe.backend.hooks import hook_name, hooked
from posprobe.backend.model import forward, n_layers
from posprobe.core.capture import capture

VOCAB, T = 61, 40  # Gemma 3 here: sliding window 6, so T crosses it in the sliding layers


def _bridge_over(hf):
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend.tiny import byte_tokenizer

    hf.config.architectures = [type(hf).__name__]  # a model built from a config has none; the bridge asks
    return TransformerBridge.boot_transformers("tiny", hf_model=hf, tokenizer=byte_tokenizer(), device="cpu").eval()


@pytest.fixture(scope="module", params=["tiny-rope", "gemma3"])
def pair(request):
    """(plain HF model, a TransformerBridge over an identical copy of its weights)."""
    if request.param == "tiny-rope":
        from posprobe.backend.tiny import tiny_hf_model

        plain = tiny_hf_model("tiny-rope", seed=0).eval()
    else:
        plain = _gemma3()
    bridge = _bridge_over(copy.deepcopy(plain))
    assert plain.config._attn_implementation == "sdpa"  # HF's default: the reference uses fused kernels
    return plain, bridge


@pytest.fixture()
def sdpa_calls(monkeypatch):
    calls: list[tuple] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    return calls


def _tokens(n: int = T) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


def test_fused_forward_equals_plain_hf_and_runs_sdpa_in_every_layer(pair, sdpa_calls):
    plain, bridge = pair
    toks = _tokens()
    with torch.no_grad():
        ref = plain(input_ids=toks).logits
        sdpa_calls.clear()
        eager = forward(bridge, toks)
        assert sdpa_calls == []  # the bridge's own attention: explicit scores and pattern
        fused = forward(bridge, toks, fused_attention=True)
    assert len(sdpa_calls) == n_layers(bridge)
    # Same kernels as the plain model (measured 0.0 on both); the bridge's eager path differs by rounding only.
    assert (fused - ref).abs().max() <= 1e-6
    assert (eager - ref).abs().max() <= 1e-4


def test_hooks_outside_attention_fire_with_the_same_values(pair):
    _, bridge = pair
    toks, last = _tokens(), n_layers(bridge) - 1
    points = [("q", 0), ("k", 0), ("v", 0), ("z", 0), ("resid_post", last)]
    got: dict = {}
    with torch.no_grad():
        for fused in (False, True):
            hooks = [
                (hook_name(p, l), lambda x, hook, key=(p, fused): got.__setitem__(key, x.clone())) for p, l in points
            ]
            with hooked(bridge, hooks):
                assert sdpa_usable(bridge)  # nothing inside attention is hooked
                forward(bridge, toks, fused_attention=fused)
    for p in ("q", "k", "v"):  # layer 0's projections see the same input: equal bit for bit
        assert torch.equal(got[(p, False)], got[(p, True)]), p
    assert (got[("z", False)] - got[("z", True)]).abs().max() <= 1e-6
    r = got[("resid_post", False)]
    assert (r - got[("resid_post", True)]).abs().max() <= 1e-5 * r.abs().max()


@pytest.mark.parametrize("point", ["rot_q", "rot_k", "scores", "pattern"])
def test_a_hook_inside_attention_keeps_the_bridges_own_attention(pair, sdpa_calls, point):
    _, bridge = pair
    toks = _tokens()
    with torch.no_grad():
        eager = forward(bridge, toks)
        with hooked(bridge, [(hook_name(point, 1), lambda x, hook: x)]):
            assert not sdpa_usable(bridge)
            sdpa_calls.clear()
            out = forward(bridge, toks, fused_attention=True)
    assert sdpa_calls == [] and torch.equal(out, eager)


def test_capture_fuses_only_when_it_reads_nothing_inside_attention(pair, sdpa_calls):
    _, bridge = pair
    toks = _tokens()
    sdpa_calls.clear()
    resid = capture(bridge, toks, ["resid_pre"], layers=[1])
    assert len(sdpa_calls) == 2  # blocks 0 and 1 ran fused (capture stops after the last layer it reads)
    sdpa_calls.clear()
    pattern = capture(bridge, toks, ["pattern"], layers=[1])
    assert sdpa_calls == [] and pattern[("pattern", 1)].shape == (2, bridge.cfg.n_heads, T, T)
    with torch.no_grad():
        ref = forward(bridge, toks, stop_at_layer=1)
    assert (resid[("resid_pre", 1)] - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_everything_is_restored_also_on_error(pair):
    _, bridge = pair
    configs = {id(bridge.original_model.config): bridge.original_model.config}
    before = {k: c._attn_implementation for k, c in configs.items()}
    with pytest.raises(RuntimeError, match="boom"):
        with sdpa_attention(bridge) as fused:
            assert fused and bridge.original_model.config._attn_implementation == "sdpa"
            with sdpa_attention(bridge) as inner:  # nesting leaves the outer context in force
                assert inner
            assert all("forward" in b.attn.__dict__ for b in bridge.blocks)
            assert bridge.original_model.config._attn_implementation == "sdpa"
            raise RuntimeError("boom")
    assert {k: c._attn_implementation for k, c in configs.items()} == before
    assert not any("forward" in b.attn.__dict__ for b in bridge.blocks)


def test_models_without_q_k_v_o_modules_are_left_alone(tiny_ape, sdpa_calls):
    # GPT-2's fused c_attn projection: the bridge's own attention always runs.
    assert not sdpa_usable(tiny_ape)
    toks = torch.randint(0, 200, (1, 12))
    with torch.no_grad():
        assert torch.equal(forward(tiny_ape, toks, fused_attention=True), forward(tiny_ape, toks))
    assert sdpa_calls == []
