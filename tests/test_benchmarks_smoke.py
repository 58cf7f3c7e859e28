"""The benchmarks still run (two steps, one round): a benchmark is only read when someone measures, so a renamed
attribute breaks it silently otherwise (bench_zoo.py read `Member.shifts_labels` after it had moved to the
architecture row). What they measure is quoted in benchmarks/README.md, never asserted here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("extra", [[], ["--extend", "pi"]], ids=["train", "extend"])
def test_bench_zoo_runs(extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(BENCH.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    got = subprocess.run([sys.executable, "bench_zoo.py", "--members", "t5", "rope-llama", "--steps", "2",
                          "--rounds", "1", "--threads", "1", *extra], cwd=BENCH, capture_output=True, text=True,
                         env=env, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    rows = [line for line in got.stdout.splitlines() if "|" in line and not line.startswith("member")]
    assert len(rows) == 2 and all("x [" in r for r in rows), got.stdout
