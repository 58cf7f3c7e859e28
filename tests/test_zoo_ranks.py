"""The zoo under torchrun (issue 65): one member per rank. Two gloo processes on the CPU train the members of one zoo
with the same weights, byte for byte, as one process does with the same thread count (each member's training depends
on its member, seed, schedule and tokens alone), and write one zoo folder, whole, once every rank is done. The
reference is a plain single-process `posprobe zoo train` run; a planted rank-dependent seed fails it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_FLAGS = ["--member", "rope-llama", "--member", "nope", "--seed", "0", "--seed", "1", "--d-model", "16",
          "--n-layers", "1", "--n-heads", "2", "--length", "16", "--vocab-size", "280", "--batch-size", "2",
          "--steps", "6", "--threads", "1", "--no-progress"]


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _train(out: Path, ranks: int) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    return subprocess.run([*launcher, "-m", "posprobe", "zoo", "train", *_FLAGS, "--out", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=600)


def _weights(zoo: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    out = {}
    for folder in sorted(p for p in zoo.iterdir() if (p / "zoo.json").is_file()):
        tensors = load_file(folder / "model.safetensors")
        out[folder.name] = b"".join(tensors[k].numpy().tobytes() for k in sorted(tensors))
    return out


@pytest.mark.slow  # three launches of posprobe (each imports torch and transformers): ~20 s on 2 cores
def test_two_ranks_train_the_members_one_process_trains_byte_for_byte(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    single = _train(one, 1)
    assert single.returncode == 0, single.stderr[-3000:]
    ranked = _train(two, 2)
    assert ranked.returncode == 0, ranked.stderr[-3000:]
    a, b = _weights(one), _weights(two)
    assert sorted(a) == ["nope-s0", "nope-s1", "rope-llama-s0", "rope-llama-s1"] and sorted(b) == sorted(a)
    for name in a:
        assert a[name] == b[name], f"{name}: the two-rank zoo's weights differ from the single process's"
    # Members alternate between the ranks (seed by seed, member by member), each rank saying what it trains.
    assert "rank 0 of 2 trains" in ranked.stderr and "rank 1 of 2 trains" in ranked.stderr
    # One zoo: the training tables hold every member, in the single run's order, with the same losses; the work
    # folder is gone; rank 1 wrote nothing of its own (stdout carries one summary per rank, the same one).
    from posprobe.report.result import Result

    ra, rb = Result.load(one / "training"), Result.load(two / "training")
    assert ra.tables["members"]["model"].tolist() == rb.tables["members"]["model"].tolist()
    assert ra.tables["training"]["loss"].tolist() == rb.tables["training"]["loss"].tolist()
    assert not (tmp_path / "two.work").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]
    assert json.loads((two / "nope-s1" / "zoo.json").read_text())["seed"] == 1
    assert ranked.stdout.count("[zoo] nope-s1:") == 2


@pytest.mark.slow  # two launches of posprobe: ~15 s on 2 cores
def test_data_parallel_ranks_train_one_member_as_one_process_does(tmp_path):
    """`--data-parallel`: both ranks train every member together, each on half of each step's batch, DDP averaging the
    gradients. The same model as one process up to float summation order (the batch mean's gradient taken as the
    mean of two half-batch means): weights within 1e-5, logged losses within 1e-5 nats. Planted: the gradients not
    averaged (each rank steps on its half alone) fails it."""
    import torch

    flags = ["--member", "rope-llama", "--seed", "0", "--d-model", "16", "--n-layers", "1", "--n-heads", "2",
             "--length", "16", "--vocab-size", "280", "--batch-size", "4", "--steps", "6", "--threads", "1",
             "--no-progress"]
    run = lambda out, launcher: subprocess.run([*launcher, "-m", "posprobe", "zoo", "train", *flags, "--out",
                                                str(out)], capture_output=True, text=True, env=_env(), timeout=600)
    single = run(tmp_path / "one", [sys.executable])
    assert single.returncode == 0, single.stderr[-3000:]
    flags.append("--data-parallel")
    ddp = run(tmp_path / "dp", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"])
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert "rank 1 of 2 trains rope-llama-s0 with the other 1 (data parallel" in ddp.stderr
    from safetensors.torch import load_file

    a = load_file(tmp_path / "one" / "rope-llama-s0" / "model.safetensors")
    b = load_file(tmp_path / "dp" / "rope-llama-s0" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)
    from posprobe.report.result import Result

    la = Result.load(tmp_path / "one" / "training").tables["training"]["loss"].to_numpy()
    lb = Result.load(tmp_path / "dp" / "training").tables["training"]["loss"].to_numpy()
    assert len(la) == len(lb) and abs(la - lb).max() < 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dp", "one"]


def test_a_single_process_needs_no_process_group(monkeypatch):
    from posprobe.core import distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ranks = distributed.Ranks()
    assert (ranks.rank, ranks.world, ranks.store) == (0, 1, None)
    ranks.wait()  # no store, no wait
    assert not distributed.active()


def test_the_world_size_is_said_when_a_resume_changes_it(tmp_path, capsys):
    from posprobe.report.checkpoint import Checkpoint
    from posprobe.zoo.run import _say_world

    ckpt = Checkpoint(tmp_path / "w", {"k": 1})
    _say_world(ckpt, 0, 2, [])
    assert "changes" not in capsys.readouterr().err
    _say_world(Checkpoint(tmp_path / "w", {"k": 1}), 0, 3, [])
    err = capsys.readouterr().err
    assert "resumed with 3 processes where the interrupted run had 2" in err
    assert "rank 0 of 3 trains nothing" in err


def test_a_rank_without_its_gpu_is_refused_before_any_work(monkeypatch, tmp_path):
    """torchrun with more processes than GPUs: the rank whose `cuda:LOCAL_RANK` does not exist says so before the
    corpus, the work folder or any training (CUDA stood in: this machine has none)."""
    import types

    import torch

    from posprobe import ZooConfig, train_zoo
    from posprobe.core import distributed
    from posprobe.data import BUILTIN_TEXT

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(distributed, "Ranks", lambda: types.SimpleNamespace(rank=1, world=2, wait=lambda: None))
    cfg = ZooConfig(tier="gpu", members=("nope",), d_model=16, n_layers=1, n_heads=2, length=16, vocab_size=280,
                    batch_size=2, steps=2, progress=False)
    with pytest.raises(ValueError, match=r"rank 1 trains on cuda:1, but this machine has 1 GPU\(s\)"):
        train_zoo(cfg, BUILTIN_TEXT, tmp_path / "zoo")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_data_parallel_needs_a_batch_that_splits_evenly(monkeypatch, tmp_path):
    import types

    from posprobe import ZooConfig, train_zoo
    from posprobe.core import distributed
    from posprobe.data import BUILTIN_TEXT

    monkeypatch.setattr(distributed, "Ranks", lambda: types.SimpleNamespace(rank=0, world=2, wait=lambda: None))
    cfg = ZooConfig(members=("nope",), d_model=16, n_layers=1, n_heads=2, length=16, vocab_size=280, batch_size=6,
                    micro_batch=2, steps=2, data_parallel=True, progress=False)
    with pytest.raises(ValueError, match="batch of 6 that splits into 2 equal shares, each a whole number of "
                                         "micro-batches of 2"):
        train_zoo(cfg, BUILTIN_TEXT, tmp_path / "zoo")
    assert list(tmp_path.iterdir()) == []


def test_a_run_killed_at_two_ranks_resumes_in_one_process_to_the_same_weights(monkeypatch, tmp_path, capsys):
    """Rank 0 of 2 trains its share (every other member) and is killed while it waits for rank 1; the same command
    in one process then says the world size changed, trains only the members not yet done, and ends with the
    weights, byte for byte, of a run that was never split (stood-in ranks, one process: the same thread count)."""
    import types

    from safetensors.torch import load_file

    from posprobe import ZooConfig, train_zoo
    from posprobe.core import distributed
    from posprobe.data import BUILTIN_TEXT

    class Killed(Exception):
        pass

    waits = []

    def wait():
        waits.append(1)
        if len(waits) == 3:  # opened, every rank opened, then: every member trained
            raise Killed

    cfg = ZooConfig(members=("rope-llama", "nope"), seeds=(0, 1), d_model=16, n_layers=1, n_heads=2, length=16,
                    vocab_size=280, batch_size=2, steps=4, progress=False)
    real = distributed.Ranks
    monkeypatch.setattr(distributed, "Ranks", lambda: types.SimpleNamespace(rank=0, world=2, wait=wait))
    with pytest.raises(Killed):
        train_zoo(cfg, BUILTIN_TEXT, tmp_path / "zoo")
    staged = sorted(p.name for p in (tmp_path / "zoo.work" / "members").iterdir())
    assert staged == ["rope-llama-s0", "rope-llama-s1"]  # rank 0's share: jobs 0 and 2, seed by seed
    monkeypatch.setattr(distributed, "Ranks", real)
    capsys.readouterr()
    train_zoo(cfg, BUILTIN_TEXT, tmp_path / "zoo")
    assert "resumed with 1 processes where the interrupted run had 2" in capsys.readouterr().err
    train_zoo(cfg, BUILTIN_TEXT, tmp_path / "plain")
    for name in ("nope-s0", "nope-s1", "rope-llama-s0", "rope-llama-s1"):
        a = load_file(tmp_path / "zoo" / name / "model.safetensors")
        b = load_file(tmp_path / "plain" / name / "model.safetensors")
        assert all(a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a), name


def test_data_parallel_in_one_process_is_plain_training_and_says_so(tmp_path, capsys):
    from safetensors.torch import load_file

    from posprobe import ZooConfig, train_zoo
    from posprobe.data import BUILTIN_TEXT

    kw = dict(members=("nope",), d_model=16, n_layers=1, n_heads=2, length=16, vocab_size=280, batch_size=2, steps=3,
              progress=False)
    train_zoo(ZooConfig(**kw, data_parallel=True), BUILTIN_TEXT, tmp_path / "dp")
    assert "--data-parallel outside torchrun" in capsys.readouterr().err
    train_zoo(ZooConfig(**kw), BUILTIN_TEXT, tmp_path / "plain")
    a, b = (load_file(tmp_path / z / "nope-s0" / "model.safetensors") for z in ("dp", "plain"))
    assert all(a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a)
