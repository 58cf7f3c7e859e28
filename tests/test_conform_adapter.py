"""`posprobe conform` with any engine, through an `EngineAdapter`: Hugging Face itself in eager attention, loaded
apart from the reference (SDPA), plugged in as a user would plug in vLLM or MLX; it conforms in all four checks. A
planted engine that declares a base 10 % off and rotates with it is named by the declared check; one that rotates
with the wrong base but declares the right one is caught by its behaviour. The adapter's contract is refused with one
sentence when broken.

Planted bugs seen failing (each by editing posprobe/, running this file, then reverting):
- the behaviour verdict without its float-noise floor (EXACT): the exact engine is called "grows with position".
- the adapter's cached scores ignored (cache_pair returning the uncached ones twice): the cache table has no
  difference at all (its KL is exactly 0, which the test checks is not the case for HF's cache).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from posprobe.analyses.configs import ConformConfig
from posprobe.analyses.conform import run_conform
from posprobe.backend.engines.adapter import EngineAdapter
from posprobe.backend.engines.rope import EngineRope

CFG = ConformConfig(lengths=(256,), bins=8, cache_at=128)


@pytest.fixture(scope="module")
def folder():
    from posprobe.backend.hf import hf_folder
    from posprobe.backend.sources import resolve

    return hf_folder(resolve("smollm2"))


def _hf_engine(folder, theta: float, declared: float, name: str) -> EngineAdapter:
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    cfg = AutoConfig.from_pretrained(folder)
    cfg = copy.deepcopy(cfg)
    cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": theta}
    model = AutoModelForCausalLM.from_pretrained(folder, config=cfg, attn_implementation="eager",
                                                 dtype=torch.float32).eval()

    def logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)

    def cached(ids, start, chunk):
        cache, rows = DynamicCache(), []
        with torch.no_grad():
            model(torch.tensor([ids[:start]]), past_key_values=cache, use_cache=True)
            for a in range(start, len(ids), chunk):
                out = model(torch.tensor([ids[a:a + chunk]]), past_key_values=cache, use_cache=True)
                rows.append(torch.log_softmax(out.logits[0], -1))
        return torch.cat(rows)

    return EngineAdapter(name, {"all": EngineRope("all", n_rot=64, base=declared)}, logprobs, cached)


def test_hf_in_eager_conforms_in_all_four_checks(folder):
    got = run_conform("smollm2", CFG, engine=_hf_engine(folder, 1e5, 1e5, "hf-eager"))
    assert got.meta["verdict"] == "conforms" and got.meta["engine"] == "hf-eager"
    assert got.tables["declared"]["bug_class"].tolist() == ["ok"]
    b = got.tables["behaviour_summary"].iloc[0]
    assert b["verdict"] == "position-flat" and b["late_kl"] < 1e-6 and b["top1_first"] == 1.0
    c = got.tables["cache_summary"].set_index("side")
    assert list(c.index) == ["reference", "hf-eager"] and (c["verdict"] == "cache-consistent").all()
    assert 0 < got.tables["cache"].query("side == 'hf-eager'")["kl"].max() < 1e-6  # another path: float noise
    mine = got.tables["precision"].query("mode == 'hf-eager (its own)'").iloc[0]
    assert mine["max_phase_error_in_context"] < 1e-2
    # the local folder is a reference too (the same weights as the packaged file's conversion)
    assert run_conform(folder, ConformConfig(checks=("declared",)),
                       engine=_hf_engine(folder, 1e5, 1e5, "x")).meta["verdict"] == "conforms"


def test_a_wrong_base_is_named_when_declared_and_caught_by_behaviour_when_hidden(folder):
    honest = run_conform("smollm2", ConformConfig(checks=("declared", "behaviour"), lengths=(256,), bins=8),
                         engine=_hf_engine(folder, 9e4, 9e4, "honest"))
    assert honest.tables["declared"].loc[0, "bug_class"] == "base off"
    hidden = run_conform("smollm2", ConformConfig(checks=("declared", "behaviour"), lengths=(256,), bins=8),
                         engine=_hf_engine(folder, 9e4, 1e5, "hidden"))
    assert hidden.tables["declared"].loc[0, "bug_class"] == "ok"
    b = hidden.tables["behaviour_summary"].iloc[0]
    assert b["verdict"] != "position-flat" and hidden.meta["verdict"].startswith("differs: behaviour")
    assert b["late_kl"] > 1e-4  # far above the exact engine's float noise


def test_the_adapters_contract_is_refused_in_one_sentence(folder):
    with pytest.raises(ValueError, match="EngineRope"):
        EngineAdapter("x", {}, lambda ids: None)
    bad = EngineAdapter("short", {"all": EngineRope("all", n_rot=64, base=1e5)}, lambda ids: np.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"shape \(3, 5\); expected \[256, vocab\]"):
        run_conform("smollm2", ConformConfig(checks=("behaviour",), lengths=(256,), bins=8), engine=bad)
    with pytest.raises(ValueError, match="an adapter takes no options"):
        run_conform("smollm2", ConformConfig(checks=("declared",), engine_options=("rope_freq_base=1",)), engine=bad)
    with pytest.raises(ValueError, match="without config.json"):
        run_conform(folder.parent, ConformConfig(checks=("declared",)), engine=bad)
