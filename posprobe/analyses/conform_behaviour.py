"""Check 2 of `posprobe conform`: the engine's behaviour against position, on the same token ids as the HF reference.

Per position t: KL(HF || engine) of the next-token distributions (nats) and whether their top-1 tokens agree; per
position bin (`bins` equal bins of the input), their means. A quantised engine differs from the dequantised
reference everywhere, by a roughly constant amount (the floor, read from the first quarter of the positions after
the first `SKIP`); a rotation error differs more the further the position, the signature this check looks for:

- `differs everywhere`: top-1 agreement under `AGREEMENT_FLOOR` already in the first quarter (a gross error: a wrong
  scale, a wrong base by far; no quantisation does this);
- `grows with position`: mean KL in the last quarter over the first quarter's above `GROWTH` (a small base error,
  a frequency or a scaling that only long distances see);
- `position-flat`: neither, or the last quarter's KL under `EXACT` nats (an unquantised engine agrees to float
  noise, whose ratio means nothing); the engine behaves as the reference up to its quantisation floor (a small base
  error may still hide here: the declared check is the one that sees it).
Torch-free (numpy on the two log-probability arrays)."""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["AGREEMENT_FLOOR", "EXACT", "GROWTH", "SKIP", "behaviour_tables", "position_metrics"]

#: First positions left out of the floor and the trend (the first tokens' distributions are broad and noisy).
SKIP = 16
#: Top-1 agreement below which the first quarter already differs grossly (4-bit SmolLM2: 0.95-0.98 on text).
AGREEMENT_FLOOR = 0.85
#: Last quarter's mean KL over the first quarter's above which divergence grows with position (SmolLM2 4-bit at
#: 2,048 tokens: 0.94-0.96 for a correct or a 1 %-off base, 1.44 for a base 10 % off).
GROWTH = 1.25
#: KL (nats) under which an engine agrees with the reference to float noise whatever the ratio (HF in eager against
#: HF in SDPA, float32: ~1e-11).
EXACT = 1e-6


def position_metrics(hf_logprobs: np.ndarray, engine_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(KL(HF || engine) per position in nats, top-1 agreement per position as 0/1) from two `[position, vocab]`
    arrays of next-token log-probabilities (float64 sums)."""
    h = np.asarray(hf_logprobs, dtype=np.float64)
    e = np.asarray(engine_logprobs, dtype=np.float64)
    if h.shape != e.shape:
        raise ValueError(f"the engine gave {e.shape} log-probabilities where the reference gave {h.shape}")
    # Each side renormalised in float64: a float32 log-softmax over a large vocabulary is off by ~1e-5 in its
    # normaliser, which would read as a KL of that size (negative too) between two equal models.
    h = h - _logsumexp(h)
    e = e - _logsumexp(e)
    kl = (np.exp(h) * (h - e)).sum(axis=1)
    return kl, (h.argmax(axis=1) == e.argmax(axis=1)).astype(np.float64)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(axis=1, keepdims=True))


def behaviour_tables(kl: np.ndarray, top1: np.ndarray, *, length: int, bins: int = 16
                     ) -> tuple[pd.DataFrame, dict]:
    """(per position bin: first and last position, mean KL in nats, top-1 agreement, positions; the verdict row:
    length, floor KL, last-quarter KL, growth ratio, first- and last-quarter agreement, verdict and sentence) for
    per-position `kl` and `top1` of an input of `length` tokens."""
    n = len(kl)
    edges = np.linspace(0, n, bins + 1).astype(int)
    rows = [{"length": length, "bin": i, "first_position": int(a), "last_position": int(b - 1),
             "kl": float(kl[a:b].mean()), "top1_agreement": float(top1[a:b].mean()), "positions": int(b - a)}
            for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])) if b > a]
    q = max(1, (n - SKIP) // 4)
    first, last = slice(SKIP, SKIP + q), slice(n - q, n)
    floor, late = float(kl[first].mean()), float(kl[last].mean())
    agree_first, agree_last = float(top1[first].mean()), float(top1[last].mean())
    growth = late / floor if floor > 0 else float("inf")
    if agree_first < AGREEMENT_FLOOR:
        verdict, why = "differs everywhere", (f"top-1 agreement {agree_first:.3f} in the first quarter (KL "
                                              f"{floor:.4g} nats): a gross error, no quantisation floor is this far")
    elif growth > GROWTH and late > EXACT:
        verdict, why = "grows with position", (f"KL {floor:.4g} -> {late:.4g} nats from the first to the last "
                                               f"quarter (x{growth:.2f}), top-1 agreement {agree_first:.3f} -> "
                                               f"{agree_last:.3f}: the signature of a rotation error")
    elif late <= EXACT:
        verdict, why = "position-flat", (f"KL {floor:.3g} -> {late:.3g} nats, top-1 agreement {agree_first:.3f} -> "
                                         f"{agree_last:.3f}: the engine agrees with the reference to float noise")
    else:
        verdict, why = "position-flat", (f"KL {floor:.4g} -> {late:.4g} nats (x{growth:.2f}), top-1 agreement "
                                         f"{agree_first:.3f} -> {agree_last:.3f}: the engine's quantisation floor, "
                                         "no growth with position")
    return pd.DataFrame(rows), {"length": length, "floor_kl": floor, "late_kl": late, "growth": growth,
                                "top1_first": agree_first, "top1_last": agree_last, "verdict": verdict, "why": why}
