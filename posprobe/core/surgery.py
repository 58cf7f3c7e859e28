"""Query/key rotation surgery presets: each returns a PositionPlan (positions, views, rotary overrides).

Positions are in tokens (floats allowed); `n` is the sequence length the plan covers (generation
extends it with `PositionPlan.extended`). Relative-position rules that depend on the query
(Self-Extend, ReRoPE, StreamingLLM) are exact per (query, key) pair through one KeyView per query
(a full forward costs O(n) extra score computations per layer; a decode step costs one).
`apply_plan` is `rope_positions` plus the two things a plan cannot express as positions: YaRN's
attention temperature and StreamingLLM's evicted keys (both read from `plan.meta`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
from jaxtyping import Bool

from posprobe.backend.facts import model_facts, require_rotary
from posprobe.backend.hooks import hook_name, hooked, layer_rotary_spec, scaled_rotary_spec, score_edits_apply
from posprobe.backend.model import model_name, n_layers
from posprobe.core.positions import KeyView, PositionError, PositionPlan, rope_positions, shifted_plan
from posprobe.core.variants import RENAMED_VARIANT
from posprobe.core.variants import SQUISH_VARIANTS as VARIANTS
from posprobe.rope import RotarySpec
from posprobe.rope_theory import ntk_aware_base, yarn_gamma, yarn_temperature


def _arange(n: int) -> torch.Tensor:
    if n < 1:
        raise PositionError(f"A plan needs at least one token; got n={n}")
    return torch.arange(n, dtype=torch.float64)


def shift(n: int, k: float, *, q_only: bool = False) -> PositionPlan:
    """q = k = i + k for token i (queries only with `q_only`). A common shift leaves a RoPE model unchanged."""
    _arange(n)
    meta = {"preset": "shift", "k": k, **({"q_only": True} if q_only else {})}
    return replace(shifted_plan(n, k, q_only=q_only), meta=meta)


def key_squish(n: int, span: tuple[int, int], *, to: float | None = 0.0, range_: tuple[float, float] | None = None,
               query_start: float | None = None, variant: str = "cache") -> PositionPlan:
    """Keys of tokens `span = (a, b)` (b exclusive) squished; other tokens keep or move their positions.

    Tokens before the span keep q = k = i.

    Args:
        n: the plan length in tokens (positions 0 .. n-1); the span must satisfy 0 <= a < b <= n.
        span: (a, b), the token indices whose keys are squished, b exclusive.
        to: the one position every span key j gets (all the same); ignored when `range_` is given. `to` and
            `range_` both None is a ValueError.
        range_: (lo, hi): span key j gets the linear map `lo + (j - a) * (hi - lo) / (b - a - 1)` (wins over
            `to`; a one-token span gets lo).
        query_start: where the tokens after the span restart: they get q = k = query_start + (i - b)
            (None, the default, means query_start = b: unchanged).
        variant: what the span's own tokens do (a name outside these, or the renamed "global", is a ValueError):
            "cache": span queries see every key at its normal position (a KeyView), so the span reads itself
            unmodified, as if it had been encoded first and then its cached keys re-positioned; later tokens see
            the squished keys.
            "keys": every query, the span's own included, sees the squished span keys; span queries stay at i.
            "qk": span queries AND keys at the squished positions (q = k, no view): what Hugging Face does with
            `position_ids` set to the squished positions on the span's tokens.

    Returns:
        The `PositionPlan` (positions as float64 tensors of length n), labelled `"squish-<variant>:<how>"`, with
            meta preset, variant, span, squish and query_start.
    """
    a, b = span
    if not 0 <= a < b <= n:
        raise PositionError(f"span {span} must satisfy 0 <= start < end <= {n} (the plan length)")
    if variant == "global":
        raise ValueError(RENAMED_VARIANT)
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    if range_ is None and to is None:
        raise ValueError("give `to` (one position) or `range_` (lo, hi) for the squished span keys")
    pos = _arange(n)
    if range_ is not None:
        lo, hi = map(float, range_)
        frac = torch.arange(b - a, dtype=torch.float64) / max(b - a - 1, 1)
        squished = lo + frac * (hi - lo)
        how = f"range[{lo:g},{hi:g}]"
    else:
        squished = torch.full((b - a,), float(to), dtype=torch.float64)
        how = f"to {float(to):g}"
    start = float(b if query_start is None else query_start)
    q = pos.clone()
    q[b:] = start + (pos[b:] - b)
    k = q.clone()
    k[a:b] = squished
    if variant == "qk":
        q[a:b] = squished
    views: tuple[KeyView, ...] = ()
    if variant == "cache":
        rows = torch.zeros(n, dtype=torch.bool)
        rows[a:b] = True
        views = (KeyView(rows, q.clone(), name="span-sees-itself"),)
    meta = {"preset": "key_squish", "variant": variant, "span": [a, b], "squish": how, "query_start": start}
    return PositionPlan(q, k, views=views, label=f"squish-{variant}:{how}", meta=meta)


def position_interpolation(n: int, scale: float) -> PositionPlan:
    """Position Interpolation (Chen et al. 2023): q = k = i / s."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0; got {scale}")
    p = _arange(n) / scale
    return PositionPlan(p, p.clone(), label=f"pi:{scale:g}", meta={"preset": "pi", "scale": scale})


def _specs(model: Any) -> dict[int, RotarySpec]:
    facts = model_facts(model)
    require_rotary(facts, "Frequency surgery")
    return {l: layer_rotary_spec(model, l) for l in facts.rotary_layers}


def ntk_rotary(spec: RotarySpec, scale: float) -> RotarySpec:
    """NTK-aware base change of one layer's rotation: base' = base * s ** (d / (d - 2)), d = rotary_dim."""
    return replace(spec, base=ntk_aware_base(spec, scale))


def ntk_aware(model: Any, n: int, scale: float) -> PositionPlan:
    """NTK-aware scaling (bloc97 2023): base' = base * s ** (d / (d - 2)), d = rotary_dim; positions unchanged."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0; got {scale}")
    rot = {l: ntk_rotary(s, scale) for l, s in _specs(model).items()}
    plan = PositionPlan.default(n, label=f"ntk:{scale:g}")
    return replace(plan, rotary=rot, meta={"preset": "ntk", "scale": scale})


def yarn_factors(spec: RotarySpec, scale: float, original_ctx: int, beta_fast: float = 32.0,
                 beta_slow: float = 1.0) -> tuple[float, ...]:
    """YaRN (Peng et al. 2023) per-band multipliers of TL's inverse frequency (angle = pos / freq).

    r_b = L / wavelength_b; ramp g = 0 if r < beta_slow, 1 if r > beta_fast, else linear between;
    new angular frequency theta_b' = ((1 - g) / s + g) * theta_b, so the multiplier is 1 / ((1 - g)/s + g).
    """
    gamma = yarn_gamma(spec, original_ctx, alpha=beta_slow, beta=beta_fast, ramp="turns")
    return tuple(float(1.0 / ((1.0 - g) / scale + g)) for g in gamma)


def yarn_rotary(spec: RotarySpec, scale: float, original_ctx: int, beta_fast: float = 32.0,
                beta_slow: float = 1.0) -> RotarySpec:
    """One layer's rotation under YaRN: `yarn_factors` times any per-band scale the layer already has."""
    base = spec.freq_scale or (1.0,) * spec.n_bands
    f = yarn_factors(spec, scale, original_ctx, beta_fast, beta_slow)
    return replace(spec, freq_scale=tuple(x * y for x, y in zip(base, f)))


def yarn_score_scale(scale: float) -> float:
    """YaRN's multiplier of the pre-softmax scores, m**2 with m = sqrt(1/t) = 0.1 ln(s) + 1 (1 for s <= 1)."""
    return yarn_temperature(scale) ** 2


def yarn(model: Any, n: int, scale: float, original_ctx: int, *, beta_fast: float = 32.0,
         beta_slow: float = 1.0) -> PositionPlan:
    """YaRN: per-band interpolation (`yarn_factors`) plus attention temperature sqrt(1/t) = 0.1 ln(s) + 1.

    The temperature multiplies q and k by m = 0.1 ln(s) + 1 (as HF scales cos/sin), i.e. the
    pre-softmax scores by m**2; `apply_plan` applies it to the pre-softmax scores, which equals scaling q
    by m**2 for models without attention soft-capping. Stored as meta["score_scale"].
    """
    if scale <= 0:
        raise ValueError(f"scale must be > 0; got {scale}")
    rot = {l: yarn_rotary(s, scale, original_ctx, beta_fast, beta_slow) for l, s in _specs(model).items()}
    meta = {"preset": "yarn", "scale": scale, "original_ctx": original_ctx, "beta_fast": beta_fast,
            "beta_slow": beta_slow, "score_scale": yarn_score_scale(scale)}
    return replace(PositionPlan.default(n, label=f"yarn:{scale:g}"), rotary=rot, meta=meta)


def drop_rotary(spec: RotarySpec, lowest: int, highest: int) -> RotarySpec:
    """One layer's rotation without its `lowest` slowest and `highest` fastest bands (band 0 = fastest)."""
    if lowest < 0 or highest < 0 or lowest + highest > spec.n_bands:
        raise ValueError(f"cannot drop {lowest} + {highest} of {spec.n_bands} bands")
    gone = set(range(highest)) | set(range(spec.n_bands - lowest, spec.n_bands))
    return replace(spec, removed=frozenset(spec.removed | gone))


def drop_frequencies(model: Any, n: int, *, lowest: int = 0, highest: int = 0) -> PositionPlan:
    """Remove the `lowest` slowest and `highest` fastest bands (cos 1, sin 0) in every layer (p-RoPE style).

    Band 0 is the fastest (TL ordering), so lowest = the last `lowest` bands.
    """
    rot = {l: drop_rotary(s, lowest, highest) for l, s in _specs(model).items()}
    meta = {"preset": "drop_frequencies", "lowest": lowest, "highest": highest}
    return replace(PositionPlan.default(n, label=f"drop:low{lowest},high{highest}"), rotary=rot, meta=meta)


def p_rope(model: Any, n: int, p: float) -> PositionPlan:
    """p-RoPE (Barbero et al. 2024): keep the fraction p fastest bands, remove the round((1-p) * bands) slowest."""
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1]; got {p}")
    bands = model_facts(model).first_rotary.n_bands
    plan = drop_frequencies(model, n, lowest=round((1 - p) * bands))
    return replace(plan, label=f"p-rope:{p:g}", meta={**plan.meta, "preset": "p_rope", "p": p})


def per_query_plan(n: int, rel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], label: str,
                   meta: dict, first: int) -> PositionPlan:
    """Queries i >= first see key j at relative position rel(i, j) (q at i, key at i - rel); one KeyView per query."""
    pos = _arange(n)
    views = []
    for i in range(first, n):
        rows = torch.zeros(n, dtype=torch.bool)
        rows[i] = True
        views.append(KeyView(rows, float(i) - rel(torch.tensor(float(i), dtype=torch.float64), pos), name=f"q{i}"))
    return PositionPlan(pos, pos.clone(), views=tuple(views), label=label, meta=meta)


def self_extend(n: int, group: int, window: int) -> PositionPlan:
    """Self-Extend (Jin et al. 2024): rel = i - j if i - j < W else i//G - j//G + W - W//G (the shift meets at W)."""
    if group < 1 or window < 1:
        raise ValueError(f"group and window must be >= 1; got {group}, {window}")

    def rel(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        d = i - j
        grouped = torch.div(i, group, rounding_mode="floor") - torch.div(j, group, rounding_mode="floor") \
            + window - window // group
        return torch.where(d < window, d, grouped)

    meta = {"preset": "self_extend", "group": group, "window": window}
    return per_query_plan(n, rel, f"self-extend:G{group},W{window}", meta, first=window)


def rerope(n: int, window: int) -> PositionPlan:
    """ReRoPE (Su 2023): relative positions clipped, rel = min(i - j, w)."""
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    return per_query_plan(n, lambda i, j: torch.clamp(i - j, max=float(window)), f"rerope:{window}",
                          {"preset": "rerope", "window": window}, first=window + 1)


def _check_string(offset: int, window: int) -> None:
    if offset < 1 or window < 0 or window > offset:
        raise ValueError(f"STRING needs offset >= 1 and 0 <= window <= offset; got offset {offset}, window {window}")


def string(n: int, offset: int, window: int = 128) -> PositionPlan:
    """STRING (An et al., ICLR 2025): relative positions from `offset` S on are shifted down onto the well-trained
    ones, starting at the local window W: rel = i - j if i - j < S, else i - j - S + W (the S-th diagonal gets W, so
    the nearest W positions stay each query's own)."""
    _check_string(offset, window)
    shift = float(offset - window)
    meta = {"preset": "string", "offset": offset, "window": window}
    return per_query_plan(n, lambda i, j: torch.where(i - j >= offset, i - j - shift, i - j),
                          f"string:S{offset},W{window}", meta, first=offset)


def streaming(n: int, sink: int, window: int) -> PositionPlan:
    """StreamingLLM (Xiao et al. 2023): query i keeps the `sink` first keys and the last `window` keys (itself incl.).

    Positions are cache slots: sinks 0..S-1, recent key j at S + j - (i - W + 1), query at S + W - 1, so
    recent keys keep rel = i - j and sink j gets rel = S + W - 1 - j. Evicted keys (S <= j <= i - W)
    are masked by `apply_plan` (meta["keep"] = [sink, window]).
    """
    if sink < 0 or window < 1:
        raise ValueError(f"need sink >= 0 and window >= 1; got {sink}, {window}")

    def rel(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return torch.where(j < sink, sink + window - 1 - j, i - j)

    meta = {"preset": "streaming", "sink": sink, "window": window, "keep": [sink, window]}
    return per_query_plan(n, rel, f"streaming:S{sink},W{window}", meta, first=sink + window)


def evicted(i: torch.Tensor, j: torch.Tensor, sink: int, window: int) -> Bool[torch.Tensor, "query_pos key_pos"]:
    """True where StreamingLLM has dropped key j from query i's cache: sink <= j <= i - window."""
    return (j[None, :] >= sink) & (j[None, :] <= i[:, None] - window)


@contextmanager
def apply_plan(model: Any, plan: PositionPlan) -> Iterator[PositionPlan]:
    """`rope_positions(model, plan)` plus meta["score_scale"] (YaRN temperature) and meta["keep"] (eviction).

    Args:
        model: a TransformerLens model with rotary layers (as `load_model` returns). A score edit (scale or
            eviction) on a model whose attention runs inside Hugging Face's own module is a NotImplementedError.
        plan: the positions to apply. `plan.meta["score_scale"]` (default 1.0) multiplies the attention scores of
            the rotary layers; `plan.meta["keep"] = (sink, window)` masks the keys StreamingLLM has evicted
            (sink <= j <= i - window) in every layer of `plan.layers` (None: all layers).

    Yields:
        The plan in force, within the `with` block.
    """
    scale = float(plan.meta.get("score_scale", 1.0))
    keep = plan.meta.get("keep")
    if (scale != 1.0 or keep is not None) and not score_edits_apply(model):
        what = "YaRN's attention temperature" if scale != 1.0 else "StreamingLLM's eviction"
        raise NotImplementedError(f"{what} edits the attention scores, but {model_name(model)}'s attention runs "
                                  "inside Hugging Face's own module, where an edit of the scores does not reach its "
                                  "output")
    with rope_positions(model, plan):
        if scale == 1.0 and keep is None:
            yield plan
            return

        # As HF applies YaRN's factor through cos/sin, only rotary layers are scaled; eviction applies everywhere.
        rotary = set(model_facts(model).rotary_layers)

        def hook_for(layer: int) -> Any:
            s = scale if layer in rotary else 1.0

            def hook(scores: torch.Tensor, hook: Any) -> torch.Tensor:
                out = scores * s if s != 1.0 else scores
                if keep is not None:
                    n_q, total = scores.shape[-2], scores.shape[-1]
                    i = torch.arange(total - n_q, total, device=scores.device)
                    gone = evicted(i, torch.arange(total, device=scores.device), int(keep[0]), int(keep[1]))
                    out = out.masked_fill(gone, float("-inf"))
                return out

            return hook

        layers = plan.layers if plan.layers is not None else range(n_layers(model))
        layers = [l for l in layers if keep is not None or l in rotary]
        with hooked(model, [(hook_name("scores", l), hook_for(l)) for l in layers]):
            yield plan


def hf_scaled(model: Any, n: int, params: dict) -> PositionPlan:
    """HF's own rope scaling `params` (`rope_type` and HF's keys) applied to a loaded model at inference, exactly as
    a config carrying them would: per rotary layer HF's table for `n` tokens (dynamic grows with n) and its cos/sin
    multiplier, positions unchanged."""
    facts = model_facts(model)
    require_rotary(facts, "Hugging Face rope scaling")
    rot = {l: scaled_rotary_spec(model, l, params, n) for l in facts.rotary_layers}
    label = "hf-" + str(params["rope_type"])
    return replace(PositionPlan.default(n, label=label), rotary=rot, meta={"preset": label, **params})


def identity_plan(n: int) -> PositionPlan:
    """Preset "none": every token at its own position."""
    return PositionPlan.default(n, label="none")


# ---- Pairwise (relative) form of the presets --------------------------------------------------------------
# A KeyView per query is exact but O(n) views and an n x n score tensor per view: fine for a few hundred
# tokens, hopeless at 16k. The same presets as a small set of (query position, key position) rules plus a
# per-pair selector let an engine work in query chunks (posprobe.core.long_engine). Every constant below
# is the one of the plan builder above; tests check that both forms give the same relative position for
# every (query, key) pair.

PosFn = Callable[[torch.Tensor], torch.Tensor]


def _same(p: torch.Tensor) -> torch.Tensor:
    return p


def _const(value: float) -> PosFn:
    return lambda p: torch.full_like(p, float(value))


@dataclass(frozen=True)
class PairRule:
    """A preset as rotation rules per (query i, key j) pair, in tokens.

    `views[v] = (q_pos, k_pos)` map query / key indices to rotation positions; `select(i, j)` gives, per
    pair, the view whose rotated q.k is the score (-1: the key is dropped, e.g. StreamingLLM eviction);
    None means view 0 everywhere. `rotary` maps a layer's RotarySpec to the preset's (None: unchanged),
    `score_scale` multiplies the pre-softmax scores (YaRN temperature). `identity` marks preset "none".
    `hf_rope` replaces each layer's rope parameters as an HF config would (the frequencies then depend on the model
    and, for "dynamic", on the input's length: the engine asks HF's own functions per layer and length).
    """

    label: str
    views: tuple[tuple[PosFn, PosFn], ...] = ((_same, _same),)
    select: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    rotary: Callable[[RotarySpec], RotarySpec] | None = None
    score_scale: float = 1.0
    identity: bool = False
    meta: dict = field(default_factory=dict)
    #: HF rope parameters (`rope_type` and its keys) that replace each rotary layer's own, as HF's config would
    #: set them (the `hf-*` presets); None keeps the model's.
    hf_rope: tuple[tuple[str, Any], ...] | None = None

    def relative(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """`[query, key]` relative position q_pos - k_pos of the selected view (NaN where dropped)."""
        i, j = i.to(torch.float64), j.to(torch.float64)
        rel = [q(i)[:, None] - k(j)[None, :] for q, k in self.views]
        if self.select is None:
            return rel[0]
        sel = self.select(i, j)
        out = torch.full(sel.shape, float("nan"), dtype=torch.float64)
        for v, r in enumerate(rel):
            out = torch.where(sel == v, r, out)
        return out


def self_extend_pairs(group: int, window: int) -> PairRule:
    """Self-Extend: neighbours (i - j < W) at their own positions; farther keys at j // G, the query at
    i // G + W - W // G, so rel = i//G - j//G + W - W//G as in `self_extend`."""
    if group < 1 or window < 1:
        raise ValueError(f"group and window must be >= 1; got {group}, {window}")
    grouped = (lambda i: torch.div(i, group, rounding_mode="floor") + window - window // group,
               lambda j: torch.div(j, group, rounding_mode="floor"))
    return PairRule(f"self-extend:G{group},W{window}", ((_same, _same), grouped),
                    select=lambda i, j: (i[:, None] - j[None, :] >= window).long(),
                    meta={"preset": "self_extend", "group": group, "window": window})


def rerope_pairs(window: int) -> PairRule:
    """ReRoPE: rel = min(i - j, w): pairs at distance >= w use the query at w and the key at 0."""
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    return PairRule(f"rerope:{window}", ((_same, _same), (_const(window), _const(0.0))),
                    select=lambda i, j: (i[:, None] - j[None, :] >= window).long(),
                    meta={"preset": "rerope", "window": window})


def string_pairs(offset: int, window: int = 128) -> PairRule:
    """STRING: pairs at distance >= S use the query moved back by S - W (rel = i - j - S + W), as in `string`."""
    _check_string(offset, window)
    shift = float(offset - window)
    return PairRule(f"string:S{offset},W{window}", ((_same, _same), (lambda i: i - shift, _same)),
                    select=lambda i, j: (i[:, None] - j[None, :] >= offset).long(),
                    meta={"preset": "string", "offset": offset, "window": window})


def streaming_pairs(sink: int, window: int) -> PairRule:
    """StreamingLLM: recent keys at their positions, sinks j < S (queries i >= S + W) at rel S + W - 1 - j,
    evicted keys (`evicted`) dropped, as in `streaming`."""
    if sink < 0 or window < 1:
        raise ValueError(f"need sink >= 0 and window >= 1; got {sink}, {window}")

    def select(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        sel = ((j[None, :] < sink) & (i[:, None] >= sink + window)).long()
        return sel.masked_fill(evicted(i, j, sink, window), -1)

    return PairRule(f"streaming:S{sink},W{window}", ((_same, _same), (_const(sink + window - 1), _same)),
                    select=select, meta={"preset": "streaming", "sink": sink, "window": window})


def p_rope_rotary(spec: RotarySpec, p: float) -> RotarySpec:
    """p-RoPE on one layer: remove the round((1 - p) * bands) slowest bands."""
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1]; got {p}")
    return drop_rotary(spec, round((1 - p) * spec.n_bands), 0)


def hf_scaled_pairs(params: dict) -> PairRule:
    """`hf_scaled` per pair: positions kept, each layer's table from HF's functions for the rope `params`."""
    label = "hf-" + str(params["rope_type"])
    return PairRule(label, hf_rope=tuple(sorted(params.items())), meta={"preset": label, **params})


def identity_pairs() -> PairRule:
    """Preset "none" (the model's own forward runs; the engine is never entered)."""
    return PairRule("none", identity=True, meta={"preset": "none"})


def shift_pairs(k: float) -> PairRule:
    """q = k = i + k for every pair."""
    return PairRule(f"shift:{k:g}", ((lambda p: p + k, lambda p: p + k),), meta={"preset": "shift", "k": k})


def pi_pairs(scale: float) -> PairRule:
    """Position Interpolation: q = k = i / s for every pair."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0; got {scale}")
    return PairRule(
        f"pi:{scale:g}", ((lambda p: p / scale, lambda p: p / scale),), meta={"preset": "pi", "scale": scale}
    )


def ntk_pairs(scale: float) -> PairRule:
    """NTK-aware scaling: positions kept, each layer's base changed by `ntk_rotary`."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0; got {scale}")
    return PairRule(f"ntk:{scale:g}", rotary=lambda s: ntk_rotary(s, scale), meta={"preset": "ntk", "scale": scale})


def yarn_pairs(scale: float, original_ctx: int, beta_fast: float = 32.0, beta_slow: float = 1.0) -> PairRule:
    """YaRN: `yarn_rotary` frequencies and the `yarn_score_scale` temperature, positions kept."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0; got {scale}")
    return PairRule(f"yarn:{scale:g}", rotary=lambda s: yarn_rotary(s, scale, original_ctx, beta_fast, beta_slow),
                    score_scale=yarn_score_scale(scale),
                    meta={"preset": "yarn", "scale": scale, "original_ctx": original_ctx, "beta_fast": beta_fast,
                          "beta_slow": beta_slow})


def p_rope_pairs(p: float) -> PairRule:
    """p-RoPE: `p_rope_rotary` in every layer, positions kept."""
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1]; got {p}")
    return PairRule(f"p-rope:{p:g}", rotary=lambda s: p_rope_rotary(s, p), meta={"preset": "p_rope", "p": p})


def drop_pairs(lowest: int, highest: int) -> PairRule:
    """`drop_rotary` in every layer, positions kept."""
    return PairRule(f"drop:low{lowest},high{highest}", rotary=lambda s: drop_rotary(s, lowest, highest),
                    meta={"preset": "drop_frequencies", "lowest": lowest, "highest": highest})


def plan_pairs(plan: PositionPlan) -> PairRule:
    """A one-sequence PositionPlan as a PairRule over the tokens it covers (indices 0..len-1): view 0 is the plan's
    own (q_pos, k_pos); each KeyView is one more view, selected for its query rows (the last view listing a row
    wins, as `rope_positions` applies views in order). Plans with per-layer limits or rotary overrides are refused:
    a PairRule applies to every layer with its own frequencies."""
    if plan.layers is not None or plan.rotary:
        raise ValueError(f"plan {plan.label!r} limits layers or overrides frequencies; only positions convert to a "
                         "PairRule")
    if plan.q_pos.dim() != 1:
        raise ValueError(f"plan {plan.label!r} is batched ({tuple(plan.q_pos.shape)}); give one sequence's plan")
    q, k = plan.q_pos.to(torch.float64), plan.k_pos.to(torch.float64)

    def at(table: torch.Tensor) -> PosFn:
        return lambda p: table[p.long()]

    views = ((at(q), at(k)), *((at(q), at(v.k_pos.to(torch.float64))) for v in plan.views))
    select = None
    if plan.views:
        which = torch.zeros(len(plan), dtype=torch.long)
        for n_view, v in enumerate(plan.views, start=1):
            which[v.queries] = n_view

        def select(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            return which[i.long()][:, None].expand(len(i), len(j))

    return PairRule(plan.label, views, select=select, meta={"preset": "plan", **dict(plan.meta)})
