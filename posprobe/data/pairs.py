"""Minimal pairs: the pair type, BLiMP's official .jsonl files, and a content fingerprint.

Nothing here touches the network; `posprobe.data.blimp_hub` downloads BLiMP for users who are online.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from posprobe.data.records import DataError, json_records, read_lines

_BLIMP_KEYS = ("sentence_good", "sentence_bad", "field", "linguistics_term", "UID", "pairID")


@dataclass(frozen=True)
class MinimalPair:
    """One grammatical/ungrammatical sentence pair."""

    good: str
    bad: str
    paradigm: str
    field: str
    phenomenon: str
    pair_id: str



def _blimp_files(path: Path) -> list[Path]:
    if not path.exists():
        raise DataError(f"BLiMP path does not exist: {path}")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
    if not files:
        raise DataError(f"no .jsonl files in BLiMP folder: {path}")
    return files


def _blimp_origin(root: Path, file: Path) -> str:
    """How an error names `file`: the path the user gave, then the file inside it."""
    return f"BLiMP file {file}" if root.is_file() else f"BLiMP folder {root}: {file.name}"


def _read_blimp_file(file: Path, origin: str) -> list[MinimalPair]:
    pairs: list[MinimalPair] = []
    for where, rec in json_records(read_lines(file, origin), origin, _BLIMP_KEYS):
        good, bad = rec["sentence_good"], rec["sentence_bad"]
        if not isinstance(good, str) or not isinstance(bad, str):
            raise DataError(f"{where}: sentence_good and sentence_bad must be strings")
        pairs.append(MinimalPair(good, bad, str(rec["UID"]), str(rec["field"]),
                                 str(rec["linguistics_term"]), str(rec["pairID"])))
    return pairs


def check_max_pairs(max_pairs: int | None) -> None:
    """Raise ValueError unless `max_pairs` is None or a positive count."""
    if max_pairs is not None and max_pairs < 1:
        raise ValueError(f"max_pairs must be >= 1 or None, got {max_pairs}")


def load_blimp(
    path: str | Path,
    *,
    paradigms: Sequence[str] | None = None,
    fields: Sequence[str] | None = None,
    max_pairs: int | None = None,
    seed: int = 0,
) -> list[MinimalPair]:
    """Load BLiMP minimal pairs from a folder of ``<paradigm>.jsonl`` files or one file.

    Args:
        path: a folder of ``<paradigm>.jsonl`` files or one such file.
        paradigms: load only these paradigms (None: all). Paradigm names are file names without ``.jsonl``
            (equal to ``UID`` in the official release); an unknown one is a DataError.
        fields: keep only the pairs of these BLiMP fields (e.g. "syntax"; None: all).
        max_pairs: applies per paradigm as a seeded random sample kept in file order (None: every pair; >= 1).
        seed: the seed of that sample.

    Returns:
        The `MinimalPair`s, files in sorted name order; none left after filtering is a DataError.
    """
    check_max_pairs(max_pairs)
    root = Path(path)
    files = _blimp_files(root)
    if paradigms is not None:
        if isinstance(paradigms, str):  # a bare string would be iterated per character
            paradigms = [paradigms]
        by_name = {f.stem: f for f in files}
        unknown = [p for p in paradigms if p not in by_name]
        if unknown:
            raise DataError(f"unknown BLiMP paradigm(s) {', '.join(unknown)}; "
                            f"available: {', '.join(sorted(by_name))}")
        files = [f for f in files if f.stem in set(paradigms)]
    wanted = None if fields is None else {fields} if isinstance(fields, str) else set(fields)
    pairs: list[MinimalPair] = []
    seen_fields: set[str] = set()
    for file in files:
        file_pairs = _read_blimp_file(file, _blimp_origin(root, file))
        seen_fields.update(p.field for p in file_pairs)
        if wanted is not None:
            file_pairs = [p for p in file_pairs if p.field in wanted]
        pairs.extend(file_pairs)
    if max_pairs is not None:
        pairs = _sample_per_paradigm(pairs, max_pairs, seed)
    if not pairs:
        raise DataError(f"no BLiMP pairs left after filtering (paradigms={paradigms}, "
                        f"fields={fields}); fields present: {', '.join(sorted(seen_fields))}")
    return pairs


def _sample_per_paradigm(pairs: list[MinimalPair], k: int, seed: int) -> list[MinimalPair]:
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault(p.paradigm, []).append(i)
    keep: set[int] = set()
    for name, idx in groups.items():
        # Seed per paradigm so a paradigm's sample does not depend on which others are loaded.
        rng = random.Random(f"blimp:{name}:{seed}")
        keep.update(idx if len(idx) <= k else rng.sample(idx, k))
    return [p for i, p in enumerate(pairs) if i in keep]


def pairs_fingerprint(pairs: Iterable[MinimalPair]) -> str:
    """Return the sha256 hex digest of the pairs' content, in order (for meta.json)."""
    h = hashlib.sha256()
    for p in pairs:
        rec = [p.paradigm, p.field, p.phenomenon, p.pair_id, p.good, p.bad]
        h.update(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")
    return h.hexdigest()
