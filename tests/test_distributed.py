"""Data parallel over 2 gloo processes on the CPU (issue 13): each rank streams a shard of the
batches or pairs, the reducer states merge across ranks, and the merged tables equal the
single-process ones. Stated tolerances: frequency and head sums are float64 sums in another order
(relative 1e-9); shift-test log-probs come from different batches (float32, 1e-4 nats), with the
same decisions."""

from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pytest
import torch
from dist_worker import compute, work


def _close(a: pd.DataFrame, b: pd.DataFrame, rtol: float, atol: float) -> None:
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    for c in a.columns:
        if pd.api.types.is_float_dtype(a[c]):
            np.testing.assert_allclose(a[c].to_numpy(), b[c].to_numpy(), rtol=rtol, atol=atol, err_msg=c)
        else:
            assert a[c].tolist() == b[c].tolist(), c


@pytest.mark.slow  # two spawned processes each import torch + transformers: ~1 min on 2 cores
def test_two_gloo_processes_merge_to_the_single_process_result(tmp_path):
    import torch.multiprocessing as mp

    single = compute()
    init = tmp_path / "init"
    mp.spawn(work, args=(2, str(init), str(tmp_path)), nprocs=2, join=True)
    with open(tmp_path / "merged.pkl", "rb") as f:
        merged = pickle.load(f)
    for name in ("bands", "profile", "heads"):
        _close(merged["freq"][name], single["freq"][name], rtol=1e-9, atol=1e-12)
    for name in ("heads", "head_classes", "offsets"):
        _close(merged["heads"][name], single["heads"][name], rtol=1e-9, atol=1e-12)
    _close(merged["ablation"], single["ablation"], rtol=1e-12, atol=1e-12)
    for m, s in zip(merged["mean"], single["mean"]):
        torch.testing.assert_close(m, s, rtol=1e-12, atol=1e-14)
    a, b = merged["shift"], single["shift"]
    _close(a.drop(columns=["logp_good", "logp_bad", "margin"]), b.drop(columns=["logp_good", "logp_bad", "margin"]),
           0, 0)
    np.testing.assert_allclose(a[["logp_good", "logp_bad"]].to_numpy(), b[["logp_good", "logp_bad"]].to_numpy(),
                               atol=1e-4)


def test_single_process_takes_every_batch_without_a_process_group(monkeypatch):
    from posprobe.core import distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not distributed.active() and distributed.world() == (0, 1) and distributed.is_writer()
    assert distributed.shard_batches(7, 2) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert [i for i, _ in distributed.shard("abc")] == [0, 1, 2]
    assert distributed.gather_objects({"x": 1}) == [{"x": 1}]


def test_running_mean_merge_is_the_pooled_statistic():
    from posprobe.core.capture import RunningMean

    x = torch.randn(50, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a, b, whole = RunningMean(), RunningMean(), RunningMean()
    a.update(x[:17])
    b.update(x[17:])
    whole.update(x)
    a.merge(b)
    torch.testing.assert_close(a.mean, x.mean(0), rtol=0, atol=1e-14)
    torch.testing.assert_close(a.var, x.var(0, unbiased=False), rtol=0, atol=1e-14)
    torch.testing.assert_close(a.count, whole.count)
