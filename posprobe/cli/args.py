"""Arguments several subcommands share, and flags generated from the analyses' Config dataclasses
(argparse and dataclasses only: importing this stays instant)."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from types import UnionType
from typing import Any, Callable, Literal, Union, get_args, get_origin, get_type_hints

from posprobe.core.config import option_help


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL plus the loading options every model-taking subcommand shares."""
    p.add_argument("model", help="TL model name, HF folder, .gguf file, packaged alias (smollm2, gemma3-270m, "
                                 "minilm) or built-in random spec (tiny-ape, tiny-rope)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, cuda:1, mps, or auto (the best present: cuda > mps > cpu); default: cpu")
    p.add_argument("--dtype", default="float32", choices=["float64", "float32", "bfloat16", "float16"])
    p.add_argument("--n-ctx", type=int, default=None, help="cap the context length (bounds buffers)")


def json_object(text: str | None, flag: str) -> dict | None:
    """The JSON object given to `flag` on the command line (e.g. HF rope_parameters) as a dict (None when not given);
    ValueError naming the flag when it is not valid JSON or not an object (one line, as every refusal)."""
    import json

    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object of fields, e.g. '{{\"rope_type\": \"linear\"}}'")
    return value


def best_device() -> str:
    """The best device present: "cuda" > "mps" > "cpu" (imports torch)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def resolve_device(text: str) -> str:
    """--device value, checked against what this torch can use before any weights load (ValueError naming the fix
    otherwise): "auto" resolved by `best_device`; "cpu" as given; "cuda", "cuda:N" and "mps" only where present
    (torch is imported for those)."""
    import re

    name = text.strip().lower()
    if name == "auto":
        return best_device()
    if name == "cpu":
        return name
    m = re.fullmatch(r"(cuda|mps)(?::(\d+))?", name)
    if m is None:
        raise ValueError(f"--device {text}: unknown device; use cpu, cuda, cuda:N, mps, or auto (the best device "
                         "present)")
    import torch

    fix = "use --device cpu, or --device auto for the best device present"
    if m.group(1) == "cuda":
        if not torch.cuda.is_available():
            why = "was built without CUDA" if torch.version.cuda is None else "sees no CUDA GPU (driver or devices)"
            raise ValueError(f"--device {text}: this torch {torch.__version__} {why}; {fix}")
        index, count = int(m.group(2) or 0), torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"--device {text}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return name
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_available():
        raise ValueError(f"--device {text}: this torch {torch.__version__} has no MPS (Apple GPU) device; {fix}")
    return name


def add_text_argument(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    """--text: the corpus the analysis cuts into windows."""
    p.add_argument("--text", metavar="PATH", default=None, required=required,
                   help="UTF-8 text file (WikiText is detokenised automatically)"
                        + ("" if required else "; default: posprobe's built-in text"))


def add_output_arguments(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    """--out (the result folder) and --no-progress."""
    p.add_argument("--out", metavar="DIR", required=required, default=None,
                   help="folder for <table>.parquet (+ .csv), meta.json and report.html (its parent must exist)")
    p.add_argument("--csv", choices=["auto", "all", "none"], default="auto",
                   help="CSV beside each parquet table: auto (tables of at most 20,000 rows), all, none")
    p.add_argument("--figures", metavar="FORMATS", default="",
                   help="also write every report figure as files, e.g. svg,pdf,png (needs kaleido and Chromium)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def add_resume_arguments(p: argparse.ArgumentParser) -> None:
    """--fresh: for commands that keep completed units in `<out>.work` and resume from there when rerun."""
    p.add_argument("--fresh", action="store_true",
                   help="discard the work folder an interrupted run left beside --out (<out>.work) and start over; "
                        "without it, rerunning the same command resumes from there")


def add_analysis_arguments(p: argparse.ArgumentParser, config_cls: type) -> None:
    """The flags of a command that runs one analysis over a text: MODEL and loading options, --text,
    one flag per field of `config_cls`, then --out/--figures/--no-progress."""
    add_model_arguments(p)
    add_text_argument(p)
    add_config_arguments(p, config_cls)
    add_output_arguments(p)


def add_config_arguments(p: argparse.ArgumentParser, config_cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the frozen Config dataclass `config_cls`, its help text from the field's
    `posprobe.core.config.option(...)` docs; `dest` is the field name, so `config_from_args` can rebuild the config."""
    hints = get_type_hints(config_cls)
    for f in fields(config_cls):
        meta = f.metadata
        if f.name in skip or not meta.get("cli", True) or "help" not in meta:
            continue
        names = [meta.get("flag") or "--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
        default = f.default if f.default is not MISSING else None
        kind, choices = _kind(hints[f.name])
        help_text = option_help(f) + ("" if default is None or kind is bool else f" (default: {_show(default)})")
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            p.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif kind is tuple:
            # extend: `--k 0 100` and `--k 0 --k 100` both give (0, 100); None = not given (the
            # field's default applies, see config_from_args).
            item = choices
            p.add_argument(*names, dest=f.name, nargs="+", action="extend", type=_list_item(item), default=None,
                           help=help_text + ("; space- or comma-separated" if item is not str else ""),
                           metavar=f.name.rstrip("s").upper() or "X")
        else:
            p.add_argument(*names, dest=f.name, type=kind, default=default, choices=choices, help=help_text)


def config_from_args(config_cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The Config built from the parsed flags (fields without a flag keep their defaults)."""
    # None means "flag not given": the field's own default applies.
    values = {f.name: getattr(args, f.name) for f in fields(config_cls) if getattr(args, f.name, None) is not None}
    for name, v in list(values.items()):
        if isinstance(v, list):  # nargs="+" gives lists; "0,3" items were split into tuples by _list_item
            values[name] = tuple(x for item in v for x in (item if isinstance(item, tuple) else (item,)))
    values.update(overrides)
    return config_cls(**values)


def _kind(hint: Any) -> tuple[Any, tuple | None]:
    # Optional[X] -> X; tuple[X, ...] -> tuple with X's parser; Literal -> str with choices.
    args = [a for a in get_args(hint) if a is not type(None)]
    origin = get_origin(hint)
    if origin is Literal:
        return type(get_args(hint)[0]), get_args(hint)
    if origin in (Union, UnionType) and len(args) == 1:
        return _kind(args[0])
    if origin is tuple:
        return tuple, args[0] if args else str
    if hint in (int, float, str, bool):
        return hint, None
    raise TypeError(f"no command-line type for {hint!r}")


def _list_item(item: Any) -> Callable[[str], Any]:
    # Numbers and choices may come comma-separated ("0,3", "system,user"); strings are taken whole (preset specs
    # contain commas). A Literal item is checked against its choices here: calling Literal itself raises.
    choices = get_args(item) if get_origin(item) is Literal else None
    conv = type(choices[0]) if choices else item

    def parse(text: str) -> Any:
        if conv is str and choices is None:
            return text
        parts = tuple(conv(x.strip()) for x in text.split(",") if x.strip())
        bad = [x for x in parts if choices is not None and x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of: {', '.join(map(str, choices))}")
        return parts if len(parts) != 1 else parts[0]

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def _show(v: Any) -> str:
    return " ".join(map(str, v)) if isinstance(v, tuple) else str(v)
