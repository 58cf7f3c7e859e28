"""Check 4 of `posprobe conform`: rotary phase precision against position, per layer type.

A rotary band j turns position p into the phase p * theta_j. Computed in a narrow dtype, the phase is off, more the
larger p; in tokens (phase error / theta_j: the position the band reads minus the true one) an error of half a token
makes the band read a neighbour. For each way of computing the phases (`MODES`, and the engine's
own where it declares one) and each layer type's own bands, against float64 phases of the same frequencies:

- `first_identical_position`: the first position whose rotation equals its predecessor's in every band (the two
  positions cannot be told apart at all: bf16 cannot tell 257 from 256, transformers #29285);
- `first_fast_neighbour_position`: the first position at which the fastest band (the one local order lives in) is
  off by half a token or more: it reads a neighbour (a slow band's tokens are no measure: it barely turns between
  neighbours, so its error is given in radians);
- the largest phase error over bands (rad) up to the model's context and up to the scanned end.
Positions are scanned one by one from 0 to the end given (default 4 x the context). Phase errors are wrapped to
(-pi, pi] before division (a band's rotation is periodic).

Modes (what implementations did and do):
- `float32`: inverse frequencies, positions and their product in float32 (HF since transformers PR #29285: autocast
  disabled around the product);
- `bfloat16` / `float16`: inverse frequencies and positions cast to the dtype and multiplied in it (the product under
  autocast before that PR; vLLM #863);
- `float32 phases, bfloat16 cos/sin`: float32 phases, cos and sin stored in bf16 (HF today in a bf16 model): the
  angle atan2(sin, cos) of the stored pair;
- the engine's own (llama.cpp's CPU rope: a float32 running product over bands, p * s * s * ..., s =
  base^(-2/n_rot) in float32), against float64 phases of the engine's declared frequencies."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pandas as pd

__all__ = ["MODES", "NEIGHBOUR", "dtype_phases", "precision_tables"]

#: Position error (tokens) at which a band reads a neighbour.
NEIGHBOUR = 0.5
#: How phases are computed, by name (module docstring).
MODES = ("float32", "bfloat16", "float16", "float32 phases, bfloat16 cos/sin")


def dtype_phases(inv_freq: np.ndarray, positions: np.ndarray, mode: str) -> np.ndarray:
    """Phases `[position, band]` (rad, float64 of the value the mode computes) of `positions` for float64 inverse
    frequencies `inv_freq` computed as `mode` says (`MODES`)."""
    import torch

    p = torch.as_tensor(positions, dtype=torch.float64)
    f = torch.as_tensor(inv_freq, dtype=torch.float64)
    if mode in ("float32", "bfloat16", "float16"):
        dt = getattr(torch, mode)
        return (p.to(dt)[:, None] * f.to(dt)[None, :]).double().numpy()
    if mode == "float32 phases, bfloat16 cos/sin":
        ph = p.float()[:, None] * f.float()[None, :]
        return torch.atan2(ph.sin().bfloat16().double(), ph.cos().bfloat16().double()).numpy()
    raise ValueError(f"unknown precision mode {mode!r}; choose from {', '.join(MODES)}")


def _errors(inv: np.ndarray, got: np.ndarray, pos: np.ndarray) -> np.ndarray:
    # |phase error| (rad) wrapped to [0, pi] per position and band; inf where the mode has no finite phase.
    with np.errstate(invalid="ignore"):
        err = np.abs(np.angle(np.exp(1j * (got - pos[:, None] * inv[None, :]))))
    return np.where(np.isfinite(got), err, np.inf)


def _scan(inv_freq: np.ndarray, phases_of: Callable[[np.ndarray], np.ndarray], end: int, context: int,
          block: int = 8192) -> dict[str, Any]:
    inv = np.asarray(inv_freq, dtype=np.float64)
    fast = int(np.argmax(inv))
    first_fast = identical = None
    worst_ctx = worst_all = fast_ctx = 0.0
    prev = None
    for a in range(0, end + 1, block):
        pos = np.arange(a, min(end + 1, a + block), dtype=np.float64)
        got = phases_of(pos)
        err = _errors(inv, got, pos)
        worst, fast_tokens = err.max(axis=1), err[:, fast] / inv[fast]
        worst_all = max(worst_all, float(worst.max()))
        if a <= context:
            worst_ctx = max(worst_ctx, float(worst[: context - a + 1].max()))
            fast_ctx = max(fast_ctx, float(fast_tokens[: context - a + 1].max()))
        if first_fast is None and (hit := np.flatnonzero(fast_tokens >= NEIGHBOUR)).size:
            first_fast = int(pos[hit[0]])
        if identical is None:
            stack = got if prev is None else np.vstack([prev[None, :], got])
            same = np.flatnonzero((stack[1:] == stack[:-1]).all(axis=1))
            if same.size:  # comparison i is position pos[0] + i (+ 1 without a previous block)
                identical = int(pos[0] + same[0] + (1 if prev is None else 0))
        prev = got[-1]
    return {"first_identical_position": identical, "first_fast_neighbour_position": first_fast,
            "fast_position_error_in_context": fast_ctx, "max_phase_error_in_context": worst_ctx,
            "max_phase_error": worst_all}


def precision_tables(hf_tables: dict[str, tuple[np.ndarray, float]], *, context: int, end: int | None = None,
                     engine: dict[str, tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]] | None = None,
                     engine_name: str = "engine", points: int = 96, block: int = 8192
                     ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(summary: per layer type and mode, the first position whose rotation equals its predecessor's in every band
    and the first where the fastest band reads a neighbour (its error >= 0.5 tokens; None: not up to `end`), the
    fastest band's largest error within `context` (tokens), the largest phase error over bands within `context` and
    up to `end` (rad, inf where the dtype overflows), the context and the scanned end; curve: per layer type, mode
    and position on a log grid of `points` positions, the largest phase error over bands (rad) and the fastest
    band's error (tokens)) for HF's tables `hf_tables` ({layer type: (inverse frequencies rad/token, multiplier)})
    under each of `MODES`, and for the engine's own phases where `engine` gives {layer type: (its float64
    frequencies, positions -> its phases)}. `end` defaults to 4 x `context`; positions are scanned `block` at a
    time (memory), with the same result for any block."""
    end = int(end if end is not None else 4 * context)
    if context < 1 or end < context:
        raise ValueError(f"precision scan: context {context} and end {end} must be >= 1 and end >= context")
    grid = np.unique(np.geomspace(1, end, points).round().astype(np.int64)).astype(np.float64)
    rows, curve = [], []
    cases: list[tuple[str, str, np.ndarray, Callable[[np.ndarray], np.ndarray]]] = []
    for lt, (inv, _) in hf_tables.items():
        for mode in MODES:
            cases.append((lt, mode, np.asarray(inv, np.float64),
                          lambda pos, inv=inv, mode=mode: dtype_phases(inv, pos, mode)))
    for lt, (inv, fn) in (engine or {}).items():
        cases.append((lt, f"{engine_name} (its own)", np.asarray(inv, np.float64), fn))
    for lt, mode, inv, fn in cases:
        rows.append({"layer_type": lt, "mode": mode, **_scan(inv, fn, end, context, block), "context": int(context),
                     "scanned_to": end})
        err = _errors(inv, fn(grid), grid)
        fast = int(np.argmax(inv))
        curve += [{"layer_type": lt, "mode": mode, "position": int(p), "phase_error": float(e.max()),
                   "fast_position_error": float(e[fast] / inv[fast])} for p, e in zip(grid, err)]
    summary = pd.DataFrame(rows)
    for col in ("first_identical_position", "first_fast_neighbour_position"):
        summary[col] = summary[col].astype("Int64")  # a position, or <NA>: none up to the scanned end
    return summary, pd.DataFrame(curve)
