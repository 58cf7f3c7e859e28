"""`posprobe conform`, check 3 (cache boundaries): the verdict on planted arrays; HF's own cached and uncached
forwards on tiny random Llamas (a static rotation agrees both ways, decoding or chunked; HF's dynamic NTK and longrope
differ exactly from their switch on, transformers #25104), each side checked against a plain HF call; llama.cpp on
the packaged SmolLM2 GGUF (consistent as it is; its cached keys' positions moved at the switch or from the prefill
on are caught); the command with a scaling llama.cpp has no form of.

Planted bugs seen failing (each by editing posprobe/, running this file, then reverting):
- the reference's uncached side as one pass for every rotation (no per-prefix passes for dynamic): the dynamic and
  longrope models are called consistent.
- the floor read from positions at and past the switch (offset >= 0): the same, and the planted arrays' verdict.
- no `cached differs everywhere` (the floor test dropped): llama.cpp's cache moved from the prefill on is called
  consistent.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import need_package

from posprobe.analyses.conform_cache import FLOOR, OFFSETS, cache_tables
from posprobe.backend.engines.reference import cached_logprobs, switch_position, uncached_logprobs

L = 32  # the tiny models' switch position


def _llama(rope: dict | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    params = {"rope_type": "default", "rope_theta": 10000.0, **(rope or {})}
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=L, rope_parameters=params)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than init's: a sharper model shows a rotation change more
        for p in model.parameters():
            p.mul_(8.0 if p.dim() == 2 else 1.0)
    return model


def _check(model, at: int = L, chunk: int = 1):
    ids = torch.randint(0, 97, (at + 65,), generator=torch.Generator().manual_seed(1)).tolist()
    positions = [at + o for o in OFFSETS]
    start = positions[0]
    per_prefix = switch_position(model.config) is not None
    u = uncached_logprobs(model, ids, positions, per_prefix=per_prefix)
    c = cached_logprobs(model, ids, start, chunk=chunk)[[p - start for p in positions]]
    return ids, positions, u, c, cache_tables("reference", u, c, at=at, positions=positions, how="test")


def test_the_verdict_on_planted_arrays():
    rng = np.random.default_rng(0)
    lp = np.log(rng.dirichlet(np.ones(50), size=len(OFFSETS)))
    pos = [100 + o for o in OFFSETS]
    t, r = cache_tables("x", lp, lp.copy(), at=100, positions=pos, how="")
    assert r["verdict"] == "cache-consistent" and t["kl"].max() == 0 and r["first_over"] is None
    moved = lp.copy()
    moved[5:] = np.log(rng.dirichlet(np.ones(50), size=len(OFFSETS) - 5))  # only past position 100 + 1
    t, r = cache_tables("x", lp, moved, at=100, positions=pos, how="")
    assert r["verdict"] == "cached differs past the switch" and r["first_over"] == 101
    noisy = lp + rng.normal(0, 1e-2, lp.shape)  # an engine's batch-shape noise everywhere, before the switch too
    noisy -= np.log(np.exp(noisy).sum(axis=1, keepdims=True))
    _, r = cache_tables("x", lp, noisy, at=100, positions=pos, how="")
    assert r["verdict"] == "cache-consistent" and r["floor_kl"] > FLOOR


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_static_rotation_is_cache_consistent_on_hf_itself(chunk):
    model = _llama(None)
    ids, positions, u, c, (t, r) = _check(model, chunk=chunk)
    assert r["verdict"] == "cache-consistent" and t["kl"].max() < 1e-9
    with torch.no_grad():  # both sides against a plain HF forward over the whole input
        plain = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()
    np.testing.assert_allclose(u, plain[positions], atol=1e-5)
    np.testing.assert_allclose(c, plain[positions], atol=1e-5)


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 4.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [16.0] * 8,
                                   "original_max_position_embeddings": L}])
def test_hfs_length_dependent_rotations_differ_from_their_switch_on(rope):
    model = _llama(rope)
    assert switch_position(model.config) == L
    ids, positions, u, c, (t, r) = _check(model)
    assert r["verdict"] == "cached differs past the switch" and r["first_over"] == L
    assert t[t["offset"] < 0]["kl"].max() < 1e-9 < t[t["offset"] >= 0]["kl"].min()
    with torch.no_grad():  # the uncached side is a fresh HF pass over each prefix
        for i in (3, 4, 10):
            model.model.rotary_emb.__init__(model.config)  # HF's module as loaded: no state of an earlier input
            plain = torch.log_softmax(model(torch.tensor([ids[: positions[i] + 1]])).logits[0, -1].double(), -1)
            np.testing.assert_allclose(u[i], plain.numpy(), atol=1e-5)


def test_llama_cpp_decodes_through_its_cache_as_one_pass_and_moved_positions_are_caught(monkeypatch):
    need_package("llama_cpp", "pip install llama-cpp-python (bash .ci/setup --test builds it)")
    from posprobe.analyses.configs import ConformConfig
    from posprobe.analyses.conform import run_conform

    ok = run_conform("smollm2", ConformConfig(checks=("cache",), lengths=(128,), cache_at=128))
    s = ok.tables["cache_summary"].set_index("side")
    assert ok.meta["verdict"] == "conforms" and (s["verdict"] == "cache-consistent").all()
    assert s.loc["llama.cpp", "floor_kl"] < 0.02  # batch shapes move a 4-bit model's sums a little

    from llama_cpp import Llama

    real = Llama.eval

    def planted(at):  # from `at` on, the cached keys but the last moved 2 positions on (llama.cpp re-rotates them)
        def gap(self, tokens):
            if self.n_tokens == at and len(tokens) == 1 and not getattr(self, "_gapped", False):
                self._gapped = True
                self._ctx.kv_cache_seq_shift(0, 0, self.n_tokens - 1, 2)
            return real(self, tokens)
        return gap

    for at, says in ((128, "cached differs past the switch"), (124, "cached differs everywhere")):
        monkeypatch.setattr(Llama, "eval", planted(at))
        bad = run_conform("smollm2", ConformConfig(checks=("cache",), lengths=(128,), cache_at=128))
        assert f"cache: llama.cpp {says} at 128" in bad.meta["verdict"], (at, bad.meta["verdict"])


def test_a_scaling_the_engine_has_no_form_of_is_checked_on_hfs_side(tmp_path, capsys):
    from posprobe.cli import main

    dyn = '{"rope_type": "dynamic", "factor": 2, "original_max_position_embeddings": 64}'
    assert main(["conform", "smollm2", "--rope-scaling", dyn, "--check", "cache", "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "engine not run: not checked" in out.splitlines()[0]
    assert "[cache] reference around position 64: cached differs past the switch" in out and "llama.cpp around" \
        not in out
    assert main(["conform", "smollm2", "--rope-scaling", dyn, "--out", str(tmp_path / "e")]) == 2
    assert "--check cache --check precision" in capsys.readouterr().err and not (tmp_path / "e").exists()
