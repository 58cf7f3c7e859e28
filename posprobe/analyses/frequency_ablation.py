"""Inference-time RoPE band ablations, measured as the change in next-token loss on text.

Two ways to take a band out: "unrotate" (the band keeps its q/k values but is not rotated, cos=1 sin=0,
p-RoPE style) and "zero" (the band's contribution to the score is removed). Model- or layer-wide
unrotation goes through a PositionPlan rotary override (`RotarySpec.removed`); per-head ablations
and "zero" rewrite the selected heads' scores exactly, band by band, in a hook on the scores.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator, Literal, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from posprobe.backend.facts import ModelFacts, model_facts, require_fixed_table, require_rotated_qk
from posprobe.backend.hooks import hook_name, hooked, pre_rotation, score_scale, score_soft_cap
from posprobe.backend.model import context_length, token_losses
from posprobe.core.capture import check_rows
from posprobe.core.positions import PositionPlan, rope_positions
from posprobe.rope import band_contributions, expand_kv


@dataclass(frozen=True, kw_only=True)
class BandAblation:
    """Which bands to take out, where. `heads` lists (layer, head) pairs (None: every head of `layers`;
    `layers` None: all layers). `fraction_kept` and `variant` only label sweep rows."""

    name: str
    bands: frozenset[int]
    heads: tuple[tuple[int, int], ...] | None = None
    layers: frozenset[int] | None = None
    mode: Literal["unrotate", "zero"] = "unrotate"
    variant: str = ""
    fraction_kept: float | None = None


def _validate(facts: ModelFacts, ab: BandAblation) -> None:
    nb = facts.first_rotary.n_bands
    bad = [b for b in ab.bands if not 0 <= b < nb]
    if bad:
        raise ValueError(f"{ab.name}: bands {sorted(bad)} out of range 0..{nb - 1}")
    if ab.mode not in ("unrotate", "zero"):
        raise ValueError(f"{ab.name}: mode must be 'unrotate' or 'zero', got {ab.mode!r}")
    for l, h in ab.heads or ():
        if not (0 <= l < facts.n_layers and 0 <= h < facts.n_heads):
            raise ValueError(f"{ab.name}: head L{l}H{h} does not exist")
    if ab.layers is not None and any(not 0 <= l < facts.n_layers for l in ab.layers):
        raise ValueError(f"{ab.name}: layers {sorted(ab.layers)} out of range")


@contextmanager
def ablate_bands(model: Any, ab: BandAblation) -> Iterator[Any]:
    """Within the block, every forward of `model` runs with the ablation in force (no KV cache)."""
    facts = model_facts(model)
    require_rotated_qk(facts, "Band ablation")
    require_fixed_table(model, facts, "Band ablation")
    _validate(facts, ab)
    layers = facts.check_rotary_layers(sorted(ab.layers) if ab.layers is not None else None, "Band ablation")
    if ab.heads is None and ab.mode == "unrotate":
        rot = {l: replace(facts.rotary[l], removed=facts.rotary[l].removed | ab.bands) for l in layers}
        plan = replace(PositionPlan.default(context_length(model), label=ab.name), rotary=rot, layers=frozenset(layers))
        with rope_positions(model, plan):
            yield model
        return
    if score_soft_cap(model) is not None:
        raise NotImplementedError("Per-head band ablation does not handle attention soft-capping yet")
    per_layer: dict[int, list[int]] = {}
    for l, h in ab.heads if ab.heads is not None else [(l, h) for l in layers for h in range(facts.n_heads)]:
        per_layer.setdefault(l, []).append(h)
    with hooked(model, [hk for l, hs in per_layer.items() for hk in _score_hooks(model, facts, l, sorted(hs), ab)]):
        yield model


def _score_hooks(model: Any, facts: ModelFacts, layer: int, heads: list[int], ab: BandAblation) -> list:
    seen: dict[str, torch.Tensor] = {}
    bands = torch.tensor(sorted(ab.bands), dtype=torch.long)
    spec = facts.rotary[layer]
    scale = score_scale(model, layer)

    def keep(which: str, pre: bool):
        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            seen[which] = pre_rotation(model, layer, x, which[-1]) if pre else x
            return x

        return hook

    on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # (head index, band index) per device, copied once

    def scores(s: torch.Tensor, hook: Any) -> torch.Tensor:
        if bands.numel() == 0:
            return s
        if s.device not in on:
            on[s.device] = (torch.tensor(heads, device=s.device), bands.to(s.device))
        idx, band_idx = on[s.device]

        def part(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            k = expand_kv(k, facts.n_heads)
            b, _ = band_contributions(q[:, :, idx], k[:, :, idx], spec, scale)
            return b[:, :, band_idx].sum(2)

        delta = -part(seen["rot_q"], seen["rot_k"])
        if ab.mode == "unrotate":
            delta = delta + part(seen["pre_q"], seen["pre_k"])
        out = s.clone()
        # Masked entries keep the model's fill value (-inf).
        out[:, idx] = torch.where(torch.isfinite(s[:, idx]), s[:, idx] + delta.to(s.dtype), s[:, idx])
        return out

    return [(hook_name("q", layer), keep("pre_q", True)), (hook_name("k", layer), keep("pre_k", True)),
            (hook_name("rot_q", layer), keep("rot_q", False)), (hook_name("rot_k", layer), keep("rot_k", False)),
            (hook_name("scores", layer), scores)]


def _loss(model: Any, rows: torch.Tensor, batch_size: int, bar: Any) -> float:
    # The sum stays on the model's device; one host read per condition, not one per batch. Under torchrun
    # each process takes its share of the batches (when there are enough) and the sums are added up.
    from posprobe.core import distributed

    n_batches = -(-rows.shape[0] // batch_size)
    split = distributed.active() and n_batches >= distributed.world()[1]
    spans = distributed.shard_batches(rows.shape[0], batch_size) if split else \
        [(i, min(i + batch_size, rows.shape[0])) for i in range(0, rows.shape[0], batch_size)]
    total: torch.Tensor | float = 0.0
    n = 0
    for a, b in spans:
        per_tok = token_losses(model, rows[a:b])
        total = total + per_tok.double().sum()
        n += per_tok.numel()
        bar.update(1)
    if split:
        both = torch.stack([total, torch.full_like(total, float(n))])  # on the model's device
        distributed.all_reduce_sums([both])
        return float(both[0]) / float(both[1])
    return float(total) / n


@torch.no_grad()
def band_ablation(
    model: Any,
    token_rows: Sequence[Sequence[int]] | torch.Tensor,
    ablations: Sequence[BandAblation],
    *,
    batch_size: int = 4,
    progress: bool = True,
) -> pd.DataFrame:
    """Mean next-token loss (nats/token) on `token_rows` without and with each ablation.

    Args:
        model: a TransformerLens causal LM whose attention rotates q and k (RoPE); an encoder or a model without
            an LM head is a ValueError.
        token_rows: the evaluation windows, `[batch, pos]` token ids of equal length (pos >= 2, at most the
            model's context).
        ablations: the conditions to measure, each a `BandAblation` (e.g. from `p_sweep` or `head_ablations`);
            bands, heads, layers and mode are checked before any forward.
        batch_size: rows per forward pass.
        progress: show a tqdm bar over the batches of all conditions.

    Returns:
        A DataFrame with one row per condition (the first, "none", is the unablated model): model, condition,
            variant, mode, layer / head (-1 = all), bands (comma list), n_bands, fraction_kept, metric="loss",
            value, base_loss, delta_loss (= value - base_loss); losses in nats/token.
    """
    facts = model_facts(model)
    require_rotated_qk(facts, "Band ablation")
    if not facts.has_lm_head or facts.is_encoder:
        raise ValueError(f"Band ablation measures LM loss; {facts.name} has no causal LM head")
    rows = check_rows(model, token_rows)
    for ab in ablations:
        _validate(facts, ab)
    nb = facts.first_rotary.n_bands
    n_b = math.ceil(rows.shape[0] / batch_size)
    out = []
    with tqdm(total=n_b * (len(ablations) + 1), desc="band ablation", unit="batch", disable=not progress) as bar:
        base = _loss(model, rows, batch_size, bar)
        out.append(dict(condition="none", variant="none", mode="none", layer=-1, head=-1, bands="", n_bands=0,
                        fraction_kept=1.0, value=base))
        for ab in ablations:
            with ablate_bands(model, ab):
                v = _loss(model, rows, batch_size, bar)
            heads = ab.heads or ()
            out.append(dict(condition=ab.name, variant=ab.variant or ab.name, mode=ab.mode,
                            layer=heads[0][0] if len(heads) == 1 else -1, head=heads[0][1] if len(heads) == 1 else -1,
                            bands=",".join(map(str, sorted(ab.bands))), n_bands=len(ab.bands),
                            fraction_kept=ab.fraction_kept if ab.fraction_kept is not None else 1 - len(ab.bands) / nb,
                            value=v))
    df = pd.DataFrame(out)
    df.insert(0, "model", facts.name)
    df["metric"] = "loss"
    df["base_loss"] = base
    df["delta_loss"] = df["value"] - base
    return df


def p_sweep(facts: ModelFacts, ps: Sequence[float] = (0.75, 0.5, 0.25, 0.0)) -> list[BandAblation]:
    """Model-wide unrotation sweep: for each p, "drop-low" keeps the fastest round(p * n_bands) bands
    rotating (p-RoPE), "drop-high" keeps the slowest ones instead.

    Args:
        facts: the model's `ModelFacts` (`model_facts(model)`); its first rotary layer gives n_bands.
        ps: the fractions of bands kept rotating, each in [0, 1] (else ValueError).

    Returns:
        Two `BandAblation`s per p, `"drop-low p=<p>"` then `"drop-high p=<p>"`, each unrotating the complementary
            bands in every head of every layer, with `fraction_kept` = p.
    """
    nb = facts.first_rotary.n_bands
    out = []
    for p in ps:
        if not 0 <= p <= 1:
            raise ValueError(f"p must be in [0, 1], got {p}")
        keep = round(p * nb)
        out.append(BandAblation(name=f"drop-low p={p:g}", variant="drop-low", fraction_kept=float(p),
                                bands=frozenset(range(keep, nb))))
        out.append(BandAblation(name=f"drop-high p={p:g}", variant="drop-high", fraction_kept=float(p),
                                bands=frozenset(range(nb - keep))))
    return out


def head_ablations(facts: ModelFacts, heads: Sequence[tuple[int, int]], fraction: float = 0.25) -> list[BandAblation]:
    """Per head: unrotate its fastest `fraction` of bands ("fast"), its slowest ("slow"), or all ("all").

    Args:
        facts: the model's `ModelFacts` (`model_facts(model)`); its first rotary layer gives n_bands.
        heads: the (layer, head) pairs to ablate, one at a time.
        fraction: the share of the head's bands in the "fast" and "slow" sets: max(1, round(fraction * n_bands))
            bands.

    Returns:
        Three `BandAblation`s per head, in the order of `heads`, named `"L<layer>H<head> fast|slow|all"` (variant
            fast, slow, all; mode "unrotate").
    """
    nb = facts.first_rotary.n_bands
    k = max(1, round(fraction * nb))
    sets = {"fast": range(k), "slow": range(nb - k, nb), "all": range(nb)}
    return [BandAblation(name=f"L{l}H{h} {v}", variant=v, heads=((l, h),), bands=frozenset(b))
            for l, h in heads for v, b in sets.items()]
