"""The zoo's retrieval skill (issue #49): a share of each training batch replaced by passkey sequences (Mohtashami &
Jaggi 2023, the task of Chen et al. 2023's Table 4), so that a member has something to do with context far back and
its effective window can be measured (`posprobe.analyses.passkey`).

One sequence of L tokens: filler, "The pass key is <5 digits>. ", more filler, "What is the pass key? The pass key is",
then the answer " <5 digits>" as its last tokens (`posprobe.data.needles.SHORT_PASSKEY`; every token is an ordinary
next-token target, as in the text windows). The needle's place is uniform over the filler, so the distance from the
key to the answer covers every value from the shortest the format allows (needle and question back to back) to the
longest (needle first) within L. Draws come from a generator seeded by (seed, step) alone, apart from the text
windows' generator: a batch is a function of (seed, step), a resumed run continues it exactly, and a zoo trained
without the skill (share 0) gets the very batches it had before."""

from __future__ import annotations

import random
from typing import Any

from posprobe.data.needles import SHORT_PASSKEY, PasskeyFormat, PasskeyPrompt, passkey_at, passkey_filler

__all__ = ["passkey_rows", "passkey_sequence", "with_passkey"]


def passkey_rows(share: float, batch_size: int) -> int:
    """How many of a batch's `batch_size` sequences are passkey sequences at `share` (at least one when share > 0)."""
    return 0 if share <= 0 else min(batch_size, max(1, round(share * batch_size)))


def passkey_sequence(tokenizer: Any, length: int, rng: random.Random, fmt: PasskeyFormat = SHORT_PASSKEY
                     ) -> PasskeyPrompt:
    """The prompt of one training sequence of exactly `length` tokens (`ids + answer`): a 5-digit key and the needle's
    place drawn from `rng` (the place uniform over the filler)."""
    key = str(rng.randint(10_000, 99_999))
    at = length - len(tokenizer(" " + key, add_special_tokens=False)["input_ids"])  # the prompt's length
    try:
        room = passkey_filler(tokenizer, at, key, fmt)
    except ValueError as e:
        raise ValueError(f"--passkey: a passkey sequence does not fit in L = {length} tokens with this tokenizer "
                         f"({e}, and the answer); use a longer --length") from None
    return passkey_at(tokenizer, at, rng.randint(0, room), key, fmt)


def with_passkey(batch: Any, tokenizer: Any, step: int, seed: int, share: float) -> Any:
    """`batch` (`[batch_size, L]` token ids of step `step`) with its last `passkey_rows(share, batch_size)` rows
    replaced by passkey sequences drawn from a generator seeded by (seed, step); `batch` itself when share is 0."""
    import torch

    n = passkey_rows(share, batch.shape[0])
    if not n:
        return batch
    rng = random.Random(f"zoo-passkey|{int(seed)}|{int(step)}")
    out = batch.clone()
    for r in range(batch.shape[0] - n, batch.shape[0]):
        p = passkey_sequence(tokenizer, batch.shape[1], rng)
        out[r] = torch.tensor(p.ids + list(p.answer), dtype=batch.dtype)
    return out
