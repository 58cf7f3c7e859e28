"""Long inputs under a surgery preset without T x T tensors: the chunked attention engine for plain Hugging
Face models, plugged into HF's attention interface by `backend.hf.custom_attention`.

How it works. Inside `long_attention(model, rule)` the model is run with position ids all zero, so HF's
own rotation is the identity (cos = 1, sin = 0) and every attention layer hands this module its query and
key *before* rotation (after QK-norm, as HF computes them). The engine rotates them itself, to the
positions and with the frequencies of the preset's `PairRule` (posprobe.core.surgery), with the layer's own
HF inverse-frequency table where the preset keeps the frequencies. Then:
  * one view, no per-pair selector, no sliding window or soft-cap (none, shift, PI, NTK, YaRN, p-RoPE):
    PyTorch's `scaled_dot_product_attention` (memory-efficient kernels, no T x T pattern);
  * otherwise (Self-Extend, ReRoPE, StreamingLLM; Gemma 3's sliding layers) queries go in chunks of
    `chunk` rows: each view's scores for the chunk (chunk x keys per head), merged by the rule's selector,
    masked (causal, sliding window, evicted keys), softmax, times V. Memory O(chunk x T) per head.
Preset "none" never enters this module: `token_nll` / `greedy_decode` run the model's own forward.

Positions are in tokens. Rotation uses HF's formula (float32 angles `position * inv_freq`, half-split pairs),
so a preset that keeps positions and frequencies reproduces HF's rotation bit for bit.
Keys are cached unrotated (generation). While decoding (`keep_keys`), the engine also keeps each layer's rotated
keys per view and rotates only the new ones when the earlier keys, their positions and the table are unchanged
(checked per step); grouped-query attention runs without copying keys and values per query head.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from posprobe.backend import hf
from posprobe.backend.architectures import LONG, lookup, proven
from posprobe.core.positions import PositionError
from posprobe.core.surgery import PairRule, shift_pairs
from posprobe.rope import hf_cos_sin, hf_rotate, inv_freq_of

# `enable_gqa` (PyTorch >= 2.5): grouped-query attention without a copy of keys and values per query head.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)



def require_supported(model: Any, what: str = "Long-context presets") -> None:
    """Raise PositionError (learned positions) or NotImplementedError (other layouts) before any forward."""
    mt = str(getattr(hf.text_config(model), "model_type", "")).lower()
    if not hf.is_rotary(model):
        raise PositionError(f"{what} rotate queries and keys; {mt or type(model).__name__} has no rotary positions "
                            "(learned or other position embeddings)")
    mods = hf.attention_modules(model)
    if mods and not hf.uses_attention_interface(mods[0]):  # Falcon; GPT-J before transformers 5.24
        raise NotImplementedError(f"{what}: {type(mods[0]).__name__} computes its scores itself (in this "
                                  "transformers version), not through the attention interface the engine plugs into")
    # Architectures proven at LONG rotate the head (all of it, or its first dims), half-split or adjacent pairs, and
    # pass q/k to the attention interface unchanged after rotation; others are refused rather than guessed.
    if LONG not in lookup(mt).proven:
        raise NotImplementedError(f"{what}: {mt!r} models are not supported "
                                  f"(supported: {', '.join(proven(LONG))})")
    nope = hf.nope_layers(model)
    for l in (l for l in range(len(mods)) if l not in nope):
        hf.refuse_unknown_rope(model, l)


def rotate_hf(x: Float[torch.Tensor, "batch head pos d_head"], positions: Float[torch.Tensor, " pos"],
              inv_freq: Float[torch.Tensor, " band"], adjacent: bool = False, scaling: float = 1.0
              ) -> Float[torch.Tensor, "batch head pos d_head"]:
    """Rotate head vectors to `positions` exactly as HF's code does (float32 angles; half-split pairs as Llama /
    Gemma, or adjacent pairs as Cohere / GLM), cos/sin times `scaling`."""
    cos, sin = hf_cos_sin(positions.to(x.device), inv_freq.to(x.device), adjacent=adjacent, scaling=scaling)
    return hf_rotate(x, cos, sin, adjacent=adjacent)


@dataclass
class _Engine:
    rule: PairRule
    inv_freq: dict[int, torch.Tensor]
    chunk: int
    nope: frozenset[int] = frozenset()
    adjacent: bool = False
    model: Any = None
    #: Layers whose own table depends on the input's length (dynamic, longrope) where the rule keeps frequencies.
    by_length: frozenset[int] = frozenset()
    tables: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    #: Called per layer with the last query's attention weights `[head, key_pos]` (float32) of every forward.
    record: Callable[[int, torch.Tensor], None] | None = None
    #: Per layer, query heads whose output is zeroed before the output projection (head masking).
    masked: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: Keep rotated keys between forwards of one growing sequence (generation with a KV cache).
    keep_keys: bool = False
    #: (layer, view) -> (key positions, inverse frequencies, multiplier, last unrotated key, rotated keys).
    rotated: dict[tuple[int, int], tuple] = field(default_factory=dict)

    def _keys(self, layer: int, view: int, key: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor,
              r: float) -> torch.Tensor:
        """`key` rotated to `pos`. With `keep_keys`, the previous forward's rotated keys are reused when this
        forward's keys extend them: same table and multiplier, same positions and the same last key where they
        overlap (a decode step); only the new keys are rotated."""
        n = key.shape[2]
        kept = self.rotated.get((layer, view)) if self.keep_keys else None
        if kept is not None:
            k_pos, k_inv, k_r, k_last, k_rot = kept
            m = k_pos.numel()
            if (m < n and k_r == r and torch.equal(k_inv, inv) and torch.equal(pos[:m], k_pos)
                    and torch.equal(key[:, :, m - 1], k_last)):
                rot = torch.cat([k_rot, rotate_hf(key[:, :, m:], pos[m:], inv, self.adjacent, r)], dim=2)
                self.rotated[(layer, view)] = (pos, inv, r, key[:, :, -1].clone(), rot)
                return rot
        rot = rotate_hf(key, pos, inv, self.adjacent, r)
        if self.keep_keys:
            self.rotated[(layer, view)] = (pos, inv, r, key[:, :, -1].clone(), rot)
        return rot

    def _finish(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        heads = self.masked.get(layer)
        if heads:
            out[:, list(heads)] = 0
        return out

    def table(self, layer: int, n_k: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies, extra cos/sin multiplier) `layer` rotates `n_k` tokens with: under an HF rope
        preset, HF's table for that config and length, rescaled from the model's own cos/sin factor (already on q
        and k) to the preset's; HF's table of that length for dynamic / longrope layers (as HF's forward at
        positions 0..n_k-1 builds it); the fixed one otherwise."""
        if self.rule.hf_rope is not None and layer not in self.nope:
            inv, factor = hf.scaled_rope_table(self.model, layer, dict(self.rule.hf_rope), n_k)
            return inv, factor / hf.inv_freq(self.model, layer)[1]
        at = hf.table_length(self.model, layer, n_k) if layer in self.by_length else None
        if at is None:
            return self.inv_freq[layer], 1.0
        if (layer, at) not in self.tables:  # one per length: a decode step asks once per layer
            self.tables[(layer, at)] = hf.rope_table(self.model, layer, n_k)[0]
        return self.tables[(layer, at)], 1.0

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               window: int | None, softcap: float | None) -> torch.Tensor:
        """Attention output `[batch, head, query_pos, d_head]` of one layer under the rule (batch of one)."""
        if query.shape[0] != 1:
            raise ValueError("long-context attention takes one sequence at a time (batch 1)")
        B, H, n_q, d = query.shape
        KV, n_k = key.shape[1], key.shape[2]
        g = H // KV
        # HF rotated q and k to position 0 (cos = its attention factor, sin = 0): any cos/sin multiplier (YaRN,
        # LongRoPE) is already on them, and a rotation is linear, so turning them here keeps it.
        inv, r = self.table(module.layer_idx, n_k)
        # Absolute token indices: queries are the last n_q of the n_k keys (batch of one sequence, no padding).
        i = torch.arange(n_k - n_q, n_k, dtype=torch.float64)
        j = torch.arange(n_k, dtype=torch.float64)
        # A NoPE layer (SmolLM3) rotates nothing (its inv_freq is all 0: the identity) and, as in HF, where YaRN's
        # temperature rides on cos/sin, keeps its own scale; masks and eviction apply to every layer.
        scale = scaling * (1.0 if module.layer_idx in self.nope else self.rule.score_scale)
        views = self.rule.views
        layer = module.layer_idx
        if len(views) == 1 and self.rule.select is None and not window and not softcap and n_q in (1, n_k):
            q_r = rotate_hf(query, views[0][0](i), inv, self.adjacent, r)
            k_r = self._keys(layer, 0, key, views[0][1](j), inv, r)
            if self.record is not None:  # the last query sees every key: its weights in full, one row per head
                # Query head h reads key/value head h // g (HF's repeat_interleave order).
                s = torch.matmul(q_r[0, :, -1].reshape(KV, g, d), k_r[0].transpose(-1, -2)).reshape(H, n_k) * scale
                self.record(layer, torch.softmax(s, dim=-1, dtype=torch.float32))
            if _SDPA_GQA:
                out = F.scaled_dot_product_attention(q_r, k_r, value, is_causal=n_q > 1, scale=scale,
                                                     enable_gqa=g > 1)
            else:
                out = F.scaled_dot_product_attention(q_r, k_r.repeat_interleave(g, dim=1),
                                                     value.repeat_interleave(g, dim=1), is_causal=n_q > 1, scale=scale)
            return self._finish(layer, out)
        k_rot = [self._keys(layer, v, key, kf(j), inv, r) for v, (_, kf) in enumerate(views)]
        out = query.new_empty(B, H, n_q, d)
        for a in range(0, n_q, self.chunk):
            b = min(a + self.chunk, n_q)
            ii = i[a:b]
            hi = int(ii[-1]) + 1
            lo = max(0, int(ii[0]) - window + 1) if window else 0
            jj = j[lo:hi]
            # The selector is computed from host indices: column ranges are read there (no device sync).
            sel_host = self.rule.select(ii, jj) if self.rule.select is not None else None
            sel = sel_host.to(query.device) if sel_host is not None else None
            scores = query.new_full((B, H, b - a, hi - lo), float("-inf"))
            for v, (qf, _) in enumerate(views):
                # Only the key columns where some query of the chunk uses view v (Self-Extend's neighbours lie
                # within W of the chunk, StreamingLLM's sinks are the first S keys): each pair is scored once.
                c0, c1 = 0, hi - lo
                if sel_host is not None:
                    cols = (sel_host == v).any(dim=0).nonzero()
                    if cols.numel() == 0:
                        continue
                    c0, c1 = int(cols[0]), int(cols[-1]) + 1
                q_r = rotate_hf(query[:, :, a:b], qf(ii), inv, self.adjacent, r).reshape(B, KV, g * (b - a), d)
                s = torch.matmul(q_r, k_rot[v][:, :, lo + c0:lo + c1].transpose(-1, -2)).view(B, H, b - a, c1 - c0)
                s = s * scale
                scores[..., c0:c1] = s if sel is None else torch.where(sel[:, c0:c1] == v, s, scores[..., c0:c1])
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            keep = (jj[None, :] <= ii[:, None]).to(query.device)
            if window:
                keep &= (jj[None, :] > ii[:, None] - window).to(query.device)
            if sel is not None:
                keep &= sel >= 0
            p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1, dtype=torch.float32)
            if self.record is not None and b == n_q:
                row = p.new_zeros(H, n_k)
                row[:, lo:hi] = p[0, :, -1]
                self.record(layer, row)
            p = p.to(value.dtype)
            out[:, :, a:b] = torch.matmul(p.view(B, KV, g * (b - a), hi - lo), value[:, :, lo:hi]).view(B, H, b - a, d)
        return self._finish(layer, out)


@contextmanager
def long_attention(model: Any, rule: PairRule, *, chunk: int = 256,
                   record: Callable[[int, torch.Tensor], None] | None = None,
                   masked: dict[int, tuple[int, ...]] | None = None, keep_keys: bool = False) -> Iterator[None]:
    """Within the block, `model` (plain HF, batch 1) attends under `rule`; call it with position ids all 0
    (`zero_positions`). Restores the model's own attention implementation on exit, even after errors.

    Args:
        model: a plain Hugging Face causal LM, run with batch 1.
        rule: the preset as per-pair rotation rules (`preset_pairs`); preset "none" (identity) is a ValueError:
            it runs the model's own forward.
        chunk: queries per chunk of the chunked attention (>= 1); memory O(chunk x T) per head.
        record: `record(layer, weights)` receives the last query's attention weights `[head, key_pos]` of every
            forward (None: nothing recorded).
        masked: {layer: query heads} whose outputs are zeroed before the output projection (None: none).
        keep_keys: keep rotated keys between the forwards of one growing sequence (KV-cache decoding: each step
            rotates only its new key).

    Yields:
        None; the model attends under `rule` within the `with` block.
    """
    if rule.identity:
        raise ValueError("preset 'none' runs the model's own forward; long_attention is for the other presets")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    require_supported(model)
    inv, nope = {}, frozenset(hf.nope_layers(model))
    for m in hf.attention_modules(model):
        l = m.layer_idx
        own = hf.inv_freq(model, l)[0]  # NoPE layers share the rotary module: its shape, zeroed below
        inv[l] = (
            torch.zeros_like(own, dtype=torch.float32) if l in nope
            else own.detach().float() if rule.rotary is None
            else inv_freq_of(rule.rotary(hf.rotary_spec(model, l))).to(own.device)
        )
    if rule.hf_rope is not None:  # a scaling the model cannot take is refused here, before any forward
        for l in (l for l in inv if l not in nope):
            hf.scaled_rope_table(model, l, dict(rule.hf_rope))
    by_length = frozenset(l for l in inv if l not in nope and rule.rotary is None and hf.length_rule(model, l))
    engine = _Engine(rule, inv, chunk, nope, hf.adjacent_pairs(model), model, by_length, record=record,
                     masked={l: tuple(h) for l, h in (masked or {}).items() if h}, keep_keys=keep_keys)
    with hf.custom_attention(model, {l: engine.attend for l in inv}):
        yield


def zero_positions(n: int, device: Any = "cpu") -> Int[torch.Tensor, "batch pos"]:
    """Position ids for a forward inside `long_attention`: all 0, so HF's rotation is the identity."""
    return torch.zeros(1, n, dtype=torch.long, device=device)


def _hidden(model: Any, ids: torch.Tensor, engine_on: bool, cache: Any = None, start: int = 0) -> Any:
    n = ids.shape[1]
    if start == 0:
        hf.fresh_rope_state(model)  # a new input: HF's dynamic RoPE must not keep a longer input's table
    pos = zero_positions(n, ids.device) if engine_on else torch.arange(start, start + n, device=ids.device)[None]
    decoder = model.get_decoder()
    return decoder(input_ids=ids, position_ids=pos, **hf.cache_kwargs(decoder, cache))


def prefill(model: Any, ids: Int[torch.Tensor, "batch pos"], cache: Any) -> None:
    """Run `ids` (one sequence, from position 0) into `cache` inside `long_attention`: the cache then holds every
    layer's keys unrotated (HF rotated them to position 0) and its values, for a caller that places them itself."""
    _hidden(model, ids, True, cache)


def _logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    return hf.logits_from_hidden(model, hidden)


@torch.no_grad()
def token_nll(model: Any, ids: Int[torch.Tensor, " pos"], rule: PairRule, *, chunk: int = 256,
              logit_chunk: int = 1024, masked: dict[int, tuple[int, ...]] | None = None
              ) -> Float[torch.Tensor, " query_pos"]:
    """NLL (nats) of token t+1 given tokens 0..t, for t = 0..T-2, under `rule` (one sequence), with the `masked`
    query heads' outputs zeroed per layer (as in `long_attention`).

    Logits are made `logit_chunk` rows at a time (a 16k x 49k logit matrix would be 3 GB)."""
    ids = torch.as_tensor(ids)[None].to(next(model.parameters()).device)
    if rule.identity and masked:
        rule = replace(shift_pairs(0.0), label=rule.label)
    if rule.identity:
        h = _hidden(model, ids, False).last_hidden_state
    else:
        with long_attention(model, rule, chunk=chunk, masked=masked):
            h = _hidden(model, ids, True).last_hidden_state
    out = []
    for a in range(0, ids.shape[1] - 1, logit_chunk):
        b = min(a + logit_chunk, ids.shape[1] - 1)
        lp = torch.log_softmax(_logits(model, h[0, a:b]).float(), dim=-1)
        out.append(-lp.gather(-1, ids[0, a + 1:b + 1, None])[:, 0])
    return torch.cat(out).cpu()


@torch.no_grad()
def greedy_decode(model: Any, ids: Int[torch.Tensor, " pos"], rule: PairRule, max_new_tokens: int, *,
                  chunk: int = 256, stop_token: int | None = None,
                  stop: Callable[[list[int]], bool] | None = None,
                  record: Callable[[int, torch.Tensor], None] | None = None,
                  masked: dict[int, tuple[int, ...]] | None = None) -> Int[torch.Tensor, " new"]:
    """Greedy continuation (token ids) of one prompt under `rule`, with a KV cache (keys stored unrotated). Ends
    after `max_new_tokens`, at `stop_token`, or once `stop(tokens so far)` is true. `record` / `masked` as in
    `long_attention` (forward s produces token s); with either, preset "none" runs through the engine with every
    position kept (equal to the model's own forward to float rounding)."""
    if rule.identity and (record is not None or masked):
        rule = replace(shift_pairs(0.0), label=rule.label)
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids = torch.as_tensor(ids)[None].to(dev)
    engine_on = not rule.identity
    # A cache without the config keeps every key of every layer (a sliding-window cache would drop keys the
    # engine indexes by absolute position); the engine applies the window itself.
    cache = DynamicCache()
    new: list[int] = []
    ctx = (long_attention(model, rule, chunk=chunk, record=record, masked=masked, keep_keys=True) if engine_on
           else _nothing())
    with ctx:
        h = _hidden(model, ids, engine_on, cache).last_hidden_state
        for step in range(max_new_tokens):
            tok = int(_logits(model, h[0, -1:]).argmax(-1))
            new.append(tok)
            if tok == stop_token or step == max_new_tokens - 1 or (stop is not None and stop(new)):
                break
            nxt = torch.tensor([[tok]], device=dev)
            h = _hidden(model, nxt, engine_on, cache, start=ids.shape[1] + step).last_hidden_state
    return torch.tensor(new, dtype=torch.long)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def estimate_bytes(model: Any, length: int, rule: PairRule, *, chunk: int = 256, logit_chunk: int = 1024,
                   cache: bool = False) -> int:
    """Rough peak memory (bytes) of one forward of `length` tokens under `rule`: weights + one layer's
    activations + the chunked score blocks + a logit block (+ the KV cache when generating).

    Deliberately generous (x1.5 on activations): it only has to refuse lengths that cannot fit."""
    return int(sum(_memory_terms(model, length, rule, chunk=chunk, logit_chunk=logit_chunk, cache=cache).values()))


def _memory_terms(model: Any, length: int, rule: PairRule, *, chunk: int, logit_chunk: int = 1024,
                  cache: bool = False) -> dict[str, float]:
    # `estimate_bytes` by term, in bytes, for T tokens at e bytes per element (D hidden, F MLP, H query / KV key heads
    # of hd dims, L layers, V vocabulary): weights; activations 1.5 * T * (8D + 3F + 4(H + 2 KV) hd + 2 H hd) * e;
    # scores min(chunk, T) * T * H * 4 * (views + 3) float32 bytes where the engine chunks (several views, a
    # selector or sliding-window layers), else 0; logits min(logit_chunk, T) * V * 4 * 3; kv 3 * L * T * KV * hd * e
    # when generating (keys, values, rotated keys); hidden 2 * T * D * e. check_memory reads which term `chunk`
    # scales (only "scores") to advise only what lowers the estimate.
    cfg = hf.text_config(model)
    e = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    D, F_ = cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    H, KV = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    hd = getattr(cfg, "head_dim", None) or D // H
    L, T = cfg.num_hidden_layers, length
    act = T * (8 * D + 3 * F_ + 4 * (H + 2 * KV) * hd + 2 * H * hd) * e
    windowed = getattr(cfg, "sliding_window", None) and getattr(cfg, "layer_types", None)
    chunked = len(rule.views) > 1 or rule.select is not None or bool(windowed)
    scores = min(chunk, T) * T * H * 4 * (len(rule.views) + 3) if chunked else 0
    logits = min(logit_chunk, T) * cfg.vocab_size * 4 * 3
    kv = 3 * L * T * KV * hd * e if cache else 0  # keys and values, and the engine's rotated keys
    hidden = T * D * e * 2  # the final hidden states kept for the logit chunks
    return {"weights": weights, "activations": 1.5 * act, "scores": scores, "logits": logits, "kv": kv,
            "hidden": hidden}


def available_bytes() -> int:
    """Memory the OS can give this process now (bytes), psutil's `available`."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_memory(model: Any, length: int, rule: PairRule, *, chunk: int = 256, cache: bool = False,
                 available: int | None = None) -> int:
    """Raise MemoryError-style ValueError when `estimate_bytes` exceeds 90% of available memory; return the estimate.

    The advice names only what lowers the estimate: a shorter length always; a smaller --chunk only where the
    engine chunks this rule's scores (the one term chunk scales, linearly in min(chunk, length)), and then the
    largest chunk that fits, or the estimate at --chunk 1 where none does."""
    need = estimate_bytes(model, length, rule, chunk=chunk, cache=cache)
    have = available_bytes() if available is None else available
    limit = 0.9 * have
    if need <= limit:
        return need
    head = (f"length {length} under {rule.label!r} needs about {need / 2**30:.1f} GiB (estimate) but only "
            f"{have / 2**30:.1f} GiB is available")
    rows = min(chunk, length)
    per_row = _memory_terms(model, length, rule, chunk=chunk, cache=cache)["scores"] / rows
    if not per_row:
        raise ValueError(f"{head}; use a shorter length (--chunk does not change this estimate)")
    if rows <= 1:
        raise ValueError(f"{head}; use a shorter length")
    floor = estimate_bytes(model, length, rule, chunk=1, cache=cache)
    if floor > limit:
        raise ValueError(f"{head}; even --chunk 1 needs about {floor / 2**30:.1f} GiB: use a shorter length")
    # Largest chunk c with floor + (c - 1) * per_row within the limit (the scores term is linear in c).
    fits = 1 + int((limit - floor) // per_row)
    while fits > 1 and estimate_bytes(model, length, rule, chunk=fits, cache=cache) > limit:
        fits -= 1  # float rounding at the boundary
    raise ValueError(f"{head}; use --chunk {fits} or smaller (about "
                     f"{estimate_bytes(model, length, rule, chunk=fits, cache=cache) / 2**30:.1f} GiB), "
                     "or a shorter length")


__all__ = ["long_attention", "token_nll", "greedy_decode", "rotate_hf", "require_supported", "estimate_bytes",
           "check_memory", "zero_positions"]
