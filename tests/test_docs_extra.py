"""The `docs` extra alone fills the tutorials (issue #64: a docs-only setup could not run tests/docs_tutorials.py,
which needs nbclient, so a fresh clone's tutorials stayed code without outputs). Every third-party module that
script imports must come from a distribution in the `docs` extra or the core dependencies; ipykernel is the
kernel nbclient starts (never imported by name). Planted: nbclient dropped from the extra fails this test."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _requirement_names(specs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", s, maxsplit=1)[0].lower().replace("_", "-") for s in specs}


def test_the_docs_extra_can_execute_the_tutorials():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    allowed = _requirement_names(project["optional-dependencies"]["docs"]) | _requirement_names(
        project["dependencies"])
    tree = ast.parse((ROOT / "tests" / "docs_tutorials.py").read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    third_party = sorted(m for m in modules if m not in sys.stdlib_module_names and m not in ("__future__",))
    dists = packages_distributions()
    needed = {d.lower().replace("_", "-") for m in third_party for d in dists.get(m, [m])} | {"ipykernel"}
    assert needed - allowed == set(), f"the docs extra lacks {sorted(needed - allowed)} (tests/docs_tutorials.py)"
