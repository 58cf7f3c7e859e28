"""Plain text: reading, WikiText detokenisation and cutting token ids into windows."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from posprobe.data.records import DataError

_WT_MARKERS = (" @-@ ", " @,@ ", " @.@ ")


def looks_like_wikitext(text: str) -> bool:
    """Return True if ``text`` looks word-tokenised like WikiText (``@-@`` or spaced commas)."""
    if any(m in text for m in _WT_MARKERS):
        return True
    # Ordinary prose almost never puts a space before a comma; tokenised text always does.
    spaced = text.count(" , ")
    return spaced >= 3 and spaced >= 0.5 * text.count(",")


def _detok_line(line: str) -> str:
    line = line.strip()
    # Headings look like "= = Career = =": keep the title, drop the markup.
    if line.startswith("=") and line.endswith("=") and line.strip("= "):
        line = line.strip("= ")
    for marker, repl in zip(_WT_MARKERS, ("-", ",", ".")):
        line = line.replace(marker, repl)
    line = re.sub(r'" (.*?) "', r'"\1"', line)
    line = re.sub(r" (n't|'t|'s|'re|'ve|'ll|'d|'m)\b", r"\1", line)
    line = re.sub(r"(?<=s) '(?= |$)", "'", line)
    line = re.sub(r" ([,.;:!?%)\]}])", r"\1", line)
    line = re.sub(r"([(\[{$]) ", r"\1", line)
    return line


def detokenize_wikitext(text: str) -> str:
    """Return ``text`` with WikiText tokenisation undone (``<unk>`` kept, headings unmarked)."""
    return "\n".join(_detok_line(line) for line in text.split("\n"))


def read_text(path: str | Path, detokenize: bool | None = None) -> str:
    """Return the UTF-8 text of ``path``; detokenised if WikiText (``detokenize=None``: auto)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"text file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {p} as UTF-8 text: {exc}") from exc
    if not text.strip():
        raise DataError(f"text file is empty: {p}")
    if "\x00" in text:
        # Valid UTF-8 but not text: a binary file (or NUL padding) would give a confident analysis of nothing.
        raise DataError(f"{p} contains NUL bytes ({text.count(chr(0)):,} of {len(text):,} characters, the first at "
                        f"character {text.index(chr(0)):,}): a binary file, not text")
    if not any(c.isalnum() for c in text):
        raise DataError(f"{p} has no letters or digits ({len(text):,} characters): not text to analyse")
    if detokenize is None:
        detokenize = looks_like_wikitext(text)
    return detokenize_wikitext(text) if detokenize else text


def token_windows(token_ids: Sequence[int], window: int, *, max_windows: int | None = None,
                  stride: int | None = None) -> list[list[int]]:
    """Return consecutive windows of exactly ``window`` ids, starting every ``stride`` ids.

    ``stride`` defaults to ``window`` (no overlap); a shorter tail is dropped.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    stride = window if stride is None else stride
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    n = len(token_ids)
    if n < window:
        raise DataError(f"need at least {window} tokens for one window, got {n}")
    starts = range(0, n - window + 1, stride)
    if max_windows is not None:
        starts = starts[:max_windows]
    # int() so numpy/torch ids come back as plain Python ints.
    return [[int(t) for t in token_ids[s : s + window]] for s in starts]


def framed_windows(token_ids: Sequence[int], length: int, *, pre: Sequence[int] = (), post: Sequence[int] = (),
                   max_windows: int | None = None, stride: int | None = None) -> list[list[int]]:
    """Windows of exactly `length` ids: `pre` + a slice of `token_ids` + `post` (e.g. [BOS] + text, or
    [CLS] + text + [SEP]), slices starting every `stride` text tokens (default: no overlap).

    The one place text is cut into model-ready rows; analyses choose `pre`/`post` from the model.
    """
    body = length - len(pre) - len(post)
    if body < 2:
        raise ValueError(f"window of {length} tokens leaves {body} text tokens after special tokens; need >= 2")
    return [list(pre) + w + list(post) for w in token_windows(token_ids, body, max_windows=max_windows, stride=stride)]


def random_token_ids(tokenizer: object, batch: int, length: int, seed: int) -> list[list[int]]:
    """`batch` rows of `length` token ids drawn uniformly (seeded) from the vocabulary without special tokens."""
    import torch

    specials = set(tokenizer.all_special_ids)  # type: ignore[attr-defined]
    vocab = torch.tensor([i for i in range(len(tokenizer)) if i not in specials])  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    return vocab[torch.randint(len(vocab), (batch, length), generator=g)].tolist()
