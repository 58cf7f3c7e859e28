"""Training the zoo: every member on the same tokens in the same order, with transformers' model classes, torch's
AdamW and transformers' cosine schedule — a plain loop rather than `Trainer`, so that a killed run resumes to the
same weights bit for bit (the batch of step s is a function of seed and s alone; model, optimiser and schedule are
restored exactly) and the loop costs nothing beyond the forward and backward passes (`benchmarks/bench_zoo.py`).

Deterministic on CPU for a seed and thread count: no dropout, posprobe's own initialisation from a seeded
generator, batches drawn from a seeded generator per step."""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from posprobe.zoo.config import ZooConfig
from posprobe.zoo.folder import STEPS_FOLDER, ZOO_FILE
from posprobe.zoo.members import Member, Widths, member
from posprobe.zoo.passkey import with_passkey

__all__ = ["TrainState", "accumulate", "batch_ids", "build_model", "init_weights", "next_token_labels", "text_windows",
           "train_member", "used_parameters"]

_INIT_STD = 0.02


def build_model(m: Member, cfg: ZooConfig, tokenizer: Any, seed: int, widths: Widths | None = None) -> Any:
    """A freshly initialised Hugging Face causal LM for member `m` at `widths` (default: the config's; float32, eager
    attention, training mode)."""
    from transformers import AutoModelForCausalLM

    from posprobe.backend import t5_decoder

    t5_decoder.register_auto_class()  # the T5-bias member's class has no causal-LM auto mapping of its own
    hf_cfg = m.hf_config(widths or cfg.widths, pad_id=tokenizer.pad_token_id, bos_id=tokenizer.bos_token_id)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    init_weights(model, seed)
    return model


def init_weights(model: Any, seed: int) -> None:
    """The same initialisation for every class (each HF class has its own; GPT-2 shrinks its residual projections):
    matrices and embeddings N(0, 0.02) from a generator seeded with `seed`, biases 0, norm scales 1. Buffers (rotary
    and sinusoid tables, ALiBi) are left as built."""
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * _INIT_STD)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)


def batch_ids(ids: torch.Tensor, step: int, cfg: ZooConfig, seed: int) -> torch.Tensor:
    """The `[batch_size, length]` token windows of optimiser step `step`: random starts drawn from a generator
    seeded by (seed, step) alone, so every member sees the same tokens in the same order and a resumed run
    continues the sequence exactly."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    starts = torch.randint(0, len(ids) - cfg.length + 1, (cfg.batch_size,), generator=g)
    return torch.stack([ids[s:s + cfg.length] for s in starts.tolist()])


def _optimizer(model: Any, cfg: ZooConfig) -> tuple[torch.optim.Optimizer, Any]:
    from transformers import get_cosine_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    decay = [p for p in model.parameters() if p.ndim >= 2]
    other = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    if cfg.min_lr_share:  # the research tier: Gu et al.'s cosine to min_lr (= lr: the rate held after warmup)
        return opt, get_cosine_with_min_lr_schedule_with_warmup(opt, cfg.warmup, cfg.steps,
                                                                 min_lr_rate=cfg.min_lr_share)
    return opt, get_cosine_schedule_with_warmup(opt, cfg.warmup, cfg.steps)


@dataclass
class TrainState:
    """Everything a training checkpoint saves and a resume loads, as one object (tuned-lens's `State`): the model,
    AdamW and the schedule, the steps taken, the loss log [(step, mean loss in nats per scored token, lr)], the
    caller's looks at the checkpoints [(step, value)], and the loss summed since the last logged step (so a run
    resumed between two logged steps logs the same mean as an uninterrupted one)."""

    model: Any
    optimizer: Any
    scheduler: Any
    running: torch.Tensor
    step: int = 0
    log: list = field(default_factory=list)
    checkpoints: list = field(default_factory=list)

    def state_dict(self) -> dict:
        """What a checkpoint saves (tensors copied off the device)."""
        return {"step": self.step, "log": self.log, "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "checkpoints": self.checkpoints, "running": self.running.detach().cpu().clone()}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from a saved checkpoint: every part restored in place."""
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.step, self.log = int(saved["step"]), list(saved["log"])
        self.checkpoints = list(saved.get("checkpoints", []))
        if "running" in saved:
            self.running = saved["running"].to(self.running.device)

    def resume(self, load: Callable[[], dict | None]) -> None:
        """Continue from what `load()` gives (a saved state), or start at step 0 when it gives None."""
        saved = load()
        if saved is not None:
            self.load_state_dict(saved)

    def save(self, save: Callable[[dict], None], step: int) -> None:
        """Record that `step` steps are done and hand the whole state to `save`."""
        self.step = step
        save(self.state_dict())


def _progress_bar(label: str, cfg: ZooConfig, begin: int, tokens_per_step: int) -> Any:
    # The house's one progress tool: tokens trained (tokens/s and the member's ETA by tqdm), resumed runs starting at
    # their offset; the loss, the step and the zoo's ETA ride in its postfix.
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps * tokens_per_step, initial=begin * tokens_per_step, unit=" tokens", unit_scale=True,
                desc=f"zoo: {label}" + (f" (resumed at step {begin})" if begin else ""), mininterval=1.0,
                disable=not cfg.progress, file=sys.stderr, leave=True,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} tokens [{elapsed}, ETA {remaining}, "
                           "{rate_fmt}{postfix}]")


def _postfix(bar: Any, step: int, total: int, loss: float | None, later_tokens: int) -> None:
    rate = bar.format_dict.get("rate")
    left = (bar.total - bar.n + later_tokens) / rate if rate else math.inf
    bar.set_postfix_str(f"step {step}/{total}" + ("" if loss is None else f", loss {loss:.3f}")
                        + (f", zoo ETA {bar.format_interval(left) if math.isfinite(left) else '?'}" if later_tokens
                           else ""), refresh=False)


def text_windows(ids: torch.Tensor, tokenizer: Any, cfg: ZooConfig, seed: int) -> Callable[[int], tuple]:
    """`batches(step) -> (ids, labels)` over windows of `cfg.length` tokens of `ids` (`batch_ids`), with passkey
    sequences at `cfg.passkey` (0: none); labels are the ids (the loop shifts them)."""
    def windows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = with_passkey(batch_ids(ids, step, cfg, seed), tokenizer, step, seed, cfg.passkey)
        return x, x

    return windows


def train_member(job: Any, folder: Path, state_io: tuple[Callable[[], dict | None], Callable[[dict], None]], *,
                 on_checkpoint: Callable[[int, Any], Any] | None = None, later_steps: int = 0) -> dict:
    """Train `job` (a `posprobe.zoo.job.Job`: member, seed, schedule, batches, start; typed loosely, as the job
    module runs this loop) and save it as a Hugging Face folder at `folder` (written beside it and renamed into
    place). `state_io` = (load, save) of the training state:
    a saved state is resumed from, and one is saved every `job.config.checkpoint_every` steps. Position ids in a
    batch (zoo extend's PoSE) are passed to the forward as `position_ids`. `on_checkpoint(step, model)` is called
    after each step in `job.checkpoints` (0 = before the first) with the model in eval mode, and what it returns is
    kept in the training state, so a resumed run does not call it again for a step it has passed; `later_steps`
    (the jobs after this one) feeds the zoo's ETA.
    Returns the member's training record: losses every `job.log_every` steps (nats per scored token), wall seconds
    of this call's training, tokens/s (padding included), `checkpoints`: [(step, value of on_checkpoint)] and
    `checkpoint_seconds` (wall seconds in on_checkpoint, not in `seconds`)."""
    cfg, m, seed = job.config, member(job.member), job.seed
    device = torch.device(cfg.device)
    model = (job.start() if job.start is not None else build_model(m, cfg, job.tokenizer, seed, job.widths)).to(device)
    # Data parallel within the member (`zoo train --data-parallel` under torchrun): every rank starts from the same
    # weights, takes rows rank, rank + world, ... of each step's batch, and DDP averages the gradients, so every rank
    # holds the same model after each step; rank 0 alone writes (states, folders).
    rank, world = _data_parallel(cfg)
    net = model if world == 1 else torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=m.architecture.unused_weights is not None)
    writes = rank == 0
    if not writes:
        state_io = (state_io[0], lambda state: None)
    opt, sched = _optimizer(model, cfg)
    st = TrainState(model, opt, sched, torch.zeros((), device=device))
    st.resume(state_io[0])
    begin, looking = st.step, [0.0]
    model.train()

    def checkpoint(step: int) -> bool:
        # The caller's look at the model after `step` steps (no gradients, no dropout in the zoo: the training that
        # follows is the same with or without it).
        if on_checkpoint is None or step not in job.checkpoints or any(s == step for s, _ in st.checkpoints):
            return False
        t = time.perf_counter()
        model.eval()
        with torch.no_grad():
            st.checkpoints.append((step, on_checkpoint(step, model)))
        model.train()
        looking[0] += time.perf_counter() - t
        return True

    batches, log_every = job.batches, job.log_every
    tokens_per_step = int(batches(0)[0].numel())
    bar = _progress_bar(job.label, cfg, begin, tokens_per_step)
    t0 = time.perf_counter()
    if begin == 0 and checkpoint(0):
        st.save(state_io[1], 0)
    if begin == 0 and cfg.save_every and writes:
        _save_step(model, job, folder, st.log, 0, tokens_per_step)
    shifts_labels = m.architecture.shifts_labels  # a fact of the HF class (its architecture row), not the member's
    try:
        # Grad on explicitly: loading a model for analysis elsewhere in the process may have turned it off globally.
        with torch.enable_grad():
            for step in range(begin, cfg.steps):
                x, labels, *positions = (t[rank::world].to(device) for t in batches(step))
                loss = accumulate(net, x, labels if shifts_labels else next_token_labels(labels), positions,
                                  cfg.micro_batch, bf16=cfg.precision == "bf16")
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                st.running += loss
                if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
                    n = (step % log_every) + 1
                    if world > 1:  # the batch's mean: every rank scored as many tokens
                        torch.distributed.all_reduce(st.running)
                        st.running /= world
                    mean = float(st.running) / n  # one host sync per logged interval, not per step
                    st.running.zero_()
                    st.log.append((step + 1, mean, float(sched.get_last_lr()[0])))
                    _postfix(bar, step + 1, cfg.steps, mean, later_steps * tokens_per_step)
                bar.update(tokens_per_step)
                looked = checkpoint(step + 1)
                if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps and writes:
                    _save_step(model, job, folder, st.log, step + 1, tokens_per_step)
                if ((step + 1) % cfg.checkpoint_every == 0 or looked) and step + 1 < cfg.steps:
                    st.save(state_io[1], step + 1)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0 - looking[0]  # training alone: the checkpoints' looks are counted apart
    log, evals = st.log, st.checkpoints
    if not math.isfinite(log[-1][1]):
        raise RuntimeError(f"zoo member {job.member} (seed {seed}) diverged: loss {log[-1][1]}; lower --lr")
    if writes:
        _save_folder(model.to("cpu").eval(), job, folder, log)
    steps_run = cfg.steps - begin
    return {"member": job.member, "seed": seed, "log": log, "seconds": seconds, "steps_run": steps_run,
            "tokens_per_s": steps_run * tokens_per_step / seconds if seconds > 0 else float("nan"),
            "params": used_parameters(model, m), "checkpoints": evals, "checkpoint_seconds": looking[0]}


def _data_parallel(cfg: ZooConfig) -> tuple[int, int]:
    # (rank, world size) of the process group training this member together; (0, 1) without one.
    if not (cfg.data_parallel and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0, 1
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def accumulate(model: Any, x: torch.Tensor, labels: torch.Tensor, positions: list, micro_batch: int | None, *,
               bf16: bool = False) -> Any:
    """Forward and backward of one step's batch, in micro-batches of `micro_batch` rows (None or the whole batch: one
    pass), each loss divided by their count so that the gradients sum to the batch mean's (exactly the mean when
    every row scores as many tokens: the text zoo's full windows).

    Args:
        model: the Hugging Face causal LM in training mode.
        x: input ids `[batch, pos]`.
        labels: what the model's loss is given (the loop has shifted them for a class that does not).
        positions: [] or [position ids `[batch, pos]`] (zoo extend's PoSE), passed as `position_ids`.
        micro_batch: rows per forward and backward pass (None: all).
        bf16: each forward under `torch.autocast` in bfloat16 on the batch's device (mixed precision: the weights,
            their gradients and the optimiser stay fp32; the backward runs outside autocast, as torch recommends).

    Returns:
        The step's loss (detached): the batch's, or the mean of the micro-batches'."""
    n = x.shape[0]
    cast = torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16)
    if micro_batch is None or micro_batch >= n:
        kw = {"position_ids": positions[0]} if positions else {}  # PoSE's skip-wise ids (zoo extend)
        with cast:
            loss = model(input_ids=x, labels=labels, **kw).loss
        loss.backward()
        return loss.detach()
    parts = range(0, n, micro_batch)
    total = None
    for i in parts:
        rows = slice(i, i + micro_batch)
        kw = {"position_ids": positions[0][rows]} if positions else {}
        with cast:
            loss = model(input_ids=x[rows], labels=labels[rows], **kw).loss / len(parts)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """`labels` moved one token left, the last position ignored (-100): what a class whose loss does not shift
    (Pix2Struct's text decoder) must be given to score token t + 1 from position t, as *ForCausalLM classes do."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)


def used_parameters(model: Any, m: Member) -> int:
    """Parameters the member's forward uses (tied weights once; weights its architecture row names unused, such as
    Pix2Struct's cross-attention, left out)."""
    unused = m.architecture.unused_weights
    return sum(p.numel() for name, p in model.named_parameters() if not (unused and unused in name))


def _steps_staging(folder: Path) -> Path:
    # Where the weights every K steps wait while the member trains (hidden: a zoo commit copies no hidden folder);
    # the finished member folder takes them in as its `checkpoints/`.
    return folder.with_name(f".{folder.name}.{STEPS_FOLDER}")


def _save_step(model: Any, job: Any, folder: Path, log: list, step: int, tokens_per_step: int) -> None:
    # The weights after `step` steps as a Hugging Face folder with its zoo.json (step, tokens), written beside and
    # renamed into place; a resumed run that passes the step again writes the same bytes.
    was_training = model.training
    model.eval()
    _save_folder(model, job, _steps_staging(folder) / f"step{step}", log,
                 {"step": step, "tokens": step * tokens_per_step}, keep_steps=False)
    model.train(was_training)


def _save_folder(model: Any, job: Any, folder: Path, log: list, extra: dict | None = None, *,
                 keep_steps: bool = True) -> None:
    import json
    from dataclasses import asdict

    from posprobe.backend.loading import quiet_progress

    m, cfg = member(job.member), job.config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with quiet_progress():  # its "Writing model shards" bar would break the zoo's progress line
        model.save_pretrained(tmp)
    job.tokenizer.save_pretrained(tmp)
    record = {"member": m.name, "family": m.family, "block": m.block, "model_type": m.model_type,
              "positions": m.positions, "differences": m.differences, "seed": job.seed, "widths": asdict(job.widths),
              "steps": cfg.steps, "batch_size": cfg.batch_size, "lr": cfg.lr, "warmup": cfg.warmup,
              "final_loss": log[-1][1] if log else None, **({"passkey": cfg.passkey} if cfg.passkey else {}),
              **({"precision": cfg.precision} if cfg.precision != "fp32" else {}),
              **job.record, **(extra or {})}
    (tmp / ZOO_FILE).write_text(json.dumps(record, indent=1), encoding="utf-8")
    if folder.exists():
        if keep_steps and (folder / STEPS_FOLDER).is_dir():  # a run killed after its last move: keep what it saved
            _steps_staging(folder).mkdir(exist_ok=True)
            for p in (folder / STEPS_FOLDER).iterdir():
                if not (_steps_staging(folder) / p.name).exists():
                    os.replace(p, _steps_staging(folder) / p.name)
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    if keep_steps and _steps_staging(folder).is_dir():  # after the member: a kill between the two keeps them staged
        os.replace(_steps_staging(folder), folder / STEPS_FOLDER)
