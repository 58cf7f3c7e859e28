"""The zoo folder format, owned here and nowhere else. A zoo written by `posprobe zoo train` (or `zoo tasks`) is:

- `<zoo>/<member>-s<seed>/`: an ordinary Hugging Face model folder (config.json, safetensors, tokenizer) plus
  `zoo.json` (member, family, block, seed, widths, training; `extension` on a member `zoo extend` made);
- `<zoo>/eval.txt`: the held-out evaluation text (what `zoo eval` and `zoo atlas` read by default);
- `<zoo>/training/`: the training Result (tables `members`, `training`; meta, report); a task zoo's `<zoo>/tasks/`
  (accuracy by task and instance length); a sink control's `<zoo>/sink-control/` (Bigram-Backcopy members' sinks);
- `<zoo>/<member>-s<seed>/checkpoints/step<K>/`: with `zoo train --save-every K`, the member's weights after K, 2K, ...
  steps (and step 0) as folders of the same kind, their zoo.json adding `step` and `tokens` (`MODEL@step<K>` loads one);
- `zoo extend` writes `<out>/<member>-s<seed>-<method>/` member folders of the same kind.
Readers and writers of any of these import the names below; torch-free, below the analyses."""

from __future__ import annotations

import json
from pathlib import Path

from posprobe.backend.sources import STEPS_FOLDER
from posprobe.report.result import Result

__all__ = ["EVAL_FILE", "MEMBER_COLUMNS", "SINK_CONTROL_FOLDER", "STEPS_FOLDER", "TASKS_FOLDER", "TRAINING_FOLDER",
           "ZOO_FILE", "default_text", "extended_folder_name", "member_folder_name", "member_info", "read_zoo",
           "resolve_text", "training_tables", "zoo_models"]

#: The file in every member folder that says what it is (family, block, seed, widths, training).
ZOO_FILE = "zoo.json"
#: The held-out evaluation text every zoo keeps beside its members (what `posprobe zoo eval` reads by default).
EVAL_FILE = "eval.txt"
#: The subfolder holding the training Result (loss curves, per-member rows).
TRAINING_FOLDER = "training"
#: The subfolder holding a task zoo's Result (accuracy by task and instance length, training curves).
TASKS_FOLDER = "tasks"
#: The subfolder holding a sink control's Result (`posprobe zoo sink-control`: sinks of Bigram-Backcopy members).
SINK_CONTROL_FOLDER = "sink-control"
#: The columns that say which zoo member a row belongs to.
MEMBER_COLUMNS = ("member", "family", "block", "seed")


def member_folder_name(name: str, seed: int) -> str:
    """The folder of member `name` trained with `seed` inside a zoo: `<name>-s<seed>`."""
    return f"{name}-s{seed}"


def extended_folder_name(name: str, seed: int, method: str) -> str:
    """The folder of member `name`, seed `seed`, extended with `method`: `<name>-s<seed>-<method>`."""
    return f"{name}-s{seed}-{method}"


def _member_folders(p: Path) -> list[Path]:
    # A member folder stands for itself; a zoo folder for its members, sorted.
    if (p / ZOO_FILE).is_file():
        return [p]
    if p.is_dir():
        return sorted(c for c in p.iterdir() if c.is_dir() and (c / ZOO_FILE).is_file())
    return []


def _record(folder: Path) -> dict:
    return json.loads((folder / ZOO_FILE).read_text(encoding="utf-8"))


def read_zoo(path: str | Path) -> list[tuple[Path, dict]]:
    """(member folder, its zoo.json record) for every member of the zoo folder `path` (or `path` itself when it is
    one member folder), sorted; ValueError when `path` is not a zoo, a member folder lacks its config or widths, or
    a member is already extended (extend the zoo it came from)."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{path}: no such folder (expected a zoo folder written by posprobe zoo train)")
    folders = _member_folders(p)
    if not folders:
        raise ValueError(f"{path} is not a zoo folder (no {ZOO_FILE} in it or its subfolders): train one with "
                         "posprobe zoo train")
    out = []
    for f in folders:
        rec = _record(f)
        if not (f / "config.json").is_file() or "widths" not in rec or "member" not in rec:
            raise ValueError(f"{f} has a {ZOO_FILE} but is not a zoo member folder (no config.json or no widths)")
        if rec.get("extension"):
            raise ValueError(f"{f} is already an extended member ({rec['extension'].get('method')}); extend the "
                             "zoo it came from")
        out.append((f, rec))
    return out


def zoo_models(paths: list[str]) -> list[tuple[str, dict | None]]:
    """(model spec, zoo record or None) for every model named: a zoo folder stands for its members (sorted), a
    member folder or any other model spec for itself. A spec that is none of these (a path that does not exist, a
    folder that is neither a zoo nor a model, a name that cannot be had offline) raises ValueError naming it, before
    any model loads."""
    out: list[tuple[str, dict | None]] = []
    for spec in paths:
        found = _member_folders(Path(spec))
        if found:
            out += [(str(f), _record(f)) for f in found]
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


def member_info(label: str, record: dict | None) -> dict:
    """A model's member, family, block and seed from its zoo record (None outside a zoo; member = its label). A member
    extended by `zoo extend` is `<member>+<method>`, so the methods are not averaged together as seeds."""
    info = {k: (record or {}).get(k) for k in MEMBER_COLUMNS}
    if info["member"] is None:
        info["member"] = label
    elif (record or {}).get("method"):
        info["member"] = f"{info['member']}+{record['method']}"
    return info


def training_tables(paths: list[str]) -> tuple[dict, dict | None]:
    """The zoo's own training record as `posprobe zoo train` saved it (the first of `paths` that has one): tables
    {"training": loss curve, "training_members": per-member rows} and the training text's data record (None, {}
    where no path has one)."""
    for spec in paths:
        folder = Path(spec) / TRAINING_FOLDER
        if (folder / "meta.json").is_file():
            got = Result.load(folder)
            return {"training": got.tables["training"], "training_members": got.tables["members"]}, got.meta.get("data")
    return {}, None
