"""Shift-by-k test (Sinha et al. 2022): start every sentence at position k, with no prior context,
and measure minimal-pair acceptability and perplexity against k = 0.

For RoPE models the same shift moves queries and keys together, so the scores must not change:
the result is an invariance control, and its measured deviation is reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Sequence

import numpy as np
import pandas as pd

from posprobe.data import DataError, MinimalPair
from posprobe.scoring import Positioned

PrefixKind = Literal["auto", "bos", "eot", "none"]


class ShiftError(ValueError):
    """A shift test that cannot run as asked (k past the context, negative k, no data)."""


@dataclass(frozen=True, kw_only=True)
class ShiftConfig:
    """Options of the shift test. `ks` always gains 0 (the baseline).

    prefix: what precedes each sentence: "bos" (tokenizer's BOS), "eot" (end-of-text token), "none"
    (first token then unscored), or "auto" (see `default_prefix`). prefix_position: "with-sentence"
    (the prefix moves to k with the sentence) or "zero" (prefix stays at position 0).
    """

    ks: tuple[int, ...] = (0, 100)
    prefix: PrefixKind = "auto"
    prefix_position: Literal["with-sentence", "zero"] = "with-sentence"
    batch_size: int = 32
    n_bootstrap: int = 1000
    seed: int = 0
    window: int = 64
    max_windows: int = 32
    allow_beyond_context: bool = False
    progress: bool = True

    def all_ks(self) -> list[int]:
        """Sorted distinct k values including the baseline 0."""
        bad = [k for k in self.ks if int(k) != k or k < 0]
        if bad:
            raise ShiftError(f"k must be a whole number >= 0; got {bad}")
        return sorted({0, *map(int, self.ks)})


@dataclass
class ShiftResult:
    """Tidy tables of a shift test plus metadata.

    pairs: one row per (k, pair) with log-probs in nats. summary: accuracy with bootstrap CI, mean
    margin, flips and McNemar p vs k=0, per k and level (overall/field/paradigm). tokens: per-token
    loss of the text windows (nats) by k and position inside the window. drift: encoders only.
    """

    pairs: pd.DataFrame
    summary: pd.DataFrame
    tokens: pd.DataFrame
    drift: pd.DataFrame
    meta: dict = field(default_factory=dict)

    def tables(self) -> dict[str, pd.DataFrame]:
        """The non-empty tables by file name stem."""
        t = {"shift_pairs": self.pairs, "shift_summary": self.summary, "shift_tokens": self.tokens,
             "shift_drift": self.drift}
        return {k: v for k, v in t.items() if len(v)}


def default_prefix(tokenizer: Any) -> tuple[str, list[int]]:
    """The documented default: the token that separated documents in pre-training.

    "<|endoftext|>" when the vocabulary has it (GPT-2, SmolLM2, Pythia: their BOS may be a chat
    marker such as SmolLM2's <|im_start|>, which reads as a turn start, not a text start), else the
    tokenizer's BOS (Llama <s>, Gemma <bos>), else nothing.
    """
    vocab = tokenizer.get_vocab()
    if "<|endoftext|>" in vocab:
        return "eot", [vocab["<|endoftext|>"]]
    if tokenizer.bos_token_id is not None:
        return "bos", [tokenizer.bos_token_id]
    return "none", []


def prefix_ids(tokenizer: Any, kind: PrefixKind) -> tuple[str, list[int]]:
    """Resolve a prefix option to (kind, token ids)."""
    if kind == "auto":
        return default_prefix(tokenizer)
    if kind == "none":
        return "none", []
    if kind == "bos":
        if tokenizer.bos_token_id is None:
            raise ShiftError("This tokenizer has no BOS token; use --prefix eot or none")
        return "bos", [tokenizer.bos_token_id]
    eot = tokenizer.get_vocab().get("<|endoftext|>", tokenizer.eos_token_id)
    if eot is None:
        raise ShiftError("This tokenizer has no end-of-text token; use --prefix bos or none")
    return "eot", [eot]


def place(prefix: list[int], sent: list[int], k: int, prefix_position: str) -> Positioned:
    """Token ids and positions: the sentence starts at k (+ prefix length), the prefix at k or 0."""
    p, n = len(prefix), len(sent)
    if prefix_position == "zero":
        pos = list(range(p)) + list(range(k + p, k + p + n))
    else:
        pos = list(range(k, k + p + n))
    return Positioned(tuple(prefix + sent), tuple(pos))


def check_context(lengths: Sequence[int], texts: Sequence[str], ks: Sequence[int], n_ctx: int, what: str) -> None:
    """Raise ShiftError before any scoring if k + the longest item passes the context length."""
    if not lengths:
        raise ShiftError(f"Empty input: no {what} to score")
    i = int(np.argmax(lengths))
    longest, kmax = lengths[i], max(ks)
    if kmax + longest > n_ctx:
        raise ShiftError(
            f"k={kmax} plus the longest {what} ({longest} tokens incl. prefix: {texts[i][:80]!r}) exceeds the "
            f"model's context of {n_ctx} positions; the largest allowed k is {n_ctx - longest}"
        )


def score_pairs(scorer: Any, tokenizer: Any, pairs: Sequence[MinimalPair], cfg: ShiftConfig, prefix: list[int],
                ks: Sequence[int]) -> pd.DataFrame:
    """Log-prob (nats) of every good and bad sentence at every k; one row per (k, pair)."""
    sents = sorted({s for p in pairs for s in (p.good, p.bad)})
    ids = {s: tokenizer(s, add_special_tokens=False).input_ids for s in sents}
    skip = 0 if prefix else 1  # without a prefix the first token has nothing to be predicted from
    first = max(len(prefix) - 1, 0)  # the prefix is context, not part of the sentence's score
    at_k = [(k, p) for k in ks for p in pairs]
    items = [(place(prefix, ids[p.good], k, cfg.prefix_position), place(prefix, ids[p.bad], k, cfg.prefix_position))
             for k, p in at_k]
    # Pair-aware scoring: the shared start of a pair is computed once, identical sentences once.
    lps = scorer.pair_logprobs(items, batch_size=cfg.batch_size, progress=cfg.progress, desc="pairs")
    rows = []
    for (k, p), (lp_good, lp_bad) in zip(at_k, lps):
        rows.append((p.paradigm, p.field, p.phenomenon, p.pair_id, k, float(lp_good[first:].sum()),
                     float(lp_bad[first:].sum()), len(ids[p.good]) - skip, len(ids[p.bad]) - skip))
    df = pd.DataFrame(rows, columns=["paradigm", "field", "phenomenon", "pair_id", "k", "logp_good", "logp_bad",
                                     "n_tokens_good", "n_tokens_bad"])
    df["margin"] = df.logp_good - df.logp_bad
    df["correct"] = df.margin > 0
    return df


def summarise(pairs: pd.DataFrame, *, n_boot: int, seed: int) -> pd.DataFrame:
    """Accuracy (with percentile bootstrap 95% CI), mean margin, flips and exact McNemar p vs k=0."""
    from posprobe.stats import bootstrap_ci, mcnemar_exact

    base = pairs[pairs.k == 0].set_index(["paradigm", "pair_id"])
    rows = []
    levels = [("overall", None), ("field", "field"), ("paradigm", "paradigm")]
    for k, at_k in pairs.groupby("k", sort=True):
        at_k = at_k.set_index(["paradigm", "pair_id"])
        was = base.loc[at_k.index, "correct"].to_numpy()
        at_k = at_k.assign(was=was)
        for level, col in levels:
            groups = [("all", at_k)] if col is None else list(at_k.groupby(col, sort=True))
            for name, g in groups:
                c, w = g.correct.to_numpy(), g.was.to_numpy()
                to_wrong, to_right = int((w & ~c).sum()), int((~w & c).sum())
                lo, hi = bootstrap_ci(c, n_boot=n_boot, seed=seed)
                rows.append(dict(k=k, level=level, group=name, n_pairs=len(g), accuracy=float(c.mean()), ci_low=lo,
                                 ci_high=hi, mean_margin=float(g.margin.mean()), delta_accuracy=float(c.mean() - w.mean()),
                                 flips=to_wrong + to_right, flips_to_wrong=to_wrong, flips_to_correct=to_right,
                                 mcnemar_p=mcnemar_exact(to_wrong, to_right)))
    return pd.DataFrame(rows)


def score_text(scorer: Any, tokenizer: Any, text: str, cfg: ShiftConfig, prefix: list[int], ks: Sequence[int]) -> pd.DataFrame:
    """Per-token loss (nats) of fixed windows of `text` at every k, by position inside the window."""
    from posprobe.data import token_windows

    # Tokenise only as much text as the windows need.
    chars = cfg.window * cfg.max_windows * 12
    ids = tokenizer(text[:chars], add_special_tokens=False).input_ids
    windows = token_windows(ids, cfg.window, max_windows=cfg.max_windows)
    items = [place(prefix, w, k, cfg.prefix_position) for k in ks for w in windows]
    lps = scorer.token_logprobs(items, batch_size=cfg.batch_size, progress=cfg.progress, desc="text windows")
    rows = []
    first = len(prefix) - 1 if prefix else 0
    for j, (item, lp) in enumerate(zip(items, lps)):
        k, w = ks[j // len(windows)], j % len(windows)
        own = lp[first:].numpy()
        start = 0 if prefix else 1
        rows += [(k, w, start + t, -float(v)) for t, v in enumerate(own)]
    return pd.DataFrame(rows, columns=["k", "window", "window_pos", "loss"])


def ppl_by_k(tokens: pd.DataFrame) -> pd.DataFrame:
    """Mean loss and perplexity per k."""
    g = tokens.groupby("k").loss.mean().rename("mean_loss").reset_index()
    g["perplexity"] = np.exp(g.mean_loss)
    return g


def config_meta(cfg: ShiftConfig) -> dict:
    """The config as a JSON-able dict."""
    d = asdict(cfg)
    d["ks"] = cfg.all_ks()
    return d


def check_pairs(pairs: Sequence[MinimalPair]) -> None:
    """Raise DataError for an empty pair list (nothing to score)."""
    if not pairs:
        raise DataError("Empty input: no minimal pairs to score")
