"""Head similarity across models (posprobe.analyses.head_similarity, Kazemnejad et al. 2023 Fig. 4): the
Jensen-Shannon sums against a brute-force numpy loop (<= 1e-9, float64), the nearest head found, a model against
itself at 0 with every head its own nearest, the symmetric case, and the model-level tables against patterns read
from Hugging Face's own eager attention weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from posprobe.analyses.head_similarity import head_similarity, jsd_sums


def _random_patterns(seed: int, batch: int = 2, heads: int = 3, n: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, heads, n, n, generator=g, dtype=torch.float64) * 2
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def _brute_jsd(p: np.ndarray, r: np.ndarray) -> float:
    total = 0.0
    for x, y in zip(p, r):
        m = (x + y) / 2
        for a, c in ((x, m), (y, m)):
            total += 0.5 * sum(a[j] * math.log(a[j] / c[j]) for j in range(len(a)) if a[j] > 0)
    return total


def test_jsd_sums_equal_a_brute_force_loop_and_are_symmetric():
    pa, pb = _random_patterns(0), _random_patterns(1, heads=4)
    got = jsd_sums(pa, pb)
    assert got.shape == (3, 4)
    for h in range(3):
        for k in range(4):
            want = sum(_brute_jsd(pa[b, h, 1:].numpy(), pb[b, k, 1:].numpy()) for b in range(pa.shape[0]))
            assert got[h, k].item() == pytest.approx(want, abs=1e-9)
    assert torch.allclose(jsd_sums(pb, pa), got.T, atol=1e-12)  # JSD is symmetric
    assert (got >= 0).all() and (got <= math.log(2) * 2 * 5 + 1e-12).all()  # at most ln 2 per (input, query)
    assert torch.allclose(torch.diagonal(jsd_sums(pa, pa)), torch.zeros(3, dtype=torch.float64), atol=1e-12)


def test_jsd_refuses_patterns_of_different_inputs():
    with pytest.raises(ValueError, match="different inputs"):
        jsd_sums(_random_patterns(0, n=6), _random_patterns(1, n=5))


def _hf_patterns(reference, ids: torch.Tensor) -> list[torch.Tensor]:
    # HF's own eager attention weights, [batch, head, query, key] per layer.
    reference.config._attn_implementation = "eager"
    with torch.no_grad():
        return [a.double() for a in reference(ids, output_attentions=True).attentions]


def test_model_level_tables_against_hf_eager_attention():
    from families import tiny_family

    a, ref_a = tiny_family("llama", seed=0)
    b, ref_b = tiny_family("llama", seed=1)
    ids = torch.randint(3, 250, (3, 10), generator=torch.Generator().manual_seed(5))
    res = head_similarity(a, b, ids, batch_size=2)
    heads = res.tables["head_similarity"].set_index(["layer", "head"])
    pa, pb = _hf_patterns(ref_a, ids), _hf_patterns(ref_b, ids)
    for layer in range(len(pa)):
        want = np.zeros((pa[layer].shape[1], pb[layer].shape[1]))
        for h in range(want.shape[0]):
            for k in range(want.shape[1]):
                want[h, k] = sum(_brute_jsd(pa[layer][i, h, 1:].numpy(), pb[layer][i, k, 1:].numpy())
                                 for i in range(ids.shape[0])) / (ids.shape[0] * (ids.shape[1] - 1))
        for h in range(want.shape[0]):
            row = heads.loc[(layer, h)]
            assert row.jsd_min == pytest.approx(want[h].min(), abs=1e-6)  # float32 patterns: 1e-6 nats
            assert row.nearest_head == int(want[h].argmin())
            assert row.jsd_mean == pytest.approx(want[h].mean(), abs=1e-6)
        per_layer = res.tables["head_similarity_layer"].set_index("layer").jsd_min[layer]
        assert per_layer == pytest.approx(want.min(axis=1).mean(), abs=1e-6)
    assert (heads.jsd_min > 1e-3).all()  # two seeds differ: the comparison is not vacuous
    itself = head_similarity(a, a, ids).tables["head_similarity"]
    assert (itself.jsd_min.abs() < 1e-12).all() and (itself.nearest_head == itself["head"]).all()


def test_models_of_different_depth_or_vocabulary_are_refused_before_any_forward(monkeypatch):
    from dataclasses import replace

    from families import tiny_family

    import posprobe.analyses.head_similarity as H

    a, _ = tiny_family("llama")
    b, _ = tiny_family("llama", seed=1)
    monkeypatch.setattr(H, "capture", lambda *x, **k: pytest.fail("a forward ran"))
    ids = torch.randint(3, 250, (2, 8))
    with pytest.raises(ValueError, match="layers must be"):
        head_similarity(a, b, ids, layers=[99])
    facts = H.model_facts
    with monkeypatch.context() as m:
        m.setattr(H, "model_facts", lambda model: replace(facts(model), n_layers=3) if model is b else facts(model))
        with pytest.raises(ValueError, match="depths must match"):
            head_similarity(a, b, ids)
    with monkeypatch.context() as m:
        m.setattr(H, "model_facts", lambda model: replace(facts(model), attention_unsupported="not proven here")
                  if model is b else facts(model))
        with pytest.raises(NotImplementedError, match="Head similarity is not available.*not proven here"):
            head_similarity(a, b, ids)
    b.tokenizer.add_tokens(["<posprobe-extra>"])
    with pytest.raises(ValueError, match="different vocabularies"):
        head_similarity(a, b, ids)


def test_layer_subsets_labels_meta_and_every_pair():
    """What the tables and meta say besides the divergences: only the layers asked for, each row labelled with both
    models, the per-layer count of A's heads, the run's config and data in meta; pairwise sums default to every
    ordered pair and do not depend on the batch size. Catches: layers ignored, names swapped, count of B's heads,
    meta's length or batch size off, pairs (i, i) or only i < j, a batch's sums dropped or counted twice."""
    from families import tiny_family

    from posprobe.analyses.head_similarity import pairwise_jsd_sums
    from posprobe.backend.facts import model_facts

    a, _ = tiny_family("llama", seed=0)
    b, _ = tiny_family("llama", seed=1)
    ids = torch.randint(3, 250, (3, 9), generator=torch.Generator().manual_seed(7))
    res = head_similarity(a, b, ids, layers=[1], batch_size=2)
    heads, per_layer = res.tables["head_similarity"], res.tables["head_similarity_layer"]
    na, nb = model_facts(a).name, model_facts(b).name
    assert set(heads.layer) == {1} and list(per_layer.layer) == [1]
    assert set(heads.model) == {na} and set(heads.other) == {nb} and list(per_layer.model) == [na]
    assert list(heads["head"]) == list(range(model_facts(a).n_heads)) and per_layer["count"].item() == len(heads)
    assert res.meta["config"] == {"layers": [1], "batch_size": 2, "length": 9}
    assert res.meta["data"]["n_items"] == 3 and res.meta["data"]["unit"] == "sequences"
    assert res.meta["analysis"] == "head-similarity" and "Jensen-Shannon" in res.meta["definition"]
    c, _ = tiny_family("llama", seed=2)
    every = pairwise_jsd_sums([a, b, c], ids, [0, 1], batch_size=1)
    assert sorted(every) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)]
    whole = pairwise_jsd_sums([a, b, c], ids, [0, 1], batch_size=3)
    for pair, layers in every.items():
        assert sorted(layers) == [0, 1]
        for layer, total in layers.items():
            assert torch.allclose(total, whole[pair][layer], atol=1e-9)
            assert torch.allclose(total, every[pair[::-1]][layer].T, atol=1e-9)  # JSD is symmetric
