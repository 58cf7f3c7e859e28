"""A zoo job is one object, run by one loop. `Job`: which member and seed, the loop's schedule (a `ZooConfig`), the
tokenizer, its batches per step, its start (a fresh model of its widths, or a model loaded from a folder), what its
zoo.json adds, the steps at which the caller looks at it, and where it lands (its folder name in the zoo, spelled by
`posprobe.zoo.folder`, and its checkpoint unit). `run_jobs` runs a list of them through the training loop
(`posprobe.zoo.train.train_member`), checkpointed: a finished job is not run again, an interrupted one resumes.
`zoo train`, `zoo tasks` and `zoo extend` each build their jobs and hand them to `run_jobs`. Torch-free at import."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

from posprobe.report.checkpoint import Checkpoint, work_folder_for
from posprobe.zoo.config import ZooConfig
from posprobe.zoo.folder import member_folder_name
from posprobe.zoo.members import Widths

__all__ = ["Job", "open_work", "run_jobs"]


@dataclass(frozen=True)
class Job:
    """One run of the zoo's training loop: member `member` with `seed`, trained for `config.steps` optimiser steps of
    `batches(step) -> (input ids, labels[, position ids])` on `config`'s schedule (AdamW, cosine, clip, device).

    `start()` builds the model to train (default: a fresh member of `widths`, itself defaulting to the config's);
    `record` adds fields to the saved folder's zoo.json; the caller looks at the model after each step in
    `checkpoints` (0 = before the first); `folder` is its folder name in the zoo, `unit` its checkpoint key and
    `label` its progress line (defaults: `<member>-s<seed>`, `<member>/<seed>`, `<member> seed <seed>`); the loss
    is logged every `log_every` steps."""

    member: str
    seed: int
    config: ZooConfig
    tokenizer: Any
    batches: Callable[[int], tuple]
    widths: Widths | None = None
    start: Callable[[], Any] | None = None
    record: dict = field(default_factory=dict)
    checkpoints: tuple[int, ...] = ()
    folder: str = ""
    unit: str = ""
    label: str = ""
    log_every: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", self.widths or self.config.widths)
        object.__setattr__(self, "folder", self.folder or member_folder_name(self.member, self.seed))
        object.__setattr__(self, "unit", self.unit or f"{self.member}/{self.seed}")
        object.__setattr__(self, "label", self.label or f"{self.member} seed {self.seed}")

    @classmethod
    def text(cls, member: str, seed: int, config: ZooConfig, tokenizer: Any, ids: Any, **fields: Any) -> Job:
        """A job on windows of `config.length` tokens of the token ids `ids` (with passkey sequences at
        `config.passkey`): `zoo train`'s batches, drawn by (seed, step) alone."""
        from posprobe.zoo.train import text_windows

        return cls(member, seed, config, tokenizer, text_windows(ids, tokenizer, config, seed), **fields)


def open_work(out: Path, key: Any, *, fresh: bool = False) -> tuple[Checkpoint, Path, Path]:
    """(the checkpoint store under `<out>.work` for run key `key`, its staging folder for finished member folders,
    the work folder); `fresh` discards what an earlier run left there."""
    work = work_folder_for(out)
    ckpt = Checkpoint(work, key, fresh=fresh)
    staging = work / "members"
    staging.mkdir(exist_ok=True)
    return ckpt, staging, work


def run_jobs(jobs: list[Job], ckpt: Checkpoint, staging: Path, *,
             look: Callable[[Job, int, Any], Any] | None = None,
             after: Callable[[Job, Path], dict] | None = None, writes: bool = True) -> list[dict]:
    """Every job through the zoo's training loop, in order, checkpointed in `ckpt`: a job whose record and folder
    (in `staging`) exist is not run again, an interrupted one resumes from its last saved state. `look(job, step,
    model)` is the caller's look at each job's `checkpoints` (its values kept in the training state); `after(job,
    folder)` adds fields to a finished job's record before it is saved (measured once, not again on a resume).
    `writes` False: a data-parallel rank other than 0, which trains with rank 0 but stores nothing.
    Returns the records in the jobs' order (`train_member`'s, with `after`'s fields)."""
    from posprobe.zoo import train  # looked up per call: tests stand a dying loop in for it

    records = []
    for i, job in enumerate(jobs):
        folder, done, state = staging / job.folder, f"{job.unit}/done", f"{job.unit}/state"
        if ckpt.has(done) and folder.is_dir():
            records.append(ckpt.get(done))
            continue
        io = (lambda u=state: ckpt.get(u) if ckpt.has(u) else None, lambda s, u=state: ckpt.put(u, s))
        rec = train.train_member(job, folder, io, on_checkpoint=None if look is None else partial(look, job),
                                 later_steps=sum(j.config.steps for j in jobs[i + 1:]))
        if after is not None:
            rec = {**rec, **after(job, folder)}
        records.append(ckpt.put(done, rec) if writes else rec)
    return records
