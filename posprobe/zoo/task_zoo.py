"""`train_task_zoo`: every member x seed trained on the synthetic tasks (`posprobe.zoo.tasks`) with the zoo's widths,
optimiser and checkpoints, then its accuracy measured per task and instance length up to test_factor x L. The zoo
folder holds the member folders (Hugging Face folders over the tasks' character vocabulary) and `tasks/` (the
Result: tables `accuracy`, `members`, `training`)."""

from __future__ import annotations

import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pandas as pd

from posprobe.report.checkpoint import discard_work_folder, run_key
from posprobe.report.result import Result
from posprobe.report.schema import make_meta
from posprobe.zoo.config import TaskConfig, ZooConfig
from posprobe.zoo.folder import TASKS_FOLDER, member_folder_name
from posprobe.zoo.job import Job, open_work, run_jobs
from posprobe.zoo.members import Widths, member
from posprobe.zoo.run import check_device, check_out_folder, commit_zoo

__all__ = ["task_context", "train_task_zoo"]


def task_context(tasks: TaskConfig) -> int:
    """Positions every task member has: the longest test sequence (tokens). Rows of a learned table past the
    longest training sequence exist but are never trained (as in Kazemnejad et al.)."""
    from posprobe.zoo.tasks import sequence_length

    return max(sequence_length(t, n) for t in tasks.tasks for n in tasks.test_lengths)


def train_task_zoo(cfg: ZooConfig, tasks: TaskConfig, out: str | os.PathLike, *, fresh: bool = False) -> Result:
    """Train `cfg.members` x `cfg.seeds` on the mixture of `tasks.tasks` (instance lengths 1..train_max, the same
    rows in the same order for every member) at the config's width, depth, heads and optimiser, for `tasks.steps`
    steps of `tasks.batch_size` instances (the config's text-tier steps, batch, length and vocabulary do not apply;
    warmup is 5% of the steps), and write the zoo to `out`.

    Args:
        cfg: the zoo's members, seeds, model shape, optimiser and device.
        tasks: the tasks, their training lengths, steps and batch size.
        out: the folder the zoo is written to (new or empty; its parent must exist).
        fresh: discard what an interrupted run left in `<out>.work` (by default the run resumes from there).

    Returns:
        The Result (analysis "zoo-tasks"): `accuracy` (model, member, family, block, seed, task, n, in_training,
            accuracy = share of exact greedy answers, count), `members`, `training` (loss per scored answer token
            every 10 steps).
    """
    from posprobe.zoo.tasks import task_batch, task_tokenizer

    out = Path(out)
    cfg = replace(cfg, steps=tasks.steps, batch_size=tasks.batch_size, warmup=None)
    check_out_folder(out)
    check_device(cfg)
    tokenizer = task_tokenizer()
    widths = Widths(d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, length=task_context(tasks),
                    vocab_size=len(tokenizer.get_vocab()))
    key = run_key("zoo-tasks", model={"members": list(cfg.members)}, data={"tasks": list(tasks.tasks)},
                  config=cfg, tasks=asdict(tasks))
    record = {"tasks": list(tasks.tasks), "train_max": tasks.train_max}

    def batches(seed: int) -> Any:
        return lambda step: task_batch(tasks.tasks, tasks.train_max, cfg.batch_size, step, seed)

    jobs = [Job(name, seed, cfg, tokenizer, batches(seed), widths=widths, record=record)
            for seed in cfg.seeds for name in cfg.members]
    ckpt, staging, work = open_work(out, key, fresh=fresh)
    # Accuracy measured right after training and kept in the checkpoint, so a resumed run does not measure again.
    records = run_jobs(jobs, ckpt, staging, after=lambda job, folder: {"accuracy": _measure(folder, tasks,
                                                                                            cfg.device)})
    result = _result(cfg, tasks, widths, records)
    commit_zoo(out, staging, {}, {TASKS_FOLDER: result})
    discard_work_folder(work)
    return result


def _measure(folder: Path, tasks: TaskConfig, device: str) -> list[dict]:
    from posprobe.backend.loading import load_causal_lm
    from posprobe.zoo.tasks import held_out_instances, task_accuracy

    model = load_causal_lm(folder).to(device)
    rows = []
    for task in tasks.tasks:
        for n in tasks.test_lengths:
            pairs = held_out_instances(task, n, tasks.test_count, seed=0)
            rows.append(dict(task=task, n=n, accuracy=task_accuracy(model, task, pairs), count=len(pairs)))
    return rows


def _result(cfg: ZooConfig, tasks: TaskConfig, widths: Widths, records: list[dict]) -> Result:
    acc, members, curve = [], [], []
    for r in records:
        m = member(r["member"])
        name = member_folder_name(m.name, r["seed"])
        info = dict(model=name, member=m.name, family=m.family, block=m.block, seed=r["seed"])
        acc += [{**info, **row, "in_training": row["n"] <= tasks.train_max} for row in r["accuracy"]]
        members.append({**info, "model_type": m.model_type, "params": r["params"], "steps": cfg.steps,
                        "seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"], "loss": r["log"][-1][1],
                        "positions": m.positions, "differences": m.differences})
        curve += [{**info, "step": s, "loss": loss, "lr": lr} for s, loss, lr in r["log"]]
    meta = make_meta("zoo-tasks", model={"name": "task zoo", "positional_kind": "several",
                                         "members": list(cfg.members)},
                     data={"source": f"synthetic tasks ({', '.join(tasks.tasks)})", "n_items": tasks.test_count,
                           "unit": "test instances per task and length"},
                     config=cfg, tasks=asdict(tasks), context=widths.length, vocab_size=widths.vocab_size)
    return Result({"accuracy": pd.DataFrame(acc), "members": pd.DataFrame(members), "training": pd.DataFrame(curve)},
                  meta)
