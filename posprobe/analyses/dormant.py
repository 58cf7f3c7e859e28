"""Zeroing sink heads, one at a time: what each does to the language-model loss on the text windows.

The question comes from Guo et al. 2024 ("Active-dormant attention heads"): heads that put nearly all their attention
on the sink, and whose removal barely changes the model. A head is a candidate when its mean attention on the first
token (alpha_1, text windows) is at least `min_attention`; each candidate's output is zeroed before the output
projection (its slice of z) and the mean next-token loss over the text windows measured again. The label says only
what that one measurement showed (`ABLATION_LABELS`): a low effect on this loss does not mean the head does nothing —
a head that barely moves a short-window loss can still carry long-context retrieval (the atlas cross-checks).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from posprobe.backend.hooks import hooked
from posprobe.backend.model import token_losses
from posprobe.backend.vocab import hook_name

__all__ = ["ABLATION_LABELS", "LOSS_FALLS", "LOSS_RISES", "LOW_EFFECT", "ablation_label", "ablation_labels",
           "head_ablation", "mean_nll"]

#: The labels of a zeroed head, by the sign and size of the change of the text loss (definitions: `ablation_labels`).
LOW_EFFECT, LOSS_RISES, LOSS_FALLS = "low-effect", "loss-rises", "loss-falls"
ABLATION_LABELS = (LOW_EFFECT, LOSS_RISES, LOSS_FALLS)


def ablation_labels(max_delta: float, tokens: int) -> dict[str, str]:
    """Each label's measured definition, with its threshold and the loss it was read on."""
    loss = f"the mean next-token loss on the {tokens}-token text windows"
    return {LOW_EFFECT: f"zeroing the head changes {loss} by less than {max_delta} nats/token in either direction "
                        "(on this loss only: the head may matter elsewhere, e.g. for long-context retrieval)",
            LOSS_RISES: f"zeroing the head raises {loss} by at least {max_delta} nats/token",
            LOSS_FALLS: f"zeroing the head lowers {loss} by at least {max_delta} nats/token"}


def ablation_label(delta: float, max_delta: float) -> str:
    """The label of a head whose zeroing changed the loss by `delta` nats/token."""
    if abs(delta) < max_delta:
        return LOW_EFFECT
    return LOSS_RISES if delta > 0 else LOSS_FALLS


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


def head_ablation(model: Any, rows: torch.Tensor, first_attention: pd.DataFrame, *, min_attention: float,
                  max_delta: float, max_heads: int, batch_size: int) -> tuple[pd.DataFrame, dict]:
    """The `max_heads` heads with the most attention on the first token (at least `min_attention`; `first_attention`:
    layer, head, value), each zeroed alone: table (layer, head, value = its alpha_1, base_loss, delta_loss in
    nats/token, kind = one of `ABLATION_LABELS`) and meta (rule, labels with their definitions, base loss)."""
    cands = first_attention[first_attention.value >= min_attention].sort_values("value", ascending=False)
    cands = cands.head(max_heads)
    tokens = int(rows.shape[1])
    rule = (f"alpha_1 >= {min_attention} on the text windows (the {max_heads} highest), zeroed one at a time before "
            f"the output projection; labelled by the change of the mean next-token loss on {int(rows.shape[0])} "
            f"text windows of {tokens} tokens: {LOW_EFFECT} when |delta loss| < {max_delta} nats/token, {LOSS_RISES} "
            f"/ {LOSS_FALLS} when it rises / falls by at least that")
    meta = {"rule": rule, "labels": ablation_labels(max_delta, tokens), "tokens": tokens,
            "windows": int(rows.shape[0]), "max_delta": max_delta}
    if not len(cands):
        return pd.DataFrame(), {**meta, "candidates": 0}
    base = mean_nll(model, rows, batch_size)
    out = []
    for r in cands.itertuples():
        layer, head = int(r.layer), int(r.head)
        loss = mean_nll(model, rows, batch_size, [(hook_name("z", layer), _zero_head(head))])
        delta = loss - base
        out.append(dict(layer=layer, head=head, value=float(r.value), base_loss=base, delta_loss=delta,
                        kind=ablation_label(delta, max_delta)))
    return pd.DataFrame(out), {**meta, "candidates": len(out), "base_loss": base}
