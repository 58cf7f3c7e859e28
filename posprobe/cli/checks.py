"""Checks the subcommands run before any weights load or torch / TransformerLens is imported.

Each raises one ValueError subclass with one clear message, so a bad input fails in about a second
with nothing written. The same checks run again after loading (for model objects and hub names,
which `peek` cannot see into); these only move the failure earlier.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from posprobe.backend.peek import PeekedFacts, WrongModelKind, peek

__all__ = ["WrongModelKind", "check_at_least", "check_layers", "check_out", "check_window", "context",
           "given_flags", "peek_model", "read_text_early", "require_rotary"]


def peek_model(args: argparse.Namespace) -> PeekedFacts | None:
    """The model's facts from its spec (None for hub names); checks the shared loading flags too."""
    n_ctx = getattr(args, "n_ctx", None)
    if n_ctx is not None and n_ctx < 1:
        raise ValueError(f"--n-ctx must be >= 1; got {n_ctx}")
    return peek(args.model)


def given_flags(args: argparse.Namespace, config_cls: type, *names: str) -> list[str]:
    """The flags of Config fields `names` that the command line set: a list option given at all, any other
    option set to a value other than its default (argparse fills defaults in, so typing the default is not seen)."""
    from dataclasses import MISSING, fields

    out = []
    for f in fields(config_cls):
        if f.name not in names:
            continue
        v = getattr(args, f.name, None)
        default = None if f.default is MISSING else f.default
        if v is not None and (isinstance(v, list) or v != default):
            out.append(f.metadata.get("flag") or "--" + f.name.replace("_", "-"))
    return out


def check_out(out: str | None) -> None:
    """--out must be a folder or not exist yet, inside a folder that exists, and both must be writable (nothing is
    left behind here)."""
    if out is None:
        return
    p = Path(out).expanduser()
    parent = p.absolute().parent
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"--out {out} exists and is not a folder")
    elif not parent.is_dir():
        raise ValueError(f"--out {out}: its parent folder {parent} does not exist (create it first)")
    # Results are written beside the folder first (OUT.work) and renamed into place, so both the parent and an
    # existing OUT must take a new file; trying it costs a file created and removed, not a run that fails at the end.
    for folder in (parent, p) if p.exists() else (parent,):
        try:
            fd, probe = tempfile.mkstemp(prefix=".posprobe-write-check-", dir=folder)
        except OSError as e:
            raise ValueError(f"--out {out}: cannot write in {folder} ({e.strerror or e})") from None
        os.close(fd)
        os.unlink(probe)


def check_at_least(args: argparse.Namespace, minimum: int, *names: str) -> None:
    """Each integer flag in `names` (argparse dest names) must be >= minimum when given."""
    for name in names:
        v = getattr(args, name, None)
        if v is not None and v < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}; got {v}")


def require_rotary(facts: PeekedFacts | None, command: str) -> None:
    """Raise WrongModelKind when the spec says the model is not RoPE (unknown kinds pass)."""
    if facts is not None and facts.known_kind and not facts.is_rotary:
        raise WrongModelKind(f"{command} needs a RoPE model, but {facts.name} uses {facts.positional_kind} positions")


def context(facts: PeekedFacts | None, args: argparse.Namespace) -> int | None:
    """The context the loaded model will have (honouring --n-ctx), or None if the spec does not say."""
    return None if facts is None else facts.context_after_load(getattr(args, "n_ctx", None))


def check_window(facts: PeekedFacts | None, args: argparse.Namespace, window: int, flag: str = "--window") -> None:
    """A window of `window` positions must fit in the model's context."""
    ctx = context(facts, args)
    if facts is not None and ctx is not None and window > ctx:
        raise ValueError(f"{flag} {window} exceeds the context of {facts.name}, n_ctx={ctx}"
                         + (" (raise --n-ctx)" if not facts.is_tiny and getattr(args, "n_ctx", None) else ""))


def check_layers(facts: PeekedFacts | None, layers: Sequence[int] | None, flag: str) -> None:
    """Layer indices must be >= 0 and, where the spec gives the depth, below it."""
    if layers is None:
        return
    if not layers:
        raise ValueError(f"{flag} names no layers")
    bad = [x for x in layers if x < 0]
    n = facts.n_layers if facts is not None else None
    if n is not None:
        bad += [x for x in layers if x >= n]
    if bad:
        span = f"0..{n - 1} for the {n}-layer {facts.name}" if n is not None and facts is not None else ">= 0"
        raise ValueError(f"{flag} {', '.join(map(str, sorted(set(bad))))} out of range: layers are {span}")


def read_text_early(path: str | None, window: int | None = None) -> str | None:
    """Read (and so validate) a --text file before the model loads; None when not given. With `window`, a text that
    cannot fill one window of that many tokens is refused here: a token covers at least one UTF-8 byte, so fewer
    bytes than the window's text tokens (window - 1 after a BOS, less a SentencePiece word-start and an end
    token) can never be enough, whatever the tokenizer."""
    from posprobe.data import read_text

    if not path:
        return None
    text = read_text(path)
    n = len(text.encode("utf-8"))
    if window is not None and n + 3 < window:
        raise ValueError(f"--text {path} has {n} bytes, too short for one window of {window} tokens (a token covers "
                         "at least one byte): give a longer text or a smaller --window")
    return text
