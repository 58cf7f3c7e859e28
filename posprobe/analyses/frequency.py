"""Per-frequency RoPE usage per head: band norms of q/k, each band's share of the attention score,
its dependence on relative distance, and attention-pattern signatures (Barbero et al. 2024).

A band is one 2-D rotary pair (band 0 is the fastest). The per-band partial dot products of the
rotated q and k, plus the dot product over the unrotated dims (partial rotary), sum exactly to the
pre-softmax score, so a band's "contribution" to a score is exact, not an attribution. Everything
is streamed over the corpus with fixed-size per-layer accumulators (memory does not grow with it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch

from posprobe.analyses.chen_bounds import TOLERANCE, head_bounds
from posprobe.analyses.configs import FrequencyConfig
from posprobe.analyses.frequency_ablation import band_ablation, head_ablations, p_sweep
from posprobe.analyses.sections import AtlasRun, AtlasSection, CompareRun, ModelEntry, register, why_not
from posprobe.backend.facts import (
    ModelFacts,
    at_length,
    model_facts,
    require_attention_supported,
    require_rotated_qk,
)
from posprobe.backend.hooks import score_scale, score_soft_cap
from posprobe.backend.model import device_of
from posprobe.core import distributed
from posprobe.core.capture import Reducer, check_rows, stream, to_cpu_once
from posprobe.report import frequency as frequency_report
from posprobe.report.checkpoint import stream_resume
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.rope import (
    RotarySpec,
    _grouped_band_products,
    angular_frequency,
    band_norms,
    band_pairs,
    wavelength,
)

#: Elements of one [head, band, query_pos, key_pos] block processed at once (bounds transient memory).
CHUNK_ELEMENTS = 1 << 24

#: Score-based kinds, named apart from the pattern-based classes of `heads` ("relative-position" there is a head whose
#: attention pattern is explained by the offset; "position-driven" here is one whose pre-softmax scores are).
CLASSIFICATION_RULE = (
    "position-driven if eta2 >= 0.3 (at least 30% of the variance of the head's causal scores is explained by "
    "binned relative distance) or previous-token / self attention mass >= 0.5; content-driven if eta2 < 0.1; "
    "mixed otherwise"
)


def rel_pos_edges(window: int) -> list[int]:
    """Lower edges of the relative-distance bins: 0, 1, 2, 3, then powers of two up to the window."""
    edges = [e for e in (0, 1, 2, 3) if e < window]
    e = 4
    while e < window:
        edges.append(e)
        e *= 2
    return edges


def _bin_plan(q0: int, m: int, edges: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # How to sum a [rows, m, n_k] block of (query q0+i, key j) entries per rel_pos bin, n_k = q0 + m.
    # Entries with j >= i sit on a skewed view [rows, m, q0 + 1] (column c = j - i, rel = q0 - c), which
    # a sum over the query axis turns into per-rel sums; the triangle j < i (rel > q0) is gathered.
    # Returns float64 (one-hot [q0 + 1, bin] of the view's columns, flat indices [T] of the triangle,
    # its one-hot [T, bin], causal mask [m * n_k]).
    n_k = q0 + m
    bin_of = torch.bucketize(torch.arange(n_k), torch.tensor(edges), right=True) - 1  # rel -> bin
    eye = torch.eye(len(edges), dtype=torch.float64)
    i, j = torch.tril_indices(m, m, -1)
    rel = torch.arange(q0, n_k)[:, None] - torch.arange(n_k)[None, :]
    return eye[bin_of[q0 - torch.arange(q0 + 1)]], i * n_k + j, eye[bin_of[q0 + i - j]], (rel >= 0).double().reshape(-1)


class FrequencyUsage(Result):
    """Tables `bands` (per layer/head/band stats, tidy; also `.df`), `profile` (per rel_pos bin),
    `heads` (per-head summary) and, after `run_frequency` with ablations, `ablation`."""

    @property
    def profile(self) -> pd.DataFrame:
        return self.tables["profile"]

    @property
    def heads(self) -> pd.DataFrame:
        return self.tables["heads"]

    @property
    def ablation(self) -> pd.DataFrame:
        return self.tables.get("ablation", pd.DataFrame())


def run_frequency(model: Any, text: str | None = None, config: FrequencyConfig | None = None, *,
                  source: str | None = None, work: str | Path | None = None, fresh: bool = False) -> FrequencyUsage:
    """Per-band RoPE usage of every head over windows of `text`, plus band ablations (loss change in nats/token)
    when `config.ablate`.

    Args:
        model: a TransformerLens model whose attention rotates q and k (RoPE).
        text: the text cut into windows (default: the built-in text).
        config: the analysis's options (None: its Config's defaults); its window must fit the model's context.
        source: what meta.json's data record names as the text (default: "built-in text" or "text").
        work: the corpus pass's checkpoint folder, as in `frequency_usage` (None: no checkpoint).
        fresh: discard what `work` holds first, as in `frequency_usage`.

    Returns:
        A FrequencyUsage result: `frequency_usage`'s tables `bands`, `profile`, `heads` and `theory`, plus
            `ablation` (`band_ablation`'s rows for `p_sweep` and the top heads' `head_ablations`) with
            `config.ablate`.

    Examples:
        >>> import posprobe as pp
        >>> cfg = pp.FrequencyConfig(window=32, max_windows=2, batch_size=2, ablate=False, progress=False)
        >>> usage = pp.run_frequency(pp.load_model("tiny-rope"), None, cfg)
        >>> sorted(usage.tables)
        ['bands', 'heads', 'profile', 'theory']
        >>> int(usage.tables["bands"].band.max()) + 1  # d_head / 2 frequency bands
        8
    """
    from posprobe.backend.model import encode_text, tokenizer_of
    from posprobe.data import BUILTIN_TEXT, framed_windows

    cfg = config or FrequencyConfig()
    facts = model_facts(model)
    require_rotated_qk(facts, "Per-frequency RoPE usage")
    require_attention_supported(facts, "Per-frequency RoPE usage")  # its head signatures read the pattern
    if cfg.window > facts.n_ctx:
        raise ValueError(f"window {cfg.window} exceeds the model's context n_ctx={facts.n_ctx}")
    body = BUILTIN_TEXT if text is None else text
    bos = tokenizer_of(model).bos_token_id
    rows = framed_windows(encode_text(model, body), cfg.window, pre=[bos] if bos is not None else [],
                          max_windows=cfg.max_windows)
    usage = frequency_usage(model, rows, batch_size=cfg.batch_size, layers=cfg.layers, queries=cfg.queries,
                            progress=cfg.progress, work=work, fresh=fresh, context=cfg.theory_context,
                            target=cfg.theory_target)
    top = top_heads(usage.heads, cfg.top_heads)
    tables = dict(usage.tables)
    if cfg.ablate:
        conds = p_sweep(facts) + head_ablations(facts, top)
        tables["ablation"] = band_ablation(model, rows[: cfg.ablate_windows], conds, batch_size=cfg.batch_size,
                                           progress=cfg.progress)
    data = data_meta(source or ("built-in text" if text is None else "text"), n_items=len(rows), unit="windows",
                     sha256=text_sha256(body))
    meta = {**usage.meta, **make_meta("frequency", model=facts.summary(), data=data, config=cfg),
            "top_heads": top, "ablate_windows": min(cfg.ablate_windows, len(rows)) if cfg.ablate else 0}
    return FrequencyUsage(tables, meta)


class _Acc:
    """Fixed-size float64 sums for one layer (per-batch partial sums are formed in the model's dtype)."""

    def __init__(self, n_heads: int, n_kv: int, n_bands: int, n_bins: int, device: torch.device | str = "cpu"):
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        self.q_norm, self.k_norm, self.n_tok = z(n_heads, n_bands), z(n_kv, n_bands), 0
        self.signed, self.abs = z(n_heads, n_bands + 1, n_bins), z(n_heads, n_bands + 1, n_bins)
        self.bin_n = z(n_bins)
        self.s2 = z(n_heads)
        self.diag, self.prev, self.first, self.n_rows = z(n_heads), z(n_heads), z(n_heads), 0
        # Sums of the unrotated band pairs (real, imaginary) over positions >= 1: Chen et al.'s h_j of the mean pair.
        self.q_pair, self.k_pair, self.n_pair = z(n_heads, n_bands, 2), z(n_kv, n_bands, 2), 0


def _pack(state: dict) -> dict:
    # The sums of every layer as plain dicts; "_q" is a batch's pending rotated queries, stale between batches.
    return {layer: dict(vars(acc)) for layer, acc in state.items() if layer != "_q"}


def _unpack(value: dict) -> dict:
    out = {}
    for layer, d in value.items():
        acc = _Acc.__new__(_Acc)
        vars(acc).update(d)
        out[layer] = acc
    return out


class _Scratch:
    """Reusable flat buffers for the per-band block. A fresh tens-of-MB tensor per layer and batch costs
    more than the arithmetic on it (the allocator returns such blocks to the OS, so every first touch
    page-faults); measured 33 ms to allocate-and-fill vs 7 ms into a reused buffer."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        need = math.prod(shape)
        buf = self._bufs.get(slot)
        if buf is None or buf.numel() < need or buf.dtype != dtype or buf.device != device:
            buf = self._bufs[slot] = torch.empty(need, dtype=dtype, device=device)
        return buf[:need].view(shape)


def _grouped_dot(q: torch.Tensor, k: torch.Tensor, dims: slice, scale: float) -> torch.Tensor:
    # q.k / scale over head dims `dims`, as [batch, kv_head, group * query_pos, key_pos] (GQA keys not repeated).
    B, n_q, H, _ = q.shape
    kv = k.shape[2]
    qg = (
        (q[..., dims] / scale).reshape(B, n_q, kv, H // kv, -1).permute(0, 2, 3, 1, 4).reshape(B, kv, H // kv * n_q, -1)
    )
    return qg @ k[..., dims].permute(0, 2, 3, 1)


def _unrotated_sum(x: torch.Tensor, spec: RotarySpec, turn: torch.Tensor) -> torch.Tensor:
    # Rotated [batch, pos, head, d_head] -> float64 [head, band, 2]: each band pair turned back by its position's
    # angle (turn = e^{-i p theta_j} for p = 1..n-1) and summed over positions >= 1 and the batch. Position 0 (BOS,
    # often a sink with an atypical key) is left out of the mean pair.
    pairs = band_pairs(x[:, 1:], spec).sum(0, dtype=torch.float64)  # [pos, head, band, 2]
    c = torch.complex(pairs[..., 0], pairs[..., 1])
    return torch.view_as_real((c * turn[:, None, :]).sum(0))


def _reducer(model: Any, facts: ModelFacts, layers: list[int], edges: list[int], queries: int | None) -> Reducer:
    H, kv, nb = facts.n_heads, facts.n_kv_heads, facts.first_rotary.n_bands
    g, rd = H // kv, facts.first_rotary.rotary_dim
    has_rest = facts.d_head > rd
    n_bins = len(edges)
    scratch = _Scratch()
    plans: dict[tuple, tuple[torch.Tensor, ...]] = {}
    counts: dict[tuple[int, int, torch.device], torch.Tensor] = {}
    turns: dict[tuple, torch.Tensor] = {}

    def turn_back(n: int, spec: RotarySpec, device: torch.device) -> torch.Tensor:
        # e^{-i p theta_j} for p = 1..n-1, complex128 [pos, band], built once per window length and rotation.
        if (n, spec, device) not in turns:
            angle = torch.outer(torch.arange(1, n, dtype=torch.float64), torch.tensor(angular_frequency(spec),
                                                                                     dtype=torch.float64))
            turns[n, spec, device] = torch.polar(torch.ones_like(angle), -angle).to(device)
        return turns[n, spec, device]

    def plan(q0: int, m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        if (q0, m, device) not in plans:
            plans[q0, m, device] = tuple(t.to(device) for t in _bin_plan(q0, m, edges))
        return plans[q0, m, device]

    def bin_count(n: int, start: int, device: torch.device) -> torch.Tensor:
        # Causal entries per bin in one window when queries start..n-1 are scored (built on the CPU,
        # copied to the device once, not per layer and batch).
        if (n, start, device) not in counts:
            bin_of = torch.bucketize(torch.arange(n), torch.tensor(edges), right=True) - 1
            per_rel = (n - torch.clamp(torch.arange(n), min=start)).double()
            counts[n, start, device] = torch.bincount(bin_of, weights=per_rel, minlength=n_bins).to(device)
        return counts[n, start, device]

    def bin_sums(x: torch.Tensor, pl: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # Contiguous [rows, m, n_k] -> float64 [rows, bin]. Per-rel sums over the m queries stay in the
        # model's dtype (m terms); everything after is float64. A one-hot matmul over all m * n_k entries
        # did 10x the flops and, in float32, was the pass's largest rounding (~1e-6 relative).
        main, tri_idx, tri, _ = pl
        r, m, n_k = x.shape
        skew = x.as_strided((r, m, n_k - m + 1), (m * n_k, n_k + 1, 1), x.storage_offset())
        return skew.sum(1).double() @ main + x.view(r, m * n_k).index_select(1, tri_idx).double() @ tri

    def per_bin(block: torch.Tensor, pl: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # [kv, band, group * query, key] -> float64 [head, band, bin].
        m = block.shape[2] // g
        sums = bin_sums(block.view(kv * nb * g, m, -1), pl)
        return sums.view(kv, nb, g, n_bins).transpose(1, 2).reshape(H, nb, n_bins)

    def fold_block(acc: _Acc, q: torch.Tensor, k: torch.Tensor, spec: RotarySpec, scale: float,
                   pl: tuple[torch.Tensor, ...]) -> None:
        nr, m, n_k = q.shape[0], q.shape[1], k.shape[1]
        bands = _grouped_band_products(q, k, spec, scale,
                                       out=scratch.take("bands", (nr, kv, nb, g * m, n_k), k.dtype, k.device))
        # Sum over batch rows first (the bin sums then read 1/nr as much); the block is read three
        # times (signed sum, abs in place, abs sum) and never copied.
        rows = scratch.take("rows", (kv, nb, g * m, n_k), k.dtype, k.device)
        acc.signed[:, :nb] += per_bin(torch.sum(bands, 0, out=rows), pl)
        acc.abs[:, :nb] += per_bin(torch.sum(bands.abs_(), 0, out=rows), pl)
        tot = _grouped_dot(q, k, slice(None), scale)  # the score itself, one matmul: [nr, kv, g * m, n_k]
        acc.s2 += (tot.double().square_().view(nr * H, m * n_k) @ pl[3]).view(nr, H).sum(0)
        if has_rest:  # partial rotary: the unrotated dims' share of the score
            rest = _grouped_dot(q, k, slice(rd, None), scale).view(nr, H, m, n_k)
            acc.signed[:, nb] += bin_sums(rest.sum(0), pl)
            acc.abs[:, nb] += bin_sums(rest.abs_().sum(0), pl)

    def fn(point: str, layer: int, x: torch.Tensor, state: dict) -> None:
        spec = facts.rotary[layer]
        acc = state.get(layer) or state.setdefault(layer, _Acc(H, kv, nb, n_bins, x.device))
        if point == "rot_q":
            state["_q"] = x
            return
        if point == "pattern":
            # Query 0 attends only to itself: not informative. Only the diagonals and the first column are
            # summed in float64, never a copy of the whole [batch, head, query, key] pattern.
            p = x[:, :, 1:, :]
            acc.diag += p.diagonal(1, -2, -1).sum((0, 2), dtype=torch.float64)
            acc.prev += p.diagonal(0, -2, -1).sum((0, 2), dtype=torch.float64)
            acc.first += p[..., 0].sum((0, 2), dtype=torch.float64)
            acc.n_rows += p.shape[0] * p.shape[2]
            return
        q, k = state.pop("_q"), x
        B, n = q.shape[:2]
        acc.q_norm += band_norms(q, spec).sum((0, 1), dtype=torch.float64)
        acc.k_norm += band_norms(k, spec).sum((0, 1), dtype=torch.float64)
        acc.n_tok += B * n
        if n > 1:
            tb = turn_back(n, spec, x.device)
            acc.q_pair += _unrotated_sum(q, spec, tb)
            acc.k_pair += _unrotated_sum(k, spec, tb)
            acc.n_pair += B * (n - 1)
        # Score statistics use the last `queries` query positions (all their keys): they see every rel_pos.
        start = n - min(n, queries or n)
        acc.bin_n += bin_count(n, start, x.device) * B
        scale = score_scale(model, layer)
        # Blocks of query rows x batch rows keep the [head, band, query_pos, key_pos] block under
        # CHUNK_ELEMENTS whatever the window. A block only needs the keys up to its last query (later
        # ones are masked), so query blocks of at most a quarter of the scored rows skip most of the
        # masked half in all-pairs mode.
        per_q = H * nb * n
        qb = min(n - start, max(1, CHUNK_ELEMENTS // per_q), max(32, -(-(n - start) // 4)))
        rb = max(1, CHUNK_ELEMENTS // (per_q * qb))
        for q0 in range(start, n, qb):
            m = min(qb, n - q0)
            pl = plan(q0, m, k.device)
            for r0 in range(0, B, rb):
                fold_block(acc, q[r0:r0 + rb, q0:q0 + m], k[r0:r0 + rb, :q0 + m], spec, scale, pl)

    return Reducer(["rot_q", "rot_k", "pattern"], layers, fn)


@torch.no_grad()
def frequency_usage(
    model: Any,
    token_rows: Sequence[Sequence[int]] | torch.Tensor,
    *,
    batch_size: int = 4,
    layers: Sequence[int] | None = None,
    queries: int | None = None,
    progress: bool = True,
    work: str | Path | None = None,
    fresh: bool = False,
    context: int | None = None,
    target: int | None = None,
) -> FrequencyUsage:
    """Stream `token_rows` through a RoPE model once and measure per-band usage of every head.

    Args:
        model: a TransformerLens model whose attention rotates q and k (RoPE); not on mps (float64 sums).
        token_rows: the windows, `[batch, pos]` token ids of equal length (pos >= 2, at most the model's context).
        batch_size: rows per forward pass.
        layers: the rotary layers to measure (None: every rotary layer).
        queries: limits the score statistics (contributions, shares, profile, eta2) to the last `queries`
            query positions of each window, with all their keys (every rel_pos still occurs): their cost grows
            with queries * window instead of window**2. None measures every causal entry exactly; >= 1.
        progress: show a tqdm bar.
        work: a folder where the pass keeps its sums as it goes (`posprobe.report.checkpoint.StreamResume`); the
            same call resumes from there to the same tables; another model, rows or settings there is refused
            (None: no checkpoint).
        fresh: discard what `work` holds first.
        context: the trained length L of `.tables["theory"]` (Chen et al.'s Theorem 2.1 per head,
            `chen_bounds.head_bounds`; default: the model's context; >= 2).
        target: a(s) beyond L is followed up to `target` tokens (> L; default 4L).

    Returns:
        A FrequencyUsage: `.df` rows (model, layer, head, kv_head, band, frequency [rad/token],
            wavelength [tokens], metric, value) with metrics q_norm, k_norm (mean 2-norm of the band pair;
            k_norm is the kv head's, repeated on the query heads sharing it), mean_contrib, mean_abs_contrib
            (mean over causal entries of the band's partial score, in score units = logits before softmax)
            and abs_share (band's share of the sum of absolute contributions); band -1 is the unrotated
            remainder (partial rotary). h_re, h_im: Chen et al.'s h_j = q_j conj(k_j) / scale of the head's mean
            pair (the unrotated band pairs as complex numbers, averaged over positions >= 1); h_typical:
            mean |q_j| x mean |k_j| / scale (score units). `.profile` gives mean_contrib / mean_abs_contrib per
            rel_pos bin (rel_pos = lower bin edge, rel_pos_hi inclusive upper edge). `.heads` has one row per
            head: pattern signatures (self_mass, prev_mass, first_mass: mean attention over queries 1..), eta2
            (share of score variance explained by rel_pos bin), fast_share (abs share of bands with wavelength
            <= window) and kind. `.tables["theory"]` is Chen et al.'s Theorem 2.1 per head for L = `context` and
            a(s) up to `target`.
    """
    facts = model_facts(model)
    require_rotated_qk(facts, "Per-frequency RoPE usage")
    require_attention_supported(facts, "Per-frequency RoPE usage")  # its head signatures read the pattern
    if device_of(model).type == "mps":  # say so before any work, not deep inside the first batch
        raise NotImplementedError("The frequency pass accumulates in float64 on the model's device, which mps "
                                  "does not support; run it with --device cpu or cuda")
    rows = check_rows(model, token_rows)
    layers = facts.check_rotary_layers(layers, "Per-frequency RoPE usage")
    if len({s.rotary_dim for s in facts.rotary if s is not None}) != 1:
        raise NotImplementedError("Layers with different rotary_dim are not supported")
    window = rows.shape[1]
    facts = at_length(model, facts, window)  # dynamic / longrope: the frequencies a window this long turns with
    edges = rel_pos_edges(window)
    if queries is not None and queries < 1:
        raise ValueError(f"queries must be >= 1 or None, got {queries}")
    length = int(context or facts.n_ctx)
    if length < 2 or (target is not None and target <= length):
        raise ValueError(f"the theory needs a context L >= 2 tokens and a target L' > L; got L = {length}, "
                         f"L' = {target}")
    red = _reducer(model, facts, layers, edges, queries)
    # Under torchrun each process streams its share of the batches and the sums are added up over
    # processes (core.distributed); a single process takes every batch.
    spans = distributed.shard_batches(rows.shape[0], batch_size)
    config = dict(batch_size=batch_size, layers=layers, queries=queries)
    resume = stream_resume(work, fresh=fresh, analysis="frequency", model=model, rows=rows, config=config,
                           pack=_pack, unpack=_unpack)
    stream(model, (rows[a:b] for a, b in spans), [red], total=len(spans), progress=progress, desc="freq-usage",
           resume=resume)
    state = red.state
    state.pop("_q", None)
    if distributed.active():
        accs = [state[l] for l in layers]
        distributed.all_reduce_sums([v for a in accs for v in vars(a).values() if isinstance(v, torch.Tensor)])
        counts = distributed.all_reduce_ints([c for a in accs for c in (a.n_tok, a.n_rows, a.n_pair)])
        for a, n_tok, n_rows, n_pair in zip(accs, counts[::3], counts[1::3], counts[2::3]):
            a.n_tok, a.n_rows, a.n_pair = n_tok, n_rows, n_pair
    # Every layer's sums cross to the CPU in one copy (the tables are built with numpy).
    band_df, prof_df, head_df = _tables(facts, to_cpu_once({l: state[l] for l in layers}), edges, window,
                                        {l: score_scale(model, l) for l in layers})
    theory = head_bounds(band_df, facts, context=length, target=target)
    data = data_meta("token rows", n_items=int(rows.shape[0]), unit="windows")
    meta = {
        **make_meta("frequency", model=facts.summary(), data=data, config=config),
        "n_windows": int(rows.shape[0]),
        "window": int(window),
        "n_tokens": int(rows.numel()),
        "layers": layers,
        "score_queries": "all" if queries is None or queries >= window else f"last {queries} of each window",
        "rel_pos_edges": edges,
        "classification_rule": CLASSIFICATION_RULE,
        "band_order": "band 0 = highest frequency (shortest wavelength); band -1 = unrotated dims",
        "score_units": "pre-softmax attention score (q.k / attn_scale), before any soft-cap",
        "attn_scores_soft_cap": score_soft_cap(model),
        "theory": {"context": length, "target": int(theory.theory_target.iloc[0]) if len(theory) else None,
                   "tolerance": TOLERANCE, "mean_pair": "mean unrotated query and key over positions >= 1",
                   "rule": f"interpolation_safe: Chen's bound d max|h_j| / (32 ln b) <= {TOLERANCE:g} (typical "
                           f"pair); extrapolation_leaves_range: a(s) of the mean pair beyond L leaves its range "
                           f"inside L by more than {TOLERANCE:g}"},
    }
    return FrequencyUsage({"bands": band_df, "profile": prof_df, "heads": head_df, "theory": theory}, meta)


def _grid(**cols: Any) -> dict[str, np.ndarray]:
    # Cartesian product of 1-D columns (first varies slowest), as flat arrays.
    names, vals = list(cols), [np.asarray(v) for v in cols.values()]
    return {n: m.ravel() for n, m in zip(names, np.meshgrid(*vals, indexing="ij"))}


def _tables(facts: ModelFacts, accs: dict[int, _Acc], edges: list[int], window: int,
            scales: dict[int, float]) -> tuple[pd.DataFrame, ...]:
    # All layers at once: one DataFrame per table built from flat arrays (per-layer frames and
    # per-row dict lookups cost ~0.7 s on SmolLM2, a fixed cost that showed at small token counts).
    H, nb = facts.n_heads, facts.first_rotary.n_bands
    group = H // facts.n_kv_heads
    his = [e - 1 for e in edges[1:]] + [window - 1]
    rest = facts.d_head > facts.first_rotary.rotary_dim
    nbx = nb + 1 if rest else nb
    bands = list(range(nb)) + ([-1] if rest else [])
    kv = torch.arange(H) // group
    layers = list(accs)
    L = len(layers)
    # Per layer and band (band -1 = unrotated remainder): frequency [rad/token] and wavelength [tokens].
    freq = np.array([angular_frequency(facts.rotary[l]) + [0.0] * (nbx - nb) for l in layers])
    wave = np.array([wavelength(facts.rotary[l]) + [math.inf] * (nbx - nb) for l in layers])
    metrics = ["q_norm", "k_norm", "mean_contrib", "mean_abs_contrib", "abs_share", "h_re", "h_im", "h_typical"]
    vals, profile, bin_n, hparts = [], [], [], []
    for layer, a in accs.items():
        spec = facts.rotary[layer]
        n_causal = a.bin_n.sum()
        signed_tot, abs_tot = a.signed.sum(-1)[:, :nbx], a.abs.sum(-1)[:, :nbx]  # [head, band(+rest)]
        share = abs_tot / abs_tot.sum(-1, keepdim=True).clamp_min(1e-300)
        nan = torch.full((H, nbx - nb), math.nan, dtype=torch.float64)
        # Chen et al.'s h_j for the mean unrotated query and key of the head: q_j conj(k_j) / scale (score units).
        # torch.complex, not view_as_complex: after to_cpu_once the sums are views into one shared buffer, at
        # offsets view_as_complex refuses (it needs an even storage offset).
        q_mean = torch.complex(a.q_pair[..., 0], a.q_pair[..., 1]) / max(a.n_pair, 1)
        k_mean = torch.complex(a.k_pair[..., 0], a.k_pair[..., 1])[kv] / max(a.n_pair, 1)
        h = q_mean * k_mean.conj() / scales[layer] if a.n_pair else torch.full_like(q_mean, complex(math.nan, math.nan))
        vals.append(torch.stack([torch.cat([a.q_norm / a.n_tok, nan], 1), torch.cat([a.k_norm[kv] / a.n_tok, nan], 1),
                                 signed_tot / n_causal, abs_tot / n_causal, share,
                                 torch.cat([h.real, nan], 1), torch.cat([h.imag, nan], 1),
                                 torch.cat([a.q_norm * a.k_norm[kv] / (a.n_tok**2 * scales[layer]), nan], 1)]))
        profile.append(torch.stack([a.signed, a.abs])[:, :, :nbx] / a.bin_n.clamp_min(1))  # [metric, head, band, bin]
        bin_n.append(a.bin_n)
        s_bin = a.signed.sum(1)  # [head, bin]: total score summed per bin
        mu = s_bin.sum(-1) / n_causal
        var = a.s2 / n_causal - mu**2
        between = ((s_bin / a.bin_n.clamp_min(1) - mu[:, None]) ** 2 * a.bin_n).sum(-1) / n_causal
        eta2 = (between / var.clamp_min(1e-300)).clamp(0, 1)
        fast = torch.tensor([w <= window for w in wavelength(spec)] + [False] * (nbx - nb))
        d, p, f = (x / max(a.n_rows, 1) for x in (a.diag, a.prev, a.first))
        kind = ["position-driven" if e >= 0.3 or pp >= 0.5 or dd >= 0.5 else "content-driven" if e < 0.1 else "mixed"
                for e, pp, dd in zip(eta2.tolist(), p.tolist(), d.tolist())]
        hparts.append(
            dict(
                layer=np.full(H, layer),
                head=np.arange(H),
                kv_head=kv.numpy(),
                base=np.full(H, float(spec.base)),
                self_mass=d.numpy(),
                prev_mass=p.numpy(),
                first_mass=f.numpy(),
                eta2=eta2.numpy(),
                fast_share=share[:, fast].sum(-1).numpy(),
                kind=np.array(kind, dtype=object),
            )
        )
    li = np.arange(L)
    g = _grid(li=li, metric=metrics, head=range(H), bi=range(nbx))
    band_df = pd.DataFrame(dict(model=facts.name, layer=np.asarray(layers)[g["li"]], head=g["head"],
                                kv_head=g["head"] // group, band=np.asarray(bands)[g["bi"]],
                                frequency=freq[g["li"], g["bi"]], wavelength=wave[g["li"], g["bi"]],
                                metric=g["metric"], value=torch.stack(vals).reshape(-1).numpy()))
    band_df = band_df[band_df.value.notna()].reset_index(drop=True)
    g = _grid(li=li, metric=["mean_contrib", "mean_abs_contrib"], head=range(H), bi=range(nbx), ri=range(len(edges)))
    prof_df = pd.DataFrame(dict(model=facts.name, layer=np.asarray(layers)[g["li"]], head=g["head"],
                                kv_head=g["head"] // group, band=np.asarray(bands)[g["bi"]],
                                frequency=freq[g["li"], g["bi"]], wavelength=wave[g["li"], g["bi"]],
                                rel_pos=np.asarray(edges)[g["ri"]], rel_pos_hi=np.asarray(his)[g["ri"]],
                                metric=g["metric"], value=torch.stack(profile).reshape(-1).numpy(),
                                count=torch.stack(bin_n).numpy()[g["li"], g["ri"]]))
    head_df = pd.DataFrame({k: np.concatenate([h[k] for h in hparts]) for k in hparts[0]})
    head_df.insert(0, "model", facts.name)
    return band_df, prof_df, head_df


def top_heads(heads: pd.DataFrame, n: int = 6) -> list[tuple[int, int]]:
    """(layer, head) of the most positional heads: half by eta2, half by fast_share, no repeats."""
    picks: list[tuple[int, int]] = []
    for col in ("eta2", "fast_share") * n:
        for _, r in heads.sort_values(col, ascending=False).iterrows():
            lh = (int(r.layer), int(r["head"]))
            if lh not in picks:
                picks.append(lh)
                break
        if len(picks) >= min(n, len(heads)):
            break
    return picks


def _atlas_run(model: Any, r: AtlasRun) -> Result:
    return run_frequency(model, r.text, FrequencyConfig(window=r.window, max_windows=r.max_windows, queries=32,
                                                         ablate=False, progress=r.config.progress), source=r.source)


def _compare(m: ModelEntry, run: CompareRun) -> Any:
    text, cfg = run.text, run.config
    if (why := why_not("frequency", m.facts)) is not None:
        return why
    got = run_frequency(m.model, text, FrequencyConfig(window=min(cfg.window, m.facts.n_ctx),
                                                       max_windows=cfg.max_windows, queries=32, ablate=False,
                                                       progress=False))
    b = got.tables["bands"]
    return {"bands": b[(b.metric == "abs_share") & (b.band >= 0)], "frequency_heads": got.tables["heads"]}, None


ATLAS_SECTION = register(AtlasSection(
    "frequency", "RoPE frequency usage", _atlas_run, frequency_report.headline_numbers,
    frequency_report.atlas_paragraph,
    blocked=lambda facts, engine_runs: (facts.unsupported, facts.rotation_unhooked, facts.attention_unsupported),
    # the layers whose heads the section measured (rotary layers only)
    meta=lambda part: {"frequency_layers": sorted(int(l) for l in part.tables["heads"].layer.unique())},
    compare=_compare, compare_page=frequency_report.compare_section))
