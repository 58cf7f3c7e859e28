"""Long-context harness: how far past its trained context does each surgery preset keep a RoPE model
working, and what does it cost inside the trained context?

Two measurements, both on one plain Hugging Face model run through `posprobe.core.long_engine`
(no T x T tensors, memory linear in length):
  * loss by position: NLL (nats/token) of token t+1 at query position t on long windows of a text,
    binned (`long_context` table), plus per preset and length the mean inside the trained context, the mean
    beyond it, and the break position (`long_context_summary`);
  * passkey retrieval (Mohtashami & Jaggi 2023; the format Self-Extend and others report): a 5-digit key
    hidden at a depth in built-in filler, asked for at the end; the greedy answer's first run of digits must
    equal the key exactly (`passkey` per trial, `passkey_accuracy` per length x depth x preset).
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from posprobe.analyses.configs import LongContextConfig
from posprobe.analyses.retrieval import answer_heads
from posprobe.backend.facts import hf_facts, hf_position_table, hf_positional_kind, hf_trained_context
from posprobe.backend.families import ROTARY
from posprobe.backend.kind import is_bridge
from posprobe.backend.model import hf_model_name, model_name, tokenizer_of, weights_fingerprint
from posprobe.core import long_engine as LA
from posprobe.core.presets import preset_pairs
from posprobe.core.stats import wilson_ci
from posprobe.core.surgery import PairRule
from posprobe.data.needles import (
    PASSKEY_FILLER,
    PASSKEY_INTRO,
    PASSKEY_NEEDLE,
    PASSKEY_QUESTION,
    PasskeyPrompt,
    _bos,
    _encode,
    needle_prompt,
    passkey_prompt,
)
from posprobe.data.needles import TASKS as NEEDLE_TASKS
from posprobe.report.checkpoint import Checkpoint, run_key
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256

__all__ = ["LongContextConfig", "run_long_context", "passkey_prompt", "PasskeyPrompt", "binned_loss",
           "summarize_nll", "PASSKEY_INTRO", "PASSKEY_FILLER", "PASSKEY_NEEDLE", "PASSKEY_QUESTION"]


def binned_loss(nll: torch.Tensor, bin_size: int) -> list[tuple[int, int, float, int]]:
    """(bin_start, bin_end exclusive, mean, count) of a `[window, query_pos]` NLL array, bins of query_pos."""
    out = []
    for a in range(0, nll.shape[-1], bin_size):
        part = nll[..., a:a + bin_size]
        out.append((a, a + part.shape[-1], float(part.mean()), int(part.numel())))
    return out


def summarize_nll(nll: torch.Tensor, ctx: int, *, bin_size: int, warmup: int, margin: float,
              span: int | None = None) -> dict[str, float]:
    """Per preset and length (NLL `[window, query_pos]`, nats/token): `in_context_nll` (query_pos < ctx),
    `beyond_context_nll` (query_pos >= ctx; NaN if the windows stay inside), `break_pos`: first bin start
    a >= warmup where the mean over query positions [a, a + span) exceeds the mean over [warmup, ctx) by
    `margin` (-1: none; NaN: no reference span). `span` (default one bin) averages out hard passages of the
    text, which single bins of one window do not."""
    inside = nll[..., :ctx]
    beyond = nll[..., ctx:]
    ref_span = nll[..., warmup:ctx]
    out = {"in_context_nll": float(inside.mean()),
           "beyond_context_nll": float(beyond.mean()) if beyond.numel() else float("nan")}
    if not ref_span.numel():
        out["break_pos"] = float("nan")
        return out
    ref = float(ref_span.mean())
    span = span or bin_size
    hits = [a for a in range(0, nll.shape[-1], bin_size)
            if a >= warmup and float(nll[..., a:a + span].mean()) > ref + margin]
    out["break_pos"] = float(hits[0]) if hits else -1.0
    return out


def _parts(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    hf, tok = model, tokenizer
    if tok is None:
        raise ValueError("give the tokenizer (run_long_context(model, text, config, tokenizer=...))")
    if not hasattr(hf, "get_decoder") or not hasattr(hf, "get_output_embeddings"):
        raise ValueError(f"the long-context harness needs a Hugging Face causal LM; got {type(hf).__name__}")
    return hf, tok


def _check(hf: Any, tok: Any, n_tokens: int, rules: dict[str, PairRule], cfg: LongContextConfig, text: str) -> int:
    """Every check that can fail, before any forward; returns the trained context."""
    if any(not r.identity for r in rules.values()):
        LA.require_supported(hf)
    if hf_positional_kind(hf) != ROTARY:
        table = hf_position_table(hf)
        longest_any = max((*cfg.lengths, *(cfg.passkey_lengths or ())))
        if table and longest_any > table:
            raise ValueError(f"length {longest_any} is past this model's {table} learned positions")
    ctx = cfg.trained_ctx or hf_trained_context(hf)
    if ctx is None:
        raise ValueError("the model config does not give its trained context; pass trained_ctx (--trained-ctx)")
    longest = max(cfg.lengths)
    if n_tokens < longest:
        raise ValueError(f"the text has {n_tokens} tokens, shorter than the longest length {longest}; "
                         "give a longer text or shorter lengths")
    for rule in rules.values():
        for L in cfg.lengths:
            LA.check_memory(hf, L, rule, chunk=cfg.chunk)
        for L in cfg.passkey_lengths or ():
            LA.check_memory(hf, L, rule, chunk=cfg.chunk, cache=True)
    for L in cfg.passkey_lengths or ():
        for task in cfg.tasks:  # long enough for each task's fixed parts
            if task == "passkey":
                passkey_prompt(tok, L, 0.5, "12345")
            else:
                needle_prompt(tok, task, L, 0.5, cfg.seed, text=text)
    return ctx


def _keys(cfg: LongContextConfig) -> dict[tuple[int, float, int], str]:
    # One key per (length, depth, trial), the same for every preset: presets are compared on the same prompts.
    rng = random.Random(cfg.seed)
    return {(L, d, t): str(rng.randint(10000, 99999)) for L in cfg.passkey_lengths or () for d in cfg.depths
            for t in range(cfg.trials)}


def run_long_context(model: Any, text: str | None, config: LongContextConfig | None = None, *, tokenizer: Any = None,
                     name: str | None = None, source: str | None = None, work: str | Path | None = None,
                     fresh: bool = False) -> Result:
    """Loss by position and passkey retrieval per preset and length.

    Batch of one sequence; every check (presets, learned positions, text length, memory) runs before the first
    forward pass. meta["beyond_context"] lists the lengths (loss and passkey) past the model's context
    (max_position_embeddings), which `trained_ctx` may set apart from.

    Args:
        model: a plain Hugging Face causal LM and its `tokenizer` (`load_hf_model`), or a TransformerBridge over a
            RoPE decoder (`load_model`; its wrapped HF model runs, with the same numbers).
        text: required (the CLI's --text; None is a ValueError): the loss is measured on its windows, which
            posprobe's short built-in text cannot fill at these lengths.
        config: the analysis's options (None: its Config's defaults).
        tokenizer: the tokenizer of a plain HF `model`; for a bridge it defaults to the bridge's, which, as TL
            does, puts BOS first.
        name: the model's name in the tables (default: the model's own).
        source: what meta.json's data record names as the text (default: "text").
        work: a folder where each window's losses and each passkey trial are kept as they complete
            (`posprobe.report.checkpoint`); calling again with the same folder resumes, and the tables equal an
            uninterrupted run's exactly. Another model, text or config there is refused. The folder is left in
            place (delete it with `discard_work_folder` once the result is saved). None: no checkpoint.
        fresh: discard what `work` holds and start again.

    Returns:
        A Result with tables `long_context`, `long_context_summary` and (with passkey lengths) `passkey`,
            `passkey_accuracy`.

    Examples:
        >>> import posprobe as pp
        >>> from posprobe.data import BUILTIN_TEXT
        >>> cfg = pp.LongContextConfig(lengths=(64,), presets=("none", "pi:scale=2"), bin_size=16, warmup=16,
        ...                            break_span=16, progress=False)
        >>> summary = pp.run_long_context(pp.load_model("tiny-rope"), BUILTIN_TEXT, cfg).tables["long_context_summary"]
        >>> summary[summary.metric == "in_context_nll"].preset.tolist()
        ['none', 'pi:scale=2']
    """
    cfg = config or LongContextConfig()
    if text is None:
        raise ValueError("give a text (the CLI's --text): the loss by position is measured on its windows")
    if is_bridge(model):
        # A bridge re-implements attention, which a registered attention function would never reach: run the HF
        # model it wraps with HF's own attention modules (the bridge's other components stay in place).
        from posprobe.backend.fast_attention import hf_model_inside

        with hf_model_inside(model) as hf:
            return run_long_context(hf, text, cfg, tokenizer=tokenizer or tokenizer_of(model),
                                    name=name or model_name(model), source=source, work=work, fresh=fresh)
    hf, tok = _parts(model, tokenizer)
    rules = {spec: preset_pairs(spec) for spec in cfg.presets}
    ids = _bos(tok) + _encode(tok, text)
    ctx = _check(hf, tok, len(ids), rules, cfg, text)
    name = name or hf_model_name(hf)
    bos = _bos(tok)
    body = ids[len(bos):]
    rows, summary = [], []
    windows: dict[int, list[list[int]]] = {}
    for L in cfg.lengths:
        n = max(1, min(cfg.max_windows, len(body) // (L - len(bos))))
        windows[L] = [bos + body[s:s + L - len(bos)] for s in range(0, n * (L - len(bos)), L - len(bos))]
    model_facts = hf_facts(hf, name)
    facts = model_facts.summary()
    table = model_facts.n_ctx  # max_position_embeddings, as the atlas and retrieval read it
    longest = sorted({*cfg.lengths, *(cfg.passkey_lengths or ())})
    beyond = {"context": table or None, "lengths": [L for L in longest if table and L > table]}
    data = data_meta(source or "text", n_items=sum(len(w) for w in windows.values()), unit="windows",
                     sha256=text_sha256(text))
    ckpt = Checkpoint(work, run_key("long-context", model={"facts": facts, "weights": weights_fingerprint(hf)},
                                    data=data, config=cfg), fresh=fresh)
    units = [(L, spec, w) for L in cfg.lengths for spec in cfg.presets for w in range(len(windows[L]))]
    nlls = ckpt.map(units, lambda u: LA.token_nll(hf, torch.tensor(windows[u[0]][u[2]]), rules[u[1]], chunk=cfg.chunk),
                    name=lambda u: f"loss|{u[1]}|{u[0]}|{u[2]}", desc="long-context loss", progress=cfg.progress,
                    noun="windows")
    by_run: dict[tuple[int, str], list[torch.Tensor]] = {}
    for (L, spec, _), v in zip(units, nlls):
        by_run.setdefault((L, spec), []).append(v)
    for (L, spec), parts in by_run.items():
        nll = torch.stack(parts)
        for a, b, v, c in binned_loss(nll, cfg.bin_size):
            rows.append(dict(model=name, preset=spec, length=L, bin_start=a, bin_end=b, metric="nll", value=v, count=c))
        stats = summarize_nll(
            nll, ctx, bin_size=cfg.bin_size, warmup=cfg.warmup, margin=cfg.margin, span=cfg.break_span
        )
        for metric, v in stats.items():
            summary.append(dict(model=name, preset=spec, length=L, metric=metric, value=v, count=len(windows[L])))
    tables = {"long_context": pd.DataFrame(rows), "long_context_summary": pd.DataFrame(summary)}
    if cfg.passkey_lengths and "passkey" in cfg.tasks:
        tables.update(_passkey(hf, tok, rules, cfg, name, ckpt))
    if cfg.passkey_lengths and any(t != "passkey" for t in cfg.tasks):
        tables.update(_needles(hf, tok, rules, cfg, name, ckpt, text))
    meta = make_meta("long-context", model=facts, data=data, config=cfg, trained_ctx=ctx,
                     plan={spec: r.label for spec, r in rules.items()},
                     plan_meta={spec: dict(r.meta) for spec, r in rules.items()},
                     passkey_format={"intro": PASSKEY_INTRO, "filler": PASSKEY_FILLER, "needle": PASSKEY_NEEDLE,
                                     "question": PASSKEY_QUESTION},
                     needle_tasks={t: asdict(NEEDLE_TASKS[t]) for t in cfg.tasks if t != "passkey"},
                     beyond_context=beyond,
                     checkpoint={"folder": str(work) if work is not None else None, "resumed_units": ckpt.resumed})
    return Result(tables, meta)


def _passkey(
    hf: Any, tok: Any, rules: dict[str, PairRule], cfg: LongContextConfig, name: str, ckpt: Checkpoint
) -> dict[str, pd.DataFrame]:
    keys = _keys(cfg)
    eos = getattr(tok, "eos_token_id", None)

    def trial(u: tuple[str, int, float, int]) -> dict:
        spec, L, d, t = u
        p = passkey_prompt(tok, L, d, keys[(L, d, t)])
        new = LA.greedy_decode(hf, torch.tensor(p.ids), rules[spec], cfg.new_tokens, chunk=cfg.chunk, stop_token=eos)
        answer = tok.decode(new.tolist(), skip_special_tokens=True)
        digits = re.search(r"\d+", answer)
        pred = digits.group(0) if digits else ""
        return dict(model=name, preset=spec, length=L, depth=d, trial=t, target=p.key, prediction=pred,
                    exact_match=pred == p.key, needle_pos=p.needle_pos)

    todo = [(spec, L, d, t) for spec in cfg.presets for (L, d, t) in keys]
    rows = ckpt.map(todo, trial, name=lambda u: f"passkey|{u[0]}|{u[1]}|{u[2]!r}|{u[3]}", desc="passkey",
                    progress=cfg.progress, noun="answers")
    trials = pd.DataFrame(rows)
    acc = (trials.groupby(["model", "preset", "length", "depth"], sort=False)
           .agg(value=("exact_match", "mean"), count=("exact_match", "size")).reset_index())
    acc.insert(4, "metric", "accuracy")
    return {"passkey": trials, "passkey_accuracy": _with_wilson(acc)}


def _with_wilson(acc: pd.DataFrame) -> pd.DataFrame:
    # A proportion of 0/1 answers gets its 95% Wilson interval over trials (ci_low, ci_high); a mean of fractional
    # scores (multi-value needle tasks) is no proportion and gets NaN.
    lo, hi = [], []
    for v, n in zip(acc.value, acc["count"]):
        k = v * n
        ok = abs(k - round(k)) < 1e-9
        a, b = wilson_ci(int(round(k)), int(n)) if ok else (float("nan"), float("nan"))
        lo.append(a)
        hi.append(b)
    return acc.assign(ci_low=lo, ci_high=hi)


def _needles(hf: Any, tok: Any, rules: dict[str, PairRule], cfg: LongContextConfig, name: str, ckpt: Checkpoint,
             text: str) -> dict[str, pd.DataFrame]:
    # Every needle task at every passkey length x depth x trial, the same prompt for every preset (seeded by the
    # trial), scored with RULER's string_match_all. Greedy decoding stops once every target has appeared: the score
    # of a longer answer would be the same.
    tasks = [t for t in cfg.tasks if t != "passkey"]

    def trial(u: tuple[str, str, int, float, int]) -> dict:
        task, spec, L, d, t = u
        p = needle_prompt(tok, task, L, d, cfg.seed * 1000 + t, text=text)
        budget = cfg.needle_tokens or NEEDLE_TASKS[task].answer_tokens()
        got = answer_heads(hf, tok, p, rules[spec], budget, chunk=cfg.chunk, heads=False)
        first = next(n.start for n in p.needles if n.asked)
        return dict(model=name, task=task, preset=spec, length=L, depth=d, trial=t, targets=" | ".join(p.targets),
                    answer=got["answer"], score=got["score"], needle_pos=first, needles=len(p.needles))

    todo = [(task, spec, L, d, t) for task in tasks for spec in cfg.presets for L in cfg.passkey_lengths or ()
            for d in cfg.depths for t in range(cfg.trials)]
    rows = ckpt.map(todo, trial, name=lambda u: f"needle|{u[0]}|{u[1]}|{u[2]}|{u[3]!r}|{u[4]}", desc="needles",
                    progress=cfg.progress, noun="answers")
    trials = pd.DataFrame(rows)
    acc = (trials.groupby(["model", "task", "preset", "length", "depth"], sort=False)
           .agg(value=("score", "mean"), count=("score", "size")).reset_index())
    acc.insert(5, "metric", "string_match_all")
    binary = trials.groupby(["model", "task", "preset", "length", "depth"], sort=False).score.agg(
        lambda x: bool(x.isin([0.0, 1.0]).all())).to_numpy()
    acc = _with_wilson(acc)
    acc.loc[~binary, ["ci_low", "ci_high"]] = float("nan")
    return {"needles": trials, "needle_accuracy": acc}
