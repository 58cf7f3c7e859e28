"""`train_zoo`: every member x seed trained on one tokenizer and one token order, checkpointed and resumable, the
zoo written as one folder of Hugging Face model folders: `<out>/<member>-s<seed>/` (config, safetensors,
tokenizer, zoo.json), `<out>/eval.txt` (the held-out text), `<out>/training/` (the tables, meta and report)."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from posprobe.report.checkpoint import discard_work_folder, run_key
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.zoo.config import ZooConfig
from posprobe.zoo.corpus import CorpusConfig
from posprobe.zoo.folder import EVAL_FILE, TRAINING_FOLDER, member_folder_name
from posprobe.zoo.job import Job, open_work, run_jobs
from posprobe.zoo.members import member

__all__ = ["check_device", "check_out_folder", "commit_zoo", "split_text", "train_zoo", "zoo_jobs"]

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
    """A tier's device must exist here: the gpu tier on a machine without CUDA is refused with the fix, as is bf16 on
    a GPU without bfloat16."""
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"the {cfg.tier} tier trains on {cfg.device}, which this machine does not have (torch "
                             f"{torch.__version__}); pass --device cpu to run it here (slow), or use --tier cpu")
        if cfg.precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"--precision bf16 needs a GPU with bfloat16 ({torch.cuda.get_device_name()} has none); "
                             "pass --precision fp32")


def train_zoo(cfg: ZooConfig, text: str | CorpusConfig, out: str | os.PathLike, *, eval_text: str | None = None,
              source: str | None = None, fresh: bool = False, budget_steps: int | None = None) -> Result:
    """Train `cfg.members` x `cfg.seeds` on `text` and write the zoo to `out` (which must not exist or be empty).

    Args:
        cfg: the zoo's members, seeds, model shape, optimiser, steps and device.
        text: the training text; without `eval_text`, its last `cfg.eval_fraction` (cut at a line break) is held
            out for evaluation (never seen by the tokenizer or the training) and written as `<out>/eval.txt`. Or a
            `CorpusConfig`: a Hugging Face `datasets` corpus (a hub dataset streamed, or local files), read once into
            a token cache in `<out>.work` (resumed mid-stream after a kill), its first documents held out.
        out: the folder the zoo is written to (new or empty; its parent must exist).
        eval_text: the held-out evaluation text (None: cut from `text`).
        source: what meta.json's data record names as the training text (default: "built-in corpus" when `text`
            is posprobe's built-in corpus, else "text").
        fresh: interrupted runs keep their state in `<out>.work` and resume when the same call is repeated;
            `fresh` discards it.
        budget_steps: timed warm-up steps per member of the zoo's loop before training (the first not counted; the
            model discarded), for the estimated hours printed with N, D and 6·N·D on stderr (when `cfg.progress`)
            and kept in the Result's `meta["budget"]`; None: 3, or 0 on the cpu tier; 0: no warm-up, no hours.

    Returns:
        The training Result (tables `members`: one row per trained member with parameters, seconds, tokens/s and
            final loss in nats/token; `training`: the loss curve every 10 steps), also saved in
            `<out>/training/`.

    Examples:
        >>> from posprobe import ZooConfig, train_zoo
        >>> from posprobe.data import builtin_corpus
        >>> cfg = ZooConfig(members=("rope", "nope"), d_model=16, n_layers=1, n_heads=2, length=16, vocab_size=280,
        ...                 batch_size=2, steps=5, warmup=1, progress=False)  # seconds; the CPU tier is ZooConfig()
        >>> result = train_zoo(cfg, builtin_corpus(), "zoo")
        >>> result.tables["members"][["model", "family"]].values.tolist()
        [['rope-s0', 'rotary'], ['nope-s0', 'nope']]
    """
    import torch

    from posprobe.core import distributed
    from posprobe.zoo.tokenizer import train_tokenizer

    out = Path(out)
    check_out_folder(out)
    check_device(cfg)
    if budget_steps is not None and (budget_steps < 0 or budget_steps == 1):
        raise ValueError(f"budget_steps must be 0 (no warm-up) or >= 2 (the first is not timed), got {budget_steps}")
    ranks = distributed.Ranks()  # under torchrun: one member per rank (docs/zoo.md#several-processes)
    rank, world = ranks.rank, ranks.world
    device = distributed.local_device(cfg.device)  # under torchrun a bare "cuda" is this rank's own GPU
    if cfg.data_parallel and world > 1:
        share = cfg.batch_size // world
        if cfg.batch_size % world or (cfg.micro_batch and share % min(cfg.micro_batch, share)):
            raise ValueError(f"--data-parallel over {world} processes needs a batch of {cfg.batch_size} that splits "
                             f"into {world} equal shares, each a whole number of micro-batches of {cfg.micro_batch}")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"rank {rank} trains on {device}, but this machine has {torch.cuda.device_count()} GPU(s): "
                         "run torchrun with --nproc-per-node at most that many")

    def rank0_first(fn: Any) -> Any:
        # `fn(first)` on rank 0, then on the others once it is done: rank 0 opens (or, with `fresh`, discards) the
        # work folder and fills the corpus cache; the others find them there.
        got = fn(True) if rank == 0 else None
        ranks.wait()
        return got if rank == 0 else fn(False)

    if isinstance(text, CorpusConfig):  # a `datasets` corpus, read once into a token cache in the work folder
        from posprobe.zoo.corpus import check_hub, prepare_corpus

        check_hub(text)  # one sentence before anything is written
        key = run_key("zoo-train", model={"members": list(cfg.members)}, data={"corpus": text.key()}, config=cfg)
        limit = int(text.corpus_tokens or cfg.steps * cfg.tokens_per_step)

        def read(first: bool) -> tuple:
            opened = open_work(out, key, fresh=fresh and first)
            return opened, prepare_corpus(text, cfg.vocab_size, limit, opened[2] / "corpus", eval_text=eval_text,
                                          progress=cfg.progress and first)

        (ckpt, staging, work), corpus = rank0_first(read)
        tokenizer, ids, held_out, train_sha = corpus.tokenizer, corpus.ids, corpus.eval_text, corpus.sha256
        source = source or text.source
    else:
        train_text, held_out = split_text(text, eval_text, cfg.eval_fraction)
        if not train_text.strip():
            raise ValueError("the training text is empty")
        tokenizer = train_tokenizer(train_text, cfg.vocab_size)
        ids = torch.tensor(tokenizer(train_text)["input_ids"], dtype=torch.long)
        train_sha = text_sha256(train_text)
    if len(ids) < cfg.length:
        raise ValueError(f"the training text has {len(ids)} tokens, too short for one window of L={cfg.length} "
                         "tokens; give more text (--text) or a shorter --length")
    if not isinstance(text, CorpusConfig):
        key = run_key("zoo-train", model={"members": list(cfg.members)},
                      data={"train_sha256": train_sha, "eval_sha256": text_sha256(held_out)}, config=cfg)
        ckpt, staging, work = rank0_first(lambda first: open_work(out, key, fresh=fresh and first))
    # The budget's warm-up runs on rank 0 alone (the others wait); each rank trains its share on its own device.
    budget = _budget(cfg, tokenizer, ids, budget_steps) if rank == 0 else []
    jobs = zoo_jobs(cfg, tokenizer, ids)
    if world > 1:
        together = cfg.data_parallel
        mine = zoo_jobs(replace(cfg, device=device), tokenizer, ids)
        mine = mine if together else mine[rank::world]
        ranks.wait()  # every rank has opened the work folder (opening it sweeps half-written units)
        _say_world(ckpt, rank, world, mine, together)
        if together:  # DDP within each member: a process group over the ranks' own store
            import torch.distributed as dist

            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                    store=dist.PrefixStore("posprobe/zoo/ddp", ranks.store), rank=rank,
                                    world_size=world)
        try:
            run_jobs(mine, ckpt, staging, writes=rank == 0 or not together)
        finally:
            if together:
                dist.destroy_process_group()
        ranks.wait()  # every member trained
        if rank != 0:
            ranks.wait()  # rank 0 has committed the zoo
            return Result.load(out / TRAINING_FOLDER)
        ckpt, staging, work = open_work(out, key)  # sees the units the other ranks wrote
    else:
        _say_world(ckpt, rank, world, jobs, cfg.data_parallel)
    records = run_jobs(jobs, ckpt, staging)  # with world > 1: every job done, only their records read
    if source is None:  # a text of the caller's is not the built-in corpus: zoo extend would look for the wrong text
        from posprobe.data import builtin_corpus

        source = "built-in corpus" if text == builtin_corpus() else "text"
    result = _result(cfg, records, source, train_sha, held_out, len(ids))
    result.meta["budget"] = budget
    commit_zoo(out, staging, {EVAL_FILE: held_out}, {TRAINING_FOLDER: result})
    discard_work_folder(work)
    if world > 1:
        ranks.wait()
    return result


def _say_world(ckpt: Any, rank: int, world: int, mine: list[Job], together: bool = False) -> None:
    # Members are independent, so a run resumed at another world size gives the same weights (each member resumes
    # from its own state); it is said, as its members now run on other ranks' devices.
    unit = "world-size"
    if rank == 0:
        if ckpt.has(unit) and ckpt.get(unit) != world:
            print(f"zoo: resumed with {world} processes where the interrupted run had {ckpt.get(unit)}: each member "
                  "continues from its own saved state, on the device of the rank that now holds it", file=sys.stderr)
        ckpt.put(unit, world)
    if world == 1:
        if together:
            print("zoo: --data-parallel outside torchrun: this one process trains every member on whole batches",
                  file=sys.stderr)
        return
    names = ", ".join(j.folder for j in mine) or "nothing (more ranks than members x seeds)"
    share = f" with the other {world - 1} (data parallel: its share of each batch)" if together else ""
    print(f"zoo: rank {rank} of {world} trains {names}{share}", file=sys.stderr)  # one line, with or without progress


def zoo_jobs(cfg: ZooConfig, tokenizer: Any, ids: Any) -> list[Job]:
    """The jobs of `zoo train`: every member of `cfg` on windows of the token ids `ids`, seed by seed (every member
    of the first seed before the next seed, so an early stop leaves whole seeds)."""
    return [Job.text(name, seed, cfg, tokenizer, ids, widths=cfg.widths_for(name)) for seed in cfg.seeds
            for name in cfg.members]


def _budget(cfg: ZooConfig, tokenizer: Any, ids: Any, steps: int | None) -> list[dict]:
    # N, D, 6ND and (after `steps` timed warm-up steps per member; default 3 but on the cpu tier) the hours, printed
    # on stderr before training when progress is on; kept in the training Result's meta.
    from dataclasses import asdict

    from posprobe.zoo.budget import print_budget, zoo_budget

    steps = (0 if cfg.tier == "cpu" else 3) if steps is None else steps
    budgets = zoo_budget(cfg, lambda wcfg: zoo_jobs(wcfg, tokenizer, ids), steps)
    if cfg.progress:
        print_budget(cfg, budgets, cfg.device)
    return [{**asdict(b), "flops": b.flops, "hours": b.hours} for b in budgets]


def check_out_folder(out: Path) -> None:
    """A zoo is written into a new (or empty) folder whose parent exists; ValueError otherwise."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not empty; a zoo is written into a new folder")
    if not out.absolute().parent.is_dir():
        raise ValueError(f"--out {out}: its parent folder does not exist (create it first)")


def _result(cfg: ZooConfig, records: list[dict], source: str | None, train_sha: str, held_out: str,
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
                                    sha256=train_sha),
                     config=cfg, eval_sha256=text_sha256(held_out), tokens_per_step=cfg.tokens_per_step)
    return Result({"members": pd.DataFrame(rows), "training": pd.DataFrame(curve)}, meta)


def commit_zoo(out: Path, staging: Path, files: dict[str, str], results: dict[str, Result]) -> None:
    """Assemble the zoo in a hidden folder beside `out` (the member folders of `staging`, text `files`, each Result
    saved in its subfolder) and rename it into place: a zoo is whole or absent."""
    tmp = out.with_name(f".{out.name}.zoo-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for folder in sorted(staging.iterdir()):
        if folder.is_dir() and not folder.name.startswith("."):
            shutil.copytree(folder, tmp / folder.name)
    for name, body in files.items():
        (tmp / name).write_text(body, encoding="utf-8")
    for name, result in results.items():
        result.save(tmp / name)
    if out.exists():
        out.rmdir()  # checked empty before training
    os.replace(tmp, out)
