"""The site's home (docs/index.md) shows the README's "I want to…" and "Features" sections as they are, links
rewritten for a page inside docs/ (`docs/x.md` -> `x.md`): one source, so the two cannot drift (issue #64: the home
had lost the context-extension and side-by-side rows and showed bare ✓ where the README counts families).

`python tests/docs_index.py` rewrites the section; tests/test_docs_calls.py fails when it differs.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
INDEX = ROOT / "docs" / "index.md"
START, STOP = "## I want to… → start here", "## How to cite"


def _region(text: str) -> tuple[int, int]:
    a = text.index(START)
    return a, text.index(STOP, a)


def rendered() -> str:
    """The README's sections from START up to STOP, with links into docs/ made relative to docs/."""
    text = README.read_text(encoding="utf-8")
    a, b = _region(text)
    return re.sub(r"\]\(docs/", "](", text[a:b])


def current() -> str:
    """docs/index.md's sections from START up to STOP."""
    text = INDEX.read_text(encoding="utf-8")
    a, b = _region(text)
    return text[a:b]


def write() -> None:
    text = INDEX.read_text(encoding="utf-8")
    a, b = _region(text)
    INDEX.write_text(text[:a] + rendered() + text[b:], encoding="utf-8")


if __name__ == "__main__":
    write()
    print(f"wrote {INDEX.relative_to(ROOT)}")
