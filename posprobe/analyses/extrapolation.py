"""Perplexity past the training length (Press et al. 2022): how a model's next-token loss changes as evaluation
sequences grow from its training length L to several times L, under the two protocols Press et al. discuss.

- "chunks": the evaluation text cut into non-overlapping sequences of the evaluation length; every token but each
  sequence's first is scored (their main tables). Longer sequences also give each token more context on average.
- "sliding": the same target tokens at every length, each block of `stride` targets scored at the end of a window
  of the evaluation length (their appendix B): only the context before the targets grows.

A model whose positions come from a table with a last row (learned absolute) cannot run past it: those rows say
"cannot run" with the reason, they are not an error. Losses come from the model's own forward pass
(`backend.model.token_losses`), in nats per token; ppl = exp(mean loss)."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Any

import pandas as pd
import torch

from posprobe.analyses.configs import PROTOCOLS, ExtrapolationConfig
from posprobe.analyses.sections import AtlasSection, CompareRun, ModelEntry, register
from posprobe.backend.facts import model_facts, require_fixed_table
from posprobe.backend.families import find as find_family
from posprobe.backend.model import context_length, device_of, encode_text, has_lm_head, model_name, token_losses
from posprobe.report import extrapolation as extrapolation_report
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256

__all__ = ["ExtrapolationConfig", "PROTOCOLS", "eval_lengths", "run_extrapolation"]

def eval_lengths(train_length: int, factors: tuple[float, ...]) -> list[int]:
    """Distinct evaluation lengths round(L x factor) and L itself (the ratios' reference), ascending, >= 2 tokens."""
    return sorted({max(2, int(round(train_length * f))) for f in factors} | {max(2, train_length)})


def _losses(model: Any, rows: torch.Tensor, batch_size: int, keep_last: int | None) -> torch.Tensor:
    """Per-token losses of `rows` [n, length] (nats), the last `keep_last` of each row (all when None), float64."""
    out = []
    dev = device_of(model)
    with torch.inference_mode():
        for i in range(0, len(rows), batch_size):
            loss = token_losses(model, rows[i:i + batch_size].to(dev)).to("cpu", torch.float64)
            out.append(loss if keep_last is None else loss[:, -keep_last:])
    return torch.cat(out) if out else torch.zeros(0, 0, dtype=torch.float64)


def run_extrapolation(model: Any, text: str, config: ExtrapolationConfig | None = None, *,
                      source: str | None = None, label: str | None = None) -> Result:
    """Perplexity vs evaluation length for `model` on `text`.

    Args:
        model: a TransformerLens causal LM (not an encoder) with a fixed position table.
        text: the evaluation text; it must hold the longest runnable length plus the stride in tokens.
        config: the analysis's options: training length L, factors, protocols, token budget (None: its Config's
            defaults).
        source: what meta.json's data record names as the text (default None: not named).
        label: the model's name in the tables (default: the model's own).

    Returns:
        A Result with table `perplexity` (one row per protocol x length: model, protocol, length, factor, nll in
            nats/token, ppl, ppl_ratio = ppl / ppl at L (same protocol), count of scored tokens, status "ok" or
            "cannot run" with `why`).

    Examples:
        >>> import posprobe as pp
        >>> from posprobe.data import BUILTIN_TEXT
        >>> cfg = pp.ExtrapolationConfig(train_length=32, factors=(1, 2), max_tokens=256, progress=False)
        >>> table = pp.run_extrapolation(pp.load_model("tiny-ape"), BUILTIN_TEXT, cfg).tables["perplexity"]
        >>> table[["protocol", "length", "status"]].values.tolist()
        [['chunks', 32, 'ok'], ['chunks', 64, 'ok'], ['sliding', 32, 'ok'], ['sliding', 64, 'ok']]
    """
    config = config or ExtrapolationConfig()
    facts = model_facts(model)
    if not has_lm_head(model) or facts.is_encoder:
        raise ValueError(f"{facts.name} has no LM head (an encoder): perplexity needs a causal language model")
    # A dynamic / longrope table depends on the input's length and HF keeps the largest one it has built, so each
    # length's number would depend on the lengths scored before it.
    require_fixed_table(model, facts, "Perplexity past the training length")
    context = context_length(model)
    L = config.train_length or context
    lengths = eval_lengths(L, config.factors)
    stride = config.stride or max(1, L // 2)
    if stride >= lengths[0]:
        raise ValueError(f"stride {stride} must be shorter than the shortest evaluation length {lengths[0]}")
    fam = find_family(facts.positional_kind)
    bounded = fam is not None and fam.bounded_by_table
    runnable = [n for n in lengths if not (bounded and n > context)]
    if not runnable:
        raise ValueError(f"no evaluation length fits {facts.name}'s {context}-row position table: {lengths}")
    ids = torch.tensor(encode_text(model, text), dtype=torch.long)
    longest = max(runnable)
    if len(ids) < longest + stride:
        raise ValueError(f"the evaluation text has {len(ids)} tokens; the longest evaluation length ({longest}) "
                         f"needs at least {longest + stride}: give a longer text or smaller factors")
    name = label or model_name(model)
    rows = []
    for protocol in config.protocols:
        base = None  # the loss at L (always evaluated; the lengths below it have no ratio)
        for n in lengths:
            row = {"model": name, "protocol": protocol, "length": n, "factor": n / L}
            if n not in runnable:
                rows.append({**row, "nll": math.nan, "ppl": math.nan, "ppl_ratio": math.nan, "count": 0,
                             "status": "cannot run",
                             "why": f"learned positions: the table has {context} rows, the sequence {n} tokens"})
                continue
            if config.progress:
                print(f"\rextrapolation: {name}: {protocol} at {n} tokens   ", end="", file=sys.stderr, flush=True)
            if protocol == "chunks":
                total = max(n, min(len(ids), config.max_tokens) // n * n)  # one sequence at least (text checked)
                loss = _losses(model, ids[:total].view(-1, n), config.batch_size, None)
            else:
                n_blocks = max(1, min(config.max_tokens // stride, (len(ids) - longest) // stride + 1))
                ends = [longest + j * stride for j in range(n_blocks)]
                windows = torch.stack([ids[e - n:e] for e in ends])
                loss = _losses(model, windows, config.batch_size, stride)
            if loss.numel() == 0:
                raise ValueError(f"the evaluation text is too short for one {n}-token sequence")
            nll = float(loss.mean())
            base = nll if n == L else base
            ratio = math.nan if base is None else math.exp(nll - base)
            rows.append({**row, "nll": nll, "ppl": math.exp(nll), "ppl_ratio": ratio, "count": int(loss.numel()),
                         "status": "ok", "why": ""})
    if config.progress:
        print(file=sys.stderr)
    meta = make_meta("extrapolation", model=facts.summary(), data=data_meta(source, n_items=len(ids), unit="tokens",
                                                                            sha256=text_sha256(text)),
                     config=config, train_length=L, lengths=lengths, stride=stride)
    return Result({"perplexity": pd.DataFrame(rows)}, meta)


def _compare(m: ModelEntry, run: CompareRun) -> Any:
    # The atlas's bounded settings, or zoo eval's own (run.extrapolation); a zoo member is scored from its own
    # training length L unless the settings name one.
    cfg = run.config
    ex = run.extrapolation or ExtrapolationConfig(factors=cfg.factors, max_tokens=cfg.extrapolation_tokens,
                                                  progress=False)
    if ex.train_length is None and m.record is not None:
        ex = replace(ex, train_length=int(m.record["widths"]["length"]))
    got = run_extrapolation(m.model, run.text, ex, source=run.source, label=m.label)
    return {"perplexity": got.tables["perplexity"]}, None


ATLAS_SECTION = register(AtlasSection("extrapolation", "Perplexity past the training length", None, None, None,
                                      compare=_compare, compare_page=extrapolation_report.compare_section))
