"""Shift-by-k test (Sinha et al. 2022): start every sentence at position k, with no prior context,
and measure minimal-pair acceptability and perplexity against k = 0.

For RoPE models the same shift moves queries and keys together, so the scores must not change:
the result is an invariance control, and its measured deviation is reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import pandas as pd
import torch

from posprobe.analyses.configs import ShiftConfig, ShiftError
from posprobe.analyses.sections import AtlasRun, AtlasSection, CompareRun, ModelEntry, register, why_not
from posprobe.backend.families import control as position_control
from posprobe.backend.families import find as find_family
from posprobe.backend.model import forward, n_layers, tokenizer_of
from posprobe.core.scoring import Positioned
from posprobe.data import BUILTIN_SOURCE, DataError, MinimalPair, pairs_fingerprint
from posprobe.report import shift as shift_report
from posprobe.report.checkpoint import Checkpoint, run_key
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.report.shift import ppl_by_k

PrefixKind = Literal["auto", "bos", "eot", "none"]


class ShiftResult(Result):
    """Tables of a shift test (only the non-empty ones are kept) plus meta.

    shift_pairs: one row per (k, pair) with log-probs in nats. shift_summary: accuracy with bootstrap
    CI, mean margin, flips and McNemar p vs k=0, per k and level (overall/field/paradigm).
    shift_tokens: per-token loss of the text windows (nats) by k and position inside the window.
    shift_drift: encoders only (cosine of representations to k=0).
    """

    @property
    def pairs(self) -> pd.DataFrame:
        return self.tables.get("shift_pairs", pd.DataFrame())

    @property
    def summary(self) -> pd.DataFrame:
        return self.tables.get("shift_summary", pd.DataFrame())

    @property
    def tokens(self) -> pd.DataFrame:
        return self.tables.get("shift_tokens", pd.DataFrame())

    @property
    def drift(self) -> pd.DataFrame:
        return self.tables.get("shift_drift", pd.DataFrame())


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
                ks: Sequence[int], ckpt: Checkpoint | None = None) -> pd.DataFrame:
    """Log-prob (nats) of every good and bad sentence at every k; one row per (k, pair). With a checkpoint,
    each block of `UNIT_ITEMS` (k, pair) items is kept as it completes."""
    sents = sorted({s for p in pairs for s in (p.good, p.bad)})
    ids = {s: tokenizer(s, add_special_tokens=False).input_ids for s in sents}
    skip = 0 if prefix else 1  # without a prefix the first token has nothing to be predicted from
    first = max(len(prefix) - 1, 0)  # the prefix is context, not part of the sentence's score
    at_k = [(k, p) for k in ks for p in pairs]
    items = [(place(prefix, ids[p.good], k, cfg.prefix_position), place(prefix, ids[p.bad], k, cfg.prefix_position))
             for k, p in at_k]
    # Pair-aware scoring: the shared start of a pair is computed once, identical sentences once.
    def score(its: list, bar: bool) -> list:
        return scorer.pair_logprobs(its, batch_size=cfg.batch_size, progress=bar, desc="pairs")

    lps = _in_units(ckpt, items, score, tag="pairs", progress=cfg.progress)
    rows = []
    for (k, p), (lp_good, lp_bad) in zip(at_k, lps):
        rows.append((p.paradigm, p.field, p.phenomenon, p.pair_id, k, float(lp_good[first:].sum()),
                     float(lp_bad[first:].sum()), len(ids[p.good]) - skip, len(ids[p.bad]) - skip))
    df = pd.DataFrame(rows, columns=["paradigm", "field", "phenomenon", "pair_id", "k", "logp_good", "logp_bad",
                                     "n_tokens_good", "n_tokens_bad"])
    df["margin"] = df.logp_good - df.logp_bad
    df["correct"] = df.margin > 0
    return df


# (k, pair) items or text windows per unit: the scoring runs block by block (so a block's batches never depend on
# what else is in the run), and each block is one checkpoint unit. Full BLiMP at two k: 132 units.
UNIT_ITEMS = 1024


def _in_units(ckpt: Checkpoint | None, items: list, score: Any, *, tag: str, progress: bool) -> list:
    """`score(block, show_bar)` over blocks of `UNIT_ITEMS` items, sharded under torchrun, each block read back
    from / stored in `ckpt`; the results in item order. One block shows the scorer's own progress bar, more show
    one bar over blocks."""
    ckpt = ckpt or Checkpoint(None, {})
    blocks = [items[a:a + UNIT_ITEMS] for a in range(0, len(items), UNIT_ITEMS)]
    inner = progress and len(blocks) == 1
    parts = ckpt.map(list(range(len(blocks))), lambda b: _sharded(lambda its: score(its, inner), blocks[b]),
                     name=lambda b: f"{tag}|{b}", desc=f"{tag} (blocks of {UNIT_ITEMS})",
                     progress=progress and not inner)
    return [x for part in parts for x in part]


def _sharded(score: Any, items: list) -> list:
    # Under torchrun each process scores every world-size-th item and all processes receive every result
    # in the original order (core.distributed); a single process scores everything in one call.
    from posprobe.core import distributed

    if not distributed.active():
        return score(items)
    mine = distributed.shard(items)
    got = score([it for _, it in mine]) if mine else []
    return distributed.gather_indexed([(i, lp) for (i, _), lp in zip(mine, got)])


def summarize_pairs(pairs: pd.DataFrame, *, n_boot: int, seed: int) -> pd.DataFrame:
    """Accuracy (with percentile bootstrap 95% CI), mean margin, flips and exact McNemar p vs k=0."""
    from posprobe.core.stats import bootstrap_ci, mcnemar_exact

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
                rows.append(
                    dict(
                        k=k,
                        level=level,
                        group=name,
                        n_pairs=len(g),
                        accuracy=float(c.mean()),
                        ci_low=lo,
                        ci_high=hi,
                        mean_margin=float(g.margin.mean()),
                        delta_accuracy=float(c.mean() - w.mean()),
                        flips=to_wrong + to_right,
                        flips_to_wrong=to_wrong,
                        flips_to_correct=to_right,
                        mcnemar_p=mcnemar_exact(to_wrong, to_right),
                    )
                )
    return pd.DataFrame(rows)


def score_text(
    scorer: Any, tokenizer: Any, text: str, cfg: ShiftConfig, prefix: list[int], ks: Sequence[int],
    ckpt: Checkpoint | None = None,
) -> pd.DataFrame:
    """Per-token loss (nats) of fixed windows of `text` at every k, by position inside the window."""
    from posprobe.data import token_windows

    # Tokenise only as much text as the windows need.
    chars = cfg.window * cfg.max_windows * 12
    ids = tokenizer(text[:chars], add_special_tokens=False).input_ids
    windows = token_windows(ids, cfg.window, max_windows=cfg.max_windows)
    items = [place(prefix, w, k, cfg.prefix_position) for k in ks for w in windows]
    lps = _in_units(ckpt, items, lambda its, bar: scorer.token_logprobs(its, batch_size=cfg.batch_size,
                                                                        progress=bar, desc="text windows"),
                    tag="text windows", progress=cfg.progress)
    rows = []
    first = len(prefix) - 1 if prefix else 0
    for j, (item, lp) in enumerate(zip(items, lps)):
        k, w = ks[j // len(windows)], j % len(windows)
        own = lp[first:].numpy()
        start = 0 if prefix else 1
        rows += [(k, w, start + t, -float(v)) for t, v in enumerate(own)]
    return pd.DataFrame(rows, columns=["k", "window", "pos", "loss"])


def config_meta(cfg: ShiftConfig) -> dict:
    """The config as a JSON-able dict."""
    d = asdict(cfg)
    d["ks"] = cfg.all_ks()
    return d


def check_pairs(pairs: Sequence[MinimalPair]) -> None:
    """Raise DataError for an empty pair list (nothing to score)."""
    if not pairs:
        raise DataError("Empty input: no minimal pairs to score")


@dataclass
class Prepared:
    """A model ready for the shift test: its scorer (None for encoders) and positional facts."""

    name: str
    scorer: Any
    tokenizer: Any
    positional_kind: str
    n_ctx: int
    is_encoder: bool
    backend: str
    tl_model: Any = None
    facts: Any = None  # the model's ModelFacts (meta["model"])


def prepare(model: Any, *, backend: str = "auto", device: str = "cpu", dtype: str = "float32",
            n_ctx: int | None = None) -> Prepared:
    """Pick the scoring backend: HF with native position_ids when weights are on disk, else TL hooks."""
    from posprobe.backend.facts import WrongModelKind, hf_facts, model_facts
    from posprobe.backend.sources import resolve
    from posprobe.core.scoring import HFScorer, TLScorer

    if backend not in ("auto", "hf", "tl"):
        raise ShiftError(f"backend must be auto, hf or tl; got {backend!r}")
    if not isinstance(model, str) and backend == "hf":
        return _prepare_hf_twin(model)
    if isinstance(model, str):
        src = resolve(model)
        from posprobe.backend.peek import peek

        early = peek(model)
        fam = getattr(early, "family", None)
        no_ids = backend == "auto" and fam is not None and not fam.hf_position_ids  # ALiBi: HF takes no ids
        if src.kind == "hf-dir" and backend != "tl" and not no_ids:
            from posprobe.backend.loading import load_hf_model

            if early is None or not early.is_encoder:  # encoders are scored through TL (representation drift)
                hf, tok = load_hf_model(model, dtype=dtype, device=device)
                facts = hf_facts(hf, src.name)
                ctx = facts.n_ctx
                return Prepared(src.name, HFScorer(hf, tok), tok, facts.positional_kind, min(ctx, n_ctx or ctx), False,
                                "hf", facts=facts)
        elif backend == "hf":
            raise ShiftError(f"{model} has no Hugging Face weights on disk; use backend 'tl'")
    from posprobe.backend.loading import load_model

    tl = load_model(model, device=device, dtype=dtype, n_ctx=n_ctx)
    f = model_facts(tl)
    fam = find_family(f.positional_kind)
    if fam is not None and fam.control is None:  # e.g. a model without positions: nothing to shift
        raise WrongModelKind(f"The shift test does not apply to {f.name}: {fam.why_no_control}")
    scorer = None if (f.is_encoder or not f.has_lm_head) else TLScorer(tl)
    return Prepared(f.name, scorer, tokenizer_of(tl), f.positional_kind, f.n_ctx, f.is_encoder, "tl", tl, f)


def _checkpoint(prep: Prepared, pairs: Sequence[MinimalPair] | None, text: str | None, cfg: ShiftConfig, *,
                work: str | Path | None, fresh: bool) -> Checkpoint:
    from posprobe.backend.model import weights_fingerprint
    from posprobe.core import distributed

    if work is None or prep.is_encoder:  # encoders' drift is one short pass: nothing worth keeping
        return Checkpoint(None, {})
    if distributed.active():
        import sys

        print("shift-test: no checkpoints under torchrun (every rank would write the same units)", file=sys.stderr)
        return Checkpoint(None, {})
    weights = prep.tl_model if prep.tl_model is not None else prep.scorer.model
    data = {"pairs": pairs_fingerprint(pairs) if pairs is not None else None,
            "text": text_sha256(text) if text is not None else None}
    key = run_key("shift-test", model={"facts": prep.facts.summary(), "backend": prep.backend,
                                       "weights": weights_fingerprint(weights)},
                  data=data, config=config_meta(cfg), unit_items=UNIT_ITEMS)
    return Checkpoint(work, key, fresh=fresh)


def hf_scorable(model: Any) -> bool:
    """True where `prepare(model, backend="hf")` can score a loaded model with Hugging Face's own forward: a
    TransformerBridge over a decoder with a trained LM head."""
    from posprobe.backend.facts import model_facts
    from posprobe.backend.kind import is_bridge

    if not is_bridge(model):
        return False
    f = model_facts(model)
    return not f.is_encoder and f.has_lm_head


def _prepare_hf_twin(model: Any) -> Prepared:
    # A loaded bridge scored through the plain HF model it wraps (shared weights): the fast path without a reload.
    from posprobe.backend.bridge import plain_hf_model
    from posprobe.backend.facts import hf_position_table, hf_positional_kind, model_facts
    from posprobe.backend.model import context_length, model_name
    from posprobe.core.scoring import HFScorer

    if not hf_scorable(model):
        raise ShiftError("backend 'hf' takes a model name or folder, or a TransformerBridge over a decoder with an LM "
                         f"head; got {type(model).__name__}")
    hf = plain_hf_model(model)
    tok = tokenizer_of(model)
    ctx = min(hf_position_table(hf) or context_length(model), context_length(model))
    return Prepared(model_name(model), HFScorer(hf, tok), tok, hf_positional_kind(hf), ctx, False, "hf", model,
                    model_facts(model))


def run_shift_test(
    model: Any,
    pairs: Sequence[MinimalPair] | None = None,
    *,
    text: str | None = None,
    config: ShiftConfig | None = None,
    data_source: str | None = None,
    backend: str = "auto",
    device: str = "cpu",
    dtype: str = "float32",
    work: str | Path | None = None,
    fresh: bool = False,
) -> ShiftResult:
    """Shift test of `model` (spec or TL object) on minimal pairs and/or text; returns a ShiftResult.

    All checks (k past the context, empty data, negative k) happen before any scoring.

    Args:
        model: a model spec (as `load_model` takes) or a loaded TL object, with learned, sinusoidal, rotary or
            ALiBi positions.
        pairs: the minimal pairs (`load_blimp`, `builtin_pairs` or your own). Without pairs or text, the built-in
            template pairs are used, 50 per paradigm.
        text: a text whose perplexity is measured at each k.
        config: the analysis's options (None: its Config's defaults).
        data_source: what meta.json's data record names as the pairs (default: "custom pairs"; the built-in
            pairs name themselves).
        backend: "hf" (position ids passed to Hugging Face's forward), "tl" (TransformerLens hooks) or "auto" (HF
            where the weights are on disk).
        device: where the model runs ("cpu", "cuda", ...).
        dtype: the weights' dtype when `model` is a spec posprobe loads.
        work: a folder where blocks of scored pairs and windows are kept as they complete; the same call resumes
            from it to the same tables (another model, data or config there is refused; not under torchrun, where
            it is ignored). None: no checkpoint.
        fresh: discard what `work` holds and start again.

    Returns:
        A ShiftResult with the non-empty ones of the tables `shift_pairs` (one row per k and pair, log-probs in
            nats), `shift_summary` (accuracy with bootstrap CI, margin, flips, McNemar p vs k=0 per k and level),
            `shift_tokens` (per-token loss of the text windows by k and position) and `shift_drift` (encoders:
            cosine of representations to k=0).

    Examples:
        >>> import posprobe as pp
        >>> cfg = pp.ShiftConfig(ks=(0, 50), n_bootstrap=50, progress=False)
        >>> result = pp.run_shift_test(pp.load_model("tiny-rope"), config=cfg)  # the built-in minimal pairs
        >>> sorted(result.tables)
        ['shift_pairs', 'shift_summary']
        >>> by_k = result.pairs.groupby("k").logp_good.mean()
        >>> bool(abs(by_k[50] - by_k[0]) < 1e-3)  # RoPE: starting every sentence at 50 changes no log-prob
        True
    """
    from posprobe.data import builtin_pairs

    cfg = config or ShiftConfig()
    ks = cfg.all_ks()
    if pairs is None and text is None:
        pairs, data_source = builtin_pairs(seed=cfg.seed, max_pairs=50), BUILTIN_SOURCE
    if pairs is not None:
        check_pairs(pairs)
    prep = prepare(model, backend=backend, device=device, dtype=dtype)
    moved_by = position_control(prep.positional_kind)
    if moved_by is None:
        raise ShiftError(f"The shift test needs learned, sinusoidal, rotary or ALiBi positions; {prep.name} uses "
                         f"{prep.positional_kind}")
    fam = find_family(prep.positional_kind)
    if fam is not None and not fam.hf_position_ids and prep.backend == "hf":
        raise ShiftError(f"{prep.name} uses {fam.label}, which Hugging Face computes without position ids: use backend "
                         f"'tl' (posprobe's {fam.label} position control)")
    kind, prefix = prefix_ids(prep.tokenizer, cfg.prefix) if not prep.is_encoder else ("cls-sep", [])
    # Absolute positions (ids into a table of n_ctx rows) stop at the context; relative ones may go past on request.
    limit = prep.n_ctx if (moved_by == "position ids" or not cfg.allow_beyond_context) else 10**12
    if pairs is not None:
        sents = sorted({s for p in pairs for s in (p.good, p.bad)})
        extra = 2 if prep.is_encoder else len(prefix)
        lengths = [len(prep.tokenizer(s, add_special_tokens=False).input_ids) + extra for s in sents]
        check_context(lengths, sents, ks, limit, "sentence")
    if text is not None:
        if not text.strip():
            raise ShiftError("Empty input: the text is empty")
        check_context([cfg.window + len(prefix)], ["text window"], ks, limit, "text window")
    pair_df, summary, tokens, drift = (pd.DataFrame() for _ in range(4))
    ckpt = _checkpoint(prep, pairs, text, cfg, work=work, fresh=fresh)
    if prep.is_encoder:
        drift = encoder_drift(prep.tl_model, [p.good for p in pairs] if pairs else [text[:2000]], ks, cfg)
    else:
        if pairs is not None:
            pair_df = score_pairs(prep.scorer, prep.tokenizer, pairs, cfg, prefix, ks, ckpt)
            summary = summarize_pairs(pair_df, n_boot=cfg.n_bootstrap, seed=cfg.seed)
        if text is not None:
            tokens = score_text(prep.scorer, prep.tokenizer, text, cfg, prefix, ks, ckpt)
    for df in (pair_df, tokens, drift):
        if len(df):
            df.insert(0, "model", prep.name)
    model_meta = prep.facts.summary()
    if pairs is not None:
        data = data_meta(data_source or "custom pairs", n_items=len(pairs), unit="pairs",
                         sha256=pairs_fingerprint(pairs))
    else:
        data = data_meta("text", n_items=len(tokens) if len(tokens) else len(drift), unit="tokens",
                         sha256=text_sha256(text))
    data["builtin"] = data_source == BUILTIN_SOURCE
    meta = make_meta(
        "shift-test", model={**model_meta, "backend": prep.backend}, data=data, config=config_meta(cfg),
        prefix=dict(kind=kind, ids=prefix, position=cfg.prefix_position,
                    tokens=prep.tokenizer.convert_ids_to_tokens(prefix) if prefix else []),
        text=None if text is None else dict(sha256=text_sha256(text), window=cfg.window, max_windows=cfg.max_windows),
    )
    if len(pair_df):
        base = pair_df[pair_df.k == 0].set_index(["paradigm", "pair_id"])
        dev = {
            int(k): float(
                (g.set_index(["paradigm", "pair_id"])[["logp_good", "logp_bad"]] - base[["logp_good", "logp_bad"]])
                .abs()
                .max()
                .max()
            )
            for k, g in pair_df.groupby("k")
        }
        meta["max_abs_logp_change_vs_k0"] = dev
    if len(tokens):
        meta["perplexity"] = ppl_by_k(tokens).to_dict("records")
    if fam is not None and fam.shift_invariant:
        meta["note"] = (f"{fam.label} model: the shift moves queries and keys together, so scores depend only on "
                        "relative positions and must not change with k. This run is an invariance control; "
                        "max_abs_logp_change_vs_k0 is the measured deviation (float rounding).")
    tables = {"shift_pairs": pair_df, "shift_summary": summary, "shift_tokens": tokens, "shift_drift": drift}
    return ShiftResult({k: v for k, v in tables.items() if len(v)}, meta)


@torch.inference_mode()
def encoder_drift(model: Any, sentences: Sequence[str], ks: Sequence[int], cfg: ShiftConfig) -> pd.DataFrame:
    """Cosine similarity of each layer's token representations (and the mean-pooled sentence vector)
    at shift k to the same at k = 0, averaged over tokens/sentences. For encoders without an LM head."""
    from posprobe.backend.hooks import encoder_layer_hooks, hooked
    from posprobe.core.positions import learned_positions

    tok = tokenizer_of(model)
    enc = [tok(s).input_ids for s in sentences]
    layers = n_layers(model)
    names = encoder_layer_hooks(model)
    reps: dict[int, list[list[torch.Tensor]]] = {}
    for k in ks:
        out: list[list[torch.Tensor]] = [[] for _ in names]
        for start in range(0, len(enc), cfg.batch_size):
            chunk = enc[start : start + cfg.batch_size]
            n = max(map(len, chunk))
            ids = torch.zeros((len(chunk), n), dtype=torch.long)
            mask = torch.zeros((len(chunk), n), dtype=torch.long)
            for r, e in enumerate(chunk):
                ids[r, : len(e)], mask[r, : len(e)] = torch.tensor(e), 1
            got: dict[str, torch.Tensor] = {}
            hooks = [(nm, lambda x, hook, nm=nm: got.__setitem__(nm, x.detach())) for nm in names]
            with hooked(model, hooks), learned_positions(model, torch.arange(n) + k):
                forward(model, ids, attention_mask=mask)
            for i, nm in enumerate(names):
                out[i] += [got[nm][r, : len(e)] for r, e in enumerate(chunk)]
        reps[k] = out
    rows = []
    for k in ks:
        for i, label in enumerate(["embeddings"] + [str(l) for l in range(layers)]):
            cos = torch.cat([torch.cosine_similarity(a, b, dim=-1) for a, b in zip(reps[k][i], reps[0][i])])
            rows.append((k, label, "token", float(cos.mean())))
        pooled = torch.stack(
            [torch.cosine_similarity(a.mean(0), b.mean(0), dim=0) for a, b in zip(reps[k][-1], reps[0][-1])]
        )
        rows.append((k, "pooled", "sentence", float(pooled.mean())))
    return pd.DataFrame(rows, columns=["k", "layer", "unit", "cosine_to_k0"])


def _atlas_run(model: Any, r: AtlasRun) -> Result:
    from posprobe.backend.model import device_of, dtype_of
    from posprobe.data import BUILTIN_SOURCE, builtin_pairs

    c, fam = r.config, r.facts.family
    return run_shift_test(
        model, builtin_pairs(max_pairs=c.max_pairs, seed=c.seed),
        config=ShiftConfig(ks=r.ks, seed=c.seed, n_bootstrap=200, allow_beyond_context=False, progress=c.progress),
        data_source=BUILTIN_SOURCE,
        # The loaded weights through HF's own forward, except where HF takes no position ids (ALiBi).
        backend="hf" if hf_scorable(model) and (fam is None or fam.hf_position_ids) else "auto",
        device=str(device_of(model)), dtype=str(dtype_of(model)).replace("torch.", ""))


def _atlas_headlines(part: Result) -> list[tuple[str, float]]:
    rows: list[tuple[str, float]] = []
    s = part.tables.get("shift_summary", pd.DataFrame())
    if len(s):
        rows += [(f"accuracy_k{int(r.k)}", float(r.accuracy)) for r in s[s.level == "overall"].sort_values("k")
                 .itertuples()]
    d = part.tables.get("shift_drift", pd.DataFrame())
    if len(d):
        rows += [(f"pooled_cosine_k{int(r.k)}", float(r.cosine_to_k0)) for r in d[d.layer == "pooled"].sort_values("k")
                 .itertuples()]
    dev = part.meta.get("max_abs_logp_change_vs_k0")
    if dev:
        rows.append(("max_abs_logp_change", float(max(dev.values()))))
    return rows


def _compare(m: ModelEntry, run: CompareRun) -> Any:
    from posprobe.backend.model import device_of, dtype_of
    from posprobe.data import builtin_pairs

    text, cfg = run.text, run.config
    if (why := why_not("shift", m.facts)) is not None:
        return why
    # The text window and its prefix token must fit at the largest k; the built-in pairs are shorter than it.
    fit = tuple(k for k in cfg.ks if k + cfg.shift_window + 1 <= m.facts.n_ctx)
    if m.facts.is_encoder:
        return ("an encoder: its shift test measures representation drift (posprobe shift-test), not the perplexity "
                "and pair accuracy compared here")
    if len(fit) < 2:
        return (f"no shift k > 0 of {list(cfg.ks)} fits a {cfg.shift_window}-token window in the model's "
                f"{m.facts.n_ctx} positions")
    got = run_shift_test(m.model, builtin_pairs(max_pairs=cfg.max_pairs, seed=cfg.seed), text=text,
                         config=ShiftConfig(ks=fit, window=cfg.shift_window, max_windows=cfg.max_windows,
                                            n_bootstrap=200, seed=cfg.seed, progress=False),
                         backend="hf" if hf_scorable(m.model) else "auto", device=str(device_of(m.model)),
                         dtype=str(dtype_of(m.model)).replace("torch.", ""))
    summary = got.summary
    overall = summary[summary.level == "overall"].drop(columns=["level", "group"]) if len(summary) else summary
    ppl = pd.DataFrame(got.meta.get("perplexity") or [])  # an encoder's text is not scored as perplexity
    return {"shift_summary": overall, "shift_perplexity": ppl}, {"ks": list(fit)}


ATLAS_SECTION = register(AtlasSection("shift", "Shift test", _atlas_run, _atlas_headlines,
                                      shift_report.atlas_paragraph,
                                      blocked=lambda facts, engine_runs: (facts.unsupported,),
    compare=_compare, compare_page=shift_report.compare_section))
