"""Chen et al.'s effective context window (Position Interpolation, 2023, Section 3.2 and Table 4), measured by passkey
retrieval on a plain Hugging Face causal LM: the zoo's members and their extensions (`posprobe zoo extend`).

A trial is the zoo's compact passkey prompt (`posprobe.data.needles.SHORT_PASSKEY`, the format the members were
trained on with `zoo train --passkey`) whose key sits exactly `distance` tokens before the answer (the needle first,
so the prompt is `distance` + a few tokens long: Chen et al.'s prompt of length k with the key at its start, the
farthest placement). Success = exact greedy decoding: the greedy continuation of the prompt is the answer's tokens
(" <5 digits>", tokenised on its own), computed by one teacher-forced forward of prompt + answer, since greedy decoding
reproduces a sequence exactly when each of its tokens is the argmax given the ones before (tested against HF's
`generate`). Chosen over the log-likelihood rank of the key among distractors because it is Chen et al.'s own
measure and its chance level is ~0 (a 5-digit key), so the 20 % floor means retrieval; a rank among N distractors
succeeds by chance 1/N of the time, near 20 % for small N, and depends on how the distractors are drawn.

Effective window (`effective_window`) = the largest measured distance whose success rate is >= 20 % at that distance
and at every shorter measured one (0 when the shortest fails). Prompts are drawn from a seed alone: every model and
checkpoint sees the same keys at the same distances."""

from __future__ import annotations

import random
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from posprobe.analyses.sections import AtlasSection, CompareRun, ModelEntry, register
from posprobe.core.stats import wilson_ci
from posprobe.data.needles import SHORT_PASSKEY, PasskeyFormat, PasskeyPrompt, passkey_at, passkey_filler
from posprobe.report import passkey as passkey_report

__all__ = ["PASSKEY_COLUMNS", "SUCCESS_FLOOR", "distance_grid", "effective_window", "greedy_prefix", "passkey_table",
           "passkey_trial", "shortest_distance", "table_rows", "window_table"]

#: Chen et al.'s success floor.
SUCCESS_FLOOR = 0.2


def effective_window(rates: Mapping[int, float] | Iterable[tuple[int, float]], floor: float = SUCCESS_FLOOR) -> int:
    """Chen et al.'s effective window from success rates by distance: the largest distance d such that the rate is
    >= `floor` at d and at every shorter distance given; 0 when the shortest one fails (or none is given). A NaN rate
    (not measured) counts as a failure."""
    best = 0
    for d, rate in sorted(dict(rates).items()):
        if not rate >= floor:
            break
        best = int(d)
    return best


def shortest_distance(tokenizer: Any, fmt: PasskeyFormat = SHORT_PASSKEY, key: str | None = None) -> int:
    """The shortest key-to-answer distance of the format (needle and question back to back) for `key`, or without
    one the longest such over 64 seeded keys (a tokenizer that merges digits gives keys of different token counts:
    nearly every key fits there, and `passkey_table` draws again for one that does not)."""
    if key is not None:
        return _probe(tokenizer, fmt, key).distance
    return max(_probe(tokenizer, fmt, k).distance for k in _keys("grid", 64))


def _keys(tag: str, n: int) -> list[str]:
    rng = random.Random(f"passkey-keys|{tag}")
    return [str(rng.randint(10_000, 99_999)) for _ in range(n)]


def _probe(tokenizer: Any, fmt: PasskeyFormat, key: str) -> PasskeyPrompt:
    # The prompt with no filler at all: its length is the format's fixed part.
    big = 1 << 20
    return passkey_at(tokenizer, big - passkey_filler(tokenizer, big, key, fmt), 0, key, fmt)


def distance_grid(tokenizer: Any, length: int, target: int, step: int | None = None,
                  fmt: PasskeyFormat = SHORT_PASSKEY) -> list[int]:
    """Distances measured for a model of training length `length` up to prompts of `target` tokens: the format's
    shortest, then every multiple of `step` (default L/8) above it whose prompt (the needle first) fits in `target`."""
    step = step or max(1, length // 8)
    shortest = shortest_distance(tokenizer, fmt)
    longest = target - max(_probe(tokenizer, fmt, k).key_pos for k in _keys("grid", 64))
    if longest < shortest:
        raise ValueError(f"a passkey prompt needs about {shortest + target - longest} tokens; got a target of "
                         f"{target}")
    return [shortest] + list(range((shortest // step + 1) * step, longest + 1, step))


def passkey_trial(tokenizer: Any, distance: int, key: str, fmt: PasskeyFormat = SHORT_PASSKEY) -> PasskeyPrompt:
    """The prompt whose key sits exactly `distance` tokens before the answer, the needle first (no filler before
    it). ValueError when `distance` is shorter than the format allows for `key`."""
    probe = _probe(tokenizer, fmt, key)
    if distance < probe.distance:
        raise ValueError(f"distance {distance} is shorter than the format allows ({probe.distance})")
    p = passkey_at(tokenizer, probe.key_pos + distance, 0, key, fmt)
    assert p.distance == distance
    return p


def greedy_prefix(model: Any, items: Sequence[tuple[Sequence[int], Sequence[int]]], *, batch_size: int = 16
                  ) -> list[int]:
    """For each (prompt ids, answer ids): how many of the answer's tokens greedy decoding from the prompt reproduces
    before its first miss (= len(answer): the greedy answer is exact). One teacher-forced forward of prompt + answer
    per item, batched by total length; `model` is an HF causal LM whose logits at t score token t + 1."""
    import torch

    device = next(model.parameters()).device
    out = [0] * len(items)
    by_length: dict[int, list[int]] = {}
    for i, (p, a) in enumerate(items):
        if not len(a) or not len(p):
            raise ValueError("a passkey item needs a prompt and an answer")
        by_length.setdefault(len(p) + len(a) - 1, []).append(i)
    with torch.no_grad():
        for n, idx in by_length.items():
            for c in range(0, len(idx), batch_size):
                chunk = idx[c:c + batch_size]
                x = torch.tensor([list(items[i][0]) + list(items[i][1])[:-1] for i in chunk], device=device)
                logits = model(input_ids=x).logits
                for row, i in enumerate(chunk):
                    p, a = items[i]
                    guess = logits[row, len(p) - 1:len(p) - 1 + len(a)].argmax(-1).tolist()
                    hits = [g == t for g, t in zip(guess, a)]
                    out[i] = hits.index(False) if False in hits else len(a)
    return out


#: The columns of `passkey_table`.
PASSKEY_COLUMNS = ["distance", "length", "trials", "successes", "success_rate", "success_low", "success_high",
                   "prefix_tokens", "status"]


def passkey_table(model: Any, tokenizer: Any, distances: Sequence[int], trials: int, seed: int = 0, *,
                  fmt: PasskeyFormat = SHORT_PASSKEY, max_length: int | None = None, batch_size: int = 16
                  ) -> pd.DataFrame:
    """Passkey success by distance: `trials` prompts per distance (keys drawn from (seed, distance, trial) alone),
    one row per distance: `distance`, `length` (prompt tokens), `trials`, `successes`, `success_rate` (exact greedy
    answer) with its 95 % Wilson interval (`success_low`, `success_high`), `prefix_tokens` (mean answer tokens right
    before the first miss). Distances whose prompt exceeds `max_length` (a learned table) get NaN rates and status
    "beyond the position table"."""
    rows, items, spans = [], [], []
    for d in distances:
        prompts = [_trial(tokenizer, int(d), f"{seed}|{d}|{t}", fmt) for t in range(trials)]
        n = max(len(p.ids) for p in prompts)
        ok = max_length is None or n + max(len(p.answer) for p in prompts) - 1 <= max_length
        rows.append({"distance": int(d), "length": n, "trials": trials if ok else 0,
                     "status": "ok" if ok else "beyond the position table"})
        spans.append((len(items), len(items) + (trials if ok else 0)))
        items += [(p.ids, p.answer) for p in prompts] if ok else []
    got = greedy_prefix(model, items, batch_size=batch_size) if items else []
    for r, (a, b) in zip(rows, spans):
        hits = [g == len(items[i][1]) for i, g in zip(range(a, b), got[a:b])]
        r["successes"] = sum(hits)
        r["success_rate"] = sum(hits) / len(hits) if hits else float("nan")
        r["success_low"], r["success_high"] = wilson_ci(sum(hits), len(hits))
        r["prefix_tokens"] = sum(got[a:b]) / len(hits) if hits else float("nan")
    return pd.DataFrame(rows, columns=PASSKEY_COLUMNS)


def _trial(tokenizer: Any, distance: int, tag: str, fmt: PasskeyFormat) -> PasskeyPrompt:
    # The trial of `tag` at `distance`: its key drawn from the tag alone, drawn again while the key is too long
    # (in tokens) for the distance.
    for again in range(1000):
        key = str(random.Random(f"passkey-eval|{tag}|{again}").randint(10_000, 99_999))
        if _probe(tokenizer, fmt, key).distance <= distance:
            return passkey_trial(tokenizer, distance, key, fmt)
    raise ValueError(f"no 5-digit key fits a passkey prompt at distance {distance}")


def window_table(passkey: pd.DataFrame, L: int, keys: Sequence[str] = ("model",)) -> pd.DataFrame:
    """Chen et al.'s effective window per group of `keys` (a model; in `zoo extend` a model at a checkpoint) of a
    `passkey_table` frame carrying those columns (rows: distance x success rate), for models of training length `L`:
    `effective_window` (tokens), `window_over_L` (it / L), `longest_distance` measured, and `success_within_L` /
    `success_beyond_L` (mean success rate over the distances <= L and > L)."""
    keys = list(keys)
    rows: list[dict] = []
    for k, g in passkey[passkey["status"] == "ok"].groupby(keys, sort=False):
        rates = dict(zip(g["distance"].astype(int), g["success_rate"].astype(float)))
        ew = effective_window(rates)
        row = {**dict(zip(keys, k)), "effective_window": ew, "window_over_L": ew / L,
               "longest_distance": int(g["distance"].max())}
        for side, part in (("within", g[g["distance"] <= L]), ("beyond", g[g["distance"] > L])):
            rate = part["success_rate"]
            row[f"success_{side}_L"] = float(rate.mean()) if len(rate) else float("nan")
            pooled = (int(part["successes"].sum()), int(part["trials"].sum())) if {"successes", "trials"} <= set(
                part) else (0, 0)
            row[f"success_{side}_L_low"], row[f"success_{side}_L_high"] = wilson_ci(*pooled)
        rows.append(row)
    return pd.DataFrame(rows, columns=[*keys, "effective_window", "window_over_L", "longest_distance",
                                       "success_within_L", "success_within_L_low", "success_within_L_high",
                                       "success_beyond_L", "success_beyond_L_low", "success_beyond_L_high"])


def table_rows(model: Any) -> int | None:
    """The rows of a Hugging Face model's learned position table (GPT-2's `n_positions`: no position past it can be
    computed), None for a model whose positions are not a table (rotary, ALiBi, T5 buckets, NoPE)."""
    from posprobe.backend.model import hf_learned_table

    table = hf_learned_table(model)
    return int(table.num_embeddings) if table is not None else None


def _compare(m: ModelEntry, run: CompareRun) -> Any:
    # The atlas over many models: a zoo member trained with the skill, scored from the format's shortest distance to
    # prompts of the longest extrapolation factor x its L, the same prompts for every member.
    rec = m.record
    if rec is None or not float(rec.get("passkey") or 0):
        return ("not trained with the passkey skill (posprobe zoo train --passkey SHARE): a model that never saw the "
                "format answers at chance, so its window would measure nothing")
    from transformers import AutoTokenizer

    L = int(rec["widths"]["length"])
    tokenizer = AutoTokenizer.from_pretrained(m.spec)
    from posprobe.backend.loading import load_causal_lm

    model = load_causal_lm(m.spec)
    distances = distance_grid(tokenizer, L, int(max(run.config.factors) * L))
    got = passkey_table(model, tokenizer, distances, run.config.passkey_trials, seed=run.config.seed,
                        max_length=table_rows(model)).assign(model=m.label, train_length=L)
    window = window_table(got, L)
    ew = int(window["effective_window"].iloc[0]) if len(window) else 0
    return {"passkey": got.drop(columns="model"), "passkey_window": window.drop(columns="model")}, {
        "effective_window": ew, "window_over_L": ew / L}


ATLAS_SECTION = register(AtlasSection("passkey", "Passkey retrieval and the effective window", None, None, None,
                                      compare=_compare, compare_page=passkey_report.compare_section))
