"""Retrieval heads (Wu et al., ICLR 2025): which heads copy the needle while the model answers, and what happens to
the answers when they are masked — under each surgery preset, on one plain Hugging Face model run through the
long-context engine (`posprobe.core.long_engine`: no T x T tensors; preset "none" keeps every position).

Per answer step s (the forward that produces token w_s) and query head h, the engine hands over the last query's
attention weights a_h. Head h *copies* at step s when its most-attended key j = argmax a_h lies inside an asked
needle's value and the token at j is w_s. Retrieval score of h on a prompt = |distinct value tokens h copied| /
|value tokens| (Wu et al.'s |g_h ∩ k| / |k|), averaged over prompts; `needle_mass` = mean over steps of a_h summed
over the value tokens; `answer_first_mass` = mean over steps of a_h on the first token. Masking zeroes a head's
output before the output projection; the needle accuracy (RULER's string_match_all) with the top-k heads masked is
compared with k random other heads (seeded draws), with 95% intervals over prompts: Wilson score intervals where every
task scores 0 or 1 (one asked value), else percentile-bootstrap intervals of the mean.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import torch

from posprobe.analyses.configs import RetrievalConfig
from posprobe.analyses.sections import AtlasRun, AtlasSection, register
from posprobe.backend.facts import hf_facts
from posprobe.backend.kind import is_bridge
from posprobe.backend.model import hf_model_name, model_name, tokenizer_of, weights_fingerprint
from posprobe.core import long_engine as LA
from posprobe.core.presets import preset_pairs
from posprobe.core.stats import bootstrap_ci, wilson_ci
from posprobe.data import BUILTIN_TEXT
from posprobe.data.needles import TASKS, NeedlePrompt, needle_prompt, string_match_all
from posprobe.report import retrieval as retrieval_report
from posprobe.report.checkpoint import Checkpoint, run_key
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256

__all__ = ["RetrievalConfig", "run_retrieval", "answer_heads", "value_tokens"]


def value_tokens(tokenizer: Any, prompt: NeedlePrompt) -> list[int]:
    """Positions of the asked needles' value tokens: each value span without the leading tokens that are only
    whitespace and the trailing ones that are only punctuation (the full stop after a number, a JSON quote)."""
    out: list[int] = []
    for n in (n for n in prompt.needles if n.asked):
        span = list(range(n.value_start, n.value_end))

        def empty(i: int) -> bool:
            return not tokenizer.decode([prompt.ids[i]]).strip(" \n\t.,\"'")

        while span and empty(span[0]):
            span.pop(0)
        while span and empty(span[-1]):
            span.pop()
        out += span
    return out


def answer_heads(hf: Any, tokenizer: Any, prompt: NeedlePrompt, rule: Any, budget: int, *, chunk: int = 256,
                 masked: dict[int, tuple[int, ...]] | None = None, heads: bool = True) -> dict[str, Any]:
    """The greedy answer to one needle prompt under `rule` (decoding stops once every target has appeared), its
    score, and with `heads` per layer and query head: retrieval score, needle mass and first-token mass (`[layer,
    head]` float64 tensors), from the engine's attention weights of every answer step."""
    eos = getattr(tokenizer, "eos_token_id", None)
    values = value_tokens(tokenizer, prompt)
    if heads and not values:
        raise ValueError(f"the {prompt.task} prompt's needle value has no tokens to copy")
    idx = torch.tensor(values, dtype=torch.long)
    steps: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def record(layer: int, w: torch.Tensor) -> None:
        w = w.detach().double().cpu()
        steps.setdefault(layer, []).append((w.argmax(-1), w[:, idx].sum(-1), w[:, 0]))

    def found_all(new: list[int]) -> bool:
        return string_match_all(tokenizer.decode(new, skip_special_tokens=True), prompt.targets) == 1.0

    new = LA.greedy_decode(hf, torch.tensor(prompt.ids), rule, budget, chunk=chunk, stop_token=eos, stop=found_all,
                           record=record if heads else None, masked=masked).tolist()
    answer = tokenizer.decode(new, skip_special_tokens=True)
    out: dict[str, Any] = {"answer": answer, "score": string_match_all(answer, prompt.targets), "tokens": new}
    if not heads:
        return out
    layers = sorted(steps)
    if any(len(steps[l]) != len(new) for l in layers):
        raise RuntimeError("the engine recorded a different number of forwards than tokens decoded")
    seq = prompt.ids + new
    where = set(values)
    H = steps[layers[0]][0][0].numel()
    score = torch.zeros(len(layers), H, dtype=torch.float64)
    for li, l in enumerate(layers):
        for h in range(H):
            copied = {int(a[h]) for s, (a, _, _) in enumerate(steps[l])
                      if int(a[h]) in where and seq[int(a[h])] == new[s]}
            score[li, h] = len(copied) / len(values)
    out["retrieval_score"] = score
    out["needle_mass"] = torch.stack([torch.stack([m for _, m, _ in steps[l]]).mean(0) for l in layers])
    out["answer_first_mass"] = torch.stack([torch.stack([f for _, _, f in steps[l]]).mean(0) for l in layers])
    out["layers"] = layers
    return out


def _prompts(tok: Any, cfg: RetrievalConfig, text: str) -> list[tuple[tuple, NeedlePrompt]]:
    return [((task, L, d, t), needle_prompt(tok, task, L, d, cfg.seed * 1000 + t, text=text))
            for task in cfg.tasks for L in cfg.lengths for d in cfg.depths for t in range(cfg.trials)]


def _unit(spec: str, key: tuple, masked: str, k: int, draw: int) -> str:
    return f"answer|{spec}|{key[0]}|{key[1]}|{key[2]!r}|{key[3]}|{masked}|{k}|{draw}"


def _answer_row(name: str, spec: str, key: tuple, p: NeedlePrompt, got: dict, masked: str, n: int, draw: int) -> dict:
    return dict(model=name, preset=spec, task=key[0], length=key[1], depth=key[2], trial=key[3], masked=masked,
                n_masked=n, draw=draw, targets=" | ".join(p.targets), answer=got["answer"], score=got["score"])


def _mean_jaccard(sets: list[set]) -> tuple[float, int]:
    """(mean Jaccard overlap over the pairs of sets that are not both empty, number of such pairs); NaN without one."""
    pairs = [(a, b) for i, a in enumerate(sets) for b in sets[i + 1:] if a | b]
    return (float(np.mean([len(a & b) / len(a | b) for a, b in pairs])) if pairs else float("nan")), len(pairs)


def _ci(scores: list[float], cfg: RetrievalConfig) -> tuple[float, float]:
    # A percentile bootstrap of all-equal 0/1 scores collapses to a point ([1, 1] for 3 of 3): 0/1 scores are a
    # proportion, and get its Wilson interval; fractional scores (multi-value tasks) keep the bootstrap of the mean.
    if cfg.binary_scores:
        if any(s not in (0.0, 1.0) for s in scores):
            raise RuntimeError(f"a single-value task scored other than 0 or 1: {sorted(set(scores))}")
        return wilson_ci(int(sum(scores)), len(scores))
    return bootstrap_ci(np.asarray(scores), n_boot=cfg.bootstrap, seed=cfg.seed)


def _interval_meta(cfg: RetrievalConfig) -> dict[str, Any]:
    if cfg.binary_scores:
        return {"method": "wilson", "level": 0.95, "over": "prompts",
                "why": "every task asks for one value, so each answer scores 0 or 1: Wilson score interval of the "
                       "proportion"}
    return {"method": "percentile-bootstrap", "level": 0.95, "over": "prompts", "resamples": cfg.bootstrap,
            "why": "a multi-value task scores fractions: percentile bootstrap of the mean score"}


def run_retrieval(model: Any, text: str | None = None, config: RetrievalConfig | None = None, *, tokenizer: Any = None,
                  name: str | None = None, source: str | None = None, work: str | Path | None = None,
                  fresh: bool = False) -> Result:
    """Retrieval heads per preset, and needle accuracy with heads masked.

    Every check (presets, mask_k against the model's heads, prompt lengths, memory) runs before the first forward.
    Lengths past the model's context (max_position_embeddings) run, and are listed in meta["beyond_context"] and the
    summary.

    Args:
        model: a plain HF causal LM with its `tokenizer`, or a TransformerBridge over a RoPE decoder (its HF model
            runs).
        text: the haystack of text-haystack tasks; None: posprobe's built-in text (as the CLI).
        config: the analysis's options (None: its Config's defaults).
        tokenizer: the tokenizer of a plain HF `model` (required there); for a bridge it defaults to the
            bridge's.
        name: the model's name in the tables (default: the model's own).
        source: what meta.json's data record names as the text (default: "built-in text" or "text").
        work: a folder where every answer (with its per-head statistics) is kept as it completes
            (`posprobe.report.checkpoint`); calling again with the same folder resumes, and the tables equal an
            uninterrupted run's exactly. Another model, text or config there is refused. None: no checkpoint.
        fresh: discard what `work` holds and start again.

    Returns:
        A Result with tables `retrieval_heads` (per preset, layer, head: retrieval_score, needle_mass,
            answer_first_mass), `head_classes` (retrieval / other), `retrieval_answers` (every prompt and masking
            variant) and `retrieval_masking` (accuracy with CI per preset, masked set and k; the Jaccard stability
            of the retrieval sets across prompts).

    Examples:
        >>> import posprobe as pp
        >>> cfg = pp.RetrievalConfig(lengths=(400,), depths=(0.5,), tasks=("niah_single_1",), mask_k=(0,),
        ...                          needle_tokens=3, bootstrap=50, progress=False)
        >>> result = pp.run_retrieval(pp.load_model("tiny-rope"), None, cfg)
        >>> sorted(result.tables)
        ['head_classes', 'retrieval_answers', 'retrieval_heads', 'retrieval_masking']
        >>> len(result.tables["retrieval_answers"])  # 1 task x 1 length x 1 depth x 1 trial, nothing masked
        1
    """
    cfg = config or RetrievalConfig()
    if text is None:
        text, source = BUILTIN_TEXT, source or "built-in text"
    if is_bridge(model):
        from posprobe.backend.fast_attention import hf_model_inside

        with hf_model_inside(model) as hf:
            return run_retrieval(hf, text, cfg, tokenizer=tokenizer or tokenizer_of(model),
                                 name=name or model_name(model), source=source, work=work, fresh=fresh)
    if tokenizer is None:
        raise ValueError("give the tokenizer (run_retrieval(model, text, config, tokenizer=...))")
    hf, tok = model, tokenizer
    rules = {spec: preset_pairs(spec) for spec in cfg.presets}
    LA.require_supported(hf, "Retrieval heads")
    name = name or hf_model_name(hf)
    facts = hf_facts(hf, name)
    n_heads = facts.n_heads
    cfg.check_heads(facts.n_layers, n_heads)
    prompts = _prompts(tok, cfg, text)  # every prompt before any forward: lengths and text are checked here
    for spec, rule in rules.items():
        for L in cfg.lengths:
            LA.check_memory(hf, L, rule, chunk=cfg.chunk, cache=True)
    # The context the atlas holds retrieval to (facts.n_ctx: max_position_embeddings); lengths past it still run.
    beyond = {"context": facts.n_ctx or None, "lengths": [L for L in cfg.lengths if facts.n_ctx and L > facts.n_ctx]}
    data = data_meta(source or "text", n_items=len(prompts), unit="prompts", sha256=text_sha256(text))
    ckpt = Checkpoint(work, run_key("retrieval", model={"facts": facts.summary(), "weights": weights_fingerprint(hf)},
                                    data=data, config=cfg), fresh=fresh)
    budget = {t: cfg.needle_tokens or TASKS[t].answer_tokens() for t in cfg.tasks}
    masking = [(kind, k, draw) for k in cfg.mask_k if k
               for kind, draw in [("top", -1)] + [("random", d) for d in range(cfg.random_draws)]]
    units = [_unit(spec, key, kind, k, draw) for spec in rules for kind, k, draw in [("none", 0, -1)] + masking
             for key, _ in prompts]
    # Counted in answers, as the progress line counts them; the ETA is taken over the answers computed now.
    done = ckpt.announce(units, "retrieval", "answers")
    total, computed, start = len(units), 0, time.perf_counter()

    def tick(what: str, unit: str) -> None:
        nonlocal done, computed
        if unit in resumed:  # already in `done`
            return
        done, computed = done + 1, computed + 1
        if cfg.progress:
            left = (time.perf_counter() - start) / computed * (total - done)
            print(f"\rretrieval: {what}: answer {done}/{total}, ETA {left:.0f} s   ", end="" if done < total else "\n",
                  file=sys.stderr)

    resumed = {u for u in units if ckpt.has(u)}
    head_rows, class_rows, answer_rows, mask_rows = [], [], [], []

    def answered(spec: str, rule: Any, key: tuple, p: Any, kind: str, k: int, draw: int,
                 masked: dict[int, tuple[int, ...]] | None) -> dict:
        # One prompt answered (or read back from the checkpoint), its row kept, the progress line moved on; with
        # `masked` heads zeroed, the score alone (no per-head statistics).
        unit = _unit(spec, key, kind, k, draw)
        extra = {} if masked is None else {"masked": masked, "heads": False}
        got = ckpt.compute(unit, lambda: answer_heads(hf, tok, p, rule, budget[key[0]], chunk=cfg.chunk, **extra))
        answer_rows.append(_answer_row(name, spec, key, p, got, kind, k, draw))
        tick(spec if masked is None else f"{spec} mask {kind} {k}", unit)
        return got

    for spec, rule in rules.items():
        per = [answered(spec, rule, key, p, "none", 0, -1, None) for key, p in prompts]
        means, heads, classes = _head_rows(name, spec, per, n_heads, cfg.threshold)
        head_rows += heads
        class_rows += classes
        mask_rows += _unmasked_rows(name, spec, per, prompts, cfg)
        for kind, k, draw, masked in _mask_sets(means, per[0]["layers"], n_heads, spec, cfg):
            scores = [answered(spec, rule, key, p, kind, k, draw, masked)["score"] for key, p in prompts]
            lo, hi = _ci(scores, cfg)
            mask_rows.append(dict(model=name, preset=spec, masked=kind, n_masked=k, draw=draw,
                                  metric="string_match_all", value=float(np.mean(scores)), ci_low=lo, ci_high=hi,
                                  count=len(scores)))
    tables = {"retrieval_heads": pd.DataFrame(head_rows), "head_classes": pd.DataFrame(class_rows),
              "retrieval_answers": pd.DataFrame(answer_rows), "retrieval_masking": pd.DataFrame(mask_rows)}
    meta = make_meta("retrieval", model=facts.summary(), data=data, config=cfg,
                     plan={spec: r.label for spec, r in rules.items()},
                     needle_tasks={t: asdict(TASKS[t]) for t in cfg.tasks},
                     classes={"retrieval": f"mean retrieval score > {cfg.threshold}", "other": "the rest"},
                     masking="a head's attention output is zeroed before the output projection; random heads are "
                             "drawn (seeded) from the heads outside the top k",
                     intervals=_interval_meta(cfg), beyond_context=beyond,
                     checkpoint={"folder": str(work) if work is not None else None, "resumed_units": ckpt.resumed})
    return Result(tables, meta)


def _head_rows(name: str, spec: str, per: list[dict], n_heads: int, threshold: float
               ) -> tuple[dict[str, torch.Tensor], list[dict], list[dict]]:
    """(each statistic's mean over the prompts `per` as [layer, head], the heads table's rows, the class rows: a head
    is "retrieval" when its mean retrieval score is over `threshold`)."""
    layers = per[0]["layers"]
    means = {m: torch.stack([g[m] for g in per]).mean(0) for m in
             ("retrieval_score", "needle_mass", "answer_first_mass")}
    head_rows, class_rows = [], []
    for li, l in enumerate(layers):
        for h in range(n_heads):
            for m, v in means.items():
                head_rows.append(dict(model=name, preset=spec, layer=l, head=h, metric=m, value=float(v[li, h]),
                                      count=len(per)))
            kind = "retrieval" if means["retrieval_score"][li, h] > threshold else "other"
            class_rows.append(dict(model=name, preset=spec, layer=l, head=h, kind=kind))
    return means, head_rows, class_rows


def _unmasked_rows(name: str, spec: str, per: list[dict], prompts: list, cfg: RetrievalConfig) -> list[dict]:
    """The masking table's rows with nothing masked: string_match_all with its interval, and the stability of the
    retrieval sets (the heads over the threshold) across prompts and across each needle task's mean."""
    layers = per[0]["layers"]

    def over(score: torch.Tensor) -> set[tuple[int, int]]:
        return {(layers[li], h) for li, h in (score > cfg.threshold).nonzero().tolist()}

    jac, n_pairs = _mean_jaccard([over(g["retrieval_score"]) for g in per])
    jac_tasks, n_task_pairs = _mean_jaccard([over(torch.stack([g["retrieval_score"] for (key, _), g in
                                                               zip(prompts, per) if key[0] == task]).mean(0))
                                             for task in cfg.tasks])
    base = [g["score"] for g in per]
    lo, hi = _ci(base, cfg)
    rows = [dict(model=name, preset=spec, masked="none", n_masked=0, draw=-1, metric="string_match_all",
                 value=float(np.mean(base)), ci_low=lo, ci_high=hi, count=len(base))]
    for metric, value, count in (("retrieval_jaccard", jac, n_pairs),
                                 ("retrieval_jaccard_tasks", jac_tasks, n_task_pairs)):
        rows.append(dict(model=name, preset=spec, masked="none", n_masked=0, draw=-1, metric=metric,
                         value=value, ci_low=float("nan"), ci_high=float("nan"), count=count))
    return rows


def _mask_sets(means: dict[str, torch.Tensor], layers: list[int], n_heads: int, spec: str,
               cfg: RetrievalConfig) -> Iterator[tuple[str, int, int, dict[int, tuple[int, ...]]]]:
    """(kind, k, draw, heads masked per layer) for every k of `cfg.mask_k`: the top k heads by mean retrieval score
    (ties by layer, head), then `cfg.random_draws` sets of k heads drawn (seeded by seed and preset) from the rest."""
    order = sorted(((float(means["retrieval_score"][li, h]), l, h) for li, l in enumerate(layers)
                    for h in range(n_heads)), key=lambda x: (-x[0], x[1], x[2]))
    everyone = [(l, h) for _, l, h in order]
    rng = random.Random(f"{cfg.seed}|{spec}")
    for k in (k for k in cfg.mask_k if k):
        top = everyone[:k]
        others = everyone[k:]  # check_heads: at least k of them, so every random set has exactly k heads
        variants = [("top", -1, top)] + [("random", d, rng.sample(others, k)) for d in range(cfg.random_draws)]
        for kind, draw, chosen in variants:
            masked: dict[int, tuple[int, ...]] = {}
            for l, h in chosen:
                masked[l] = masked.get(l, ()) + (h,)
            yield kind, k, draw, masked


#: The shortest context the atlas's retrieval section runs in: a needle prompt's fixed parts and a haystack around it.
RETRIEVAL_MIN_CTX = 512


def _atlas_run(model: Any, r: AtlasRun) -> Result:
    # Bounded: one task, three depths, the top 5 heads and one draw of 5 random heads masked (9 answers); fewer on a
    # model with under 10 heads, where the random control could not draw 5 heads outside the top 5.
    f, c = r.facts, r.config
    return run_retrieval(model, r.text, RetrievalConfig(
        lengths=(min(c.needle_length, f.n_ctx),), depths=(0.25, 0.5, 0.75), tasks=("niah_single_2",),
        mask_k=(min(5, f.n_layers * f.n_heads // 2),), random_draws=1, seed=c.seed, progress=c.progress),
        source=r.source)


def _atlas_headlines(part: Result) -> list[tuple[str, float]]:
    m = part.tables["retrieval_masking"]
    acc = m[m.metric == "string_match_all"].groupby("masked").value.mean()
    kinds = part.tables["head_classes"].kind.value_counts()
    return [("needle_accuracy", float(acc.get("none", float("nan")))),
            ("needle_accuracy_top_masked", float(acc.get("top", float("nan")))),
            ("needle_accuracy_random_masked", float(acc.get("random", float("nan")))),
            ("n_retrieval", float(kinds.get("retrieval", 0)))]


def _atlas_blocked(facts: Any, engine_runs: bool) -> tuple[str | None, ...]:
    short = (f"a {facts.n_ctx}-token context is shorter than the {RETRIEVAL_MIN_CTX} tokens a needle prompt needs"
             if facts.n_ctx < RETRIEVAL_MIN_CTX else None)
    return facts.unsupported, short, None if engine_runs else "the long-context engine does not run this model"


ATLAS_SECTION = register(AtlasSection("retrieval", "Retrieval heads", _atlas_run, _atlas_headlines,
                                      retrieval_report.atlas_paragraph, blocked=_atlas_blocked))
