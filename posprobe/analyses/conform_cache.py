"""Check 3 of `posprobe conform`: cached against uncached scores around the position where a rope type switches.

A length-dependent rotation (HF's `dynamic` NTK: a new base once the length passes L; `longrope`: long factors once it
passes the original context) rotates the keys of an uncached pass of n tokens by n's table, while a cache keeps the
keys it rotated when the length was shorter: past the switch the cached and the uncached scores differ (transformers
#25104; llama.cpp PR #24875, uzu PR #604 for LongRoPE under chunked prefill). A static rotation must give the same
scores both ways, up to float noise.

On each side (the HF reference; the engine where it decodes incrementally) and for the positions `at + OFFSETS`
(`at`: the switch, or any position the user names): the cached scores (a prefill of the tokens before `at - 4`,
then steps of `chunk` tokens through the cache) against uncached ones (the reference: one pass per prefix where its
rotation depends on the length, one pass over all the tokens where it does not: a causal model's positions then
see the same keys; the engine: one pass over all the tokens in one batch). Per position KL(uncached || cached) of the
next-token distributions (nats) and top-1 agreement; the verdict per side:

- `cached differs everywhere`: KL already over `EVERYWHERE` nats before `at` (a cache wrong from the prefill on:
  positions or keys off; no batch-shape noise is this large);
- `cache-consistent`: KL at and past `at` at most `GROWTH` x the largest before it, or under `FLOOR` nats;
- `cached differs past the switch`: otherwise, with the first position and the largest KL.
Torch-free (numpy on the log-probability arrays)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from posprobe.analyses.conform_behaviour import position_metrics

__all__ = ["EVERYWHERE", "FLOOR", "GROWTH", "OFFSETS", "cache_tables"]

#: Positions checked, relative to the switch: four before it (the floor: both ways rotate alike there), the switch
#: and four after, then two further (a dynamic base drifts with the length: the error grows past the switch).
OFFSETS = (-4, -3, -2, -1, 0, 1, 2, 3, 4, 16, 64)
#: KL (nats) under which cached and uncached agree whatever the floor (float32 noise: ~1e-12 on HF's reference).
FLOOR = 1e-6
#: KL at and past the switch over the largest before it above which the cache differs (an engine's batch shapes
#: move its floating-point sums a little everywhere; a switch moves the scores past it only).
GROWTH = 10.0
#: KL (nats) before the switch above which the cache is wrong everywhere (llama.cpp's 4-bit SmolLM2: at most 0.0023
#: from batch shapes alone; its keys' positions moved by 2 after the prefill: 0.07-0.17).
EVERYWHERE = 0.05


def cache_tables(side: str, uncached: np.ndarray, cached: np.ndarray, *, at: int, positions: list[int],
                 how: str) -> tuple[pd.DataFrame, dict]:
    """(per position: side, position, offset from `at`, KL(uncached || cached) in nats, top-1 agreement 0/1; the
    verdict row: side, at, how each way was scored, floor and largest KL past the switch, first position over the
    bar, verdict and sentence) for `[position, vocab]` next-token log-probabilities `uncached` and `cached` at
    `positions` (each `at + OFFSETS[i]`)."""
    kl, top1 = position_metrics(uncached, cached)
    kl = np.maximum(kl, 0.0)  # a float64 KL of two equal rows can come out -1e-17
    rows = [{"side": side, "position": int(p), "offset": int(p - at), "kl": float(k), "top1_agreement": float(a)}
            for p, k, a in zip(positions, kl, top1)]
    before = np.array([r["kl"] for r in rows if r["offset"] < 0])
    after = [r for r in rows if r["offset"] >= 0]
    floor = float(before.max()) if len(before) else 0.0
    bar = max(GROWTH * floor, FLOOR)
    over = [r for r in after if r["kl"] > bar]
    worst = max((r["kl"] for r in after), default=0.0)
    if floor > EVERYWHERE:
        verdict = "cached differs everywhere"
        why = (f"KL(uncached || cached) {floor:.3g} nats already before position {at} (up to {worst:.3g} past it): "
               "the cache is wrong from the prefill on, not at a switch")
    elif over:
        verdict = "cached differs past the switch"
        why = (f"KL(uncached || cached) {over[0]['kl']:.3g} nats at position {over[0]['position']} (the switch at "
               f"{at}), up to {worst:.3g} by {after[-1]['position']}, against {floor:.3g} before it: the cache keeps "
               "keys rotated for a shorter length")
    else:
        verdict = "cache-consistent"
        why = (f"KL(uncached || cached) at most {worst:.3g} nats at and past position {at} ({floor:.3g} before it): "
               "the cache rotates as a fresh pass does")
    return pd.DataFrame(rows), {"side": side, "at": int(at), "how": how, "floor_kl": floor, "late_kl": worst,
                                "first_over": over[0]["position"] if over else None, "verdict": verdict,
                                "why": why}
