"""Score decomposition as a report: pick the split, run it on one sentence, summarise, plot.

The CLI (`posprobe decompose`) and analyses/score_decomposition.py both call `decompose_report`.
Figures are rebuilt from the tidy DataFrame alone.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Int

from posprobe.data import token_windows
from posprobe.analyses.decompose import (
    HEATMAP_TERMS, Decomposition, decompose_layer, decompose_layer0, head_summary, positional_mean, summary_table,
)
from posprobe.backend.facts import model_facts
from posprobe.report.result import Result, environment_meta

BUILTIN_TEXT = (
    "The old lighthouse stood at the edge of the cliff, and every night its lamp swept across the dark water. "
    "Fishermen who worked the northern banks had trusted that light for more than a century. "
    "When the keeper retired, the town council voted to replace him with an automatic beacon, but the "
    "villagers objected and raised money to keep the tower staffed. "
    "A young engineer named Clara answered the advertisement and moved into the cottage at its base. "
    "She repaired the clockwork that turned the lens, cleaned the brass fittings and kept a careful log of "
    "passing ships, storms and the hours of fog. "
    "In her first winter a cargo vessel lost its engine during a gale and drifted towards the rocks. "
    "Clara saw its lights, fired the signal rockets and telephoned the lifeboat station in the harbour. "
    "The crew of nine was brought ashore before dawn, cold but unharmed, and the story was printed in "
    "newspapers across the country. "
    "Years later the beacon was finally automated, yet the town still pays for a keeper, because people "
    "say that a machine can watch the sea but cannot care about the sailors on it. "
    "Visitors now climb the spiral stairs in summer, read the old logbooks and look out over the bay."
)


@dataclass(frozen=True, kw_only=True)
class DecomposeConfig:
    """What to decompose. `method`: "auto" (exact at layer 0 of a learned-absolute model, else
    data-driven), "exact" or "data". `text` is the corpus for positional means (default
    BUILTIN_TEXT); `sentence` the analysed sentence (default: the corpus's first sentence);
    `head` the head of the heatmaps (default: the top-ranked head)."""

    layer: int = 0
    method: str = "auto"
    text: str | None = None
    sentence: str | None = None
    head: int | None = None
    max_windows: int = 32
    progress: bool = True


def _specials(model: Any) -> tuple[list[int], list[int]]:
    tok = model.tokenizer
    if type(model).__name__ == "HookedEncoder":
        return [tok.cls_token_id], [tok.sep_token_id]
    bos = tok.bos_token_id if model.cfg.default_prepend_bos else None
    return ([bos] if bos is not None else []), []


def encode(model: Any, text: str) -> Int[torch.Tensor, "batch pos"]:
    """`[1, pos]` token ids of `text` with the special tokens the model expects (BOS / [CLS] [SEP])."""
    pre, post = _specials(model)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError("The sentence is empty after tokenisation")
    return torch.tensor([pre + ids + post])


def corpus_rows(model: Any, text: str, length: int, max_windows: int) -> Int[torch.Tensor, "batch pos"]:
    """Windows of `text` laid out like `encode` output of total length `length` (half-overlapping)."""
    pre, post = _specials(model)
    body = length - len(pre) - len(post)
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    rows = token_windows(ids, max(body, 2), max_windows=max_windows, stride=max(body // 2, 1))
    return torch.tensor([pre + r[:body] + post for r in rows])


def _first_sentence(text: str) -> str:
    head = text.strip().split(". ")[0].strip()
    return head if head.endswith(".") else head + "."


def run_decomposition(model: Any, config: DecomposeConfig) -> tuple[Decomposition, pd.DataFrame]:
    """Run the chosen split on the sentence; returns (Decomposition, tidy head summary)."""
    facts = model_facts(model)
    if not 0 <= config.layer < facts.n_layers:
        raise ValueError(f"--layer {config.layer} out of range for a {facts.n_layers}-layer model")
    if config.method not in ("auto", "exact", "data"):
        raise ValueError(f"method must be auto, exact or data, got {config.method!r}")
    if config.head is not None and not 0 <= config.head < facts.n_heads:
        raise ValueError(f"--head {config.head} out of range for {facts.n_heads} heads")
    exact = config.method == "exact" or (
        config.method == "auto" and config.layer == 0 and facts.positional_kind == "learned_absolute")
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


def heatmap_figure(frame: pd.DataFrame, head: int, terms: tuple[str, ...]) -> Any:
    """2x2 TUPE-style heatmaps (query_pos x key_pos) of four terms of one head, from tidy rows."""
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    fig = make_subplots(rows=2, cols=2, subplot_titles=list(terms), horizontal_spacing=0.12, vertical_spacing=0.12)
    for i, term in enumerate(terms):
        d = frame[(frame["head"] == head) & (frame.term == term)]
        z = d.pivot(index="query_pos", columns="key_pos", values="value")
        fig.add_trace(go.Heatmap(z=z.values, x=z.columns, y=z.index, coloraxis="coloraxis", name=term),
                      row=i // 2 + 1, col=i % 2 + 1)
    fig.update_yaxes(autorange="reversed", title_text="query_pos")
    fig.update_xaxes(title_text="key_pos")
    fig.update_layout(title=f"Head {head}: score terms (score units)", height=760,
                      coloraxis={"colorscale": "RdBu", "cmid": 0})
    return fig


def share_figure(summary: pd.DataFrame) -> Any:
    """Stacked bars: each term's share of within-row score variance, per head."""
    import plotly.express as px

    d = summary[(summary.metric == "var_share") & (summary.term != "positional")]
    return px.bar(d, x="head", y="value", color="term", barmode="relative",
                  title="Share of score variance per term (cov(term, score) / var(score), row-centred)",
                  labels={"value": "share"})


def profile_figure(frame: pd.DataFrame, head: int) -> Any:
    """Mean pp term on each diagonal (rel_pos = query_pos - key_pos) of one head."""
    import plotly.express as px

    d = frame[(frame["head"] == head) & (frame.term == "pp")].groupby("rel_pos", as_index=False)["value"].mean()
    return px.line(d, x="rel_pos", y="value", markers=True, title=f"Head {head}: pp term by relative position",
                   labels={"value": "mean pp (score units)"})


def decompose_report(model: Any, config: DecomposeConfig) -> tuple[Result, list, str]:
    """Everything `posprobe decompose` writes: (Result with tidy df + meta, figures, summary HTML).

    df rows: the per-head summary (metric = var_share, var_ratio, mean_abs, rel_pos_fraction, rank)
    and the term maps of the chosen head (metric = "score", query_pos/key_pos/rel_pos set).
    """
    dec, summary = run_decomposition(model, config)
    table = summary_table(summary)
    head = config.head if config.head is not None else int(table["head"].iloc[0])
    maps = dec.frame(batch=0, heads=[head]).assign(metric="score")
    df = pd.concat([summary, maps], ignore_index=True)
    cols = ["model", "layer", "head", "term", "metric", "query_pos", "key_pos", "rel_pos", "value"]
    df = df[cols].astype({"query_pos": "Int64", "key_pos": "Int64", "rel_pos": "Int64"})
    figures = [heatmap_figure(maps, head, HEATMAP_TERMS[dec.method]), share_figure(summary), profile_figure(maps, head)]
    tok = model.tokenizer
    words = [tok.decode([t]) for t in dec.tokens[0].tolist()]
    meta = {
        "analysis": "decompose", "method": dec.method, "layer": dec.layer, "head": head,
        "sentence_tokens": words, "n_tokens": len(words), "corpus": "builtin" if config.text is None else "user text",
        "max_abs_error": dec.max_error(), "parts": list(dec.parts), **dec.meta,
        "model": model_facts(model).summary(), "environment": environment_meta(),
    }
    what = ("exact layer-0 split: w = token (+ token-type) embedding, p = position embedding, bias = LN bias "
            "and b_Q/b_K terms" if dec.method == "exact-layer0" else
            "data-driven split of resid_pre: p = corpus positional mean minus global mean, c = the sentence's "
            "mean offset (context), r = remainder; mean = terms with the global mean; bias = LN bias and b_Q/b_K terms")
    summary_html = (
        f"<p>{html.escape(what)}. Terms sum to the model's scores within {dec.max_error():.2e} "
        f"(score units). Sentence ({len(words)} tokens): <code>{html.escape(' | '.join(words))}</code>.</p>"
        "<p>share_* = cov(term, score)/var(score) over unmasked entries after removing each query row's mean "
        "(softmax ignores it); shares sum to 1. pp_rel_pos_fraction = fraction of the pp term's variance "
        "explained by its mean on each diagonal i-j. Heads ranked by the share of all terms with a position part.</p>"
        + table.to_html(classes="pp-table", border=0, index=False)
    )
    return Result(df, meta), figures, summary_html
