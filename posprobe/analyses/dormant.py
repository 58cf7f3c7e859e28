"""Dormant heads (Guo et al. 2024, "Active-dormant attention heads"): heads that put nearly all their attention on
the sink and whose removal barely changes the model. A head is a candidate when its mean attention on the first
token (alpha_1, text windows) is at least `min_attention`; each candidate's output is zeroed before the output
projection (its slice of z) and the text loss measured; it is dormant when the loss changes by less than
`max_delta` nats/token, active otherwise.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from posprobe.backend.hooks import hooked
from posprobe.backend.model import token_losses
from posprobe.backend.vocab import hook_name

__all__ = ["dormant_heads", "mean_nll"]


@torch.no_grad()
def mean_nll(model: Any, rows: torch.Tensor, batch_size: int, hooks: list | None = None) -> float:
    """Mean next-token loss (nats/token) over `rows`, with `hooks` in place."""
    total, count = 0.0, 0
    with hooked(model, hooks or []):
        for a in range(0, rows.shape[0], batch_size):
            loss = token_losses(model, rows[a:a + batch_size])
            total += float(loss.double().sum())
            count += loss.numel()
    return total / count


def _zero_head(head: int) -> Any:
    def hook(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()
        z[:, :, head] = 0.0  # [batch, pos, head, d_head]: this head's output, before the output projection
        return z

    return hook


def dormant_heads(model: Any, rows: torch.Tensor, first_attention: pd.DataFrame, *, min_attention: float,
                  max_delta: float, max_heads: int, batch_size: int) -> tuple[pd.DataFrame, dict]:
    """The `max_heads` heads with the most attention on the first token (at least `min_attention`; `first_attention`:
    layer, head, value), each zeroed alone: table (layer, head, value = its alpha_1, base_loss, delta_loss in
    nats/token, kind "dormant" | "active") and meta (rule, base loss)."""
    cands = first_attention[first_attention.value >= min_attention].sort_values("value", ascending=False)
    cands = cands.head(max_heads)
    rule = (f"alpha_1 >= {min_attention} on the text windows (the {max_heads} highest), zeroed one at a time before "
            f"the output projection; dormant when |delta loss| < {max_delta} nats/token")
    if not len(cands):
        return pd.DataFrame(), {"rule": rule, "candidates": 0}
    base = mean_nll(model, rows, batch_size)
    out = []
    for r in cands.itertuples():
        layer, head = int(r.layer), int(r.head)
        loss = mean_nll(model, rows, batch_size, [(hook_name("z", layer), _zero_head(head))])
        delta = loss - base
        out.append(dict(layer=layer, head=head, value=float(r.value), base_loss=base, delta_loss=delta,
                        kind="dormant" if abs(delta) < max_delta else "active"))
    return pd.DataFrame(out), {"rule": rule, "candidates": len(out), "base_loss": base}
