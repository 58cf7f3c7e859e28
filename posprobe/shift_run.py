"""Run the shift test end to end on a model spec or object: choose the scorer, check, score, summarise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import pandas as pd
import torch

from posprobe.data import BUILTIN_SOURCE, MinimalPair, pairs_fingerprint
from posprobe.shift import (ShiftConfig, ShiftError, ShiftResult, check_context, check_pairs, config_meta,
                            ppl_by_k, prefix_ids, score_pairs, score_text, summarise)


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


def _hf_kind(config: Any) -> str:
    d = config.to_dict()
    if d.get("model_type") in ("bloom", "mpt"):
        return "alibi"
    if any(key in d for key in ("rope_theta", "rope_parameters", "rotary_dim", "rotary_pct", "rope_scaling")):
        return "rotary"
    return "learned_absolute"


def prepare(model: Any, *, backend: str = "auto", device: str = "cpu", dtype: str = "float32",
            n_ctx: int | None = None) -> Prepared:
    """Pick the scoring backend: HF with native position_ids when weights are on disk, else TL hooks."""
    from posprobe.scoring import HFScorer, TLScorer
    from posprobe.sources import read_hf_config, resolve

    if backend not in ("auto", "hf", "tl"):
        raise ShiftError(f"backend must be auto, hf or tl; got {backend!r}")
    if isinstance(model, str):
        src = resolve(model)
        if src.kind == "hf-dir" and backend != "tl":
            from posprobe.models import hf_folder, load_hf_model

            arch = (read_hf_config(hf_folder(src)).get("architectures") or [""])[0]
            if not arch.startswith("Bert"):
                hf, tok = load_hf_model(model, dtype=dtype, device=device)
                ctx = getattr(hf.config, "max_position_embeddings", None) or getattr(hf.config, "n_positions")
                return Prepared(src.name, HFScorer(hf, tok), tok, _hf_kind(hf.config), min(ctx, n_ctx or ctx), False, "hf")
        elif backend == "hf":
            raise ShiftError(f"{model} has no Hugging Face weights on disk; use backend 'tl'")
    from posprobe.facts import model_facts
    from posprobe.models import load_model

    tl = load_model(model, device=device, dtype=dtype, n_ctx=n_ctx)
    f = model_facts(tl)
    scorer = None if (f.is_encoder or not f.has_lm_head) else TLScorer(tl)
    return Prepared(f.name, scorer, tl.tokenizer, f.positional_kind, f.n_ctx, f.is_encoder, "tl", tl)


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
) -> ShiftResult:
    """Shift test of `model` (spec or TL object) on minimal pairs and/or text; returns a ShiftResult.

    Without pairs or text, the built-in template pairs are used. All checks (k past the context,
    empty data, negative k) happen before any scoring.
    """
    from posprobe.data import builtin_pairs

    cfg = config or ShiftConfig()
    ks = cfg.all_ks()
    if pairs is None and text is None:
        pairs, data_source = builtin_pairs(seed=cfg.seed, max_pairs=50), BUILTIN_SOURCE
    if pairs is not None:
        check_pairs(pairs)
    prep = prepare(model, backend=backend, device=device, dtype=dtype)
    if prep.positional_kind not in ("learned_absolute", "rotary"):
        raise ShiftError(f"The shift test needs learned or rotary positions; {prep.name} uses {prep.positional_kind}")
    kind, prefix = prefix_ids(prep.tokenizer, cfg.prefix) if not prep.is_encoder else ("cls-sep", [])
    limit = prep.n_ctx if (prep.positional_kind == "learned_absolute" or not cfg.allow_beyond_context) else 10**12
    if pairs is not None:
        sents = sorted({s for p in pairs for s in (p.good, p.bad)})
        extra = 2 if prep.is_encoder else len(prefix)
        lengths = [len(prep.tokenizer(s, add_special_tokens=False).input_ids) + extra for s in sents]
        check_context(lengths, sents, ks, limit, "sentence")
    if text is not None:
        if not text.strip():
            raise ShiftError("Empty input: the text is empty")
        check_context([cfg.window + len(prefix)], ["text window"], ks, limit, "text window")
    empty = pd.DataFrame()
    pair_df, summary, tokens, drift = empty, empty, empty, empty
    if prep.is_encoder:
        drift = encoder_drift(prep.tl_model, [p.good for p in pairs] if pairs else [text[:2000]], ks, cfg)
    else:
        if pairs is not None:
            pair_df = score_pairs(prep.scorer, prep.tokenizer, pairs, cfg, prefix, ks)
            summary = summarise(pair_df, n_boot=cfg.n_bootstrap, seed=cfg.seed)
        if text is not None:
            tokens = score_text(prep.scorer, prep.tokenizer, text, cfg, prefix, ks)
    for df in (pair_df, tokens, drift):
        if len(df):
            df.insert(0, "model", prep.name)
    from posprobe.results import environment_meta

    meta = dict(
        analysis="shift-test", model=prep.name, positional_kind=prep.positional_kind, n_ctx=prep.n_ctx,
        backend=prep.backend, config=config_meta(cfg), prefix=dict(kind=kind, ids=prefix,
        tokens=prep.tokenizer.convert_ids_to_tokens(prefix) if prefix else [], position=cfg.prefix_position),
        data=dict(source=data_source or ("custom pairs" if pairs is not None else None),
                  n_pairs=len(pairs) if pairs is not None else 0,
                  fingerprint=pairs_fingerprint(pairs) if pairs is not None else None,
                  builtin=data_source == BUILTIN_SOURCE),
        environment=environment_meta(),
    )
    if len(pair_df):
        base = pair_df[pair_df.k == 0].set_index(["paradigm", "pair_id"])
        dev = {int(k): float((g.set_index(["paradigm", "pair_id"])[["logp_good", "logp_bad"]] - base[["logp_good", "logp_bad"]]).abs().max().max())
               for k, g in pair_df.groupby("k")}
        meta["max_abs_logp_change_vs_k0"] = dev
    if len(tokens):
        meta["perplexity"] = ppl_by_k(tokens).to_dict("records")
    if prep.positional_kind == "rotary":
        meta["note"] = ("RoPE model: the shift moves queries and keys together, so scores depend only on relative "
                        "positions and must not change with k. This run is an invariance control; "
                        "max_abs_logp_change_vs_k0 is the measured deviation (float rounding).")
    return ShiftResult(pair_df, summary, tokens, drift, meta)


@torch.inference_mode()
def encoder_drift(model: Any, sentences: Sequence[str], ks: Sequence[int], cfg: ShiftConfig) -> pd.DataFrame:
    """Cosine similarity of each layer's token representations (and the mean-pooled sentence vector)
    at shift k to the same at k = 0, averaged over tokens/sentences. For encoders without an LM head."""
    from posprobe.hooks import hooked
    from posprobe.positions import learned_positions

    tok = model.tokenizer
    enc = [tok(s).input_ids for s in sentences]
    n_layers = model.cfg.n_layers
    names = ["embed.ln.hook_normalized"] + [f"blocks.{l}.hook_normalized_resid_post" for l in range(n_layers)]
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
                model(ids, one_zero_attention_mask=mask)
            for i, nm in enumerate(names):
                out[i] += [got[nm][r, : len(e)] for r, e in enumerate(chunk)]
        reps[k] = out
    rows = []
    for k in ks:
        for i, label in enumerate(["embeddings"] + [str(l) for l in range(n_layers)]):
            cos = torch.cat([torch.cosine_similarity(a, b, dim=-1) for a, b in zip(reps[k][i], reps[0][i])])
            rows.append((k, label, "token", float(cos.mean())))
        pooled = torch.stack([torch.cosine_similarity(a.mean(0), b.mean(0), dim=0) for a, b in zip(reps[k][-1], reps[0][-1])])
        rows.append((k, "pooled", "sentence", float(pooled.mean())))
    return pd.DataFrame(rows, columns=["k", "layer", "unit", "cosine_to_k0"])


__all__ = ["run_shift_test", "prepare", "encoder_drift"]
