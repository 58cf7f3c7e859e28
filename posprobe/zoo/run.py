"""`train_zoo`: every member x seed trained on one tokenizer and one token order, checkpointed and resumable, the
zoo written as one folder of Hugging Face model folders: `<out>/<member>-s<seed>/` (config, safetensors,
tokenizer, zoo.json), `<out>/eval.txt` (the held-out text), `<out>/training/` (the tables, meta and report)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pandas as pd

from posprobe.report.checkpoint import Checkpoint, discard_work_folder, run_key, work_folder_for
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.zoo.config import ZooConfig
from posprobe.zoo.members import member

__all__ = ["EVAL_FILE", "check_device", "member_folder_name", "split_text", "train_zoo"]

#: The held-out evaluation text every zoo keeps beside its members (what `posprobe zoo eval` reads by default).
EVAL_FILE = "eval.txt"


def member_folder_name(name: str, seed: int) -> str:
    """The folder of member `name` trained with `seed` inside a zoo: `<name>-s<seed>`."""
    return f"{name}-s{seed}"


def split_text(text: str, eval_text: str | None, fraction: float) -> tuple[str, str]:
    """(training text, evaluation text): `eval_text` when given, else the last `fraction` of `text` cut at a line
    break (never seen by the tokenizer or the training)."""
    if eval_text is not None:
        return text, eval_text
    cut = int(len(text) * (1 - fraction))
    nl = text.rfind("\n", 0, cut)
    cut = nl + 1 if nl > 0 else cut
    return text[:cut], text[cut:]


def check_device(cfg: ZooConfig) -> None:
    """A tier's device must exist here: the gpu tier on a machine without CUDA is refused with the fix."""
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"the {cfg.tier} tier trains on {cfg.device}, which this machine does not have (torch "
                             f"{torch.__version__}); pass --device cpu to run it here (slow), or use --tier cpu")


def train_zoo(cfg: ZooConfig, text: str, out: str | os.PathLike, *, eval_text: str | None = None,
              source: str | None = None, fresh: bool = False) -> Result:
    """Train `cfg.members` x `cfg.seeds` on `text` and write the zoo to `out` (which must not exist or be empty).

    Interrupted runs keep their state in `<out>.work` and resume when the same call is repeated (`fresh` discards
    it). Returns the training Result (tables `members`: one row per trained member with parameters, seconds,
    tokens/s and final loss in nats/token; `training`: the loss curve every 10 steps), also saved in
    `<out>/training/`."""
    import torch

    from posprobe.zoo.tokenizer import train_tokenizer
    from posprobe.zoo.train import train_member

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not empty; a zoo is written into a new folder")
    if not out.absolute().parent.is_dir():
        raise ValueError(f"--out {out}: its parent folder does not exist (create it first)")
    check_device(cfg)
    train_text, held_out = split_text(text, eval_text, cfg.eval_fraction)
    if not train_text.strip():
        raise ValueError("the training text is empty")
    tokenizer = train_tokenizer(train_text, cfg.vocab_size)
    ids = torch.tensor(tokenizer(train_text)["input_ids"], dtype=torch.long)
    if len(ids) < cfg.length:
        raise ValueError(f"the training text has {len(ids)} tokens, too short for one window of L={cfg.length} "
                         "tokens; give more text (--text) or a shorter --length")
    key = run_key("zoo-train", model={"members": list(cfg.members)},
                  data={"train_sha256": text_sha256(train_text), "eval_sha256": text_sha256(held_out)}, config=cfg)
    work = work_folder_for(out)
    ckpt = Checkpoint(work, key, fresh=fresh)
    staging = work / "members"
    staging.mkdir(exist_ok=True)
    jobs = [(name, seed) for seed in cfg.seeds for name in cfg.members]
    records = []
    for i, (name, seed) in enumerate(jobs):
        unit, done_unit = f"{name}/{seed}/state", f"{name}/{seed}/done"
        folder = staging / member_folder_name(name, seed)
        if ckpt.has(done_unit) and folder.is_dir():
            records.append(ckpt.get(done_unit))
            continue
        io = (lambda u=unit: ckpt.get(u) if ckpt.has(u) else None, lambda s, u=unit: ckpt.put(u, s))
        rec = train_member(name, seed, cfg, ids, tokenizer, folder, io,
                           later_steps=cfg.steps * (len(jobs) - i - 1))
        records.append(ckpt.put(done_unit, rec))
    result = _result(cfg, records, source, train_text, held_out, len(ids))
    _commit(out, staging, held_out, result)
    discard_work_folder(work)
    return result


def _result(cfg: ZooConfig, records: list[dict], source: str | None, train_text: str, held_out: str,
            n_tokens: int) -> Result:
    rows, curve = [], []
    for r in records:
        m = member(r["member"])
        rows.append({"model": member_folder_name(m.name, r["seed"]), "member": m.name, "family": m.family,
                     "block": m.block, "model_type": m.model_type, "seed": r["seed"], "params": r["params"],
                     "steps": cfg.steps, "seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"],
                     "loss": r["log"][-1][1], "positions": m.positions, "differences": m.differences})
        curve += [{"model": member_folder_name(m.name, r["seed"]), "member": m.name, "family": m.family,
                   "block": m.block, "seed": r["seed"], "step": s, "tokens": s * cfg.tokens_per_step, "loss": loss,
                   "lr": lr} for s, loss, lr in r["log"]]
    meta = make_meta("zoo-train", model={"name": "zoo", "positional_kind": "several", "members": list(cfg.members)},
                     data=data_meta(source or "built-in corpus", n_items=n_tokens, unit="training tokens",
                                    sha256=text_sha256(train_text)),
                     config=cfg, eval_sha256=text_sha256(held_out), tokens_per_step=cfg.tokens_per_step)
    return Result({"members": pd.DataFrame(rows), "training": pd.DataFrame(curve)}, meta)


def _commit(out: Path, staging: Path, held_out: str, result: Result) -> None:
    # Everything is assembled in a hidden folder beside `out` and renamed into place: a zoo is whole or absent.
    tmp = out.with_name(f".{out.name}.zoo-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for folder in sorted(staging.iterdir()):
        if folder.is_dir() and not folder.name.startswith("."):
            shutil.copytree(folder, tmp / folder.name)
    (tmp / EVAL_FILE).write_text(held_out, encoding="utf-8")
    result.save(tmp / "training")
    if out.exists():
        out.rmdir()  # checked empty before training
    os.replace(tmp, out)
