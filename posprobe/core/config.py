"""Fields of the analyses' frozen Config dataclasses, each with the help text the CLI shows.

The CLI generates one flag per field from this metadata (`posprobe.cli.args.add_config_arguments`), so
a notebook user and a shell user set the same options, documented once.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, *, flag: str | None = None, aliases: tuple[str, ...] = (), cli: bool = True) -> Any:
    """A Config field with its command-line help: `x: int = option(3, "what x is (unit)")`.

    flag: the option's name when it differs from `--field-name`; aliases: further accepted names;
    cli=False keeps the field out of the command line (set by the command itself)."""
    meta = {"help": help, "flag": flag, "aliases": aliases, "cli": cli}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or None for sequence defaults (configs are frozen)")
    return field(default=default, metadata=meta)
