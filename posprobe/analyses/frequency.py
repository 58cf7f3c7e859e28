"""Per-frequency RoPE usage per head: band norms of q/k, each band's share of the attention score,
its dependence on relative distance, and attention-pattern signatures (Barbero et al. 2024).

A band is one 2-D rotary pair (band 0 is the fastest). The per-band partial dot products of the
rotated q and k, plus the dot product over the unrotated dims (partial rotary), sum exactly to the
pre-softmax score, so a band's "contribution" to a score is exact, not an attribution. Everything
is streamed over the corpus with fixed-size per-layer accumulators (memory does not grow with it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import pandas as pd
import torch
from jaxtyping import Float

from posprobe.core.capture import Reducer, batches, stream
from posprobe.backend.facts import ModelFacts, model_facts, require_rotary
from posprobe.backend.hooks import score_scale, score_soft_cap
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.core.rope import RotarySpec, angular_frequency, band_contributions, band_dims, band_norms, wavelength
from posprobe.backend.model import context_length

#: Elements of one [head, band, query_pos, key_pos] block processed at once (bounds transient memory).
CHUNK_ELEMENTS = 1 << 24

CLASSIFICATION_RULE = (
    "positional if eta2 >= 0.3 (at least 30% of the variance of the head's causal scores is explained by "
    "binned relative distance) or previous-token / self attention mass >= 0.5; semantic if eta2 < 0.1; "
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


def _bin_block(q0: int, m: int, n: int, bin_of: torch.Tensor, n_bins: int, dtype: torch.dtype) -> torch.Tensor:
    # One-hot [m * key_pos, bin] for query rows q0..q0+m-1; masked (future) keys map to no bin.
    rel = torch.arange(q0, q0 + m)[:, None] - torch.arange(n)[None, :]
    causal = rel >= 0
    out = torch.zeros(m, n, n_bins, dtype=dtype)
    out[causal, bin_of[rel[causal]]] = 1
    return out.reshape(m * n, n_bins)


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


@dataclass(frozen=True, kw_only=True)
class FrequencyConfig:
    """Options of `run_frequency` (and `posprobe freq-report`).

    window: tokens per window incl. BOS; max_windows: windows cut from the text; queries: score
    statistics from the last N query positions of each window (None: all, exact); ablate: also run
    band ablations (model-wide p sweep + top heads) on the first `ablate_windows` windows;
    top_heads: heads given their own report section and ablations.
    """

    window: int = 128
    max_windows: int = 8
    batch_size: int = 4
    queries: int | None = 64
    ablate: bool = True
    ablate_windows: int = 4
    top_heads: int = 6
    layers: tuple[int, ...] | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("window", "max_windows", "batch_size", "ablate_windows", "top_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.queries is not None and self.queries < 1:
            raise ValueError(f"queries must be >= 1 or None, got {self.queries}")


def run_frequency(model: Any, text: str | None = None, config: FrequencyConfig | None = None, *,
                  source: str | None = None) -> FrequencyUsage:
    """Per-band RoPE usage of every head over windows of `text` (default: the built-in text), plus band
    ablations (loss change in nats/token) when `config.ablate`. Returns a FrequencyUsage result."""
    from posprobe.analyses.frequency_ablation import band_ablation, head_ablations, p_sweep
    from posprobe.backend.model import encode_text, tokenizer_of
    from posprobe.data import BUILTIN_TEXT, framed_windows

    cfg = config or FrequencyConfig()
    facts = model_facts(model)
    require_rotary(facts, "Per-frequency RoPE usage")
    if cfg.window > facts.n_ctx:
        raise ValueError(f"window {cfg.window} exceeds the model's context n_ctx={facts.n_ctx}")
    body = BUILTIN_TEXT if text is None else text
    bos = tokenizer_of(model).bos_token_id
    rows = framed_windows(encode_text(model, body), cfg.window, pre=[bos] if bos is not None else [],
                          max_windows=cfg.max_windows)
    usage = frequency_usage(model, rows, batch_size=cfg.batch_size, layers=cfg.layers, queries=cfg.queries,
                            progress=cfg.progress)
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
    """Fixed-size float64 sums for one layer."""

    def __init__(self, n_heads: int, n_kv: int, n_bands: int, n_bins: int):
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.q_norm, self.k_norm, self.n_tok = z(n_heads, n_bands), z(n_kv, n_bands), 0
        self.signed, self.abs = z(n_heads, n_bands + 1, n_bins), z(n_heads, n_bands + 1, n_bins)
        self.bin_n = z(n_bins)
        self.s2 = z(n_heads)
        self.diag, self.prev, self.first, self.n_rows = z(n_heads), z(n_heads), z(n_heads), 0


def _reducer(model: Any, facts: ModelFacts, layers: list[int], edges: list[int], queries: int | None) -> Reducer:
    H, nb = facts.n_heads, facts.rotary[0].n_bands
    has_rest = facts.d_head > facts.rotary[0].rotary_dim
    cache: dict[int, torch.Tensor] = {}

    def fn(point: str, layer: int, x: torch.Tensor, state: dict) -> None:
        spec = facts.rotary[layer]
        acc = state.get(layer) or state.setdefault(layer, _Acc(H, facts.n_kv_heads, nb, len(edges)))
        if point == "rot_q":
            state["_q"] = x
            return
        if point == "pattern":
            p = x[:, :, 1:, :].to(torch.float64)  # query 0 attends only to itself: not informative
            acc.diag += p.diagonal(1, -2, -1).sum((0, 2))
            acc.prev += p.diagonal(0, -2, -1).sum((0, 2))
            acc.first += p[..., 0].sum((0, 2))
            acc.n_rows += p.shape[0] * p.shape[2]
            return
        q = state.pop("_q")
        n = q.shape[1]
        if n not in cache:
            cache[n] = torch.bucketize(torch.arange(n), torch.tensor(edges), right=True) - 1  # rel -> bin
        bin_of = cache[n].to(x.device)
        B = q.shape[0]
        acc.q_norm += band_norms(q, spec).sum((0, 1)).to(torch.float64)
        acc.k_norm += band_norms(x, spec).sum((0, 1)).to(torch.float64)
        acc.n_tok += B * n
        # Score statistics use the last `queries` query positions (all their keys): they see every rel_pos.
        start = n - min(n, queries or n)
        per_rel = (n - torch.clamp(torch.arange(n), min=start)).double()  # causal entries at each rel_pos
        acc.bin_n += torch.bincount(bin_of, weights=per_rel, minlength=len(edges)) * B
        scale = score_scale(model, layer)
        # Chunk over batch rows and query blocks so the [head, band, query_pos, key_pos] block stays
        # under CHUNK_ELEMENTS whatever the window.
        per_q = H * nb * n
        qb = min(n - start, max(1, CHUNK_ELEMENTS // per_q))
        rb = max(1, CHUNK_ELEMENTS // (per_q * qb))
        for q0 in range(start, n, qb):
            qs = slice(q0, min(n, q0 + qb))
            m = qs.stop - q0
            bmq = _bin_block(q0, m, n, cache[n], len(edges), x.dtype).to(x.device)
            causal = bmq.sum(-1)
            for r0 in range(0, B, rb):
                rs = slice(r0, r0 + rb)
                bands, rest = band_contributions(q[rs, qs], x[rs], spec, scale)
                nr = bands.shape[0]
                tot = bands.sum(2) + rest
                acc.s2 += ((tot * tot).reshape(nr, H, m * n) @ causal).sum(0).to(torch.float64)
                # Few passes over the big [head, band, query, key] block: signed sums, abs in place, abs sums.
                flat = bands.reshape(nr, H * nb, m * n)
                acc.signed[:, :nb] += (flat @ bmq).sum(0).reshape(H, nb, -1).to(torch.float64)
                acc.abs[:, :nb] += (flat.abs_() @ bmq).sum(0).reshape(H, nb, -1).to(torch.float64)
                if has_rest:  # partial rotary: the unrotated dims' share of the score
                    rflat = rest.reshape(nr, H, m * n)
                    acc.signed[:, nb] += (rflat @ bmq).sum(0).to(torch.float64)
                    acc.abs[:, nb] += (rflat.abs() @ bmq).sum(0).to(torch.float64)

    return Reducer(["rot_q", "rot_k", "pattern"], layers, fn)


def _check_rows(model: Any, token_rows: Any) -> torch.Tensor:
    rows = torch.as_tensor(token_rows) if not isinstance(token_rows, torch.Tensor) else token_rows
    if rows.dim() != 2 or rows.shape[0] == 0 or rows.shape[1] < 2:
        raise ValueError("token_rows must be a non-empty [batch, pos] set of equal-length rows with pos >= 2")
    if rows.shape[1] > context_length(model):
        raise ValueError(f"windows of {rows.shape[1]} tokens exceed the model's n_ctx={context_length(model)}")
    return rows


@torch.no_grad()
def frequency_usage(
    model: Any,
    token_rows: Sequence[Sequence[int]] | torch.Tensor,
    *,
    batch_size: int = 4,
    layers: Sequence[int] | None = None,
    queries: int | None = None,
    progress: bool = True,
) -> FrequencyUsage:
    """Stream `token_rows` through a RoPE model once and measure per-band usage of every head.

    Returns a FrequencyUsage: `.df` rows (model, layer, head, kv_head, band, frequency [rad/token],
    wavelength [tokens], metric, value) with metrics q_norm, k_norm (mean 2-norm of the band pair;
    k_norm is the kv head's, repeated on the query heads sharing it), mean_contrib, mean_abs_contrib
    (mean over causal entries of the band's partial score, in score units = logits before softmax)
    and abs_share (band's share of the sum of absolute contributions); band -1 is the unrotated
    remainder (partial rotary). `.profile` gives mean_contrib / mean_abs_contrib per rel_pos bin
    (rel_pos = lower bin edge, rel_pos_hi inclusive upper edge). `.heads` has one row per head: pattern
    signatures (diag_mass, prev_mass, first_mass, mean attention over queries 1..), eta2 (share of score
    variance explained by rel_pos bin), fast_share (abs share of bands with wavelength <= window) and kind.

    `queries` limits the score statistics (contributions, shares, profile, eta2) to the last `queries`
    query positions of each window, with all their keys (every rel_pos still occurs): their cost grows
    with queries * window instead of window**2. None measures every causal entry exactly.
    """
    facts = model_facts(model)
    require_rotary(facts, "Per-frequency RoPE usage")
    rows = _check_rows(model, token_rows)
    layers = list(range(facts.n_layers)) if layers is None else list(layers)
    if not layers or any(not 0 <= l < facts.n_layers for l in layers):
        raise ValueError(f"layers must be within 0..{facts.n_layers - 1}; got {layers}")
    if len({s.rotary_dim for s in facts.rotary}) != 1:
        raise NotImplementedError("Layers with different rotary_dim are not supported")
    window = rows.shape[1]
    edges = rel_pos_edges(window)
    if queries is not None and queries < 1:
        raise ValueError(f"queries must be >= 1 or None, got {queries}")
    red = _reducer(model, facts, layers, edges, queries)
    n_batches = math.ceil(rows.shape[0] / batch_size)
    stream(model, batches(rows, batch_size), [red], total=n_batches, progress=progress, desc="freq-usage")
    state = red.state
    state.pop("_q", None)
    band_df, prof_df, head_df = _tables(facts, {l: state[l] for l in layers}, edges, window)
    data = data_meta("token rows", n_items=int(rows.shape[0]), unit="windows")
    config = dict(batch_size=batch_size, layers=layers, queries=queries)
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
    }
    return FrequencyUsage({"bands": band_df, "profile": prof_df, "heads": head_df}, meta)


def _grid(**cols: Any) -> pd.DataFrame:
    # Cartesian product of 1-D columns (first varies slowest), as a DataFrame.
    import numpy as np

    names, vals = list(cols), [np.asarray(v) for v in cols.values()]
    mesh = np.meshgrid(*vals, indexing="ij")
    return pd.DataFrame({n: m.ravel() for n, m in zip(names, mesh)})


def _tables(facts: ModelFacts, accs: dict[int, _Acc], edges: list[int], window: int) -> tuple[pd.DataFrame, ...]:
    H, nb = facts.n_heads, facts.rotary[0].n_bands
    group = H // facts.n_kv_heads
    his = [e - 1 for e in edges[1:]] + [window - 1]
    rest = facts.d_head > facts.rotary[0].rotary_dim
    nbx = nb + 1 if rest else nb
    bands = list(range(nb)) + ([-1] if rest else [])
    kv = torch.arange(H) // group
    bparts, pparts, hparts = [], [], []
    for layer, a in accs.items():
        spec = facts.rotary[layer]
        freq = {**dict(enumerate(angular_frequency(spec))), -1: 0.0}
        wave = {**dict(enumerate(wavelength(spec))), -1: math.inf}
        n_causal = a.bin_n.sum()
        signed_tot, abs_tot = a.signed.sum(-1)[:, :nbx], a.abs.sum(-1)[:, :nbx]  # [head, band(+rest)]
        share = abs_tot / abs_tot.sum(-1, keepdim=True).clamp_min(1e-300)
        nan = torch.full((H, nbx - nb), math.nan, dtype=torch.float64)
        terms = {"q_norm": torch.cat([a.q_norm / a.n_tok, nan], 1),
                 "k_norm": torch.cat([a.k_norm[kv] / a.n_tok, nan], 1),
                 "mean_contrib": signed_tot / n_causal, "mean_abs_contrib": abs_tot / n_causal, "abs_share": share}
        for t, v in terms.items():
            g = _grid(head=range(H), band=bands)
            g["metric"], g["value"], g["layer"] = t, v.reshape(-1).numpy(), layer
            g["frequency"], g["wavelength"] = g.band.map(freq), g.band.map(wave)
            bparts.append(g.dropna(subset=["value"]))
        mean_bin = torch.stack([a.signed, a.abs])[:, :, :nbx] / a.bin_n.clamp_min(1)  # [metric, head, band, bin]
        g = _grid(metric=["mean_contrib", "mean_abs_contrib"], head=range(H), band=bands, rel_pos=edges)
        g["rel_pos_hi"] = g.rel_pos.map(dict(zip(edges, his)))
        g["value"], g["count"], g["layer"] = mean_bin.reshape(-1).numpy(), g.rel_pos.map(dict(zip(edges, a.bin_n.tolist()))), layer
        g["frequency"], g["wavelength"] = g.band.map(freq), g.band.map(wave)
        pparts.append(g)
        s_bin = a.signed.sum(1)  # [head, bin]: total score summed per bin
        mu = s_bin.sum(-1) / n_causal
        var = a.s2 / n_causal - mu**2
        between = ((s_bin / a.bin_n.clamp_min(1) - mu[:, None]) ** 2 * a.bin_n).sum(-1) / n_causal
        eta2 = (between / var.clamp_min(1e-300)).clamp(0, 1)
        fast = torch.tensor([w <= window for w in wavelength(spec)] + [False] * (nbx - nb))
        d, p, f = (x / max(a.n_rows, 1) for x in (a.diag, a.prev, a.first))
        kind = ["positional" if e >= 0.3 or pp >= 0.5 or dd >= 0.5 else "semantic" if e < 0.1 else "mixed"
                for e, pp, dd in zip(eta2.tolist(), p.tolist(), d.tolist())]
        hparts.append(pd.DataFrame(dict(layer=layer, head=range(H), kv_head=kv.numpy(), base=spec.base,
                                        diag_mass=d.numpy(), prev_mass=p.numpy(), first_mass=f.numpy(),
                                        eta2=eta2.numpy(), fast_share=share[:, fast].sum(-1).numpy(), kind=kind)))
    band_df, prof_df, head_df = (pd.concat(x, ignore_index=True) for x in (bparts, pparts, hparts))
    for df in (band_df, prof_df):
        df["kv_head"] = df["head"] // group
    for df in (band_df, prof_df, head_df):
        df.insert(0, "model", facts.name)
    order = ["model", "layer", "head", "kv_head", "band", "frequency", "wavelength"]
    band_df = band_df[order + ["metric", "value"]]
    prof_df = prof_df[order + ["rel_pos", "rel_pos_hi", "metric", "value", "count"]]
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
