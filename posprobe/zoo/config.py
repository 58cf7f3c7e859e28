"""The zoo's options: one frozen `ZooConfig` (what to train, how big, how long), the size tiers and JSON config
files. Torch-free: the CLI builds its flags from these fields and checks them before anything is trained."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from posprobe.core.config import at_least, option
from posprobe.zoo.members import Widths, member, member_names

__all__ = ["TIERS", "TaskConfig", "ZooConfig", "load_config_file"]

#: Sizes and schedules per tier. cpu: every member in about a minute on 2 cores (~25k tokens/s each);
#: gpu: minutes per member on one GPU (same code path, wider and longer); research: Gu et al. 2025's 60M LLaMA for the
#: llama block (sail-sg/Attention-Sink, configs/tinyllama_60m.yaml and lit_gpt/config.py "tinyllama_60M": 10 layers,
#: d 768, 8 heads, context 2,048, vocabulary 50,432, 20,000 steps of 512 x 2,048 tokens, lr 4e-4 held after 100
#: warmup steps (min_lr = lr)), GPT-2 small's depth and heads (12, 12) for the gpt block. Keys that are not ZooConfig
#: fields: warmup_share (warmup = this share of the steps; default WARMUP_SHARE).
TIERS: dict[str, dict[str, Any]] = {
    "cpu": dict(d_model=128, n_layers=4, n_heads=4, length=128, vocab_size=512, batch_size=16, steps=800,
                lr=2e-3, device="cpu"),
    "gpu": dict(d_model=512, n_layers=8, n_heads=8, length=512, vocab_size=8192, batch_size=32, steps=4000,
                lr=1e-3, device="cuda"),
    "research": dict(d_model=768, n_layers=10, n_heads=8, length=2048, vocab_size=50432, batch_size=512,
                     steps=20000, lr=4e-4, device="cuda", warmup_share=100 / 20000, min_lr_share=1.0, micro_batch=8,
                     gpt_n_layers=12, gpt_n_heads=12),
}
_TIERED = ("d_model", "n_layers", "n_heads", "length", "vocab_size", "batch_size", "steps", "lr", "device")
#: Default warmup: this share of the steps.
WARMUP_SHARE = 0.05


@dataclass(frozen=True, kw_only=True)
class ZooConfig:
    """What `train_zoo` trains: members x seeds, all with the same block widths, tokenizer, data order, steps,
    optimiser (AdamW, cosine schedule with warmup) and seed. Fields left None take the tier's value."""

    members: tuple[str, ...] = option(member_names(), "zoo members to train (repeatable; default: all)",
                                      flag="--member")
    seeds: tuple[int, ...] = option((0,), "training seeds (repeatable): each member is trained once per seed",
                                    flag="--seed")
    tier: Literal["cpu", "gpu", "research"] = option(
        "cpu", "size tier: cpu (every member in about a minute on 2 cores), gpu (minutes per member on one GPU) or "
               "research (Gu et al. 2025's 60M LLaMA and GPT-2 small's depth: hours per member on one GPU)")
    d_model: int | None = option(None, "residual width (default: the tier's)")
    n_layers: int | None = option(None, "blocks (default: the tier's)")
    n_heads: int | None = option(None, "attention heads per block (default: the tier's)")
    length: int | None = option(None, "training length L in tokens (default: the tier's)")
    vocab_size: int | None = option(None, "byte-level BPE vocabulary size (default: the tier's)")
    batch_size: int | None = option(None, "sequences of L tokens per step (default: the tier's)")
    steps: int | None = option(None, "optimiser steps per member (default: the tier's)")
    tokens: float | None = option(None, "training tokens per member D, instead of --steps: steps = ceil(D / (batch "
                                        "x L)), e.g. 5e9")
    lr: float | None = option(None, "peak learning rate of AdamW (default: the tier's)")
    warmup: int | None = option(None, "linear warmup steps before the cosine decay (default: 5% of the steps; the "
                                      "research tier: 0.5%, Gu et al.'s 100 of 20,000)")
    min_lr_share: float | None = option(None, "the cosine decays to this share of --lr (default: the tier's: 0; "
                                              "research: 1, the rate held after warmup as Gu et al.'s min_lr = lr)")
    micro_batch: int | None = option(None, "sequences per forward and backward pass; a step accumulates the "
                                           "gradients of batch / micro-batch of them (default: the whole batch; "
                                           "research: 8)")
    gpt_n_layers: int | None = option(None, "blocks of the gpt-block members (learned, sinusoidal, alibi, rope, "
                                            "partial) (default: --n-layers when given, else the tier's: research 12, "
                                            "GPT-2 small)")
    gpt_n_heads: int | None = option(None, "heads of the gpt-block members (default: --n-heads when given, else the "
                                           "tier's: research 12, GPT-2 small)")
    weight_decay: float = option(0.1, "AdamW weight decay on matrices (not on norms, biases)")
    grad_clip: float = option(1.0, "gradient norm clip")
    checkpoint_every: int = option(100, "steps between checkpoints (a killed run resumes from the last)")
    save_every: int = option(0, "also keep each member's weights every K steps (and at step 0) as Hugging Face "
                                "folders <member>/checkpoints/step<K>, for emergence over training (posprobe zoo "
                                "emergence; MODEL@step<K> loads one); 0: the final weights only")
    eval_fraction: float = option(0.1, "share of --text held out for evaluation when --eval-text is not given")
    passkey: float = option(0.0, "share of each batch's sequences replaced by passkey retrieval sequences (the key "
                                 "at every distance within L; 0: the text alone, as before)")
    data_parallel: bool = option(False, "under torchrun: every rank trains each member together, on its share of "
                                        "each step's batch (DDP), instead of one member per rank")
    precision: Literal["fp32", "bf16"] | None = option(
        None, "fp32, or bf16: forward and backward under torch.autocast in bfloat16 with fp32 weights, gradients and "
              "AdamW (mixed precision; default: bf16 on the gpu and research tiers on CUDA, else fp32)")
    device: str | None = option(None, "", cli=False)
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"unknown tier {self.tier!r}; choose one of {', '.join(TIERS)}")
        object.__setattr__(self, "members", tuple(dict.fromkeys(self.members)))
        object.__setattr__(self, "seeds", tuple(dict.fromkeys(int(s) for s in self.seeds)))
        if not self.members:
            raise ValueError("no zoo members to train")
        if not self.seeds or any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be >= 0 and at least one; got {self.seeds}")
        for name in self.members:
            member(name)  # unknown names fail here, before any work
        tier = TIERS[self.tier]
        for name, given in (("gpt_n_layers", "n_layers"), ("gpt_n_heads", "n_heads")):
            if getattr(self, name) is None:  # the gpt block follows --n-layers / --n-heads when they are given
                object.__setattr__(self, name, getattr(self, given) or tier.get(name) or tier[given])
        if self.tokens is not None and self.steps is not None:
            raise ValueError("give the steps or the tokens per member, not both (--steps, --tokens)")
        for name in _TIERED:
            if getattr(self, name) is None:
                object.__setattr__(self, name, tier[name])
        if self.precision is None:
            gpu = self.tier != "cpu" and str(self.device).startswith("cuda")
            object.__setattr__(self, "precision", "bf16" if gpu else "fp32")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")
        if self.min_lr_share is None:
            object.__setattr__(self, "min_lr_share", tier.get("min_lr_share", 0.0))
        if self.micro_batch is None and "micro_batch" in tier:  # None: the whole batch in one pass
            object.__setattr__(self, "micro_batch", min(tier["micro_batch"], self.batch_size))
        if self.tokens is not None:
            if not self.tokens >= 1:
                raise ValueError(f"tokens must be >= 1, got {self.tokens}")
            # The budget becomes steps (what the loop, its records and a resume read); tokens is cleared, so that
            # `dataclasses.replace` of the config does not meet both.
            object.__setattr__(self, "steps", math.ceil(self.tokens / (self.batch_size * self.length)))
            object.__setattr__(self, "tokens", None)
        if self.warmup is None:
            object.__setattr__(self, "warmup", int(round(tier.get("warmup_share", WARMUP_SHARE) * self.steps)))
        for name in ("d_model", "n_layers", "n_heads", "length", "batch_size", "steps", "checkpoint_every",
                     "micro_batch", "gpt_n_layers", "gpt_n_heads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.length < 2:
            raise ValueError(f"length must be >= 2 tokens, got {self.length}")
        for heads in dict.fromkeys((self.n_heads, self.gpt_n_heads)):
            if self.d_model % heads or (self.d_model // heads) % 8:
                raise ValueError(f"d_model {self.d_model} must split into {heads} heads of a multiple of 8 dims "
                                 "(partial rotary and p-RoPE rotate a quarter of each head in pairs)")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0 steps (0: the final weights only), got {self.save_every}")
        if self.micro_batch is not None and self.batch_size % self.micro_batch:
            raise ValueError(f"micro_batch {self.micro_batch} must divide batch_size {self.batch_size}")
        if not 0 <= self.min_lr_share <= 1:
            raise ValueError(f"min_lr_share must be in [0, 1], got {self.min_lr_share}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps); got {self.warmup} with {self.steps} steps")
        if self.lr <= 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError("lr and grad_clip must be > 0 and weight_decay >= 0")
        if not 0 <= self.passkey <= 1:
            raise ValueError(f"passkey must be a share in [0, 1], got {self.passkey}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.vocab_size < 258:
            raise ValueError(f"vocab_size must be >= 258 (256 bytes and two special tokens), got {self.vocab_size}")

    @property
    def widths(self) -> Widths:
        """The block shape every member shares."""
        return Widths(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, length=self.length,
                      vocab_size=self.vocab_size)

    def widths_for(self, name: str) -> Widths:
        """The block shape of member `name`: the config's widths, with `gpt_n_layers` and `gpt_n_heads` for a
        member of the gpt block (the research tier's GPT-2-small depth).

        Args:
            name: a member's name (`posprobe.zoo.members.MEMBERS`).

        Returns:
            Its Widths."""
        w = self.widths
        if member(name).block != "gpt":
            return w
        return Widths(d_model=w.d_model, n_layers=self.gpt_n_layers, n_heads=self.gpt_n_heads, length=w.length,
                      vocab_size=w.vocab_size)

    @property
    def tokens_per_step(self) -> int:
        """Training tokens per optimiser step (batch x L)."""
        return self.batch_size * self.length


#: The synthetic tasks (`posprobe.zoo.tasks`), repeated here so that flags are built without importing it.
TASK_NAMES = ("copy", "reverse", "addition", "sorting")


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The synthetic tasks of `posprobe zoo tasks` (after Kazemnejad et al. 2023): trained on instance lengths
    1..L, accuracy measured on lengths 1..test_factor x L."""

    tasks: tuple[str, ...] = option(TASK_NAMES, "tasks mixed in training and measured (repeatable)", flag="--task")
    train_max: int = option(8, "longest training instance L (symbols to copy, reverse or sort; digits per operand of "
                               "an addition)")
    test_factor: float = option(3.0, "accuracy on instance lengths 1 .. test_factor x L")
    test_count: int = option(64, "test instances per task and length")
    steps: int = option(1500, "optimiser steps per member (the text zoo's tier steps do not apply)")
    batch_size: int = option(32, "task instances per step")

    def __post_init__(self) -> None:
        bad = sorted(set(self.tasks) - set(TASK_NAMES))
        if bad or not self.tasks:
            raise ValueError(f"unknown tasks {bad}; choose from {', '.join(TASK_NAMES)}")
        object.__setattr__(self, "tasks", tuple(dict.fromkeys(self.tasks)))
        at_least(self, 1, "train_max", "test_count", "steps", "batch_size")
        if self.test_factor < 1:
            raise ValueError(f"test_factor must be >= 1, got {self.test_factor}")

    @property
    def test_lengths(self) -> list[int]:
        """Instance lengths measured: 1 .. test_factor x L."""
        return list(range(1, int(self.test_factor * self.train_max) + 1))


def load_config_file(path: str | Path, **overrides: Any) -> ZooConfig:
    """A ZooConfig from a JSON file of its fields (lists for tuples), with `overrides` (not None) on top; unknown
    keys are refused with the known ones named."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a JSON object of ZooConfig fields")
    known = {f.name for f in fields(ZooConfig)} - {"progress"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return ZooConfig(**raw)
