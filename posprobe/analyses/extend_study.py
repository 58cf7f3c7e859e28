"""Several `zoo extend` runs side by side: the head-dimension x training-length table of issue #63.

The question it answers: does a context-extension method keep the passkey skill, and does the answer move with the
number of rotary bands that turn within the training length L (Liu et al.'s critical dimension, 2 dims per band)?
Position Interpolation divides every frequency by s, so inside L only the bands whose period fits in L / s still
complete a turn: the few fast bands that carry local order (offset 1 against 0) are the ones it slows most.

Each run is a folder written by `posprobe zoo extend` (its `extend/` result and its HF folders). One row per head
dim, L, fine-tuning (text alone or with the skill mixed in), method and checkpoint step, pooled over the seeds of
every run with that key (seeds run later as runs of their own pool with the first; a seed in two runs is an error):

* success within L and beyond L: every trial of every seed and distance pooled (successes / trials), each with its
  95 % Wilson interval (a rate moves in steps of 1 / trials, so a single cell is noisy);
* Chen et al.'s effective window per seed (`window_seeds`, in seed order) with its mean, lowest and highest;
* `member_skill_seeds`: the unextended member's success within L per seed (in seed order): a method cannot keep a
  skill its member never learned, so `min_skill` leaves out every seed whose member is below it (in every row, the
  member's included) and `seeds_left_out` counts them;
* the prediction, from the member's own rotation: `bands_within_L` (bands whose period 2 pi / theta_j is at most L)
  and `bands_within_L_over_s` (at most L / s: the bands still turning within L once PI divides every frequency by s);
* the mechanism, where the run measured it (`zoo extend` does unless `--no-mechanism`): `fast_share`, the share of
  |q.k| carried by the member's fast bands (those counted in `bands_within_L`), mean over layers and seeds, for
  this model at its last checkpoint (the mechanism is measured there only) and, beside it, `fast_share_unextended`
  for the member before extension; `interpolation_bound` (and `_unextended`), Chen et al.'s bound on how far the
  score can move between integer positions, d max|h_j| / (32 ln b) in logits, at its largest over the model's heads
  from the measured h_j, mean over seeds; `prev_token_attention` (and `_unextended`), the strongest previous-token
  head: the largest over the model's heads of the mean attention from i to i - 1 on windows of L tokens (the run's
  `previous_token` table), mean over seeds. Passkey retrieval is a copy: a head that reads the token before each
  position feeds the one that finds the key, and PI, which turns offset 1 into 1 / s, blurs that head.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from posprobe.core.stats import wilson_ci
from posprobe.report.result import Result
from posprobe.report.schema import make_meta
from posprobe.report.zoo_extend import UNEXTENDED

__all__ = ["STUDY_COLUMNS", "extend_study", "printed_study", "extend_study_table"]

#: Methods that keep the member's base in their saved config (the member's rotation is read from one of them).
_SAME_BASE = ("direct", "pi", "yarn", "pose")

STUDY_COLUMNS = ["head_dim", "L", "target", "scale", "fine_tuning", "method", "step", "seeds", "trials_within_L",
                 "success_within_L", "success_within_L_low", "success_within_L_high", "trials_beyond_L",
                 "success_beyond_L", "success_beyond_L_low", "success_beyond_L_high", "window_mean", "window_min",
                 "window_max", "window_seeds", "member_skill_seeds", "seeds_left_out", "bands", "bands_within_L",
                 "bands_within_L_over_s", "fast_share", "fast_share_unextended", "interpolation_bound",
                 "interpolation_bound_unextended", "prev_token_attention", "prev_token_attention_unextended", "run"]


def _member_rotation(run: Path, passkey: pd.DataFrame) -> tuple[int, float]:
    """(head dim, base) of the run's member, from the config.json of a run whose method keeps the member's base."""
    for model in passkey.loc[passkey["method"].isin(_SAME_BASE), "model"].unique():
        cfg_file = run / str(model) / "config.json"
        if cfg_file.is_file():
            c = json.loads(cfg_file.read_text(encoding="utf-8"))
            rope = dict(c.get("rope_parameters") or {})
            base = rope.get("rope_theta", c.get("rope_theta"))
            head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
            if base is not None:
                return int(head_dim), float(base)
    raise ValueError(f"{run}: no saved direct, PI, YaRN or PoSE folder to read the member's rotation from")


def _bands_within(head_dim: int, base: float, length: float) -> tuple[int, np.ndarray]:
    from posprobe.rope import RotarySpec
    from posprobe.rope_theory import band_periods

    periods = band_periods(RotarySpec(head_dim, base))
    return int((periods <= length).sum()), periods


def _fast_share(usage: pd.DataFrame, fast: int) -> dict[tuple[str, int], float]:
    """Per (method, seed): the share of |q.k| on bands 0..fast-1, mean over layers (band 0 the fastest)."""
    if usage is None or not len(usage):
        return {}
    out = {}
    for (method, seed), g in usage.groupby(["method", "seed"], sort=False):
        per_layer = g.groupby("layer").apply(
            lambda x: float(x.loc[x["band"] < fast, "value"].sum() / x["value"].sum()), include_groups=False)
        out[(str(method), int(seed))] = float(per_layer.mean())
    return out


def _largest_bound(mechanism: pd.DataFrame | None) -> dict[tuple[str, int], float]:
    """Per (method, seed): Chen et al.'s interpolation bound at its largest over the model's heads (logits)."""
    if mechanism is None or not len(mechanism):
        return {}
    got = mechanism.groupby(["method", "seed"], sort=False)["interpolation_bound"].max()
    return {(str(m), int(s)): float(v) for (m, s), v in got.items()}


def _strongest_previous(previous: pd.DataFrame | None) -> dict[tuple[str, int], float]:
    """Per (method, seed): the largest mean attention from i to i - 1 over the model's heads."""
    if previous is None or not len(previous):
        return {}
    got = previous.groupby(["method", "seed"], sort=False)["prev_attention"].max()
    return {(str(m), int(s)): float(v) for (m, s), v in got.items()}


def _member_skill(pk: pd.DataFrame, L: int, run: Path) -> dict[int, float]:
    """Per seed: the unextended member's passkey success within L (successes / trials pooled over distances <= L)."""
    mine = pk[(pk["method"] == UNEXTENDED) & (pk["distance"] <= L)]
    if mine.empty:
        raise ValueError(f"{run}: no passkey trials of the unextended member within L = {L}")
    sums = mine.groupby("seed")[["successes", "trials"]].sum()
    return {int(seed): float(r["successes"] / r["trials"]) for seed, r in sums.iterrows()}


def extend_study_table(runs: Sequence[str | os.PathLike], *, steps: str = "last",
                       min_skill: float = 0.0) -> pd.DataFrame:
    """The study's table over the `zoo extend` output folders `runs` (see the module docstring for each column).

    Args:
        runs: folders written by `posprobe zoo extend` with passkey trials (each holds `extend/` and the HF folders).
        steps: "last" (each method at its last checkpoint, the unextended member at 0) or "all" (every checkpoint).
        min_skill: leave out every seed whose unextended member succeeds within L on less than this share of its
            trials (0 keeps every seed; 0.5 reads "did the method keep a skill the member had").

    Returns:
        One row per head dim, L, fine-tuning, method and step (columns `STUDY_COLUMNS`; rates in [0, 1], windows
            and lengths in tokens), sorted by L, head dim, fine-tuning and method.

    Example:
        A zoo member trained 4 steps with the skill (too few to learn it), extended from 64 to 128 tokens by PI:

        >>> from posprobe.analyses.context_extension import extend_zoo
        >>> from posprobe.data import builtin_corpus
        >>> from posprobe.zoo import ZooConfig, train_zoo
        >>> from posprobe.zoo.extend import ExtendConfig
        >>> _ = train_zoo(ZooConfig(members=("rope-llama",), d_model=32, n_layers=2, n_heads=2, length=64,
        ...                         vocab_size=300, steps=4, passkey=0.5, progress=False), builtin_corpus(), "zoo")
        >>> _ = extend_zoo("zoo", ExtendConfig(methods=("pi",), length=128, steps=2, checkpoints=(0, 2),
        ...                eval_tokens=256, sliding="never", passkey_step=16, passkey_trials=3, mechanism=False,
        ...                progress=False), "ext")
        >>> extend_study_table(["ext"])[["head_dim", "L", "method", "step", "bands", "bands_within_L",
        ...                       "bands_within_L_over_s"]]
           head_dim   L      method  step  bands  bands_within_L  bands_within_L_over_s
        0        16  64          pi     2      8               3                      2
        1        16  64  unextended     0      8               3                      2
    """
    if steps not in ("last", "all"):
        raise ValueError(f"steps must be 'last' or 'all'; got {steps!r}")
    if not runs:
        raise ValueError("name at least one `zoo extend` output folder")
    if not 0.0 <= float(min_skill) <= 1.0:
        raise ValueError(f"min_skill is a share of trials, in [0, 1]; got {min_skill!r}")
    cells: dict[tuple, list[dict]] = {}  # one key per row: the runs' parts pooled into it
    # The seeds min_skill leaves out, per member cell (head dim, L, target, fine-tuning), also from runs that keep none.
    left_out: dict[tuple, list[dict]] = {}
    for run in map(Path, runs):
        if not (run / "extend" / "meta.json").is_file():
            raise ValueError(f"{run} is not a `zoo extend` output folder (no extend/meta.json)")
        res = Result.load(run / "extend")
        if "passkey" not in res.tables:
            raise ValueError(f"{run} has no passkey trials (the zoo was trained without --passkey, or "
                             "--passkey-trials 0)")
        meta, pk, win = res.meta, res.tables["passkey"], res.tables["effective_window"]
        L, target = int(meta["train_length"]), int(meta["target_length"])
        share = float(meta["config"].get("passkey") or 0)
        tuning = "text" if share == 0 else f"text + passkey {share:g}"
        head_dim, base = _member_rotation(run, pk)
        fast, periods = _bands_within(head_dim, base, L)
        facts = dict(run=str(run), fast=fast, fast_after_pi=int((periods <= L / (target / L)).sum()),
                     usage=_fast_share(res.tables.get("band_usage"), fast),
                     bounds=_largest_bound(res.tables.get("mechanism")),
                     previous=_strongest_previous(res.tables.get("previous_token")))
        pk = pk[pk["status"] == "ok"]
        skill = _member_skill(pk, L, run)
        out = [s for s in sorted(skill) if skill[s] < min_skill]
        facts.update(skill=skill)
        left_out.setdefault((head_dim, L, target, tuning), []).extend(
            dict(head_dim=head_dim, L=L, fine_tuning=tuning, seed=s, member_within_L=skill[s], run=str(run))
            for s in out)
        pk, win = pk[~pk["seed"].isin(out)], win[~win["seed"].isin(out)]
        for method, g in pk.groupby("method", sort=False):
            chosen = sorted(g["step"].unique()) if steps == "all" else [int(g["step"].max())]
            for step in chosen:
                # The mechanism is measured once, on each run's last checkpoint: earlier steps get none.
                cells.setdefault((head_dim, L, target, tuning, str(method), int(step)), []).append(
                    dict(facts, at=g[g["step"] == step], last=step == int(g["step"].max()),
                         w=win[(win["method"] == method) & (win["step"] == step)]))
    if not cells:
        raise ValueError(f"no seed's member succeeds within L on at least {min_skill:g} of its passkey trials: "
                         "nothing is left to compare (lower --min-skill)")
    rows = [dict(_row(key, parts), seeds_left_out=len(left_out.get(key[:4], []))) for key, parts in cells.items()]
    df = pd.DataFrame(rows, columns=STUDY_COLUMNS)
    # Which seeds were left out (a cell whose every seed is out has no row at all): for the command's stderr.
    df.attrs["left_out"] = [x for group in left_out.values() for x in group]
    return df.sort_values(["L", "head_dim", "fine_tuning", "method", "step"], kind="stable").reset_index(drop=True)


def _row(key: tuple, parts: list[dict]) -> dict:
    # One row of the table: the trials, windows and mechanism of every run part with this key, pooled over their
    # seeds (a seed may come from one run only: two runs of one seed would count its trials twice).
    head_dim, L, target, tuning, method, step = key
    seen: dict[int, str] = {}
    for p in parts:
        for s in sorted(int(x) for x in p["at"]["seed"].unique()):
            if s in seen:
                raise ValueError(f"seed {s} of head dim {head_dim}, L = {L}, {tuning}, {method} is in two runs "
                                 f"({seen[s]} and {p['run']}): its trials would count twice; leave one out")
            seen[s] = p["run"]
    at = pd.concat([p["at"] for p in parts], ignore_index=True)
    w = pd.concat([p["w"] for p in parts], ignore_index=True).sort_values("seed", kind="stable")
    row = {"head_dim": head_dim, "L": L, "target": target, "scale": target / L, "fine_tuning": tuning,
           "method": method, "step": step, "seeds": len(seen)}
    for side, part in (("within", at[at["distance"] <= L]), ("beyond", at[at["distance"] > L])):
        hits, n = int(part["successes"].sum()), int(part["trials"].sum())
        row[f"trials_{side}_L"] = n
        row[f"success_{side}_L"] = hits / n if n else float("nan")
        row[f"success_{side}_L_low"], row[f"success_{side}_L_high"] = wilson_ci(hits, n)
    ew = [int(x) for x in w["effective_window"]]
    parts_skill = {s: p["skill"][s] for p in parts for s in map(int, p["at"]["seed"].unique())}
    row.update(window_mean=float(np.mean(ew)) if ew else float("nan"), window_min=min(ew) if ew else None,
               window_max=max(ew) if ew else None, window_seeds=" ".join(map(str, ew)),
               member_skill_seeds=" ".join(f"{parts_skill[s]:.3f}" for s in sorted(parts_skill)),
               bands=head_dim // 2,
               bands_within_L=parts[0]["fast"], bands_within_L_over_s=parts[0]["fast_after_pi"])
    for column, table in (("fast_share", "usage"), ("interpolation_bound", "bounds"),
                          ("prev_token_attention", "previous")):
        mine = [p[table][(method, s)] for p in parts if p["last"] for s in map(int, sorted(p["at"]["seed"].unique()))
                if (method, s) in p[table]]
        before = [p[table][(UNEXTENDED, s)] for p in parts for s in map(int, sorted(p["at"]["seed"].unique()))
                  if (UNEXTENDED, s) in p[table]]
        row[column] = float(np.mean(mine)) if mine else float("nan")
        row[f"{column}_unextended"] = float(np.mean(before)) if before else float("nan")
    row["run"] = " ".join(dict.fromkeys(p["run"] for p in parts))
    return row


def extend_study(runs: Sequence[str | os.PathLike], *, steps: str = "last", min_skill: float = 0.0) -> Result:
    """The study over `runs` as a Result (table `study`, see `extend_study_table`), for `posprobe zoo extend-study`.

    Args:
        runs: folders written by `posprobe zoo extend` with passkey trials.
        steps: "last" or "all" checkpoints (as in `extend_study_table`).
        min_skill: leave out seeds whose unextended member succeeds within L below this share (as there).

    Returns:
        A Result with the table `study` and meta naming the runs.
    """
    df = extend_study_table(runs, steps=steps, min_skill=min_skill)
    meta = make_meta("zoo-extend-study", model={"name": "zoo", "positional_kind": "several"},
                     data={"source": "zoo extend runs", "runs": [str(r) for r in runs],
                           "seeds_left_out": df.attrs.get("left_out", [])},
                     config={"steps": steps, "min_skill": float(min_skill)},
                     title=f"Context extension across {len(runs)} runs")
    return Result({"study": df}, meta)


def printed_study(df: pd.DataFrame) -> str:
    """The study table as text for stdout: one line per row, rates with their 95 % Wilson intervals.

    Args:
        df: a `extend_study_table` frame.

    Returns:
        The lines, a header first.
    """
    def rate(r: pd.Series, side: str) -> str:
        p, lo, hi = (r[f"success_{side}_L{x}"] for x in ("", "_low", "_high"))
        return "n/a" if pd.isna(p) else f"{p:.2f} [{lo:.2f}-{hi:.2f}]"

    lines = [f"{'head dim':>8} {'L':>5} {'fine-tuning':18} {'method':11} {'step':>5} {'seeds':>5} "
             f"{'within L [95% CI]':>18} {'beyond L [95% CI]':>18} {'windows':>14} {'bands within L (L/s)':>21} "
             f"{'fast share':>10} {'prev-token':>10}  member within L (left out)"]
    for _, r in df.iterrows():
        share = "" if pd.isna(r["fast_share"]) else f"{r['fast_share']:.3f}"
        prev = "" if pd.isna(r["prev_token_attention"]) else f"{r['prev_token_attention']:.2f}"
        out = f" ({r['seeds_left_out']})" if r["seeds_left_out"] else ""
        lines.append(f"{r['head_dim']:>8} {r['L']:>5} {r['fine_tuning']:18} {r['method']:11} {r['step']:>5} "
                     f"{r['seeds']:>5} {rate(r, 'within'):>18} {rate(r, 'beyond'):>18} {r['window_seeds']:>14} "
                     f"{r['bands_within_L']:>5} of {r['bands']:<3} ({r['bands_within_L_over_s']}){'':>7} {share:>10} "
                     f"{prev:>10}  {r['member_skill_seeds']}{out}")
    return "\n".join(lines)
