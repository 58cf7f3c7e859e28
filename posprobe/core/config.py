"""Fields of the analyses' frozen Config dataclasses, each with the help text the CLI shows.

The CLI generates one flag per field from this metadata (`posprobe.cli.args.add_config_arguments`), so
a notebook user and a shell user set the same options, documented once.
"""

from __future__ import annotations

from dataclasses import Field, field
from typing import Any, Callable


def option(
    default: Any,
    help: str | Callable[[], str],
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    cli: bool = True,
) -> Any:
    """A Config field with its command-line help: `x: int = option(3, "what x is (unit)")`.

    help: the text, or a function returning it where it is generated when the CLI is built (the preset grammar
    from the preset registry); flag: the option's name when it differs from `--field-name`; aliases: further
    accepted names; cli=False keeps the field out of the command line (set by the command itself)."""
    meta = {"help": help, "flag": flag, "aliases": aliases, "cli": cli}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or None for sequence defaults (configs are frozen)")
    return field(default=default, metadata=meta)


def option_help(f: Field) -> str:
    """The help text of a Config field made with `option` ("" where it has none)."""
    h = f.metadata.get("help", "")
    return h() if callable(h) else h


def at_least(cfg: object, minimum: int, *names: str) -> None:
    """Raise ValueError naming the first of the fields `names` of `cfg` that is below `minimum` (None is allowed: a
    value derived later)."""
    for name in names:
        v = getattr(cfg, name)
        if v is not None and v < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {v}")
