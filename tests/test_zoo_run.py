"""The zoo's run around training (`posprobe.zoo.run`), with training replaced by a stub that records what it was
asked: which members and seeds in which order, how many steps are left after each (the zoo's ETA), what a resumed
run skips, how the text is split, and that the zoo appears whole or not at all. Seconds, no model.

Plants seen failing (one at a time): members outer and seeds inner; the steps left counting the current member; a
finished member trained again on resume; the evaluation text cut mid-line; the cut at the fraction from the start;
a hidden staging folder copied into the zoo; a non-empty --out accepted; the training curve's tokens per step off
by the batch."""

from __future__ import annotations

import pytest

from posprobe.report.result import Result
from posprobe.zoo.config import ZooConfig
from posprobe.zoo.job import open_work, run_jobs
from posprobe.zoo.members import MEMBERS
from posprobe.zoo.run import _result, check_device, check_out_folder, commit_zoo, split_text, zoo_jobs

REC = {"member": "rope", "seed": 4, "params": 123, "seconds": 2.0, "tokens_per_s": 50.0,
       "log": [(10, 3.5, 1e-3), (20, 3.0, 5e-4)]}
SMALL = dict(d_model=16, n_heads=2, n_layers=1, length=8, vocab_size=300, steps=10, warmup=1, batch_size=3,
             progress=False)


def test_the_held_out_text_is_the_last_fraction_cut_at_a_line_break():
    text = "".join(f"line {i:02d}\n" for i in range(10))  # 10 lines of 8 characters
    train, held = split_text(text, None, 0.25)
    assert train + held == text
    # the cut point 60 (= 80 x 0.75) falls inside line 7; the last line break before it ends line 6
    assert train == "".join(f"line {i:02d}\n" for i in range(7)) and held.startswith("line 07\n")
    assert split_text(text, "given", 0.25) == (text, "given")
    assert split_text("no breaks at all", None, 0.5) == ("no break", "s at all")  # no line break: the plain cut


def test_out_must_be_new_or_empty_with_an_existing_parent(tmp_path):
    check_out_folder(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_out_folder(tmp_path / "empty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "file").write_text("x")
    for bad, says in (("full", "exists and is not empty"), ("file", "exists and is not empty"),
                      ("no/parent", "its parent folder does not exist")):
        with pytest.raises(ValueError, match=says):
            check_out_folder(tmp_path / bad)


def test_a_cuda_tier_is_refused_on_a_machine_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="the gpu tier trains on cuda.*pass --device cpu"):
        check_device(ZooConfig(tier="gpu"))
    check_device(ZooConfig(tier="gpu", device="cpu"))


def _stub(calls: list, fail_at: tuple | None = None):
    def train_member(job, folder, io, *, on_checkpoint=None, later_steps=0):
        calls.append((job.member, job.seed, later_steps))
        if (job.member, job.seed) == fail_at:
            io[1]({"half": True})  # a checkpoint saved mid-member, then the run dies
            raise KeyboardInterrupt
        folder.mkdir(parents=True)
        return {"member": job.member, "seed": job.seed, "resumed_from": io[0]()}
    return train_member


def test_jobs_run_seed_by_seed_with_the_steps_left_and_resume_skips_finished_members(tmp_path, monkeypatch):
    import posprobe.zoo.train as zoo_train

    cfg = ZooConfig(**{**SMALL, "members": ("rope", "nope"), "seeds": (0, 1)})
    out = tmp_path / "zoo"
    jobs = zoo_jobs(cfg, None, None)
    assert [j.folder for j in jobs] == ["rope-s0", "nope-s0", "rope-s1", "nope-s1"]
    calls: list = []

    def run(key, fresh=False, fail_at=None):
        monkeypatch.setattr(zoo_train, "train_member", _stub(calls, fail_at))
        ckpt, staging, _ = open_work(out, key, fresh=fresh)
        return run_jobs(jobs, ckpt, staging), staging

    with pytest.raises(KeyboardInterrupt):
        run("key", fail_at=("rope", 1))
    # every member of seed 0, then seed 1; steps left after each job: 10 x the jobs after it
    assert calls == [("rope", 0, 30), ("nope", 0, 20), ("rope", 1, 10)]
    calls.clear()
    records, staging = run("key")
    assert calls == [("rope", 1, 10), ("nope", 1, 0)]  # the two finished ones are not trained again
    assert [(r["member"], r["seed"]) for r in records] == [("rope", 0), ("nope", 0), ("rope", 1), ("nope", 1)]
    assert records[2]["resumed_from"] == {"half": True} and records[3]["resumed_from"] is None
    assert sorted(p.name for p in staging.iterdir()) == ["nope-s0", "nope-s1", "rope-s0", "rope-s1"]
    calls.clear()
    run("another key", fresh=True)  # another run: everything again
    assert len(calls) == 4


def test_the_zoo_is_assembled_beside_out_and_renamed_whole(tmp_path):
    staging = tmp_path / "staging"
    for name in ("rope-s0", ".partial", "nope-s0"):
        (staging / name).mkdir(parents=True)
        (staging / name / "w.bin").write_text(name)
    (staging / "stray.txt").write_text("not a member")
    out = tmp_path / "zoo"
    out.mkdir()  # an empty --out is allowed
    res = _result(ZooConfig(**{**SMALL, "members": ("rope",)}), [REC], None, "train text", "held", 77)
    commit_zoo(out, staging, {"eval.txt": "held out"}, {"training": res})
    assert sorted(p.name for p in out.iterdir()) == ["eval.txt", "nope-s0", "rope-s0", "training"]
    assert (out / "rope-s0" / "w.bin").read_text() == "rope-s0" and (out / "eval.txt").read_text() == "held out"
    assert Result.load(out / "training").tables["members"].model.tolist() == ["rope-s4"]
    assert not list(tmp_path.glob(".zoo*"))  # nothing left beside it


def test_the_training_tables_count_tokens_as_steps_times_batch_times_length():
    cfg = ZooConfig(**{**SMALL, "members": ("rope",)})
    r = _result(cfg, [REC], None, "train text", "held", 77)
    curve, members = r.tables["training"], r.tables["members"]
    assert curve.tokens.tolist() == [10 * 3 * 8, 20 * 3 * 8] and curve.lr.tolist() == [1e-3, 5e-4]
    assert members.loss.tolist() == [3.0] and members.model.tolist() == ["rope-s4"]
    assert r.meta["data"]["n_items"] == 77 and r.meta["data"]["source"] == "built-in corpus"
    assert r.meta["tokens_per_step"] == 24 and r.meta["model"]["name"] == "zoo"
    assert r.meta["data"]["unit"] == "training tokens"
    want = [["gpt", "rotary", MEMBERS["rope"].differences]]
    assert members[["block", "family", "differences"]].values.tolist() == want
