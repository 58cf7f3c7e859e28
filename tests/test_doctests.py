"""Every `>>>` example in posprobe's docstrings runs and prints what it says (doctest), on the tiny or packaged
models and offline, so the examples in the API reference cannot rot."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def modules_with_examples() -> list[str]:
    """Dotted names of the posprobe modules whose source holds a `>>>` example."""
    found = []
    for path in sorted((ROOT / "posprobe").rglob("*.py")):
        if ">>> " in path.read_text(encoding="utf-8"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def test_the_public_entry_points_carry_examples():
    assert len(modules_with_examples()) >= 5


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples_run(name, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # an example that saves writes here
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name} mentions '>>> ' but doctest found no example in it"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name} (output above)"
