"""The codebase is clean under ruff (lint rules and import order as configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import need_package

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    need_package("ruff", "pip install -e '.[test]'")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                         text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
