"""A positive control for attention sinks (`posprobe zoo sink-control`, issue #63): zoo members trained on the
Bigram-Backcopy task (`posprobe.zoo.backcopy`; Guo et al. 2024, arXiv 2410.13835), on which transformers of one to
three layers are known to form an attention sink on the first token, measured with the very Sink_1^epsilon every
other model gets (`posprobe.analyses.sinks.sink_statistics`, Gu et al. 2025), beside Guo et al.'s two companions:
the value-state drain (the first token's value norm against the mean of the others', per head) and the
residual-state peak (the first token's residual norm after each block against the median of the others').

Guo et al.'s mechanism is read per head too (`roles`): a head is *dormant* on non-trigger queries (their attention
on the first token) and *active* on trigger queries (their attention on the token just before, the one the next
token copies). Each member is looked at before training (step 0, where no sink may be found: the control is not
vacuous), at a few steps on the way, and at the end (also its massive activations, Sun et al. 2024)."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from posprobe.analyses.configs import SinksConfig
from posprobe.analyses.sinks import sink_statistics
from posprobe.core.capture import capture
from posprobe.report.checkpoint import discard_work_folder, run_key
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta
from posprobe.zoo.backcopy import (
    BackcopyConfig,
    backcopy_batch,
    backcopy_rows,
    backcopy_tokenizer,
    backcopy_vocab,
    loss_floor,
    trigger_ids,
)
from posprobe.zoo.config import ZooConfig
from posprobe.zoo.folder import SINK_CONTROL_FOLDER, member_folder_name
from posprobe.zoo.job import Job, open_work, run_jobs
from posprobe.zoo.members import Widths, member
from posprobe.zoo.run import check_device, check_out_folder, commit_zoo

__all__ = ["BackcopyConfig", "backcopy_measures", "run_sink_control"]

_CONDITION = "bigram-backcopy"


@torch.no_grad()
def backcopy_measures(model: Any, rows: torch.Tensor, triggers: tuple[int, ...], *, epsilon: float = 0.3,
                      batch_size: int = 16) -> dict[str, pd.DataFrame]:
    """Sinks, value drain, residual peak and the active/dormant split of `model` (a posprobe model) on task rows.

    Args:
        model: a model loaded by `posprobe.load_model` (a member folder).
        rows: `[batch, L]` Bigram-Backcopy sequences, the BOS first.
        triggers: the trigger ids.
        epsilon: Gu et al.'s threshold on a head's mean attention on the first token.
        batch_size: sequences per forward pass.

    Returns:
        {"sink_heads": layer, head, metric, value (`sink_statistics`' metrics, among them first_attention, sink_rate
        and first_value_norm_ratio, and the roles: dormant_first_attention = non-trigger queries' attention on the
        first token, active_first_attention and active_previous_attention = trigger queries' attention on the first
        and on the previous token), "sink_share": layer, metric "sink_share", value, count = sequences,
        "residual_norms": layer, metric (first_norm = mean |residual| of the first token after the block,
        median_norm = median over the other positions of all rows, ratio), value}."""
    cfg = SinksConfig(length=rows.shape[1], epsilon=epsilon, batch_size=batch_size, massive_top=0, progress=False)
    heads, share = sink_statistics(model, rows, cfg, condition=_CONDITION)
    is_trigger = torch.isin(rows, torch.tensor(triggers, dtype=rows.dtype))
    sums: dict[tuple[int, str], torch.Tensor] = {}
    counts = {"dormant": 0.0, "active": 0.0}
    norms: dict[int, list[torch.Tensor]] = {}
    for a in range(0, rows.shape[0], batch_size):
        x, trig = rows[a:a + batch_size], is_trigger[a:a + batch_size]
        got = capture(model, x, ["pattern", "resid_post"])
        queries = {"dormant": ~trig, "active": trig.clone()}
        for q in queries.values():
            q[:, 0] = False  # query 0 sees only itself
        for name, q in queries.items():
            counts[name] += float(q.sum())
        for (point, layer), t in got.items():
            t = t.double().cpu()
            if point == "resid_post":
                norms.setdefault(layer, []).append(t.norm(dim=-1))  # [batch, pos]
                continue
            first, prev = t[..., 0], torch.diagonal(t, offset=-1, dim1=-2, dim2=-1)  # [batch, head, q], [.., q-1]
            prev = torch.cat([torch.zeros_like(prev[..., :1]), prev], dim=-1)  # aligned with the query
            for key, (vals, q) in {"dormant_first_attention": (first, queries["dormant"]),
                                   "active_first_attention": (first, queries["active"]),
                                   "active_previous_attention": (prev, queries["active"])}.items():
                s = (vals * q[:, None].double()).sum((0, 2))
                sums[(layer, key)] = sums.get((layer, key), 0) + s
    roles = []
    for (layer, key), s in sorted(sums.items()):
        n = counts["dormant" if key.startswith("dormant") else "active"] or float("nan")
        roles.append(pd.DataFrame({"condition": _CONDITION, "layer": layer, "head": range(len(s)), "metric": key,
                                   "value": (s / n).numpy()}))
    resid = []
    for layer, parts in sorted(norms.items()):
        n = torch.cat(parts)
        first, median = float(n[:, 0].mean()), float(n[:, 1:].median())
        resid += [dict(condition=_CONDITION, layer=layer, metric=m, value=v)
                  for m, v in (("first_norm", first), ("median_norm", median), ("ratio", first / median))]
    return {"sink_heads": pd.concat([heads, *roles], ignore_index=True), "sink_share": share,
            "residual_norms": pd.DataFrame(resid)}


def _measure_folder(folder: Path, rows: torch.Tensor, triggers: tuple[int, ...], config: BackcopyConfig, *,
                    massive: bool = False) -> dict:
    from posprobe.backend.loading import load_model, quiet_progress

    with quiet_progress():
        model = load_model(str(folder), device=config.device)
    tables = backcopy_measures(model, rows, triggers)
    if massive:
        from posprobe.analyses.massive import massive_table

        tables["massive_activations"] = massive_table(model, rows, top=3, batch_size=16, progress=False,
                                                      condition=_CONDITION)
    return {k: v.to_dict("list") for k, v in tables.items()}


def run_sink_control(config: BackcopyConfig, out: str | os.PathLike, *, fresh: bool = False) -> Result:
    """Train `config.members` x `config.seeds` on the Bigram-Backcopy task through the zoo's one training loop and
    measure their sinks; write the zoo to `out` (new or empty): the member folders (Hugging Face folders over the
    task's character vocabulary, zoo.json saying the task) and `<out>/sink-control/` (the Result). A killed run
    resumes from `<out>.work` when repeated (`fresh` discards it).

    Args:
        config: what to train and measure.
        out: the new zoo folder.
        fresh: discard an interrupted run's work folder.

    Returns:
        The Result (analysis "zoo-sink-control"): tables `sink_share` and `sink_heads` (`backcopy_measures`'), and
            `residual_norms`, each per model and `step` (0, the looks on the way, the last), `massive_activations`
            (the trained models), `members` (parameters, training seconds, final loss, the task's loss floor) and
            `training` (loss every 10 steps); meta["sink_share"]: model -> layer -> Gu et al.'s share at the last
            step.

    Example:
        Ten steps of the learned member (too few for a sink: the command's 600 steps make one in every sequence):

        >>> import posprobe as pp
        >>> cfg = pp.BackcopyConfig(members=("learned",), d_model=16, length=16, steps=10, batch_size=4,
        ...                         eval_sequences=4, looks=0, progress=False)
        >>> result = pp.run_sink_control(cfg, "sink-control")
        >>> sorted(result.tables["sink_share"].step.unique().tolist())
        [0, 10]
    """
    out = Path(out)
    check_out_folder(out)
    tokenizer = backcopy_tokenizer()
    widths = Widths(d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads, length=config.length,
                    vocab_size=len(backcopy_vocab()))
    zoo = ZooConfig(members=config.members, seeds=config.seeds, d_model=config.d_model, n_layers=config.n_layers,
                    n_heads=config.n_heads, length=config.length, steps=config.steps, batch_size=config.batch_size,
                    lr=config.lr, weight_decay=config.weight_decay, device=config.device, progress=config.progress,
                    checkpoint_every=max(1, config.steps // 4))
    check_device(zoo)
    triggers = trigger_ids(config.triggers)
    rows = backcopy_rows(config.eval_sequences, config.length, triggers=config.triggers)
    chars = {i: t for t, i in backcopy_vocab().items()}
    record = {"task": "bigram-backcopy", "triggers": [chars[i] for i in triggers], "length": config.length}

    def batches(seed: int) -> Any:
        return lambda step: backcopy_batch(config.batch_size, config.length, step, seed, triggers=config.triggers)

    jobs = [Job(name, seed, zoo, tokenizer, batches(seed), widths=widths, record=record, checkpoints=config.look_steps)
            for seed in config.seeds for name in config.members]
    key = run_key("zoo-sink-control", model={"members": list(config.members)}, data={"task": "bigram-backcopy"},
                  config=replace(config, progress=True))

    def look(job: Job, step: int, model: Any) -> dict:  # the model during training, through a folder of its own
        from posprobe.backend.loading import quiet_progress

        with tempfile.TemporaryDirectory() as tmp:
            with quiet_progress():
                model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            return _measure_folder(Path(tmp), rows, triggers, config)

    def after(job: Job, folder: Path) -> dict:
        if config.progress:
            print(f"zoo sink-control: measuring {folder.name}", file=sys.stderr, flush=True)
        return {"final": _measure_folder(folder, rows, triggers, config, massive=True)}

    ckpt, staging, work = open_work(out, key, fresh=fresh)
    records = run_jobs(jobs, ckpt, staging, look=look, after=after)
    result = _result(config, widths, records, rows, [chars[i] for i in triggers])
    commit_zoo(out, staging, {}, {SINK_CONTROL_FOLDER: result})
    discard_work_folder(work)
    return result


def _result(config: BackcopyConfig, widths: Widths, records: list[dict], rows: torch.Tensor,
            triggers: list[str]) -> Result:
    tables: dict[str, list[pd.DataFrame]] = {}
    members, curve, shares = [], [], {}
    floor = loss_floor(rows, config.triggers)
    for r in records:
        m = member(r["member"])
        name = member_folder_name(m.name, r["seed"])
        info = dict(model=name, member=m.name, family=m.family, block=m.block, seed=r["seed"])
        looks = [(int(step), got) for step, got in r["checkpoints"]] + [(config.steps, r["final"])]
        for step, got in looks:
            for table, cols in got.items():
                df = pd.DataFrame(cols)
                for i, (k, v) in enumerate({**info, "step": step}.items()):
                    df.insert(i, k, v)
                tables.setdefault(table, []).append(df)
        final = pd.DataFrame(r["final"]["sink_share"])
        shares[name] = {int(layer): float(v) for layer, v in zip(final.layer, final.value)}
        members.append({**info, "model_type": m.model_type, "params": r["params"], "steps": config.steps,
                        "seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"], "loss": r["log"][-1][1],
                        "loss_floor": floor, "positions": m.positions})
        curve += [{**info, "step": s, "loss": loss, "lr": lr} for s, loss, lr in r["log"]]
    out = {k: pd.concat(v, ignore_index=True) for k, v in tables.items()}
    meta = make_meta("zoo-sink-control", model={"name": "sink control", "positional_kind": "several",
                                                "members": list(config.members)},
                     data=data_meta("Bigram-Backcopy sequences (bigrams of the built-in corpus)",
                                    n_items=len(rows), unit="held-out sequences"),
                     config=config, triggers=triggers, vocab_size=widths.vocab_size, sink_share=shares,
                     paper="Guo et al. 2024, arXiv 2410.13835 (Bigram-Backcopy); Sink_1^epsilon: Gu et al. 2025")
    return Result({**out, "members": pd.DataFrame(members), "training": pd.DataFrame(curve)}, meta)
