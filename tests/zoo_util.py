"""What a zoo model actually reads, observed from outside posprobe: every batch of token ids that reaches a token
embedding (torch's global forward pre-hook, so nothing in posprobe's loop is replaced or trusted), and the synthetic
task instance a row of ids spells."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def token_reads(vocab_size: int) -> Iterator[list[tuple[bool, torch.Tensor]]]:
    """Collect (module in training mode?, ids `[batch, pos]`) for every forward of an `nn.Embedding` with
    `vocab_size` rows (the token embedding; position tables and T5's bucket table have other sizes)."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    reads: list[tuple[bool, torch.Tensor]] = []

    def hook(module, args):
        if isinstance(module, torch.nn.Embedding) and module.num_embeddings == vocab_size and args:
            reads.append((module.training, args[0].detach().cpu().clone()))

    handle = register_module_forward_pre_hook(hook)
    try:
        yield reads
    finally:
        handle.remove()


def spelled_instance(tokens: list[str]) -> tuple[str, int, str, str]:
    """(task, instance length, input, answer) of one row `<eot> <task> input = answer <eot> <pad>...` read token by
    token; the length is the symbols of the input, or the digits of the first operand of an addition."""
    task = tokens[1].strip("<>")
    eq = tokens.index("=")
    inp = "".join(tokens[2:eq])
    answer = "".join(tokens[eq + 1:tokens.index("<|endoftext|>", eq)])
    n = len(inp.split("+")[0]) if task == "addition" else len(inp)
    return task, n, inp, answer


class Died(Exception):
    """Raised by `dying_state_io` to stand in for a process killed after a checkpoint."""


def dying_state_io(ckpt, after: int) -> tuple[tuple, list[int]]:
    """(load, save) state I/O over checkpoint `ckpt` whose save raises Died at its `after`-th call (the state is
    written first, as a kill right after a checkpoint), and the list of the steps it saved."""
    saved: list[int] = []

    def save_then_die(state: dict) -> None:
        ckpt.put("state", state)
        saved.append(state["step"])
        if len(saved) == after:
            raise Died

    return (lambda: ckpt.get("state") if ckpt.has("state") else None, save_then_die), saved
