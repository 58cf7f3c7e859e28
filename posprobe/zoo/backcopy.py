"""The Bigram-Backcopy task (Guo et al. 2024, "Active-Dormant Attention Heads: Mechanistically Demystifying
Extreme-Token Phenomena in LLMs", arXiv 2410.13835): a positive control for attention sinks. Transformers of one to
three layers trained on it put their non-trigger queries' attention on the first token (a sink), with a small value
there (a value-state drain) and a large residual norm (a residual-state peak).

A sequence of L tokens: `<eot>` (the BOS), then one character drawn from the characters' unigram frequencies with the
triggers left out, then every next token drawn from the bigram transition of the token before it — except after a
trigger, where the next token copies the token just before the trigger (x[t] = x[t - 2] when x[t - 1] is a trigger).
A trigger is therefore always preceded and followed by the same non-trigger character.

Where the paper's choices are kept and where they are not (its code: github.com/GuoTianYu2000/Active-Dormant-Attention,
`BBM/data.py`, class `bbm`, and `BBM/scripts/`):
- the transition: the paper counts the character bigrams of tiny Shakespeare (65 characters, every consecutive pair);
  tiny Shakespeare is not available offline, so here they are counted on posprobe's built-in corpus (CC0, shipped
  with the package) reduced to letters and single spaces (50 characters; line breaks read as spaces). Prose
  punctuation is almost always followed by a space, a trigger, so with it ',' ';' ':' would be absorbing (", , , ,"
  to the end); tiny Shakespeare's line breaks after punctuation keep it from that. Reduced so, the chance that a
  non-trigger is followed by a trigger is at most 0.80 ('y'), 0.41 on average (tiny Shakespeare's: 0.81, 0.32);
- the triggers: the k most frequent characters (paper: k = 3, also 5); on both corpora k = 3 gives ' ', 'e', 't';
- the first token after BOS: the unigram frequencies with the triggers removed (the paper's `no_trigger_init`);
- the vocabulary: the paper adds `<s>` (and an unused delimiter) after the characters; here ids 0/1 are EOT/PAD as in
  every zoo vocabulary, EOT is the BOS, id 2 is `<unk>` (never generated), then the characters sorted;
- the length: the paper's sequences are 256 tokens; `BackcopyConfig.length` (default 64) keeps CPU training short.

Draws come from a torch generator seeded by (seed, step) alone (a batch is a function of them; a resumed run
continues exactly); the measurement rows come from another stream. Torch is imported only where tensors are made."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any

from posprobe.core.config import at_least, option
from posprobe.zoo.tokenizer import EOT, PAD, character_tokenizer

__all__ = ["BackcopyConfig", "UNK", "backcopy_batch", "backcopy_rows", "backcopy_tokenizer", "backcopy_vocab",
           "bigram_counts", "loss_floor", "transition_matrix", "trigger_ids"]

UNK = "<unk>"
_SPECIAL = (EOT, PAD, UNK)
#: Seed offset of measurement rows: drawn from another stream than any training batch.
_TEST_STREAM = 104_729


@dataclass(frozen=True, kw_only=True)
class BackcopyConfig:
    """The sink control of `posprobe zoo sink-control`: members trained on the Bigram-Backcopy task, then the first
    token's attention share, value norm and residual norm measured on held-out task sequences."""

    members: tuple[str, ...] = option(("learned", "rope-llama"), "zoo members to train (repeatable; learned has "
                                      "Guo et al.'s block: LayerNorm, learned positions, MLP)", flag="--member")
    seeds: tuple[int, ...] = option((0,), "training seeds (repeatable)", flag="--seed")
    n_layers: int = option(1, "blocks (the paper: 1 to 3)")
    d_model: int = option(64, "residual width")
    n_heads: int = option(1, "attention heads per block (the paper: 1)")
    length: int = option(64, "tokens per sequence, BOS included (the paper: 256)")
    triggers: int = option(3, "trigger characters: the k most frequent (the paper: k = 3)")
    steps: int = option(600, "optimiser steps")
    batch_size: int = option(32, "sequences per step")
    lr: float = option(3e-3, "peak learning rate of AdamW (the zoo's cosine schedule, 5% warmup)")
    weight_decay: float = option(1e-4, "AdamW weight decay on matrices (the paper's 1e-4)")
    eval_sequences: int = option(64, "held-out task sequences the sinks are measured on")
    looks: int = option(4, "intermediate steps (evenly spaced) at which the sink share is measured too, besides step "
                           "0 and the end")
    device: str = option("cpu", "", cli=False)
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(dict.fromkeys(self.members)))
        object.__setattr__(self, "seeds", tuple(dict.fromkeys(int(s) for s in self.seeds)))
        if not self.members or not self.seeds or any(s < 0 for s in self.seeds):
            raise ValueError("give at least one member and one seed (seeds >= 0)")
        at_least(self, 1, "n_layers", "d_model", "n_heads", "triggers", "steps", "batch_size", "eval_sequences")
        at_least(self, 0, "looks")
        at_least(self, 3, "length")
        if self.triggers >= len(backcopy_vocab()) - len(_SPECIAL):
            raise ValueError(f"triggers must leave non-trigger characters; got {self.triggers}")
        if self.lr <= 0 or self.weight_decay < 0:
            raise ValueError("lr must be > 0 and weight_decay >= 0")

    @property
    def look_steps(self) -> tuple[int, ...]:
        """Steps at which the training loop hands the model over for a sink measurement: 0 and `looks` evenly
        spaced steps before the end (the end itself is measured on the saved folder)."""
        inner = {round(self.steps * (i + 1) / (self.looks + 1)) for i in range(self.looks)}
        return tuple(sorted({0} | {s for s in inner if 0 < s < self.steps}))


def _corpus() -> str:
    import re

    from posprobe.data import builtin_corpus

    # Letters and single spaces: a line break separates words as a space does; punctuation is left out (above).
    return re.sub(" +", " ", re.sub("[^A-Za-z ]", "", builtin_corpus().replace("\n", " ")))


@functools.lru_cache(maxsize=1)
def backcopy_vocab() -> dict[str, int]:
    """The task's fixed vocabulary (token -> id): EOT (0, the BOS), PAD (1), `<unk>` (2), then the characters of the
    built-in corpus reduced to letters and spaces, sorted.

    Returns:
        The vocabulary, 53 tokens."""
    tokens = list(_SPECIAL) + sorted(set(_corpus()))
    return {t: i for i, t in enumerate(tokens)}


def backcopy_tokenizer() -> Any:
    """The task's character tokenizer over `backcopy_vocab()` (ids 0/1 = EOT/PAD), saved with every member.

    Returns:
        A `PreTrainedTokenizerFast`."""
    return character_tokenizer(backcopy_vocab(), list(_SPECIAL), UNK)


def bigram_counts() -> Counter:
    """How often each character follows each other in the built-in corpus (every consecutive pair).

    Returns:
        Counter of (id, next id)."""
    v = backcopy_vocab()
    ids = [v[c] for c in _corpus()]
    return Counter(zip(ids, ids[1:]))


def trigger_ids(k: int = 3) -> tuple[int, ...]:
    """The k most frequent characters of the corpus (ties broken by id), the task's triggers.

    Args:
        k: how many triggers.

    Returns:
        Their ids, most frequent first."""
    v = backcopy_vocab()
    freq = Counter(v[c] for c in _corpus())
    return tuple(sorted(freq, key=lambda i: (-freq[i], i))[:k])


@functools.lru_cache(maxsize=8)
def _matrix(k: int) -> Any:
    import torch

    n = len(backcopy_vocab())
    counts = torch.zeros(n, n, dtype=torch.float64)
    for (a, b), c in bigram_counts().items():
        counts[a, b] = c
    start = counts.sum(0)  # unigram frequencies of every character but the first of the corpus
    start[list(trigger_ids(k))] = 0
    start /= start.sum()
    rows = counts.sum(1, keepdim=True)
    p = torch.where(rows > 0, counts / rows.clamp_min(1), start)  # no successor (the specials): the start row
    p[backcopy_vocab()[EOT]] = start
    return p


def transition_matrix(k: int = 3) -> Any:
    """The draw of the token after token a, row a of a `[V, V]` float64 matrix: the corpus's bigram frequencies of a;
    the BOS row (and the rows of PAD and `<unk>`, never used) the unigram frequencies without the k triggers. Rows of
    triggers are never drawn from (a trigger's successor is a copy).

    Args:
        k: how many triggers.

    Returns:
        The row-stochastic matrix (a copy)."""
    return _matrix(k).clone()


def _draw(batch_size: int, length: int, k: int, generator: Any) -> Any:
    import torch

    if length < 3:
        raise ValueError(f"a Bigram-Backcopy sequence needs at least 3 tokens, got {length}")
    p = _matrix(k)
    is_trigger = torch.zeros(p.shape[0], dtype=torch.bool)
    is_trigger[list(trigger_ids(k))] = True
    x = torch.empty(batch_size, length, dtype=torch.long)
    x[:, 0] = backcopy_vocab()[EOT]
    for t in range(1, length):
        prev = x[:, t - 1]
        drawn = torch.multinomial(p[prev], 1, generator=generator)[:, 0]
        x[:, t] = torch.where(is_trigger[prev], x[:, t - 2], drawn) if t > 1 else drawn
    return x


def backcopy_batch(batch_size: int, length: int, step: int, seed: int, *, triggers: int = 3) -> tuple[Any, Any]:
    """The `[batch_size, length]` token ids of optimiser step `step` and their labels (the ids: every token is a
    next-token target, the loop shifts them), drawn from a generator seeded by (seed, step) alone.

    Args:
        batch_size: sequences.
        length: tokens per sequence, the BOS included.
        step: the optimiser step.
        seed: the training seed.
        triggers: how many triggers (the k most frequent characters).

    Returns:
        (input ids, labels), both `[batch_size, length]` long tensors."""
    import torch

    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    x = _draw(batch_size, length, triggers, g)
    return x, x.clone()


def backcopy_rows(count: int, length: int, seed: int = 0, *, triggers: int = 3) -> Any:
    """`count` held-out sequences of `length` tokens (from a stream no training batch draws from): what the sinks
    are measured on.

    Args:
        count: sequences.
        length: tokens per sequence, the BOS included.
        seed: the measurement seed.
        triggers: how many triggers.

    Returns:
        `[count, length]` long tensor."""
    import torch

    g = torch.Generator().manual_seed(_TEST_STREAM * 1_000_003 + int(seed))
    return _draw(count, length, triggers, g)


def loss_floor(rows: Any, triggers: int = 3) -> float:
    """The least mean next-token loss any model can reach on `rows` (nats per predicted token, positions 1..L-1):
    the task's own law, -log P(x[t] | x[t - 1]), 0 where x[t - 1] is a trigger (the copy is certain).

    Args:
        rows: `[batch, L]` task sequences.
        triggers: how many triggers.

    Returns:
        The mean loss of the task's own law on `rows`."""
    import torch

    p = _matrix(triggers)[rows[:, :-1], rows[:, 1:]]
    copied = torch.isin(rows[:, :-1], torch.tensor(trigger_ids(triggers)))
    return float(torch.where(copied, torch.ones_like(p), p).log().neg().mean())
