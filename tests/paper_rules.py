"""The surgery presets as their papers state them, and a decoder forward that applies them pair by pair.

Independent of posprobe: the relative position each preset gives query i and key j is written out from the papers'
formulas (plain Python on integers), and `pairwise_logits` runs a Hugging Face Llama-style decoder (Llama, SmolLM3)
with its own modules for everything but the attention scores, which it computes in plain float64 torch: q_i turned
by rel(i, j) against the unrotated k_j (RoPE's score depends on the two positions only through their difference),
with the inverse frequencies given (HF's table, or a paper's change of it), the layer's own scaling, a score factor,
and dropped pairs (rel NaN) masked. The identity tests of the long-context engine and the per-query plans compare
against it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def self_extend(i: int, j: int, group: int, window: int) -> int:
    """Jin et al. 2024 (Eq. 3): neighbours exact, farther keys grouped by G and shifted so the two meet at W."""
    return i - j if i - j < window else i // group - j // group + window - window // group


def rerope(i: int, j: int, window: int) -> int:
    """Su 2023: relative positions clipped at W."""
    return min(i - j, window)


def string(i: int, j: int, offset: int, window: int) -> int:
    """An et al. 2025: distances from S on moved down by S - W."""
    return i - j - offset + window if i - j >= offset else i - j


def streaming(i: int, j: int, sink: int, window: int) -> int | None:
    """Xiao et al. 2023: the cache holds S sinks and the last W tokens at consecutive slots; None = evicted."""
    if j < sink:
        return sink + window - 1 - j if i >= sink + window else i - j
    return None if j <= i - window else i - j


def t5_bucket(rel: int, num_buckets: int, max_distance: int) -> int:
    """T5's causal bucket of key-minus-query offset `rel` (Raffel et al. 2020; Mesh TensorFlow's
    `_relative_position_bucket`, unidirectional): a key d = max(0, -rel) tokens back gets bucket d while d is below
    half the buckets, then logarithmically wider buckets up to `max_distance`, beyond which all share the last."""
    d = max(0, -rel)
    exact = num_buckets // 2
    if d < exact:
        return d
    wide = math.log(d / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    return min(num_buckets - 1, exact + int(wide))


def relative_table(n: int, rule: Callable[[int, int], float | None]) -> torch.Tensor:
    """`[query, key]` float64 table of rule(i, j) for j <= i; NaN above the diagonal and where the rule drops j."""
    out = torch.full((n, n), float("nan"), dtype=torch.float64)
    for i in range(n):
        for j in range(i + 1):
            r = rule(i, j)
            if r is not None:
                out[i, j] = float(r)
    return out


def plan_relative(q_pos: torch.Tensor, k_pos: torch.Tensor, views=()) -> torch.Tensor:
    """`[query, key]` float64 q_pos[i] - k_pos[j] of one sequence's position plan, each query through the last
    KeyView listing it (the order in which position control applies them)."""
    q, k = q_pos.double(), k_pos.double()
    rel = q[:, None] - k[None, :]
    for v in views:
        rows = v.queries.nonzero()[:, 0]
        rel[rows] = q[rows, None] - v.k_pos.double()[None, :]
    return rel


def rope_of(cfg) -> tuple[float, int]:
    """(rope_theta, head dim) of a Llama-style HF config, as the config states them."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return float(cfg.rope_parameters["rope_theta"]), d


def yarn_multiplier(band: int, d: int, base: float, s: float, original: int, fast: float = 32.0,
                    slow: float = 1.0) -> float:
    """Peng et al. 2023 (Eqs. 17-20): r = L / lambda, ramp gamma between alpha = slow and beta = fast, h(theta) =
    (1 - gamma) theta / s + gamma theta: the factor by which the band's angle per token shrinks, theta / h(theta)."""
    lam = 2 * math.pi * base ** (2 * band / d)
    r = original / lam
    gamma = 0.0 if r < slow else 1.0 if r > fast else (r - slow) / (fast - slow)
    return 1.0 / ((1 - gamma) / s + gamma)


def yarn_temperature(s: float) -> float:
    """Peng et al. 2023: sqrt(1/t) = 0.1 ln(s) + 1 multiplies q and k, so the scores by its square."""
    return (0.1 * math.log(s) + 1.0) ** 2 if s > 1 else 1.0


def inv_freq(base: float, d: int) -> torch.Tensor:
    """RoPE's angle per token of each band, base^(-2b/d) (Su et al. 2021), float64."""
    return base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def pairwise_logits(hf, ids: torch.Tensor, rel: torch.Tensor | Callable[[int], torch.Tensor], *,
                    freqs: Callable[[int], torch.Tensor | None],
                    score_factor: Callable[[int], float] = lambda layer: 1.0,
                    masked: dict[int, tuple[int, ...]] | None = None,
                    weights: dict[int, torch.Tensor] | None = None, window: int | None = None) -> torch.Tensor:
    """`[pos, vocab]` logits of a Hugging Face Llama-style decoder (half-split RoPE) for one sequence `ids` `[pos]`,
    where layer l's query i scores key j at relative position rel[i, j] (or rel(l)[i, j]) with angles rel * freqs(l)
    (freqs None: a NoPE layer, no rotation), times the layer's own scaling and score_factor(l). NaN in rel drops the
    key. `masked[l]` lists query heads whose output is zeroed before o_proj; `weights`, when given, receives each
    layer's attention weights `[head, query, key]` (float64). `window`: each query sees only its last `window` keys
    (itself included), as a sliding-window layer does."""
    m = hf.model
    n = ids.shape[-1]
    cfg = hf.config
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if window:
        causal &= ~torch.ones(n, n, dtype=torch.bool).tril(-window)
    rel_of = rel if callable(rel) else (lambda layer: rel)
    with torch.no_grad():
        h = m.embed_tokens(ids[None])
        for layer_idx, layer in enumerate(m.layers):
            attn = layer.self_attn
            r = rel_of(layer_idx).to(torch.float64)
            keep = causal & ~r.isnan()
            rel0 = r.nan_to_num(0.0)
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(n, n_heads, hd).transpose(0, 1).double()  # head pos d
            k = attn.k_proj(x).view(n, n_kv, hd).transpose(0, 1).double().repeat_interleave(n_heads // n_kv, 0)
            v = attn.v_proj(x).view(n, n_kv, hd).transpose(0, 1).double().repeat_interleave(n_heads // n_kv, 0)
            f = freqs(layer_idx)
            if f is None:
                scores = q @ k.transpose(-1, -2)
            else:
                ang = rel0[..., None] * f  # query key band
                cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
                scores = (torch.einsum("hid,ijd,hjd->hij", q, cos, k)
                          + torch.einsum("hid,ijd,hjd->hij", _rotate_half(q), sin, k))
            scores = scores * float(attn.scaling) * score_factor(layer_idx)
            p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
            if weights is not None:
                weights[layer_idx] = p
            o = p @ v
            for head in (masked or {}).get(layer_idx, ()):
                o[head] = 0
            out = o.transpose(0, 1).reshape(1, n, n_heads * hd).to(h.dtype)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return hf.lm_head(m.norm(h))[0]


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """-log p(token t+1 | tokens <= t), nats, t = 0..pos-2."""
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -lp.gather(-1, ids[1:, None])[:, 0]


def preset_reference(spec: str, n: int, cfg) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(rel table `[n, n]`, angle per token of each band, score factor of the rotary layers) for a preset spec as
    posprobe's CLI writes it ("self-extend:group=2,window=6") on a model with HF config `cfg`, from the papers'
    formulas above."""
    base, d = rope_of(cfg)
    name, _, args = spec.partition(":")
    a = {k: float(v) for k, v in (kv.split("=") for kv in args.split(",") if kv)}
    f, factor = inv_freq(base, d), 1.0
    rule: Callable[[int, int], float | None] = lambda i, j: i - j  # none, shift (RoPE sees differences only)
    if name == "pi":
        rule = lambda i, j: (i - j) / a["scale"]  # noqa: E731
    elif name == "ntk":
        f = inv_freq(base * a["scale"] ** (d / (d - 2)), d)
    elif name == "yarn":
        s, original = a["scale"], int(a["original"])
        mult = [yarn_multiplier(b, d, base, s, original, a.get("beta_fast", 32.0), a.get("beta_slow", 1.0))
                for b in range(d // 2)]
        f = f / torch.tensor(mult, dtype=torch.float64)
        factor = yarn_temperature(s)
    elif name == "self-extend":
        rule = lambda i, j: self_extend(i, j, int(a["group"]), int(a["window"]))  # noqa: E731
    elif name == "rerope":
        rule = lambda i, j: rerope(i, j, int(a["window"]))  # noqa: E731
    elif name == "string":
        rule = lambda i, j: string(i, j, int(a["offset"]), int(a.get("window", 128)))  # noqa: E731
    elif name == "streaming":
        rule = lambda i, j: streaming(i, j, int(a["sink"]), int(a["window"]))  # noqa: E731
    elif name not in ("none", "shift"):
        raise ValueError(f"no paper reference for preset {spec!r}")
    return relative_table(n, rule), f, factor
