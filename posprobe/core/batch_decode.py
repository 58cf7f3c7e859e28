"""Batched, cached greedy decoding of many prompts that share a prefix encoded under a position plan (plain HF
decoders: Llama, SmolLM, Gemma, ...). The key-squishing study's generator.

Why this shape. Key squishing changes where the *keys of a prefix* sit (the instruction's), and where later tokens
sit; after the prefix, every token has q = k (the plan's `extended` rule). So:
  1. the shared prefix (batch of one) runs once under the plan through the long-context engine
     (`core.long_engine`: positions per (query, key) pair, keys cached unrotated);
  2. its cached keys are rotated once to the positions later queries see them at (the plan's k_pos), with HF's own
     formula and each layer's own table; values are kept as they are;
  3. the rows' own tokens (each prompt's rest, different lengths) and the generated tokens run through the model's
     own forward and KV cache, rows side by side, with explicit position ids per row. Rows are aligned on their
     last token: padding sits between the shared prefix and a row's own tokens, masked out of every key set.
The unmodified model is the plan `None`: positions 0..n-1 everywhere (greedy output equal to HF's `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from jaxtyping import Float, Int

from posprobe.backend import hf
from posprobe.core import long_engine
from posprobe.core.positions import PositionError, PositionPlan
from posprobe.core.surgery import PairRule, plan_pairs, shift_pairs


@dataclass(frozen=True)
class Decoded:
    """Per row: the generated token ids (up to and including the stop token), the log-softmax of the first
    next-token distribution (the answer's first token, float32 `[row, vocab]`), and with references the log-prob
    (nats) of each reference token given the prompt and the reference tokens before it."""

    tokens: list[list[int]]
    first_logprobs: Float[torch.Tensor, "row vocab"]
    reference_logprobs: list[torch.Tensor] | None = None
    #: Per row, mean over layers and heads of the attention the last prompt token pays to `attend_span` keys.
    span_attention: list[float] | None = None


def require_decodable(model: Any) -> None:
    """Raise (NotImplementedError / PositionError) before any forward where batched plan decoding is not exact: the
    engine's model types, and rotary tables that do not change with the input's length."""
    long_engine.require_supported(model, "Batched squish decoding")
    nope = set(hf.nope_layers(model))
    for layer in range(len(hf.attention_modules(model))):
        if layer not in nope and hf.length_rule(model, layer):
            raise NotImplementedError(
                f"layer {layer} of {type(model).__name__} rebuilds its rotary table with the input's length "
                f"({hf.length_rule(model, layer)}): cached keys could not keep one rotation")


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _windowed(model: Any) -> bool:
    return any(hf.attention_window(model, layer) for layer in range(len(hf.attention_modules(model))))


def _prefix_cache(model: Any, prefix: torch.Tensor, plan: PositionPlan | None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys rotated to where later tokens see them, values) of the prefix `[1, kv, pos, d]`."""
    from transformers import DynamicCache

    n = prefix.numel()
    rule: PairRule = shift_pairs(0.0) if plan is None else plan_pairs(plan)
    cache = DynamicCache()
    with long_engine.long_attention(model, rule):
        long_engine.prefill(model, prefix[None].to(_device(model)), cache)
    k_pos = torch.arange(n, dtype=torch.float64) if plan is None else plan.k_pos.to(torch.float64)
    nope = set(hf.nope_layers(model))
    adjacent = hf.adjacent_pairs(model)
    out = []
    for layer, layer_cache in enumerate(cache.layers):
        keys, values = layer_cache.keys, layer_cache.values
        if layer not in nope:
            # HF put its cos/sin multiplier on the keys already (rotation to position 0): rotate with 1.0 on top,
            # as the engine does.
            inv, _ = hf.inv_freq(model, layer)
            keys = long_engine.rotate_hf(keys, k_pos, inv.float(), adjacent, 1.0)
        out.append((keys, values))
    return out


def _cache_for(rows: int, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(prefix_kv):
        cache.update(k.expand(rows, -1, -1, -1).contiguous(), v.expand(rows, -1, -1, -1).contiguous(), layer)
    return cache


def _hidden(model: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
    decoder = model.get_decoder()
    return decoder(input_ids=ids, attention_mask=mask, position_ids=pos, **hf.cache_kwargs(decoder, cache)
                   ).last_hidden_state


def _aligned(prefix_len: int, rests: Sequence[torch.Tensor], pad: int, start: float,
             ends: Sequence[torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask over prefix + ids, position ids) for rows `rest (+ end)`: rests right-aligned on a common
    column (padding before them), each `end` right after its rest and padded after it."""
    width = max(r.numel() for r in rests)
    tail = max((e.numel() for e in ends), default=0) if ends is not None else 0
    rows = len(rests)
    ids = torch.full((rows, width + tail), pad, dtype=torch.long)
    mask = torch.zeros(rows, prefix_len + width + tail, dtype=torch.long)
    mask[:, :prefix_len] = 1
    pos = torch.zeros(rows, width + tail, dtype=torch.float64)
    for r, rest in enumerate(rests):
        m = rest.numel()
        ids[r, width - m:width] = rest
        mask[r, prefix_len + width - m:prefix_len + width] = 1
        pos[r, width - m:width] = start + torch.arange(m, dtype=torch.float64)
        if ends is not None and ends[r].numel():
            e = ends[r].numel()
            ids[r, width:width + e] = ends[r]
            mask[r, prefix_len + width:prefix_len + width + e] = 1
            pos[r, width:width + e] = start + m + torch.arange(e, dtype=torch.float64)
    return ids, mask, pos


def _positions(pos: torch.Tensor) -> torch.Tensor:
    # HF takes integer position ids; a plan's later tokens sit at whole positions (query_start is whole).
    if not torch.equal(pos, pos.round()):
        raise PositionError("the tokens after the prefix must sit at whole positions (give a whole query start)")
    return pos.long()


def _span_mass(model: Any, records: dict[int, tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
               span: tuple[int, int]) -> list[float]:
    """Per row: mean over layers and query heads of the last query's attention onto key columns `span`."""
    per_layer = []
    mods = {m.layer_idx: m for m in hf.attention_modules(model)}
    for layer, (q, k) in records.items():
        heads, cols = q.shape[1], k.shape[2]
        g = heads // k.shape[1]
        kk = k.repeat_interleave(g, dim=1).float()
        s = torch.matmul(q[:, :, -1:].float(), kk.transpose(-1, -2))[:, :, 0] * float(mods[layer].scaling)
        keep = mask[:, None, :cols].to(s.device) != 0
        window = hf.attention_window(model, layer)
        if window:  # HF's sliding mask counts columns back from the query's own
            keep = keep & (torch.arange(cols, device=s.device) > cols - 1 - window)
        s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, dim=-1)
        per_layer.append(p[:, :, span[0]:span[1]].sum(-1).mean(-1))
    return torch.stack(per_layer).mean(0).tolist()


@torch.no_grad()
def decode_batch(model: Any, prefix: Int[torch.Tensor, " pos"], rests: Sequence[Int[torch.Tensor, " pos"]], *,
                 plan: PositionPlan | None = None, max_new_tokens: int = 32, stop_token: int | None = None,
                 references: Sequence[Int[torch.Tensor, " pos"]] | None = None,
                 attend_span: tuple[int, int] | None = None, batch_size: int = 16) -> Decoded:
    """Greedy continuations of `prefix + rest` for every rest, the prefix encoded under `plan` (None: unmodified;
    a one-sequence PositionPlan covering exactly the prefix, e.g. `key_squish`), each rest and the new tokens at
    the positions `plan.extended` gives them. With `references`, also the teacher-forced log-probs (nats) of one
    reference continuation per row; with `attend_span`, the attention (fraction, mean over layers and heads) the
    last prompt token pays to the prefix tokens [a, b) (softmax of q.k times each layer's own scaling: models with
    soft-capped scores are refused). Rows run `batch_size` at a time; models with sliding-window layers run rows
    of equal length together only (padding would move their windows)."""
    require_decodable(model)
    prefix = torch.as_tensor(prefix).flatten().long()
    if prefix.numel() < 1:
        raise ValueError("empty prefix: the rows must share at least one token")
    if not rests or any(torch.as_tensor(r).numel() < 1 for r in rests):
        raise ValueError("every row needs at least one token after the shared prefix")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if references is not None and len(references) != len(rests):
        raise ValueError(f"{len(references)} references for {len(rests)} rows")
    if plan is not None and len(plan) != prefix.numel():
        raise PositionError(f"the plan covers {len(plan)} tokens but the shared prefix has {prefix.numel()}")
    if attend_span is not None:
        a, b = attend_span
        if not 0 <= a < b <= prefix.numel():
            raise ValueError(f"attend_span {attend_span} must lie inside the prefix (0..{prefix.numel()})")
        if hf.final_logit_softcap(model) or getattr(hf.text_config(model), "attn_logit_softcapping", None):
            raise NotImplementedError("attention onto the span assumes unscaled softmax(q.k / sqrt(d)) scores")
    rests = [torch.as_tensor(r).flatten().long() for r in rests]
    n = prefix.numel()
    total = n + max(r.numel() for r in rests) + max(max_new_tokens, max((x.numel() for x in references or ()),
                                                                        default=0))
    ctx = hf.trained_context(model)
    if ctx is not None and total > ctx and plan is None:
        raise PositionError(f"prefix ({n}) + longest row + new tokens = {total} exceeds the model's context {ctx}")
    start = float(n) if plan is None else float(plan.q_pos[-1]) + 1.0
    prefix_kv = _prefix_cache(model, prefix, plan)
    tok_pad = 0
    order = list(range(len(rests)))
    groups: list[list[int]]
    if _windowed(model):
        by_len: dict[int, list[int]] = {}
        for r in order:
            by_len.setdefault(rests[r].numel(), []).append(r)
        groups = [g[i:i + batch_size] for g in by_len.values() for i in range(0, len(g), batch_size)]
    else:
        groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    dev = _device(model)
    tokens: dict[int, list[int]] = {}
    first: dict[int, torch.Tensor] = {}
    ref_lp: dict[int, torch.Tensor] = {}
    mass: dict[int, float] = {}
    for g in groups:
        sub = [rests[r] for r in g]
        ids, mask, pos = _aligned(n, sub, tok_pad, start)
        ids, mask, pos_ids = ids.to(dev), mask.to(dev), _positions(pos).to(dev)
        cache = _cache_for(len(g), prefix_kv)
        records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if attend_span is not None:
            def keep(layer: int):
                def wrap(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                    records[layer] = (q[:, :, -1:].detach(), k.detach())
                    return q, k
                return wrap
            with hf.intercepted_qk(model, {m.layer_idx: keep(m.layer_idx) for m in hf.attention_modules(model)}):
                h = _hidden(model, ids, mask, pos_ids, cache)
            for r, m in zip(g, _span_mass(model, records, mask, attend_span)):
                mass[r] = m
        else:
            h = _hidden(model, ids, mask, pos_ids, cache)
        logits = hf.logits_from_hidden(model, h[:, -1])
        lp0 = torch.log_softmax(logits.float(), dim=-1)
        for r, row in zip(g, lp0):
            first[r] = row.cpu()
        out = [[] for _ in g]
        done = torch.zeros(len(g), dtype=torch.bool, device=dev)
        nxt_pos = pos_ids[:, -1:] + 1
        for step in range(max_new_tokens):
            nxt = logits.argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not bool(done[i]):
                    out[i].append(t)
            if stop_token is not None:
                done |= nxt == stop_token
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones(len(g), 1, dtype=mask.dtype, device=dev)], dim=1)
            h = _hidden(model, nxt[:, None], mask, nxt_pos, cache)
            nxt_pos = nxt_pos + 1
            logits = hf.logits_from_hidden(model, h[:, -1])
        for r, o in zip(g, out):
            tokens[r] = o
        if references is not None:
            refs = [torch.as_tensor(references[r]).flatten().long() for r in g]
            ids, mask, pos = _aligned(n, sub, tok_pad, start, refs)
            width = max(x.numel() for x in sub)
            h = _hidden(model, ids.to(dev), mask.to(dev), _positions(pos).to(dev), _cache_for(len(g), prefix_kv))
            for i, (r, ref) in enumerate(zip(g, refs)):
                e = ref.numel()
                lg = hf.logits_from_hidden(model, h[i, width - 1:width - 1 + e])
                lp = torch.log_softmax(lg.float(), dim=-1)
                ref_lp[r] = lp.gather(-1, ref.to(dev)[:, None])[:, 0].cpu()
    return Decoded(
        tokens=[tokens[r] for r in order], first_logprobs=torch.stack([first[r] for r in order]),
        reference_logprobs=None if references is None else [ref_lp[r] for r in order],
        span_attention=None if attend_span is None else [mass[r] for r in order],
    )
