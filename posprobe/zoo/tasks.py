"""Synthetic length-generalisation tasks after Kazemnejad et al. (2023): copy, reverse, addition and sorting, each an
instance of length n (symbols to copy, reverse or sort; digits per operand of an addition), generated from a seed.

A sequence is `<eot> <task> input = output <eot>`; training scores only the output and the closing `<eot>`, on
instances of length 1..L, and accuracy is measured on lengths up to 3L. An answer is correct when greedy decoding
reproduces it exactly; that is the case exactly when, with the true answer fed in (teacher forcing), every answer
token is the argmax of the logits before it — one forward pass per batch, no decoding loop (`task_accuracy`).
The vocabulary is fixed (characters, not learned merges), so every member and seed reads the same ids. Torch is
imported only where tensors are made."""

from __future__ import annotations

import functools
import random
from typing import Any

from posprobe.zoo.config import TASK_NAMES
from posprobe.zoo.tokenizer import EOT, PAD, character_tokenizer

__all__ = ["TASKS", "UNK", "encode_instance", "instance", "sequence_length", "task_batch", "task_tokenizer",
           "task_accuracy", "held_out_instances"]

TASKS = TASK_NAMES
UNK = "<unk>"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_DIGITS = "0123456789"
_SYMBOLS = _DIGITS + _LETTERS + "+="
#: Seed offset of test instances: drawn from another stream than any training batch.
_TEST_STREAM = 7_919


@functools.lru_cache(maxsize=1)
def _vocab() -> dict[str, int]:
    tokens = [EOT, PAD, UNK] + [f"<{t}>" for t in TASKS] + list(_SYMBOLS)
    return {t: i for i, t in enumerate(tokens)}


def task_tokenizer() -> Any:
    """A character-level `PreTrainedTokenizerFast` over the tasks' fixed vocabulary (ids 0/1 = EOT/PAD as in every
    zoo vocabulary, then `<unk>`, one token per task, digits, lowercase letters, '+', '='), saved with every member."""
    return character_tokenizer(_vocab(), [EOT, PAD, UNK] + [f"<{t}>" for t in TASKS], UNK)


def instance(task: str, n: int, rng: random.Random) -> tuple[str, str]:
    """(input, answer) of `task` at length `n` drawn from `rng`: copy / reverse / sorting of n lowercase letters;
    addition of two n-digit numbers (no leading zero unless n = 1), written "a+b", answered with the sum's digits."""
    if n < 1:
        raise ValueError(f"instance length must be >= 1, got {n}")
    if task == "addition":
        lo = 0 if n == 1 else 10 ** (n - 1)
        a, b = rng.randrange(lo, 10 ** n), rng.randrange(lo, 10 ** n)
        return f"{a}+{b}", str(a + b)
    letters = "".join(rng.choice(_LETTERS) for _ in range(n))
    if task == "copy":
        return letters, letters
    if task == "reverse":
        return letters, letters[::-1]
    if task == "sorting":
        return letters, "".join(sorted(letters))
    raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def sequence_length(task: str, n: int) -> int:
    """Tokens of the longest sequence of `task` at instance length n: <eot> <task> input = answer <eot>."""
    if task == "addition":
        return 2 * n + 1 + (n + 1) + 4
    return 2 * n + 4


def encode_instance(task: str, inp: str, answer: str) -> tuple[list[int], int]:
    """(token ids of the whole sequence, index of the first answer token)."""
    v = _vocab()
    head = [v[EOT], v[f"<{task}>"]] + [v[c] for c in inp] + [v["="]]
    return head + [v[c] for c in answer] + [v[EOT]], len(head)


def task_batch(tasks: tuple[str, ...], max_n: int, batch_size: int, step: int, seed: int) -> tuple[Any, Any]:
    """(input ids, labels) `[batch_size, longest sequence at max_n]` of optimiser step `step`: each row a task and a
    length 1..max_n drawn from a generator seeded by (seed, step) alone, so every member sees the same rows and a
    resumed run continues exactly; labels are -100 except on the answer and its closing <eot>; rows right-padded."""
    import torch

    rng = random.Random(int(seed) * 1_000_003 + int(step))
    width = max(sequence_length(t, max_n) for t in tasks)
    x = torch.full((batch_size, width), _vocab()[PAD], dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    for r in range(batch_size):
        task = tasks[rng.randrange(len(tasks))]
        ids, start = encode_instance(task, *instance(task, rng.randint(1, max_n), rng))
        x[r, :len(ids)] = torch.tensor(ids)
        labels[r, start:len(ids)] = torch.tensor(ids[start:])
    return x, labels


def held_out_instances(task: str, n: int, count: int, seed: int) -> list[tuple[str, str]]:
    """`count` (input, answer) pairs of `task` at length n, from a stream no training batch draws from."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    rng = random.Random(f"{_TEST_STREAM}/{seed}/{task}/{n}")  # str seeds are hashed deterministically (sha512)
    return [instance(task, n, rng) for _ in range(count)]


def task_accuracy(model: Any, task: str, pairs: list[tuple[str, str]], *, batch_size: int = 64) -> float:
    """Share of `pairs` whose answer (and closing <eot>) greedy decoding from `<eot> <task> input =` reproduces
    exactly, read by teacher forcing: every answer token is the argmax of the logits before it. `model`: a Hugging
    Face causal LM over the task vocabulary."""
    import torch

    correct = 0
    device = next(model.parameters()).device
    for i in range(0, len(pairs), batch_size):
        chunk = [encode_instance(task, inp, ans) for inp, ans in pairs[i:i + batch_size]]
        width = max(len(ids) for ids, _ in chunk)
        x = torch.full((len(chunk), width), _vocab()[PAD], dtype=torch.long)
        for r, (ids, _) in enumerate(chunk):
            x[r, :len(ids)] = torch.tensor(ids)
        with torch.no_grad():
            pred = model(input_ids=x.to(device)).logits.argmax(-1).cpu()
        for r, (ids, start) in enumerate(chunk):
            # logits at position j predict token j + 1
            correct += bool((pred[r, start - 1:len(ids) - 1] == x[r, start:len(ids)]).all())
    return correct / len(pairs)
