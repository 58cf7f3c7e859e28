"""`posprobe zoo extend`: context extension by fine-tuning, measured. The zoo's loop
(`posprobe.zoo.extend`) continues every chosen member from L to L' under each method; at each checkpoint the model
is scored by the length-extrapolation analysis (`run_extrapolation`, both of Press et al.'s protocols) at L, L' and
2L', beside the unextended member at the same lengths, and (for a zoo trained with the passkey skill, `zoo train
--passkey`) by passkey success by distance up to L' and Chen et al.'s effective window (`posprobe.analyses.passkey`).

It lives in analyses/ because it combines the zoo (which trains: the zoo is a model factory below the analyses)
with an analysis (which scores).

Numbers: ppl = exp(mean next-token loss in nats); in-window cost = ppl at L / the unextended member's ppl at L (same
protocol); steps-to-threshold = the first checkpoint whose ppl at L' is <= the unextended member's ppl at L."""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pandas as pd

from posprobe.analyses.configs import ExtrapolationConfig
from posprobe.analyses.extension_mechanism import entropy_table, looked_at, mechanism_tables
from posprobe.analyses.passkey import PASSKEY_COLUMNS, distance_grid, passkey_table, table_rows, window_table
from posprobe.report.checkpoint import discard_work_folder, run_key
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.report.zoo_extend import UNEXTENDED
from posprobe.zoo.extend import ExtendConfig, ExtendJob, plan_extension, steps_to_threshold
from posprobe.zoo.folder import TRAINING_FOLDER, member_folder_name, resolve_text
from posprobe.zoo.job import Job, open_work, run_jobs
from posprobe.zoo.members import member
from posprobe.zoo.methods import METHODS, yarn_bands
from posprobe.zoo.run import check_out_folder, commit_zoo, split_text

__all__ = ["extend_zoo", "summary_table", "training_text", "window_columns", "yarn_bands"]

#: What one effective window is measured for in `zoo extend`: a model at a checkpoint.
EXTEND_KEYS = ("model", "member", "family", "block", "seed", "method", "step")


def training_text(zoo: str | os.PathLike, text: str | None, source: str | None) -> tuple[str, str]:
    """(fine-tuning text, its source): `text` as given, else the zoo's own training text where it can be had again:
    posprobe's built-in corpus, or the file the zoo was trained on (`zoo train --text PATH`) where it is still there,
    each recognised by the sha256 in `<zoo>/training/meta.json`; ValueError saying which it is otherwise."""
    if text is not None:
        if not text.strip():
            raise ValueError("the fine-tuning text is empty")
        return text, source or "text"
    meta_file = Path(zoo) / TRAINING_FOLDER / "meta.json"
    meta = json.loads(meta_file.read_text(encoding="utf-8")) if meta_file.is_file() else {}
    data = meta.get("data") or {}
    origin = data.get("source")
    frac = float((meta.get("config") or {}).get("eval_fraction", 0.1))
    why = "that cannot be found again here"
    if origin == "built-in corpus":
        from posprobe.data import builtin_corpus

        whole: str | None = builtin_corpus()
    elif origin and Path(origin).is_file():
        whole = Path(origin).read_text(encoding="utf-8")
        why = "which has changed since (its sha256 differs)"
    else:
        whole = None
        # "text": train_zoo's record of a text given without a file name (nothing on disk to look for)
        why = "which is not here" if origin and origin != "text" else why
        origin = "a text given without a file name" if origin == "text" else origin
    if whole is not None:
        for candidate in (split_text(whole, None, frac)[0], whole):  # the split's training part, or all of it
            if text_sha256(candidate) == data.get("sha256"):
                return candidate, origin
    raise ValueError(f"pass --text: the fine-tuning text (the zoo was trained on {origin or 'a text'}, {why})")


class _Scorer:
    """Perplexity of a model at L, L' and 2L' on the evaluation text: the model is written as an HF folder and read
    back by posprobe's loader, so the numbers are `zoo eval`'s for the same folder."""

    def __init__(self, work: Path, tokenizer: Any, text: str, config: ExtrapolationConfig, device: str) -> None:
        self.folder, self.tokenizer, self.text, self.config = work / "scoring", tokenizer, text, config
        self.device = device

    def folder_rows(self, folder: Path, label: str, protocols: tuple[str, ...]) -> list[dict]:
        from posprobe.analyses.extrapolation import run_extrapolation
        from posprobe.backend.loading import load_model, quiet_progress

        with quiet_progress():  # its "Loading weights" bar would break the training's progress line
            model = load_model(str(folder), device=self.device)
        cfg = replace(self.config, protocols=protocols)
        df = run_extrapolation(model, self.text, cfg, label=label).tables["perplexity"]
        keep = ["protocol", "length", "factor", "nll", "ppl", "count", "status"]
        return [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()} for r in df[keep].to_dict("records")]

    def model_rows(self, model: Any, label: str, protocols: tuple[str, ...]) -> list[dict]:
        from posprobe.backend.loading import quiet_progress

        shutil.rmtree(self.folder, ignore_errors=True)
        with quiet_progress():
            model.save_pretrained(self.folder)
        self.tokenizer.save_pretrained(self.folder)
        try:
            return self.folder_rows(self.folder, label, protocols)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def extend_zoo(zoo: str | os.PathLike, config: ExtendConfig, out: str | os.PathLike, *, text: str | None = None,
               source: str | None = None, eval_text: str | None = None, fresh: bool = False) -> Result:
    """Extend the members of the zoo folder `zoo` under `config` and write the extended members to `out`:
    `<out>/<member>-s<seed>-<method>/` (HF folders) and `<out>/extend/` (the Result). Every refusal is
    raised before any training.

    Args:
        zoo: the zoo folder whose members are extended.
        config: the extension's options: methods, target length L', steps, evaluation and passkey settings.
        out: the folder the extended members and the Result are written to (new or empty; its parent must exist).
        text: the fine-tuning text (default: the zoo's own when it can be found again, recognised by its sha256;
            ValueError otherwise).
        source: what meta.json's data record names as the fine-tuning text when `text` is given (default "text").
        eval_text: the evaluation text (default: the zoo's held-out eval.txt); it must hold at least
            2L' + L/2 tokens.
        fresh: discard what an interrupted run left in `<out>.work` (by default the run resumes from there).

    Returns:
        A Result with tables `curves` (member x seed x method x checkpoint x protocol x length: ppl, nll,
            `vs_unextended_L` = ppl / the unextended member's ppl at L), `summary` (per member, seed, method,
            protocol: ppl at L, L', 2L' at step 0 and at the last step, in-window cost, steps-to-threshold),
            `plan` (each run's HF rope_parameters and settings, and what was left out and why), `yarn_bands`
            (gamma per band), `training` (loss every 10 steps) and `runs` (training seconds and tokens/s; scoring
            seconds at the checkpoints, apart); with passkey trials (`config.passkey_trials`, default 10 when the
            zoo was trained with `--passkey`) also `passkey` (member x seed x method x checkpoint x distance:
            success rate of the exact greedy answer) and `effective_window` (per checkpoint; the unextended
            members as method "unextended"), and the summary's `ew_*` columns; with `config.mechanism` also
            `mechanism`, `band_usage`, `previous_token`, `mechanism_refused` and `attention_entropy`.
    """
    import torch
    from transformers import AutoTokenizer

    from posprobe.backend.loading import load_causal_lm, quiet_progress

    jobs, left_out = plan_extension(zoo, config)
    out = Path(out)
    check_out_folder(out)
    L, target = jobs[0].length, jobs[0].target
    ex_cfg = ExtrapolationConfig(train_length=L, factors=(1.0, target / L, 2 * target / L),
                                 max_tokens=config.eval_tokens, progress=False)
    eval_text, eval_source = resolve_text([str(zoo)], eval_text, None if eval_text is None else "eval text")
    text, source = training_text(zoo, text, source)
    tokenizer = AutoTokenizer.from_pretrained(jobs[0].source)
    tok_file = (jobs[0].source / "tokenizer.json").read_bytes()
    odd = [j.source.name for j in jobs if (j.source / "tokenizer.json").read_bytes() != tok_file]
    if odd:
        raise ValueError(f"the members {odd} have another tokenizer than {jobs[0].source.name}: not one zoo")
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    if len(ids) < target:
        raise ValueError(f"the fine-tuning text has {len(ids)} tokens, too short for one window of L' = {target}")
    need = 2 * target + max(1, L // 2)
    n_eval = len(tokenizer(eval_text)["input_ids"])
    if n_eval < need:
        raise ValueError(f"the evaluation text has {n_eval} tokens; scoring at 2L' = {2 * target} needs at least "
                         f"{need}: give a longer --eval-text or a shorter --length")
    sources = sorted({j.source.name for j in jobs})
    key = run_key("zoo-extend", model={"zoo": str(Path(zoo).resolve()), "members": sources},
                  data={"train_sha256": text_sha256(text), "eval_sha256": text_sha256(eval_text)}, config=config)
    ckpt, staging, work = open_work(out, key, fresh=fresh)
    scorer = _Scorer(work, tokenizer, eval_text, ex_cfg, config.device)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if config.progress else (lambda msg: None)
    trials = config.passkey_trials_for(any(float(j.record.get("passkey") or 0) > 0 for j in jobs))
    distances = distance_grid(tokenizer, L, target, config.passkey_step) if trials else []

    def passkey_rows(model: Any) -> list[dict]:  # success by distance; [] when not measured
        return passkey_table(model, tokenizer, distances, trials,
                             max_length=table_rows(model)).to_dict("records") if trials else []

    def unextended(j: ExtendJob) -> dict:
        return {"ppl": scorer.folder_rows(j.source, j.source.name, config.protocols_at(None)),
                "passkey": passkey_rows(load_causal_lm(j.source).to(config.device))}

    for r in left_out:
        say(f"zoo extend: left out {r['member']} {r['method']}: {r['why']}")

    base: dict[tuple[str, int], list[dict]] = {}
    for j in jobs:
        if (j.member, j.seed) not in base:
            say(f"zoo extend: scoring unextended {j.source.name} at {L}, {target}, {2 * target} tokens")
            base[(j.member, j.seed)] = ckpt.compute(f"{j.member}/{j.seed}/unextended", lambda j=j: unextended(j))

    def look(job: Job, step: int, model: Any) -> dict:  # the scores of a run at one of its checkpoints
        return {"ppl": scorer.model_rows(model, job.folder, config.protocols_at(step)), "passkey": passkey_rows(model)}

    records = run_jobs([j.job(config, ids, tokenizer) for j in jobs], ckpt, staging, look=look,
                       after=lambda job, folder: {"method": job.record["method"]})
    result = _result(config, jobs, left_out, base, records, source, text, eval_source, eval_text)
    if config.mechanism:  # per head, before and after each method: a(s), Chen's bounds, band usage
        say(f"zoo extend: the mechanism (frequency pass and Chen's bounds) on {len(jobs)} extended members and "
            "their sources")
        with quiet_progress():  # a "Loading weights" bar per model would bury the stage lines
            stored = ckpt.compute("mechanism", lambda: {k: v.to_dict("list") for k, v in mechanism_tables(
                looked_at(jobs, lambda j: staging / j.folder_name), eval_text, device=config.device,
                previous_length=L).items()})
            result.tables.update({k: pd.DataFrame(v) for k, v in stored.items()})
            say(f"zoo extend: attention entropy at {L}, {target}, {2 * target} tokens on the same models")
            stored = ckpt.compute("entropy", lambda: entropy_table(
                looked_at(jobs, lambda j: staging / j.folder_name), eval_text, [L, target, 2 * target],
                device=config.device).to_dict("list"))
            result.tables["attention_entropy"] = pd.DataFrame(stored)
    commit_zoo(out, staging, {}, {"extend": result})
    discard_work_folder(work)
    return result


def _result(config: ExtendConfig, jobs: list[ExtendJob], left_out: list[dict], base: dict, records: list[dict],
            source: str, text: str, eval_source: str | None, eval_text: str) -> Result:
    L, target = jobs[0].length, jobs[0].target
    curves, train_rows, runs, plan, passkey = [], [], [], [], []

    def tag(j: ExtendJob, method: str) -> dict:
        m = member(j.member)
        return {"model": j.folder_name if method != UNEXTENDED else member_folder_name(j.member, j.seed),
                "member": j.member,
                "family": m.family, "block": m.block, "seed": j.seed, "method": method}

    done_base = set()
    for j, rec in zip(jobs, records):
        unext = base[(j.member, j.seed)]
        ref = {r["protocol"]: r["ppl"] for r in unext["ppl"] if r["length"] == L}
        if (j.member, j.seed) not in done_base:
            done_base.add((j.member, j.seed))
            curves += [{**tag(j, UNEXTENDED), "step": 0, "tokens": 0, **r,
                        "vs_unextended_L": r["ppl"] / ref[r["protocol"]]} for r in unext["ppl"]]
            passkey += [{**tag(j, UNEXTENDED), "step": 0, "tokens": 0, **r} for r in unext["passkey"]]
        tokens_per_step = j.batch_size * j.train_length  # pose and drope train at L
        for step, looked in rec["checkpoints"]:
            curves += [{**tag(j, j.method), "step": step, "tokens": step * tokens_per_step, **r,
                        "vs_unextended_L": r["ppl"] / ref[r["protocol"]]} for r in looked["ppl"]]
            passkey += [{**tag(j, j.method), "step": step, "tokens": step * tokens_per_step, **r}
                        for r in looked["passkey"]]
        train_rows += [{**tag(j, j.method), "step": s, "tokens": s * tokens_per_step, "loss": loss, "lr": lr}
                       for s, loss, lr in rec["log"]]
        runs.append({**tag(j, j.method), "steps": config.steps, "batch_size": j.batch_size,
                     "tokens_per_step": tokens_per_step, "seconds": rec["seconds"],
                     "tokens_per_s": rec["tokens_per_s"], "scoring_seconds": rec.get("checkpoint_seconds"),
                     "final_loss": rec["log"][-1][1]})
        plan.append({"member": j.member, "seed": j.seed, "method": j.method, "status": "ok", "why": "",
                     "rope_parameters": json.dumps(j.rope_parameters) if j.rope_parameters is not None else "",
                     "batch_size": j.batch_size, "lr": j.lr, "warmup": j.warmup, "notes": json.dumps(j.notes)})
    plan += [{"member": r["member"], "seed": None, "method": r["method"], "status": "left out", "why": r["why"],
              "rope_parameters": "", "batch_size": None, "lr": None, "warmup": None, "notes": ""} for r in left_out]
    curves_df = pd.DataFrame(curves)
    passkey_df = pd.DataFrame(passkey, columns=[*tag(jobs[0], UNEXTENDED), "step", "tokens", *PASSKEY_COLUMNS])
    windows = window_table(passkey_df, L, EXTEND_KEYS)
    summary = summary_table(curves_df, L, target)
    if len(windows):
        summary = summary.merge(window_columns(windows), on=["member", "seed", "method"], how="left")
    # A method's per-band table (YaRN's gamma), once per member.
    yarn = [METHODS[j.method].bands(j) for j in {(j.member, j.method): j for j in jobs
                                                 if METHODS[j.method].bands is not None}.values()]
    yarn_df = pd.concat(yarn, ignore_index=True) if yarn else pd.DataFrame(
        columns=["member", "band", "period", "turns_in_L", "gamma", "gamma_paper", "freq_factor"])
    gammas = {m: [round(float(g), 4) for g in yarn_df[yarn_df["member"] == m]["gamma"]]
              for m in dict.fromkeys(yarn_df["member"])}
    meta = make_meta("zoo-extend", model={"name": "zoo", "positional_kind": "several",
                                          "members": sorted({j.member for j in jobs})},
                     data=data_meta(source, n_items=len(text), unit="characters", sha256=text_sha256(text)),
                     config={**asdict(config), "rope_parameters": config.rope_parameters},
                     train_length=L, target_length=target, scale=target / L,
                     eval_source=eval_source, eval_sha256=text_sha256(eval_text),
                     lengths=sorted({L, target, 2 * target}), yarn_gamma=gammas,
                     left_out=left_out, title=f"Context extension from {L} to {target} tokens")
    tables = {"summary": summary, "curves": curves_df, "plan": pd.DataFrame(plan), "yarn_bands": yarn_df,
              "training": pd.DataFrame(train_rows), "runs": pd.DataFrame(runs)}
    if len(passkey_df):
        tables.update(passkey=passkey_df, effective_window=windows)
    return Result(tables, meta)


def window_columns(windows: pd.DataFrame) -> pd.DataFrame:
    """Per member, seed and method (the summary's keys): the unextended member's effective window (`ew_unextended`),
    the method's at step 0 (`ew_step0`) and at its last checkpoint (`ew`)."""
    rows = []
    ext = windows[windows["method"] != UNEXTENDED]
    for (name, seed, method), g in ext.groupby(["member", "seed", "method"], sort=False):
        u = windows[(windows["method"] == UNEXTENDED) & (windows["member"] == name) & (windows["seed"] == seed)]
        at = dict(zip(g["step"], g["effective_window"]))
        rows.append({"member": name, "seed": seed, "method": method,
                     "ew_unextended": int(u["effective_window"].iloc[0]) if len(u) else None,
                     "ew_step0": at.get(0), "ew": at[max(at)]})
    return pd.DataFrame(rows, columns=["member", "seed", "method", "ew_unextended", "ew_step0", "ew"])


def summary_table(curves: pd.DataFrame, L: int, target: int) -> pd.DataFrame:
    """One row per member, seed, method and protocol from the `curves` table: the unextended member's ppl at L and
    L', ppl at L, L' and 2L' at step 0 and at the last checkpoint (NaN where the protocol was not scored there), the
    in-window cost at L (last / unextended) and steps-to-threshold (the first checkpoint whose ppl at L' <= the
    unextended ppl at L, among the `n_checkpoints` scored with this protocol; None if none)."""
    rows = []
    ok = curves[curves["status"] == "ok"]
    unext = ok[ok["method"] == UNEXTENDED]
    for (name, seed, method, protocol), g in ok[ok["method"] != UNEXTENDED].groupby(
            ["member", "seed", "method", "protocol"], sort=False):
        u = unext[(unext["member"] == name) & (unext["seed"] == seed) & (unext["protocol"] == protocol)]
        ppl = {(int(r.step), int(r.length)): float(r.ppl) for r in g.itertuples()}
        ref = {n: float(u[u["length"] == n]["ppl"].iloc[0]) if (u["length"] == n).any() else float("nan")
               for n in (L, target)}
        steps = sorted({s for s, _ in ppl})
        last = steps[-1]
        rows.append({"member": name, "seed": seed, "method": method, "protocol": protocol,
                     "ppl_L_unextended": ref[L], "ppl_Lp_unextended": ref[target],
                     **{f"ppl_{k}_step0": ppl.get((0, n), float("nan"))
                        for k, n in (("L", L), ("Lp", target), ("2Lp", 2 * target))},
                     "step": last,
                     **{f"ppl_{k}": ppl.get((last, n), float("nan"))
                        for k, n in (("L", L), ("Lp", target), ("2Lp", 2 * target))},
                     "in_window_cost": ppl.get((last, L), float("nan")) / ref[L],
                     "steps_to_threshold": steps_to_threshold([(s, ppl[(s, target)]) for s in steps
                                                               if (s, target) in ppl], ref[L]),
                     "n_checkpoints": len(steps)})
    return pd.DataFrame(rows)
