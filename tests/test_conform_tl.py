"""`posprobe conform --engine transformer-lens`: TransformerLens as the engine, on the packaged SmolLM2 GGUF against
posprobe's HF reference of the same file. The TransformerBridge (TL 4.x here, TL 3.9 in .ci/legacy) and the TL 3
HookedTransformer (TL 3.9 only): what each declares is read independently from its config, its forward agrees with
HF to float noise, its cache verdict follows from whether the cache holds the prefill, and the HookedTransformer's
phase arithmetic equals TL's own rotary tables.

Planted bugs seen failing (each by editing posprobe/, running this file, then reverting):
- the engine's ids shifted by one (`list(ids[1:]) + [0]` in tl.next_token_logprobs): behaviour differs everywhere.
- tl.phases without TL's scaling-factor term on a scaled config, or with the base's exponent over n_rot instead of
  n_rot / 2: the HookedTransformer's tables disagree.
- the cache's steps without the cache object (kw dropped): the HookedTransformer is called cached-differs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import need_hooked

from posprobe.analyses.configs import ConformConfig
from posprobe.analyses.conform import run_conform

CHECKS = ("declared", "behaviour", "cache")


def _run(backend: str):
    cfg = ConformConfig(engine="transformer-lens", engine_options=(f"backend={backend}",), checks=CHECKS,
                        lengths=(128,), bins=8, cache_at=96)
    return run_conform("smollm2", cfg)


def test_the_bridge_declares_its_config_and_computes_as_hf():
    from transformers import DynamicCache

    from posprobe.backend.engines.tl import _model

    got = _run("bridge")
    model = _model(str(_path()), "bridge")
    d = got.tables["declared"].iloc[0]
    assert d["engine_base"] == float(model.cfg.rotary_base)  # what TL's config says, read apart
    assert d["bug_class"] == ("ok" if model.cfg.rotary_base == 1e5 else "base off")
    b = got.tables["behaviour_summary"].iloc[0]
    assert b["verdict"] == "position-flat" and b["late_kl"] < 1e-6 and b["top1_first"] == 1.0
    # The cache verdict follows from whether the bridge keeps the prefill in the HF cache it is handed.
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([list(range(100, 140))]), past_key_values=cache)
    kept = cache.get_seq_length() == 40
    tl = got.tables["cache_summary"].set_index("side").loc["transformer-lens"]
    assert tl["verdict"] == ("cache-consistent" if kept else "cached differs everywhere"), (kept, tl["why"])


def _path():
    from posprobe.analyses.conform import engine_file

    return engine_file("smollm2", "transformer-lens")


def test_the_hooked_transformer_conforms_and_its_phases_are_tls_tables():
    need_hooked()
    from posprobe.backend.engines import tl

    got = _run("hooked")
    assert got.meta["verdict"] == "conforms", got.meta["verdict"]
    assert got.tables["behaviour_summary"]["late_kl"].iloc[0] < 1e-6
    assert got.tables["cache"].query("side == 'transformer-lens'")["kl"].max() < 1e-6
    model = tl._model(str(_path()), "hooked")
    rope = tl.declared({}, {"backend": "hooked"}, path=_path())["all"]
    attn = model.blocks[0].attn  # TL's own tables, [n_ctx, rotary_dim], half-split pairs
    pos = np.array([0, 1, 100, 1000, attn.rotary_sin.shape[0] - 1])
    mine = tl.phases(rope)(pos)
    half = rope.n_rot // 2
    theirs = torch.atan2(attn.rotary_sin[pos, :half], attn.rotary_cos[pos, :half]).double().numpy()
    wrapped = np.angle(np.exp(1j * (mine - theirs)))
    assert np.abs(wrapped).max() < 1e-5


def test_options_and_scalings_tl_cannot_take_are_refused():
    with pytest.raises(ValueError, match="backend=bridge or backend=hooked"):
        ConformConfig(engine="transformer-lens", engine_options=("rope_freq_base=1",))
    with pytest.raises(ValueError, match="cannot be handed to it"):
        run_conform("smollm2", ConformConfig(engine="transformer-lens", checks=("declared",),
                                             rope_scaling={"rope_type": "linear", "factor": 2.0}))
