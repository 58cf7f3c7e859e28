"""Word/position cross-term decomposition of pre-softmax attention scores (Ke et al. 2021, TUPE).

The attention input of one layer is split into additive parts; each part goes through the layer's
LayerNorm with the per-token scale frozen at the model's own value (so the norm is linear), then
through W_Q / W_K (and the layer's RoPE rotation, which is linear too). A score is bilinear in
(query vector, key vector), so the pair terms sum exactly to the model's attention scores (capture point `scores`) on
every unmasked entry. A pair term is named query part + key part ("wp" = word query, position key).

Parts of the exact layer-0 split (models that add learned position embeddings to token embeddings):
  w  token (word) embedding, centred
  p  position embedding, centred
  t  BERT only: token-type (segment) embedding, centred. The model is run with one segment
     (token_type_ids = 0), so this is the same vector at every token: it carries neither word nor
     position identity and is grouped with the constant parts under "bias". (After the frozen norm
     it differs between tokens only through the per-token scale, like every other part.)
  n  the norm's bias b_ln (constant vector; absent after TL's LN folding, which moves it into b_Q)
  b  b_Q on the query side, b_K on the key side
For BERT the split is taken at the embedding LayerNorm, whose output is the layer-0 attention
input (BERT blocks are post-LN: attention reads resid_pre directly).

Parts of the data-driven split of any layer's resid_pre h[c, t] (sequence c, position t), given
the corpus mean mu[t] of resid_pre at each position (Song & Zhong 2023):
  m  global mean       g = mean over the corpus positions of mu[t]
  p  positional part   mu[t] - g
  c  context part      mean over t of (h[c, t] - mu[t]) in the analysed sequence (one vector per
                       sequence; uses the whole sequence, so it is descriptive, not causal)
  r  remainder         h - g - (mu[t] - g) - c   (token identity and everything else)
  n, b                 as above
Grouped terms: "ww", "wp", "pw", "pp" (layer 0) or the nine pairs of {p, c, r} (data-driven),
"mean" = pairs with the global mean m and no bias part (data-driven only), and "bias" = every pair
that involves a constant part: t, n or b. `terms(detail=True)` keeps every pair apart ("tw", "nb").
ALiBi models (data-driven): q.k of the parts plus "alibi", the model's distance bias: -slope * (i - j) with each
head's slope measured from the model (backend.families.alibi), plus the per-query-row constant the model adds with
it (softmax ignores it; measured as the row mean of what q.k and the penalty leave). Stored as the pair of a
pseudo-part "a" with itself, so the terms still sum to the scores; the check then proves the penalty explains every
within-row difference.
T5-bias models (data-driven): q.k of the parts (unscaled, T5's convention) plus "relative_bias", the learned bias of
each pair's offset bucket read from the model's own table (backend.t5_decoder), the same pseudo-part "a"; it needs no
row constant, so the check proves the table explains the scores exactly.
Each family computes its own term (`Family.score_bias`, in `backend.families`, reached through
`backend.hooks.score_bias`): a new family that biases scores sets `score_term` and `score_bias` on its `FAMILY` and
changes nothing here.

Model internals (weights, norms, hook points) are read only through `posprobe.backend`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import einops
import pandas as pd
import torch
from jaxtyping import Float, Int

from posprobe.analyses.configs import DecomposeConfig
from posprobe.analyses.sections import AtlasSection, CompareRun, ModelEntry, register
from posprobe.backend.facts import WrongModelKind, model_facts, require_supported
from posprobe.backend.families import alibi, find, relative
from posprobe.backend.hooks import (
    attention_scores,
    kept_pairs,
    kept_scores,
    layer_rotary_spec,
    rotate_at,
    score_bias,
    scores_hook_is_pattern,
)
from posprobe.backend.model import (
    NormSpec,
    device_of,
    embedding_norm,
    embedding_points,
    encode_text,
    n_layers,
    pre_attention_norm,
    qk_weights,
    scores_not_bilinear,
    special_tokens,
    tokenizer_of,
)
from posprobe.core.capture import batches, capture, mean_by_position, stream
from posprobe.data import BUILTIN_TEXT, framed_windows
from posprobe.report import decompose as decompose_report
from posprobe.report.decompose import summary_table
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256

# Parts that are the same vector at every token (before the frozen norm's per-token scale).
BIAS_PARTS = frozenset("tnb")
EXACT_TERMS = ("ww", "wp", "pw", "pp", "bias")
DATA_TERMS = ("pp", "pc", "pr", "cp", "cc", "cr", "rp", "rc", "rr", "mean", "bias")
#: ALiBi models: the distance bias (with the model's per-row constant), a term with a position part.
ALIBI_TERM = alibi.FAMILY.score_term
#: T5-bias models: the learned bias of each pair's offset bucket, a term with a position part.
BUCKET_TERM = relative.FAMILY.score_term
# The four TUPE-style maps; in the data-driven split the remainder r plays the word's role.
HEATMAP_TERMS = {"exact-layer0": ("ww", "wp", "pw", "pp"), "data-driven": ("rr", "rp", "pr", "pp")}


@dataclass(frozen=True)
class Decomposition:
    """One layer's pre-softmax scores split into pair terms (see the module docstring).

    `pairs[i, j]` is the score contribution of query part `parts[i]` with key part `parts[j]`
    (float64, same units as the model's scores: q.k / attn_scale). `scores` is the model's own
    pre-softmax scores (-inf on masked entries). Values of `pairs` on masked entries are what the
    parts would give; the model never uses them.
    """

    model: str
    layer: int
    method: str
    parts: tuple[str, ...]
    pairs: Float[torch.Tensor, "q_part k_part batch head_index query_pos key_pos"]
    scores: Float[torch.Tensor, "batch head_index query_pos key_pos"]
    tokens: Int[torch.Tensor, "batch pos"]
    meta: dict = field(default_factory=dict)

    @property
    def allowed(self) -> torch.Tensor:
        """bool `[batch head_index query_pos key_pos]`: entries the model does not mask."""
        return torch.isfinite(self.scores)

    def term_names(self, detail: bool = False) -> tuple[str, ...]:
        """Grouped term names in display order, or every pair name (`detail=True`)."""
        if detail:
            return tuple(a + b for a in self.parts for b in self.parts if "a" not in a + b or a + b == "aa")
        names = EXACT_TERMS if self.method == "exact-layer0" else DATA_TERMS
        return names + (self.bias_term,) if "a" in self.parts else names

    @property
    def bias_term(self) -> str:
        """The name of the family's score bias, pseudo-part "a" with itself ("alibi" or "relative_bias")."""
        return str(self.meta.get("bias_term", ALIBI_TERM))

    def terms(self, detail: bool = False) -> dict[str, Float[torch.Tensor, "batch head_index query_pos key_pos"]]:
        """{term: float64 score contribution}; grouped (see module docstring) or per pair ("wp", "mb", ...)."""
        out = {t: torch.zeros_like(self.pairs[0, 0]) for t in self.term_names(detail)}
        for i, a in enumerate(self.parts):
            for j, b in enumerate(self.parts):
                if ("a" in a + b) and a + b != "aa":
                    continue  # the ALiBi pseudo-part pairs with nothing but itself
                out[self.bias_term if a + b == "aa" and not detail else _group(a + b, detail)] += self.pairs[i, j]
        return out

    def reconstructed(self) -> Float[torch.Tensor, "batch head_index query_pos key_pos"]:
        """Sum of all terms (float64), -inf where the model masks."""
        return self.pairs.sum((0, 1)).masked_fill(~self.allowed, -math.inf)

    def max_error(self) -> float:
        """Largest |sum of terms - model score| over unmasked entries (score units)."""
        ok = self.allowed
        return float((self.reconstructed()[ok] - self.scores.to(torch.float64)[ok]).abs().max())

    def frame(self, batch: int = 0, heads: Sequence[int] | None = None, detail: bool = False) -> pd.DataFrame:
        """Tidy rows (model, layer, head, query_pos, key_pos, rel_pos, term, value) for unmasked entries
        of one sequence; value in score units."""
        heads = range(self.scores.shape[1]) if heads is None else heads
        rows = []
        for term, t in self.terms(detail).items():
            for h in heads:
                qi, ki = torch.nonzero(self.allowed[batch, h], as_tuple=True)
                rows.append(pd.DataFrame({
                    "model": self.model, "layer": self.layer, "head": int(h), "query_pos": qi.numpy(),
                    "key_pos": ki.numpy(), "rel_pos": (qi - ki).numpy(), "term": term,
                    "value": t[batch, h][qi, ki].numpy(),
                }))
        return pd.concat(rows, ignore_index=True)


def _group(pair: str, detail: bool) -> str:
    if detail:
        return pair
    if pair == "aa":
        return ALIBI_TERM
    return "bias" if BIAS_PARTS.intersection(pair) else "mean" if "m" in pair else pair


def _decompositions(facts: Any) -> tuple[str, ...]:
    # The decompose methods whose score terms exist for this positional family (its adapter says; none unknown).
    fam = find(facts.positional_kind)
    return () if fam is None else fam.decompositions


def _check_linear(model: Any, layer: int) -> None:
    # Everything after the frozen norm must be linear in the input for the split to be exact.
    reason = scores_not_bilinear(model)
    if reason is not None:
        raise NotImplementedError(f"{model_facts(model).name} {reason}, so the score terms would not add up")
    if not 0 <= layer < n_layers(model):
        raise ValueError(f"Layer {layer} out of range for a {n_layers(model)}-layer model")


def _as_tokens(tokens: Any) -> torch.Tensor:
    t = torch.as_tensor(tokens)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[1] < 1 or t.shape[0] < 1:
        raise ValueError(f"Expected tokens [batch, pos], got shape {tuple(t.shape)}")
    return t


def _capture(model: Any, tokens: torch.Tensor, points: Sequence[str], layer: int) -> dict[str, torch.Tensor]:
    # The maths below runs on the CPU (float64), wherever the model lives.
    derive = "scores" in points and scores_hook_is_pattern(model)
    if derive:  # the hook carries the pattern (TL delegates the attention to HF's module): rebuild the scores from
        # this layer's q and k, turned to their own positions on a RoPE layer, and mask the pairs the layer drops.
        points = [p for p in points if p != "scores"] + ["q", "k"]
    got = capture(model, tokens.to(device_of(model)), list(dict.fromkeys(points)), layers=[layer])
    out = {p: x.cpu() for (p, _), x in got.items()}
    if derive:
        q, k = got[("q", layer)], got[("k", layer)]
        if layer in model_facts(model).rotary_layers:
            q, k = (_own_rotation(model, layer, x) for x in (q, k))
        s = attention_scores(model, layer, q, k).cpu()
        out["scores"] = s.masked_fill(~kept_pairs(model, layer, s.shape[-2], s.shape[-1]), float("-inf"))
    elif "scores" in out:  # masked entries as -inf on every backend (a bridge fills the dtype's minimum)
        s = out["scores"]
        out["scores"] = s.masked_fill(~kept_scores(model, s), float("-inf"))
    return out


def _own_rotation(model: Any, layer: int, x: torch.Tensor) -> torch.Tensor:
    # Each token to its own position with the layer's rotation for an input this long (dynamic / longrope RoPE switch
    # tables with the length), in the model's own recipe.
    n = x.shape[1]
    return rotate_at(model, layer, x, torch.arange(n, dtype=torch.float64), layer_rotary_spec(model, layer, n), n)


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", torch.float64)


def _frozen_norm(
    norm: NormSpec | None, parts: dict[str, torch.Tensor], scale: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Push each part through `norm` with its per-token scale frozen; adds the norm's bias to part "n"."""
    if norm is None:  # the attention reads these vectors directly (BERT's post-LN blocks)
        return dict(parts)
    s = _f64(scale)
    w = None if norm.weight is None else _f64(norm.weight)
    out = {}
    for key, x in parts.items():
        x = x - x.mean(-1, keepdim=True) if norm.centre else x
        x = x / s
        out[key] = x * w if w is not None else x
    if norm.bias is not None:
        b = _f64(norm.bias)
        out["n"] = out["n"] + b if "n" in out else b.expand_as(next(iter(out.values())))
    return out


def _pair_scores(
    model: Any, layer: int, parts: dict[str, torch.Tensor], rotated: bool,
) -> tuple[tuple[str, ...], torch.Tensor]:
    """Scores of every (query part, key part) pair, with the layer's b_Q/b_K as part "b"; with `rotated`, q and k
    turned to their own positions by the layer's rotation."""
    W_Q, b_Q, W_K, b_K = (_f64(t) for t in qk_weights(model, layer))
    names = tuple(parts) + ("b",)
    x0 = next(iter(parts.values()))
    batch, pos = x0.shape[:2]
    q = {n: einops.einsum(x, W_Q, "b p d, h d e -> b p h e") for n, x in parts.items()}
    k = {n: einops.einsum(x, W_K, "b p d, h d e -> b p h e") for n, x in parts.items()}
    q["b"] = b_Q.expand(batch, pos, *b_Q.shape)
    k["b"] = b_K.expand(batch, pos, *b_K.shape)
    if rotated:
        # The layer's own rotation recipe (on a bridge HF's float32 cos/sin): linear, so the parts still add up.
        q = {n: _own_rotation(model, layer, v) for n, v in q.items()}
        k = {n: _own_rotation(model, layer, v) for n, v in k.items()}
    pairs = torch.stack([torch.stack([attention_scores(model, layer, q[x], k[y]) for y in names]) for x in names])
    return names, pairs


@torch.no_grad()
def decompose_layer0(model: Any, tokens: Int[torch.Tensor, "batch pos"]) -> Decomposition:
    """Exact layer-0 split of the scores into word/position/bias pair terms (float64, score units).

    Learned-absolute models only (GPT-2-like decoders; BERT-like encoders at the embedding LayerNorm,
    with the one-segment token-type embedding as its own part "t", grouped under "bias").
    Works with raw and TL-processed (folded LN, centred) weights. RoPE models raise WrongModelKind.

    Args:
        model: a learned-absolute TransformerLens model.
        tokens: the token ids, `[batch, pos]`.

    Returns:
        A `Decomposition` of layer 0 with parts w, p (and t), float64 pair terms in score units that sum to
            the model's scores.
    """
    facts = model_facts(model)
    require_supported(facts, "The score decomposition")
    if "exact-layer0" not in _decompositions(facts):
        raise WrongModelKind(
            f"The exact layer-0 split needs position embeddings added to the token embeddings, but {facts.name} "
            f"uses {facts.positional_kind} positions; use the data-driven split decompose_layer(model, tokens, "
            "layer, positional_mean) instead"
        )
    _check_linear(model, 0)
    tokens = _as_tokens(tokens)
    where = embedding_points(model)
    # Embedding-side norm (BERT) and/or the block's own pre-attention norm (pre-LN decoders), in order.
    norms = [n for n in (embedding_norm(model), pre_attention_norm(model, 0)) if n is not None]
    got = _capture(model, tokens, [*where.values(), "scores", *(n.scale_point for n in norms)], 0)
    word = _f64(got[where["word"]])
    parts = {"w": word, "p": _f64(got[where["position"]]).expand_as(word)}
    if "token_type" in where:
        parts["t"] = _f64(got[where["token_type"]]).expand_as(word)
    for norm in norms:
        parts = _frozen_norm(norm, parts, got[norm.scale_point])
    part_names, pairs = _pair_scores(model, 0, parts, False)
    meta = {"constant_parts": sorted(BIAS_PARTS.intersection(part_names))}
    if "t" in part_names:
        meta["token_type_term"] = "bias"
    return _checked(Decomposition(facts.name, 0, "exact-layer0", part_names, pairs, got["scores"], tokens.cpu(), meta))


#: Largest |sum of terms - model score| accepted, relative to max(1, max |score|), by the scores' dtype: float
#: rounding of the model's own forward (float32 measured <= 5e-5 on GPT-2, SmolLM2, MiniLM and Gemma 3 layouts;
#: float64 RoPE models 3.4e-7, as HF computes rotary angles in float32 even for float64 weights).
IDENTITY_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _checked(dec: Decomposition) -> Decomposition:
    """`dec`, after checking that its terms sum to the model's scores; RuntimeError otherwise (a model whose
    scores hold more than q.k, e.g. a bias or a post-softmax pattern, would give terms that look like a result)."""
    err = dec.max_error()
    ok = dec.allowed
    scale = max(1.0, float(dec.scores.to(torch.float64)[ok].abs().max())) if ok.any() else 1.0
    tol = IDENTITY_TOLERANCE.get(dec.scores.dtype, 1e-2) * scale
    if not err <= tol:
        raise RuntimeError(f"{dec.model}: the decomposition's terms differ from the model's layer-{dec.layer} scores "
                           f"by {err:.3g} (tolerance {tol:.1g}): its attention scores are not q.k of the parts "
                           "posprobe splits, so no result is written")
    return dec


@torch.no_grad()
def positional_mean(
    model: Any, token_rows: Int[torch.Tensor, "batch pos"], layers: Sequence[int], *, batch_size: int = 8,
    progress: bool = True,
) -> dict[int, Float[torch.Tensor, "pos d_model"]]:
    """Corpus mean of resid_pre at each position, per layer (float64, residual-stream units).

    Args:
        model: a TransformerLens model.
        token_rows: the corpus windows, `[batch, pos]` token ids of equal length.
        layers: the layers whose resid_pre is averaged.
        batch_size: rows per forward pass.
        progress: show a tqdm bar.

    Returns:
        {layer: `[pos, d_model]` float64 mean}, ready for `decompose_layer`'s `positional_mean`.
    """
    rows = _as_tokens(token_rows)
    reducer = mean_by_position("resid_pre", layers)
    state = stream(model, batches(rows.to(device_of(model)), batch_size), [reducer],
                   total=math.ceil(rows.shape[0] / batch_size), progress=progress, desc="positional mean")[0]
    return {layer: state[layer].mean for layer in layers}


@torch.no_grad()
def decompose_layer(
    model: Any, tokens: Int[torch.Tensor, "batch pos"], layer: int,
    positional_mean: Float[torch.Tensor, "pos d_model"],
) -> Decomposition:
    """Data-driven split of layer `layer`'s scores into mean/positional/context/remainder pair terms.

    RoPE models: each part's q/k are rotated with the layer's own rotation.

    Args:
        model: a TransformerLens model whose position information is carried in the residual stream or by RoPE
            (else WrongModelKind).
        tokens: the token ids, `[batch, pos]`.
        layer: the layer whose attention scores are split.
        positional_mean: `[pos, d_model]`, where `positional_mean[t]` is the corpus mean of resid_pre at
            position t of this layer (see `positional_mean()`); it must cover the sequence length.

    Returns:
        A `Decomposition` of float64 terms in score units (parts m, p, c, r, plus the family's own score bias
            where it has one); they sum to the model's scores.
    """
    facts = model_facts(model)
    require_supported(facts, "The score decomposition")
    if "data-driven" not in _decompositions(facts):
        raise WrongModelKind(
            f"The data-driven split covers position information carried in the residual stream or by RoPE; "
            f"{facts.name} uses {facts.positional_kind} positions, which act outside it"
        )
    _check_linear(model, layer)
    tokens = _as_tokens(tokens)
    mu = torch.as_tensor(positional_mean).to(torch.float64).cpu()
    n = tokens.shape[1]
    if mu.dim() != 2 or mu.shape[1] != facts.d_model:
        raise ValueError(f"positional_mean must be [pos, {facts.d_model}], got {tuple(mu.shape)}")
    if mu.shape[0] < n:
        raise ValueError(f"positional_mean covers {mu.shape[0]} positions but the sequence has {n} tokens")
    norm = pre_attention_norm(model, layer)
    got = _capture(model, tokens, ["resid_pre", "scores"] + ([norm.scale_point] if norm else []), layer)
    h = _f64(got["resid_pre"])
    g = mu.mean(0)
    pos = mu[:n] - g
    ctx = (h - mu[:n]).mean(1, keepdim=True)
    parts = {"m": g.expand_as(h), "p": pos.expand_as(h), "c": ctx.expand_as(h), "r": h - g - pos - ctx}
    parts = _frozen_norm(norm, parts, got[norm.scale_point] if norm else None)
    part_names, pairs = _pair_scores(model, layer, parts, layer in facts.rotary_layers)
    meta: dict[str, Any] = {"corpus_positions": int(mu.shape[0])}
    if facts.family is not None and facts.family.score_term:
        # The family's own score term (ALiBi's distance bias, T5's bucket bias): the family computes it.
        bias = score_bias(model, facts.family, layer, got["scores"], pairs.sum((0, 1)))
        part_names, pairs = _with_bias(part_names, pairs, bias)
        meta["bias_term"] = facts.family.score_term
    return _checked(Decomposition(facts.name, layer, "data-driven", part_names, pairs, got["scores"],
                                  tokens.cpu(), meta))


def _with_bias(names: tuple[str, ...], pairs: torch.Tensor, bias: torch.Tensor,
               ) -> tuple[tuple[str, ...], torch.Tensor]:
    # The family's score bias as pseudo-part "a" paired with itself, so the terms still sum to the scores.
    p = len(names)
    out = pairs.new_zeros((p + 1, p + 1, *pairs.shape[2:]))
    out[:p, :p] = pairs
    out[p, p] = bias
    return (*names, "a"), out


def _row_centre(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    # Softmax ignores a constant per query row, so only within-row variation moves the pattern.
    x = torch.where(ok, x, 0.0)
    mean = x.sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(ok, x - mean, 0.0)


def relative_fraction(
    term: Float[torch.Tensor, "batch query_pos key_pos"], ok: torch.Tensor,
) -> tuple[float, Float[torch.Tensor, " rel"]]:
    """Fraction of `term`'s variance (over unmasked entries) explained by its mean on each diagonal
    i - j, and those diagonal means indexed by rel_pos + (n - 1)."""
    n = term.shape[-1]
    ar = torch.arange(n, device=term.device)  # on the term's device: a CPU range cannot take a device mask
    rel = (ar[:, None] - ar[None, :] + n - 1).expand_as(term)[ok.to(term.device)]
    v = term[ok].to(torch.float64)
    cnt = torch.bincount(rel, minlength=2 * n - 1).to(torch.float64)
    means = torch.bincount(rel, weights=v, minlength=2 * n - 1) / cnt.clamp_min(1)
    total = ((v - v.mean()) ** 2).sum()
    within = ((v - means[rel]) ** 2).sum()
    frac = float(1 - within / total) if total > 0 else float("nan")
    return frac, torch.where(cnt > 0, means, float("nan"))


def head_summary(dec: Decomposition, *, row_centred: bool = True) -> pd.DataFrame:
    """Per-head term summary, tidy: model, layer, head, term, metric, value.

    Args:
        dec: a `Decomposition` (from `decompose_layer0` or `decompose_layer`).
        row_centred: remove each query row's mean from terms and scores before the variances, as softmax
            ignores it (False: remove the mean over all unmasked entries of the head).

    Returns:
        A tidy DataFrame with columns model, layer, head, term, metric, value. metrics: `var_share` =
            cov(term, score) / var(score) over unmasked entries (shares sum to 1), `var_ratio`
            = var(term) / var(score), `mean_abs` = mean |term| (score units); for term "pp",
            `rel_pos_fraction` (see `relative_fraction`); for term "positional" (every term with a p part, plus
            the family's own score bias such as ALiBi's) `var_share` and `rank` (1 = the head whose score
            variance is most positional).
    """
    terms = dec.terms()
    total = sum(terms.values())
    rows = []
    for h in range(dec.scores.shape[1]):
        ok = dec.allowed[:, h]
        centre = (lambda x: _row_centre(x, ok)) if row_centred else (lambda x: torch.where(ok, x - x[ok].mean(), 0.0))
        s = centre(total[:, h])
        ss = float((s**2).sum())
        positional = 0.0
        for name, t in terms.items():
            tc = centre(t[:, h])
            share = float((tc * s).sum()) / ss if ss > 0 else float("nan")
            if "p" in name or name == dec.bias_term:
                positional += share
            rows += [(h, name, "var_share", share),
                     (h, name, "var_ratio", float((tc**2).sum()) / ss if ss > 0 else float("nan")),
                     (h, name, "mean_abs", float(t[:, h][ok].abs().mean()))]
        rows.append((h, "pp", "rel_pos_fraction", relative_fraction(terms["pp"][:, h], ok)[0]))
        rows.append((h, "positional", "var_share", positional))
    df = pd.DataFrame(rows, columns=["head", "term", "metric", "value"])
    pos = df[(df.term == "positional") & (df.metric == "var_share")]
    order = pos.sort_values("value", ascending=False, kind="stable")["head"].tolist()
    ranks = pd.DataFrame({"head": order, "term": "positional", "metric": "rank", "value": range(1, len(order) + 1)})
    df = pd.concat([df, ranks], ignore_index=True)
    df.insert(0, "layer", dec.layer)
    df.insert(0, "model", dec.model)
    df["value"] = df["value"].astype(float)
    return df


# --------------------------------------------------------------------------- the analysis as a command runs it


def encode(model: Any, text: str) -> Int[torch.Tensor, "batch pos"]:
    """`[1, pos]` token ids of `text` with the special tokens the model expects (BOS / [CLS] [SEP])."""
    pre, post = special_tokens(model)
    ids = encode_text(model, text)
    if not ids:
        raise ValueError("The sentence is empty after tokenisation")
    return torch.tensor([pre + ids + post])


def corpus_rows(model: Any, text: str, length: int, max_windows: int) -> Int[torch.Tensor, "batch pos"]:
    """Windows of `text` laid out like `encode` output of total length `length` (half-overlapping)."""
    pre, post = special_tokens(model)
    body = max(length - len(pre) - len(post), 2)
    return torch.tensor(framed_windows(encode_text(model, text), body + len(pre) + len(post), pre=pre, post=post,
                                       max_windows=max_windows, stride=max(body // 2, 1)))


def _first_sentence(text: str) -> str:
    head = text.strip().split(". ")[0].strip()
    return head if head.endswith(".") else head + "."


def decompose_heads(model: Any, config: DecomposeConfig) -> tuple[Decomposition, pd.DataFrame]:
    """Run the chosen split on the sentence; returns (Decomposition, tidy head summary)."""
    facts = model_facts(model)
    require_supported(facts, "The score decomposition")
    if not 0 <= config.layer < facts.n_layers:
        raise ValueError(f"--layer {config.layer} out of range for a {facts.n_layers}-layer model")
    _check_linear(model, config.layer)  # before the corpus pass: QK-norm / soft-cap models refuse at once
    if config.method not in ("auto", "exact", "data"):
        raise ValueError(f"method must be auto, exact or data, got {config.method!r}")
    if config.head is not None and not 0 <= config.head < facts.n_heads:
        raise ValueError(f"--head {config.head} out of range for {facts.n_heads} heads")
    exact = config.method == "exact" or (
        config.method == "auto" and config.layer == 0 and "exact-layer0" in _decompositions(facts))
    if exact and config.layer != 0:
        raise ValueError("The exact split exists at layer 0 only; use method 'data' for later layers")
    text = config.text if config.text is not None else BUILTIN_TEXT
    tokens = encode(model, config.sentence or _first_sentence(text))
    if tokens.shape[1] > facts.n_ctx:
        raise ValueError(f"The sentence has {tokens.shape[1]} tokens, more than the model's context {facts.n_ctx}")
    if exact:
        dec = decompose_layer0(model, tokens)
    else:
        rows = corpus_rows(model, text, tokens.shape[1], config.max_windows)
        mean = positional_mean(model, rows, [config.layer], progress=config.progress)[config.layer]
        dec = decompose_layer(model, tokens, config.layer, mean)
        dec.meta["corpus_windows"] = int(rows.shape[0])
    return dec, head_summary(dec)


def run_decompose(model: Any, config: DecomposeConfig | None = None, *, source: str | None = None) -> Result:
    """Everything `posprobe decompose` writes, as a Result with one `decompose` table + meta.

    Args:
        model: a TransformerLens model (as `load_model` returns); the exact layer-0 split on learned-absolute
            models, the data-driven split otherwise.
        config: the analysis's options, the text among them (None: its Config's defaults).
        source: what meta.json's data record names as the text (default: "built-in text" or "text").

    Returns:
        A Result with one `decompose` table (columns model, layer, head, term, metric, query_pos, key_pos,
            rel_pos, value): the per-head summary (metric = var_share, var_ratio, mean_abs, rel_pos_fraction,
            rank) and the term maps of the chosen head (metric = "score", query_pos/key_pos/rel_pos set), in
            score units; meta holds the method, layer, head, sentence tokens and max_abs_error.

    Examples:
        >>> import posprobe as pp
        >>> result = pp.run_decompose(pp.load_model("tiny-ape"), pp.DecomposeConfig(max_windows=4, progress=False))
        >>> result.meta["method"], sorted(result.tables["decompose"].term.unique())
        ('exact-layer0', ['bias', 'positional', 'pp', 'pw', 'wp', 'ww'])
    """
    config = config or DecomposeConfig()
    dec, summary = decompose_heads(model, config)
    table = summary_table(summary)
    head = config.head if config.head is not None else int(table["head"].iloc[0])
    maps = dec.frame(batch=0, heads=[head]).assign(metric="score")
    df = pd.concat([summary, maps], ignore_index=True)
    cols = ["model", "layer", "head", "term", "metric", "query_pos", "key_pos", "rel_pos", "value"]
    df = df[cols].astype({"query_pos": "Int64", "key_pos": "Int64", "rel_pos": "Int64"})
    tok = tokenizer_of(model)
    words = [tok.decode([t]) for t in dec.tokens[0].tolist()]
    text = config.text if config.text is not None else BUILTIN_TEXT
    data = data_meta(source or ("built-in text" if config.text is None else "text"), n_items=len(words),
                     unit="tokens", sha256=text_sha256(text))
    cfg = {k: v for k, v in asdict(config).items() if k != "text"}  # the text is in data (hash), not config
    meta = make_meta(
        "decompose",
        model=model_facts(model).summary(),
        data=data,
        config=cfg,
        method=dec.method,
        layer=dec.layer,
        head=head,
        sentence_tokens=words,
        n_tokens=len(words),
        max_abs_error=dec.max_error(),
        parts=list(dec.parts),
        heatmap_terms=list(HEATMAP_TERMS[dec.method] if "a" not in dec.parts
                           else ("rr", "rp", "pp", dec.bias_term)),
        **dec.meta,
    )
    return Result({"decompose": df}, meta)


def _compare(m: ModelEntry, run: CompareRun) -> Any:
    from posprobe.analyses.probes import text_rows
    from posprobe.backend.model import tokenizer_of

    text, cfg = run.text, run.config
    if m.facts.unsupported is not None:
        return m.facts.unsupported
    # The sentence decomposed: the text's first window, so it fits every model's context.
    window = min(cfg.window, m.facts.n_ctx - 2)
    sentence = tokenizer_of(m.model).decode(text_rows(m.model, text, window, 1)[0][1:])
    got = run_decompose(m.model, DecomposeConfig(text=text, sentence=sentence, max_windows=cfg.max_windows,
                                                 progress=False))
    d = got.tables["decompose"]
    summary = d[d.metric != "score"].drop(columns=["query_pos", "key_pos", "rel_pos"])
    return {"decomposition": summary}, {"method": got.meta.get("method"), "terms": got.meta.get("terms")}


ATLAS_SECTION = register(AtlasSection("decomposition", "Layer-0 score decomposition", None, None, None,
                                      compare=_compare, compare_page=decompose_report.compare_section))
