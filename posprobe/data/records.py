"""Reading user data files line by line: the one error type for malformed data and the one JSON-lines reader, so
every file format posprobe reads (BLiMP, questions, IFEval) names the file and line the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence


class DataError(ValueError):
    """Input data is missing, malformed or empty after filtering."""


def read_lines(path: str | Path, origin: str) -> list[str]:
    """The file's lines (UTF-8); DataError naming `origin` if it cannot be read or decoded."""
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{origin}: cannot read file: {exc}") from exc


def json_records(lines: Iterable[str], origin: str, required: Sequence[str] = ()) -> Iterator[tuple[str, dict]]:
    """(where, record) per non-blank line, `where` = "<origin>, line N"; DataError for a line that is not a JSON
    object or lacks a `required` key."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{origin}, line {lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            # str(exc), not exc.msg: the message without its position ("Unterminated string starting at")
            # does not say where.
            raise DataError(f"{where}: malformed JSON: {exc}") from None
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        missing = [k for k in required if k not in rec]
        if missing:
            raise DataError(f"{where}: missing key(s) {', '.join(missing)}")
        yield where, rec
