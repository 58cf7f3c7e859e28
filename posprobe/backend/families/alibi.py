"""ALiBi: no position in the residual stream; each head adds -slope * distance to its scores (BLOOM, MPT,
Falcon-RW). Slopes are measured from the model's own computation, never taken from the formula (Falcon-RW in
transformers 5.23 applies its bias twice). Position control moves the distances the bias sees."""

from __future__ import annotations

import math
from typing import Any

from posprobe.backend.families.base import Family

_KIND = "alibi"


def _detect_hf(cfg: Any, row_family: Family | None) -> bool:
    # Falcon-RW is a Falcon config with `alibi` set (other Falcons are rotary).
    return bool(cfg.get("alibi")) or (row_family is not None and row_family.kind == _KIND)


FAMILY = Family(
    kind=_KIND,
    label="ALiBi",
    score_term="alibi",
    score_bias=lambda read, model, layer, scores, qk: score_bias(read.alibi_slopes(model)[layer], scores, qk),
    tl_names=frozenset({"alibi"}),
    shift_invariant=True,
    hf_position_ids=False,
    detect_hf=_detect_hf,
    phrase="ALiBi (linear distance bias)",
    control="score bias",
    decompositions=("data-driven",),  # with the bias as its own term ("alibi")
    not_applicable={
        "frequency": "per-frequency RoPE usage needs rotary positions; ALiBi has no bands",
        "geometry": "position geometry reads a learned position table; ALiBi models have none",
        "shift": "ALiBi's bias depends on distance alone, so shifting every position changes nothing by construction",
        "retrieval": "retrieval heads are read through the long-context engine, which rotates q and k",
    },
    gguf_archs=frozenset({"bloom", "mpt", "refact", "jais", "jina-bert-v2"}),
)


def phrase(slopes: tuple[float, ...]) -> str:
    """One ALiBi layer: its steepest and shallowest measured slope, as powers of two where they are."""
    def one(s: float) -> str:
        # A zero (or negative) measured slope is no power of two: printed as a number (log2 of it crashed here).
        e = math.log2(s) if s > 0 else None
        return f"2^{e:.0f}" if e is not None and abs(e - round(e)) < 1e-4 else f"{s:.3g}"

    return f"ALiBi (slopes {one(max(slopes))} … {one(min(slopes))}, measured)" if slopes else "ALiBi (no heads)"


def fit_slopes(bias: Any, arch: str) -> tuple[float, ...]:
    """Each head's slope (score units per token of key position) from one layer's measured causal bias
    `[head, query, key]` (float64; scores minus scale * q.k): bias = slope * j + c_i, fitted by least squares on
    the key index centred per query row. NotImplementedError, naming `arch`, where the bias is not linear in j."""
    import torch

    n = bias.shape[-1]
    i, j = torch.tril_indices(n, n)
    b = bias[:, i, j]
    jj = j.double()
    row_mean_b = torch.stack([b[:, i == r].mean(1) for r in range(n)], 1)[:, i]
    row_mean_j = torch.stack([jj[i == r].mean() for r in range(n)])[i]
    x, y = jj - row_mean_j, b - row_mean_b
    slope = (y * x).sum(1) / (x * x).sum()
    err = float((y - slope[:, None] * x).abs().max())
    if err > 1e-4 * max(1.0, float(b.abs().max())):
        raise NotImplementedError(f"{arch}'s attention bias is not linear in the key position (fit error {err:.2g}): "
                                  "not ALiBi as posprobe controls it")
    return tuple(float(v) for v in slope)


def distance_bias(slopes: tuple[float, ...], n_q: int, n_k: int) -> Any:
    """ALiBi's distance penalty, float64 `[head, query_pos, key_pos]` in score units: -slope * (i - j) for query i
    (the last n_q of n_k positions) and key j. Models add it with their own per-query-row constant (BLOOM adds
    slope * j), which softmax ignores."""
    import torch

    i = torch.arange(n_k - n_q, n_k, dtype=torch.float64)[:, None]
    j = torch.arange(n_k, dtype=torch.float64)[None, :]
    return -torch.tensor(slopes, dtype=torch.float64)[:, None, None] * (i - j)


def score_bias(slopes: tuple[float, ...], scores: Any, qk: Any) -> Any:
    """ALiBi's score term on one layer with measured `slopes`: the distance penalty (`distance_bias`) plus the
    per-query-row constant the model adds, float64 `[batch, head_index, query_pos, key_pos]`. The constant is the
    row mean, over kept keys, of what q.k (`qk`) and the penalty leave of `scores`; only a constant per row is taken
    from the scores, so the decomposition's sum check fails unless the penalty explains the rest."""
    import torch

    n_q, n_k = scores.shape[-2:]
    bias = distance_bias(slopes, n_q, n_k).expand_as(qk)
    ok = torch.isfinite(scores)
    rest = torch.where(ok, scores.to(torch.float64) - qk - bias, 0.0)
    return bias + rest.sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp_min(1)
