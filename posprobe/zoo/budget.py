"""What a zoo run will cost, said before it trains: per member the parameters N (counted on the Hugging Face model
its config builds, on torch's meta device: no memory, milliseconds), the training tokens D (steps x batch x L), the
compute 6·N·D (Kaplan et al.'s forward + backward estimate; it leaves out attention's L-dependent terms) and the
hours it will take here, from a throughput measured on a few steps of the zoo's own training loop (the first step
not counted, the model discarded after).

A warm-up step is one micro-batch (`ZooConfig.micro_batch`, or the batch) with its own optimiser step, so the
measured rate is a little lower than a step that accumulates several micro-batches: the estimate errs long."""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from posprobe.zoo.config import ZooConfig
from posprobe.zoo.members import Member, Widths, member

__all__ = ["Budget", "budget_lines", "count_parameters", "member_budget", "measure_throughput", "print_budget",
           "zoo_budget"]

#: The clock the warm-up reads (tests stand a scripted one in).
_clock: Callable[[], float] = time.perf_counter


def count_parameters(m: Member, widths: Widths) -> tuple[int, int]:
    """(N, token-embedding parameters) of member `m` at `widths`: its Hugging Face class built from its config on
    the meta device, every parameter its forward uses counted once (tied input and output embeddings once; weights
    its architecture row names unused, such as Pix2Struct's cross-attention, left out: `train.used_parameters`).

    Args:
        m: the member.
        widths: its block shape.

    Returns:
        (N, the token embedding's share of N)."""
    import torch
    from transformers import AutoModelForCausalLM

    from posprobe.backend import t5_decoder
    from posprobe.zoo.train import used_parameters

    t5_decoder.register_auto_class()
    # The zoo's ids: EOT (BOS/EOS) is 0 and PAD 1 in every vocabulary it trains (posprobe.zoo.tokenizer).
    hf_cfg = m.hf_config(widths, pad_id=1, bos_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    return used_parameters(model, m), model.get_input_embeddings().weight.numel()


@dataclass(frozen=True)
class Budget:
    """One member's budget: parameters N (and the token embedding's part), tokens D, FLOPs = 6·N·D, and where a
    warm-up was measured, its tokens/s and the hours D takes at that rate."""

    member: str
    widths: Widths
    params: int
    embedding_params: int
    tokens: int
    tokens_per_s: float | None = None

    @property
    def flops(self) -> float:
        """6·N·D."""
        return 6.0 * self.params * self.tokens

    @property
    def hours(self) -> float | None:
        """D / (tokens/s) / 3600, or None without a measured rate."""
        if not self.tokens_per_s:
            return None
        return self.tokens / self.tokens_per_s / 3600.0


def member_budget(cfg: ZooConfig, name: str, tokens_per_s: float | None = None) -> Budget:
    """The budget of member `name` under `cfg` (its widths: `cfg.widths_for`; D = steps x batch x L).

    Args:
        cfg: the zoo's config.
        name: the member.
        tokens_per_s: a measured training rate (None: no estimate of hours).

    Returns:
        Its Budget."""
    w = cfg.widths_for(name)
    n, emb = count_parameters(member(name), w)
    return Budget(name, w, n, emb, cfg.steps * cfg.tokens_per_step, tokens_per_s)


def measure_throughput(job: Any, steps: int) -> float:
    """Training tokens per second of `job` (a `posprobe.zoo.job.Job` whose config is the warm-up's: `steps` steps
    of one micro-batch) through the zoo's own loop (`train.train_member`) on a fresh model, timed from the end of
    step 1 to the end of step `steps` (the first step's allocations and kernel choices not counted); nothing is
    kept (state and folder go to a temporary folder).

    Args:
        job: the warm-up job.
        steps: steps run (>= 2).

    Returns:
        Tokens per second over steps 2..`steps`."""
    import torch

    from posprobe.zoo import train

    if steps < 2:
        raise ValueError(f"a warm-up needs at least 2 steps (the first is not timed), got {steps}")
    stamps: dict[int, float] = {}
    cuda = str(job.config.device).startswith("cuda")

    def stamp(step: int, model: Any) -> None:
        if cuda:
            torch.cuda.synchronize()
        stamps[step] = _clock()

    job = replace(job, checkpoints=(1, steps), log_every=steps)
    with tempfile.TemporaryDirectory(prefix="posprobe-warmup-") as tmp:
        train.train_member(job, Path(tmp) / "member", (lambda: None, lambda state: None), on_checkpoint=stamp)
    tokens_per_step = int(job.batches(0)[0].numel())
    seconds = stamps[steps] - stamps[1]
    return (steps - 1) * tokens_per_step / seconds if seconds > 0 else math.inf


def zoo_budget(cfg: ZooConfig, warmup_jobs: Callable[[ZooConfig], list] | None = None,
               warmup_steps: int = 0) -> list[Budget]:
    """Every member's budget under `cfg`, with the rate of a warm-up of `warmup_steps` steps where asked.

    Args:
        cfg: the zoo's config.
        warmup_jobs: config -> the zoo's jobs under it (`posprobe.zoo.run.zoo_jobs` over the real tokens): called
            with the warm-up's config (the first seed, `warmup_steps` steps of one micro-batch, no warmup of the
            rate, no progress), one job per member.
        warmup_steps: steps per member's warm-up (0: none, no hours).

    Returns:
        One Budget per member, in the config's order."""
    rates: dict[str, float] = {}
    if warmup_steps and warmup_jobs is not None:
        micro = cfg.micro_batch or cfg.batch_size
        wcfg = replace(cfg, seeds=cfg.seeds[:1], steps=warmup_steps, batch_size=micro, micro_batch=None, warmup=0,
                       checkpoint_every=warmup_steps, progress=False)
        for job in warmup_jobs(wcfg):
            rates[job.member] = measure_throughput(job, warmup_steps)
    return [member_budget(cfg, name, rates.get(name)) for name in cfg.members]


def budget_lines(cfg: ZooConfig, budgets: list[Budget], device: str) -> list[str]:
    """The budget as printed before training: one header, one line per member, one total over members x seeds.

    Args:
        cfg: the zoo's config.
        budgets: `zoo_budget`'s.
        device: where the warm-up ran (named in the header).

    Returns:
        The lines (no newlines)."""
    d = cfg.steps * cfg.tokens_per_step
    lines = [f"zoo budget ({cfg.tier} tier, {device}): D = {cfg.steps:,} steps x {cfg.batch_size} x {cfg.length:,} "
             f"tokens = {d:.3e} tokens per member; FLOPs = 6 N D"]
    for b in budgets:
        w = b.widths
        eta = (f"{b.tokens_per_s:,.0f} tokens/s in warm-up -> {_hours(b.hours)}" if b.hours is not None
               else "no warm-up (hours not estimated)")
        lines.append(f"zoo budget: {b.member}: {w.n_layers} layers x d {w.d_model} x {w.n_heads} heads, N = "
                     f"{b.params:,} parameters ({b.params - b.embedding_params:,} without the token embedding), "
                     f"D = {b.tokens:.3e}, FLOPs = {b.flops:.3e}, {eta}")
    flops = sum(b.flops for b in budgets) * len(cfg.seeds)
    hours = [b.hours for b in budgets]
    total = (f", {_hours(sum(hours) * len(cfg.seeds))} here" if hours and all(h is not None for h in hours) else "")
    lines.append(f"zoo budget: {len(budgets)} members x {len(cfg.seeds)} seeds: {flops:.3e} FLOPs{total}")
    return lines


def _hours(h: float) -> str:
    return f"{h:,.1f} h" if h >= 0.1 else f"{h * 3600:,.1f} s"


def print_budget(cfg: ZooConfig, budgets: list[Budget], device: str) -> None:
    """Print `budget_lines` on stderr.

    Args:
        cfg: the zoo's config.
        budgets: `zoo_budget`'s.
        device: where the warm-up ran."""
    for line in budget_lines(cfg, budgets, device):
        print(line, file=sys.stderr)
