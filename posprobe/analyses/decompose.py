"""Word/position cross-term decomposition of pre-softmax attention scores (Ke et al. 2021, TUPE).

The attention input of one layer is split into additive parts; each part goes through the layer's
LayerNorm with the per-token scale frozen at the model's own value (so the norm is linear), then
through W_Q / W_K (and the layer's RoPE rotation, which is linear too). A score is bilinear in
(query vector, key vector), so the pair terms sum exactly to the model's `hook_attn_scores` on
every unmasked entry. A pair term is named query part + key part ("wp" = word query, position key).

Parts of the exact layer-0 split (models that add learned position embeddings to token embeddings):
  w  token embedding, centred (BERT: + token-type embedding, folded in here)
  p  position embedding, centred
  n  the norm's bias b_ln (constant vector; absent after TL's LN folding, which moves it into b_Q)
  b  b_Q on the query side, b_K on the key side
For BERT the split is taken at the embedding LayerNorm (`embed.ln`), whose output is the layer-0
attention input (BERT blocks are post-LN: attention reads resid_pre directly).

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
that involves n or b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import einops
import pandas as pd
import torch
from jaxtyping import Float, Int

from posprobe.core.capture import batches, capture, mean_by_position, stream
from posprobe.backend.facts import WrongModelKind, model_facts
from posprobe.backend.hooks import attention_scores, attn, hook_name, hooked, layer_rotary_spec, pos_embed_hook
from posprobe.core.rope import rotate

BIAS_PARTS = frozenset("nb")
EXACT_TERMS = ("ww", "wp", "pw", "pp", "bias")
DATA_TERMS = ("pp", "pc", "pr", "cp", "cc", "cr", "rp", "rc", "rr", "mean", "bias")
# The four TUPE-style maps; in the data-driven split the remainder r plays the word's role.
HEATMAP_TERMS = {"exact-layer0": ("ww", "wp", "pw", "pp"), "data-driven": ("rr", "rp", "pr", "pp")}
# TL 3 hook names hooks.POINTS does not list yet (embedding side).
_ENCODER_EMBED = {"w": "embed.hook_embed", "t": "embed.hook_token_type_embed", "scale": "embed.ln.hook_scale"}


@dataclass(frozen=True)
class Decomposition:
    """One layer's pre-softmax scores split into pair terms (see the module docstring).

    `pairs[i, j]` is the score contribution of query part `parts[i]` with key part `parts[j]`
    (float64, same units as `hook_attn_scores`: q.k / attn_scale). `scores` is the model's own
    `hook_attn_scores` (-inf on masked entries). Values of `pairs` on masked entries are what the
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
            return tuple(a + b for a in self.parts for b in self.parts)
        return EXACT_TERMS if self.method == "exact-layer0" else DATA_TERMS

    def terms(self, detail: bool = False) -> dict[str, Float[torch.Tensor, "batch head_index query_pos key_pos"]]:
        """{term: float64 score contribution}; grouped (see module docstring) or per pair ("wp", "mb", ...)."""
        out = {t: torch.zeros_like(self.pairs[0, 0]) for t in self.term_names(detail)}
        for i, a in enumerate(self.parts):
            for j, b in enumerate(self.parts):
                out[_group(a + b, detail)] += self.pairs[i, j]
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
    return "bias" if BIAS_PARTS.intersection(pair) else "mean" if "m" in pair else pair


def _check_linear(model: Any, layer: int) -> None:
    # Everything after the frozen norm must be linear in the input for the split to be exact.
    cfg = model.cfg
    if cfg.use_qk_norm or cfg.original_architecture in ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM"):
        raise NotImplementedError(f"{cfg.model_name} normalises q/k (QK-norm), so scores are not bilinear in the parts")
    if cfg.attn_scores_soft_cap and cfg.attn_scores_soft_cap > 0:
        raise NotImplementedError(f"{cfg.model_name} soft-caps attention scores, so the terms would not add up")
    if cfg.use_logn_attn or cfg.clip_qkv:
        raise NotImplementedError(f"{cfg.model_name}: log-n scaling / q-k-v clipping is not supported")
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"Layer {layer} out of range for a {cfg.n_layers}-layer model")


def _as_tokens(tokens: Any) -> torch.Tensor:
    t = torch.as_tensor(tokens)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[1] < 1 or t.shape[0] < 1:
        raise ValueError(f"Expected tokens [batch, pos], got shape {tuple(t.shape)}")
    return t


def _is_encoder(model: Any) -> bool:
    return type(model).__name__ == "HookedEncoder"


def _forward(model: Any, tokens: torch.Tensor, layer: int) -> None:
    if _is_encoder(model):
        model(tokens, return_type=None)
    else:  # later layers cannot change this layer's activations
        model(tokens, stop_at_layer=layer + 1)


def _grab(model: Any, tokens: torch.Tensor, names: dict[str, str], layer: int) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}

    def make(key: str):
        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            got[key] = x.detach()
            return x
        return hook

    with hooked(model, [(n, make(k)) for k, n in names.items()]):
        _forward(model, tokens.to(model.cfg.device), layer)
    return got


def _frozen_norm(module: Any, parts: dict[str, torch.Tensor], scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Push each part through `module` with its per-token scale frozen; adds the bias as part "n"."""
    if module is None:  # the attention reads these vectors directly (BERT's post-LN blocks)
        return dict(parts)
    kind = type(module).__name__
    if kind not in ("LayerNorm", "LayerNormPre", "RMSNorm", "RMSNormPre"):
        raise NotImplementedError(f"Cannot freeze a {kind} norm")
    centre = kind.startswith("LayerNorm")
    w, b = getattr(module, "w", None), getattr(module, "b", None)
    out = {}
    for key, x in parts.items():
        x = x - x.mean(-1, keepdim=True) if centre else x
        x = x / scale.to(torch.float64)
        out[key] = x * w.to(torch.float64) if w is not None else x
    if b is not None:
        out["n"] = b.to(torch.float64).expand_as(next(iter(out.values())))
    return out


def _pair_scores(model: Any, layer: int, parts: dict[str, torch.Tensor]) -> tuple[tuple[str, ...], torch.Tensor]:
    """Scores of every (query part, key part) pair, with the layer's b_Q/b_K as part "b"."""
    a = attn(model, layer)
    W_Q, b_Q = a.W_Q.to(torch.float64), a.b_Q.to(torch.float64)
    # GQA keeps key weights per kv head; attention_scores expands them like TL does.
    W_K, b_K = getattr(a, "_W_K", a.W_K).to(torch.float64), getattr(a, "_b_K", a.b_K).to(torch.float64)
    names = tuple(parts) + ("b",)
    x0 = next(iter(parts.values()))
    batch, pos = x0.shape[:2]
    q = {n: einops.einsum(x, W_Q, "b p d, h d e -> b p h e") for n, x in parts.items()}
    k = {n: einops.einsum(x, W_K, "b p d, h d e -> b p h e") for n, x in parts.items()}
    q["b"] = b_Q.expand(batch, pos, *b_Q.shape)
    k["b"] = b_K.expand(batch, pos, *b_K.shape)
    if model.cfg.positional_embedding_type == "rotary":
        spec, positions = layer_rotary_spec(model, layer), torch.arange(pos, dtype=torch.float64)
        q = {n: rotate(v, positions, spec) for n, v in q.items()}
        k = {n: rotate(v, positions, spec) for n, v in k.items()}
    pairs = torch.stack([torch.stack([attention_scores(model, layer, q[x], k[y]) for y in names]) for x in names])
    return names, pairs


@torch.no_grad()
def decompose_layer0(model: Any, tokens: Int[torch.Tensor, "batch pos"]) -> Decomposition:
    """Exact layer-0 split of the scores into word/position/bias pair terms (float64, score units).

    Learned-absolute models only (GPT-2-like decoders; BERT-like HookedEncoders at `embed.ln`).
    Works with raw and TL-processed (folded LN, centred) weights. RoPE models raise WrongModelKind.
    """
    facts = model_facts(model)
    if facts.positional_kind != "learned_absolute":
        raise WrongModelKind(
            f"The exact layer-0 split needs position embeddings added to the token embeddings, but {facts.name} "
            f"uses {facts.positional_kind} positions; use the data-driven split decompose_layer(model, tokens, "
            "layer, positional_mean) instead"
        )
    _check_linear(model, 0)
    tokens = _as_tokens(tokens)
    names = {"p": pos_embed_hook(model), "scores": hook_name("scores", 0)}
    if _is_encoder(model):
        names.update(_ENCODER_EMBED)
        module = model.embed.ln
    else:
        names["w"] = "hook_embed"
        module = model.blocks[0].ln1 if model.cfg.normalization_type else None
        if module is not None:
            names["scale"] = hook_name("ln1_scale", 0)
    got = _grab(model, tokens, names, 0)
    word = got["w"].to(torch.float64) + (got["t"].to(torch.float64) if "t" in got else 0.0)
    parts = _frozen_norm(module, {"w": word, "p": got["p"].to(torch.float64).expand_as(word)}, got.get("scale"))
    part_names, pairs = _pair_scores(model, 0, parts)
    return Decomposition(facts.name, 0, "exact-layer0", part_names, pairs, got["scores"], tokens.cpu(),
                         {"token_type_folded_into_word": _is_encoder(model)})


@torch.no_grad()
def positional_mean(
    model: Any, token_rows: Int[torch.Tensor, "batch pos"], layers: Sequence[int], *, batch_size: int = 8,
    progress: bool = True,
) -> dict[int, Float[torch.Tensor, "pos d_model"]]:
    """Corpus mean of resid_pre at each position, per layer (float64, residual-stream units)."""
    rows = _as_tokens(token_rows)
    reducer = mean_by_position("resid_pre", layers)
    state = stream(model, batches(rows.to(model.cfg.device), batch_size), [reducer],
                   total=math.ceil(rows.shape[0] / batch_size), progress=progress, desc="positional mean")[0]
    return {layer: state[layer].mean for layer in layers}


@torch.no_grad()
def decompose_layer(
    model: Any, tokens: Int[torch.Tensor, "batch pos"], layer: int,
    positional_mean: Float[torch.Tensor, "pos d_model"],
) -> Decomposition:
    """Data-driven split of layer `layer`'s scores into mean/positional/context/remainder pair terms.

    `positional_mean[t]` is the corpus mean of resid_pre at position t (see `positional_mean()`);
    it must cover the sequence length. Float64 terms in score units; they sum to the model's scores.
    RoPE models: each part's q/k are rotated with the layer's own rotation.
    """
    facts = model_facts(model)
    if facts.positional_kind not in ("learned_absolute", "rotary", "none"):
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
    use_norm = not _is_encoder(model) and model.cfg.normalization_type is not None
    points = ["resid_pre", "scores"] + (["ln1_scale"] if use_norm else [])
    got = capture(model, tokens.to(model.cfg.device), points, layers=[layer])
    h = got[("resid_pre", layer)].to(torch.float64).cpu()
    g = mu.mean(0)
    pos = mu[:n] - g
    ctx = (h - mu[:n]).mean(1, keepdim=True)
    parts = {"m": g.expand_as(h), "p": pos.expand_as(h), "c": ctx.expand_as(h), "r": h - g - pos - ctx}
    module = model.blocks[layer].ln1 if use_norm else None
    scale = got[("ln1_scale", layer)].cpu() if use_norm else None
    parts = _frozen_norm(module, parts, scale)
    part_names, pairs = _pair_scores(model, layer, parts)
    return Decomposition(facts.name, layer, "data-driven", part_names, pairs, got[("scores", layer)].cpu(),
                         tokens.cpu(), {"corpus_positions": int(mu.shape[0])})


def _row_centre(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    # Softmax ignores a constant per query row, so only within-row variation moves the pattern.
    x = torch.where(ok, x, 0.0)
    mean = x.sum(-1, keepdim=True) / ok.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(ok, x - mean, 0.0)


def relative_fraction(
    term: Float[torch.Tensor, "batch query_pos key_pos"], ok: torch.Tensor,
) -> tuple[float, Float[torch.Tensor, "rel"]]:
    """Fraction of `term`'s variance (over unmasked entries) explained by its mean on each diagonal
    i - j, and those diagonal means indexed by rel_pos + (n - 1)."""
    n = term.shape[-1]
    rel = (torch.arange(n)[:, None] - torch.arange(n)[None, :] + n - 1).expand_as(term)[ok]
    v = term[ok].to(torch.float64)
    cnt = torch.bincount(rel, minlength=2 * n - 1).to(torch.float64)
    means = torch.bincount(rel, weights=v, minlength=2 * n - 1) / cnt.clamp_min(1)
    total = ((v - v.mean()) ** 2).sum()
    within = ((v - means[rel]) ** 2).sum()
    frac = float(1 - within / total) if total > 0 else float("nan")
    return frac, torch.where(cnt > 0, means, float("nan"))


def head_summary(dec: Decomposition, *, row_centred: bool = True) -> pd.DataFrame:
    """Per-head term summary, tidy: model, layer, head, term, metric, value.

    metrics: `var_share` = cov(term, score) / var(score) over unmasked entries (shares sum to 1;
    with `row_centred` each query row's mean is removed first, as softmax ignores it), `var_ratio`
    = var(term) / var(score), `mean_abs` = mean |term| (score units); for term "pp",
    `rel_pos_fraction` (see `relative_fraction`); for term "positional" (every term with a p part)
    `var_share` and `rank` (1 = the head whose score variance is most positional).
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
            if "p" in name:
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


def summary_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Wide per-head table (one row per head, ranked): var_share per term, pp rel_pos_fraction, rank."""
    share = summary[summary.metric == "var_share"].pivot(index="head", columns="term", values="value")
    terms = [t for t in list(EXACT_TERMS) + list(DATA_TERMS) + ["positional"] if t in share.columns]
    wide = share[list(dict.fromkeys(terms))].add_prefix("share_")
    extra = summary[summary.metric.isin(["rel_pos_fraction", "rank"])].pivot(index="head", columns="metric", values="value")
    wide = wide.join(extra.rename(columns={"rel_pos_fraction": "pp_rel_pos_fraction"}))
    return wide.sort_values("rank").reset_index().round(4)
