"""Running an analysis across a zoo: the length-extrapolation comparison (Press et al. 2022) over every member of
one or more zoo folders, or over any models a user passes. A model the analysis refuses is a row with its reason,
never dropped silently."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd

from posprobe.analyses.extrapolation import ExtrapolationConfig, run_extrapolation
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.zoo.run import EVAL_FILE
from posprobe.zoo.train import ZOO_FILE

__all__ = ["evaluate_zoo", "member_info", "resolve_text", "zoo_models"]

#: The columns that say which zoo member a row belongs to.
MEMBER_COLUMNS = ("member", "family", "block", "seed")


def zoo_models(paths: list[str]) -> list[tuple[str, dict | None]]:
    """(model spec, zoo record or None) for every model named: a zoo folder stands for its members (sorted), a
    member folder or any other model spec for itself. A spec that is none of these (a path that does not exist, a
    folder that is neither a zoo nor a model, a name that cannot be had offline) raises ValueError naming it, before
    any model loads."""
    out: list[tuple[str, dict | None]] = []
    for spec in paths:
        p = Path(spec)
        if (p / ZOO_FILE).is_file():
            out.append((str(p), json.loads((p / ZOO_FILE).read_text(encoding="utf-8"))))
        elif p.is_dir() and any((c / ZOO_FILE).is_file() for c in p.iterdir() if c.is_dir()):
            out += [(str(c), json.loads((c / ZOO_FILE).read_text(encoding="utf-8")))
                    for c in sorted(p.iterdir()) if (c / ZOO_FILE).is_file()]
        else:
            _check_spec(spec)
            out.append((spec, None))
    if not out:
        raise ValueError("no models to evaluate")
    return out


def _check_spec(spec: str) -> None:
    # What loading would refuse, asked without loading: posprobe's own resolver (local folders, packaged weights,
    # tiny specs; a hub name only when it can be had).
    from posprobe.backend.sources import ModelLoadError, resolve, resolve_local

    if Path(spec).is_dir() and not (Path(spec) / "config.json").is_file():
        raise ValueError(f"{spec} is not a zoo folder (no {ZOO_FILE} in it or its subfolders), a zoo member or a "
                         "Hugging Face model folder (no config.json)")
    try:
        if resolve_local(spec, assemble=False) is None:
            resolve(spec)
    except ModelLoadError as e:
        raise ValueError(f"{spec}: {e}") from None


def default_text(paths: list[str]) -> tuple[str, str] | None:
    """(text, source) of the first zoo folder's held-out evaluation text, or None."""
    for spec in paths:
        for folder in (Path(spec), Path(spec).parent):
            if (folder / EVAL_FILE).is_file() and (folder / EVAL_FILE).stat().st_size:
                return (folder / EVAL_FILE).read_text(encoding="utf-8"), str(folder / EVAL_FILE)
    return None


def member_info(label: str, record: dict | None) -> dict:
    """A model's member, family, block and seed from its zoo record (None outside a zoo; member = its label). A member
    extended by `zoo extend` is `<member>+<method>`, so the methods are not averaged together as seeds."""
    info = {k: (record or {}).get(k) for k in MEMBER_COLUMNS}
    if info["member"] is None:
        info["member"] = label
    elif (record or {}).get("method"):
        info["member"] = f"{info['member']}+{record['method']}"
    return info


def resolve_text(paths: list[str], text: str | None, source: str | None) -> tuple[str, str | None]:
    """(text, source): `text` as given, else the first zoo folder's held-out eval.txt; ValueError when there is none
    or it is empty (before any model loads)."""
    if text is None:
        found = default_text(paths)
        if found is None:
            raise ValueError("no text: pass --text (only a zoo folder carries its own eval.txt)")
        text, source = found
    if not text.strip():
        raise ValueError("the text is empty")
    return text, source


def evaluate_zoo(paths: list[str], config: ExtrapolationConfig | None = None, *, text: str | None = None,
                 source: str | None = None, device: str = "cpu") -> Result:
    """Perplexity vs evaluation length for every model in `paths` (zoo folders, member folders, other model
    specs) on `text` (default: the zoo's held-out eval.txt). Each zoo member is evaluated at its own training
    length L. Returns a Result with tables `perplexity` (every model x protocol x length, with the member's family,
    block and seed) and `ratios` (ppl(xL) / ppl(L) per member, protocol and factor: mean, min and max over seeds)."""
    from posprobe.backend.loading import load_model
    from posprobe.backend.sources import ModelLoadError

    config = config or ExtrapolationConfig()
    models = zoo_models(paths)
    text, source = resolve_text(paths, text, source)
    frames = []
    for spec, rec in models:
        label = Path(spec).name if rec is not None else spec
        cfg = config
        if rec is not None and config.train_length is None:
            cfg = replace(config, train_length=int(rec["widths"]["length"]))
        info = member_info(label, rec)
        try:
            model = load_model(spec, device=device)
            df = run_extrapolation(model, text, cfg, source=source, label=label).tables["perplexity"]
        except (ValueError, NotImplementedError, ModelLoadError) as e:
            df = pd.DataFrame([{"model": label, "status": "refused", "why": str(e)}])
        frames.append(df.assign(**info))
    table = pd.concat(frames, ignore_index=True)
    meta = make_meta("zoo-eval", model={"name": "zoo", "positional_kind": "several", "models": [s for s, _ in models]},
                     data=data_meta(source, n_items=len(text), unit="characters", sha256=text_sha256(text)),
                     config=config)
    return Result({"perplexity": table, "ratios": ratio_summary(table)}, meta)


def ratio_summary(table: pd.DataFrame) -> pd.DataFrame:
    """ppl(xL) / ppl(L) per member, protocol and factor: mean over seeds, min and max, seeds counted; rows that
    cannot run keep their status; a member none of whose models ran is one row with status "refused" and its why."""
    if "ppl_ratio" not in table:
        table = table.assign(ppl_ratio=float("nan"), protocol=None, factor=float("nan"))
    ok = table[table["status"].isin(["ok", "cannot run"])]
    keys = ["member", "family", "block", "protocol", "factor"]
    g = ok.groupby(keys, sort=False, dropna=False)
    out = g.agg(ppl_ratio=("ppl_ratio", "mean"), ratio_low=("ppl_ratio", "min"), ratio_high=("ppl_ratio", "max"),
                n_seeds=("model", "nunique"), status=("status", "first")).reset_index()
    # A member none of whose models ran stays a row (status refused, with the first reason), so every table that
    # lists members lists it.
    gone = table[~table["member"].isin(ok["member"])].drop_duplicates("member")
    if len(gone):
        why = gone["why"] if "why" in gone else ""
        out = pd.concat([out, gone[["member", "family", "block"]].assign(status="refused", why=why)],
                        ignore_index=True)
    return out
