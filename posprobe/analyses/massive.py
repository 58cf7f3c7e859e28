"""Massive activations (Sun et al. 2024, "Massive activations in large language models"): a few residual-stream
entries, orders of magnitude above the median, at fixed dimensions and on the first token or delimiters.

Per layer (the residual stream after each block, `resid_post`) and per sequence: the `top` largest |activation|
with their position, token and dimension, and the sequence's median |activation|; the table keeps the corpus-wide
top entries per layer, each with its ratio to the layer's median (the mean over sequences of the per-sequence
median, so memory stays flat in the corpus size).

Sun et al.'s definition: an activation is massive when its magnitude exceeds 100 and about 1000x the median
magnitude of its hidden state (`min_abs`, `ratio`). Their intervention: at the first layer with a massive
activation (L*), set every entry of the massive dimensions that is massive by the same rule (against its own
sequence's median) to zero, or to the mean of those entries over the text; report the loss (nats/token) and the
first token's attention in the later layers under each, against the untouched model. The edit is one forward hook
at L*'s output, decided per sequence from the activations themselves (the same rule a plain Hugging Face forward
hook applies: tests/test_sinks.py).
"""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd
import torch

from posprobe.backend.facts import model_facts
from posprobe.backend.hooks import hooked
from posprobe.backend.model import has_lm_head, n_layers, token_losses, tokenizer_of
from posprobe.backend.vocab import hook_name
from posprobe.core.capture import Reducer, batches, capture, stream

__all__ = ["massive_table", "massive_edit", "intervene"]


def _reducer(n_layers: int, top: int) -> Reducer:
    def fn(point: str, layer: int, x: torch.Tensor, state: dict) -> None:
        a = x.detach().abs().float()  # [batch, pos, d]
        b, n, d = a.shape
        flat = a.reshape(b, -1)
        vals, idx = flat.topk(min(top, flat.shape[1]), dim=-1)  # per sequence (enough for `top` distinct entries)
        s = state.setdefault(layer, {"cands": [], "median_sum": 0.0, "rows": 0})
        row0 = state.setdefault(("row0", layer), 0)
        for r in range(b):
            for v, i in zip(vals[r].tolist(), idx[r].tolist()):
                s["cands"].append((v, row0 + r, i // d, i % d))
        # The corpus top so far over distinct (position, dimension) — the first token's activations repeat in
        # every sequence — each with its largest instance: bounded by `top` entries.
        best: dict[tuple[int, int], tuple] = {}
        for c in sorted(s["cands"], reverse=True):
            best.setdefault((c[2], c[3]), c)
        s["cands"] = sorted(best.values(), reverse=True)[:top]
        s["median_sum"] += float(flat.median(dim=-1).values.double().sum())
        s["rows"] += b
        state[("row0", layer)] = row0 + b

    return Reducer(["resid_post"], list(range(n_layers)), fn)


@torch.no_grad()
def massive_table(model: Any, rows: torch.Tensor, *, top: int, batch_size: int, progress: bool,
                  condition: str) -> pd.DataFrame:
    """Per layer, the corpus's `top` largest |residual activation| after the block at distinct (position, dimension)
    (layer, rank, value, pos, token, dim, median_abs = mean over sequences of the median |activation|,
    ratio = value / median_abs)."""
    red = _reducer(n_layers(model), top)
    stream(model, batches(rows, batch_size), [red], total=-(-rows.shape[0] // batch_size), progress=progress,
           desc=f"massive activations ({condition})")
    tok = tokenizer_of(model)
    out = []
    for layer in range(n_layers(model)):
        s = red.state[layer]
        med = s["median_sum"] / s["rows"]
        for rank, (v, r, pos, dim) in enumerate(s["cands"], start=1):
            out.append(dict(condition=condition, layer=layer, rank=rank, value=v, pos=pos,
                            token=tok.convert_ids_to_tokens(int(rows[r, pos])), dim=dim, median_abs=med,
                            ratio=v / med if med > 0 else float("inf")))
    return pd.DataFrame(out)


def _massive(sub: torch.Tensor, med: torch.Tensor, ratio: float, min_abs: float) -> torch.Tensor:
    """Which entries of `sub` ([batch, pos, dims]) are massive: |value| above `ratio` x their sequence's median
    `med` ([batch]) and above `min_abs`."""
    return (sub.abs() > ratio * med[:, None, None]) & (sub.abs() > min_abs)


def massive_edit(dims: list[int], ratio: float, mode: str, means: torch.Tensor | None = None, *,
                 min_abs: float = 0.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """The edit of a `[batch, pos, d]` residual: entries of `dims` whose |value| exceeds `ratio` x their
    sequence's median |activation| and `min_abs` set to 0 (`mode` "zero") or to `means` (one per dim, `mode`
    "mean")."""
    def edit(x: torch.Tensor) -> torch.Tensor:
        med = x.abs().float().reshape(x.shape[0], -1).median(dim=-1).values.to(x.dtype)  # [batch]
        sub = x[..., dims]
        hit = _massive(sub, med, ratio, min_abs)
        if mode == "zero":
            new = torch.where(hit, torch.zeros_like(sub), sub)
        else:
            assert means is not None
            new = torch.where(hit, means.to(x.dtype).to(x.device).expand_as(sub), sub)
        x = x.clone()
        x[..., dims] = new
        return x

    return edit


@torch.no_grad()
def intervene(model: Any, rows: torch.Tensor, table: pd.DataFrame, *, ratio: float, batch_size: int,
              min_abs: float = 0.0) -> tuple[pd.DataFrame, dict]:
    """Loss and first-token attention with the massive activations of the first layer that has them set to zero
    or to their mean, against the model as it is. Returns (table: variant "none"/"zero"/"mean", metric "nll"
    (nats/token) / "first_attention" (mean over heads of layers after L*), value, count = tokens or heads) and
    meta (layer, dims, hits, means); an empty table where no layer has an activation above `ratio` x median and
    `min_abs`."""
    hits = table[(table.ratio > ratio) & (table.value > min_abs)]
    if not len(hits) or not has_lm_head(model):
        why = (f"no activation exceeds {ratio:g}x the median and {min_abs:g}" if not len(hits)
               else "the model has no language-model head")
        return pd.DataFrame(), {"skipped": why}
    layer = int(hits.layer.min())
    dims = sorted({int(d) for d in hits[hits.layer == layer].dim})
    point = hook_name("resid_post", layer)
    later = list(range(layer + 1, n_layers(model)))
    # The mean of the massive entries over the text (signed, per dim), read with the same rule that edits them.
    total = torch.zeros(len(dims), dtype=torch.float64)
    count = torch.zeros(len(dims), dtype=torch.float64)
    for a in range(0, rows.shape[0], batch_size):
        x = capture(model, rows[a:a + batch_size], ["resid_post"], layers=[layer])[("resid_post", layer)]
        med = x.abs().float().reshape(x.shape[0], -1).median(dim=-1).values
        sub = x[..., dims].float()
        hit = _massive(sub, med.to(sub.device), ratio, min_abs)
        total += torch.where(hit, sub, torch.zeros_like(sub)).double().sum((0, 1)).cpu()
        count += hit.double().sum((0, 1)).cpu()
    means = (total / count.clamp_min(1)).float()
    out = []
    acc = {"first": 0.0}
    fired: set[int] = set()

    def read_pattern(layer: int) -> Callable:
        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            fired.add(layer)
            acc["first"] += float(x[..., 0].double().mean(-1).sum())
            return x

        return hook

    readers = [(hook_name("pattern", l), read_pattern(l)) for l in later]
    n_heads = model_facts(model).n_heads * len(later)
    for mode in ("none", "zero", "mean"):
        edit = None if mode == "none" else massive_edit(dims, ratio, mode, means, min_abs=min_abs)
        hooks = ([] if edit is None else [(point, lambda x, hook, e=edit: e(x))]) + readers
        nll, n_tok = 0.0, 0
        acc["first"] = 0.0
        with hooked(model, hooks):
            for a in range(0, rows.shape[0], batch_size):
                fired.clear()
                loss = token_losses(model, rows[a:a + batch_size])  # one forward: the loss and the later patterns
                if fired != set(later):
                    raise RuntimeError(f"the attention pattern of layers {sorted(set(later) - fired)} was never "
                                       "seen: the first-token attention after the edit cannot be measured")
                nll += float(loss.double().sum())
                n_tok += loss.numel()
        out.append(dict(variant=mode, metric="nll", value=nll / n_tok, count=n_tok))
        if later:
            out.append(dict(variant=mode, metric="first_attention", value=acc["first"] / (rows.shape[0] * n_heads),
                            count=n_heads))
    meta = {"layer": layer, "dims": dims, "ratio": ratio, "min_abs": min_abs, "massive_entries": int(count.sum()),
            "means": [float(m) for m in means]}
    return pd.DataFrame(out), meta
