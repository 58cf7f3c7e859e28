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


#: Entry points that must carry a runnable example (besides every `run_*` export): (module, name).
REQUIRED = [("posprobe.backend.loading", "load_model"), ("posprobe.core.positions", "PositionPlan"),
            ("posprobe.core.positions", "token_positions"), ("posprobe.core.positions", "rope_positions"),
            ("posprobe.zoo.run", "train_zoo"), ("posprobe.report.result", "Result"),
            ("posprobe.analyses.atlas_many", "evaluate_zoo")]
#: `run_*` exports still without one (none today; a name here is allowed to lack its example for a while).
PENDING: set[str] = set()


def test_the_public_entry_points_carry_examples():
    """Every public `run_*`, `load_model`, the position plans, `train_zoo` and `Result` show a `>>>` example (run by
    test_docstring_examples_run below, since their modules hold one)."""
    import posprobe

    assert len(modules_with_examples()) >= 5
    entry = {(getattr(posprobe, n).__module__, n) for n in posprobe.__all__ if n.startswith("run_")} | set(REQUIRED)
    without = sorted(n for m, n in entry if ">>> " not in (getattr(importlib.import_module(m), n).__doc__ or ""))
    assert without == sorted(PENDING), f"no >>> example in the docstring of {sorted(set(without) - PENDING)}"
    modules = set(modules_with_examples())
    assert {m for m, n in entry if n not in PENDING} <= modules


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
