"""--threads: every command takes it (also `zoo train`, after its own flags), it sets torch's compute threads before
any work, and a busy machine left at torch's default gets one line on stderr saying so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from posprobe.cli import main
from posprobe.cli.main import SUBCOMMANDS, _leaf_parsers, build_parser
from posprobe.cli.threads import set_threads, warn_if_busy


def test_every_command_takes_threads():
    """Catches: --threads added to the top-level parser only (`posprobe zoo train ... --threads 1` unrecognised)."""
    leaves = _leaf_parsers(build_parser())
    assert len(leaves) >= len(SUBCOMMANDS) + 3  # zoo's train, eval, atlas, tasks, list stand for zoo
    for p in leaves:
        assert "--threads" in p._option_string_actions, p.prog
    assert build_parser().parse_args(["zoo", "train", "--out", "z", "--threads", "1"]).threads == 1


def test_threads_sets_torch_and_is_checked(capsys):
    """Catches: the flag parsed but never applied, or 0 threads passed on to torch."""
    before = torch.get_num_threads()
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1
        assert main(["info", "tiny-rope", "--threads", "0"]) == 2
        assert "--threads must be >= 1" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_threads_reaches_a_fresh_process_before_torch_starts():
    """In a new process the flag is applied before torch is imported (OMP_NUM_THREADS), so torch starts with it."""
    code = ("import sys; from posprobe.cli.threads import set_threads; set_threads(1); import torch; "
            "print(torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "1", done.stderr


@pytest.mark.parametrize(("load", "omp", "warned"), [(1.9, "", True), (0.3, "", False), (1.9, "1", False)])
def test_a_busy_machine_is_named_on_stderr(monkeypatch, capsys, load, omp, warned):
    """Catches: the warning shown on a quiet machine, or under OMP_NUM_THREADS=1 where there is nothing to fix."""
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        warn_if_busy()
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert ("machine is busy (1-minute load 1.9 on 2 cores)" in err) == warned, err


def test_a_refusal_on_a_busy_machine_stays_one_line(monkeypatch, capsys):
    """The busy line is printed where the heavy work starts, after the input checks. Catches: it printed before them,
    so a refused input gives two lines instead of one sentence."""
    from posprobe.cli import main

    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["heads", "tiny-rope", "--window", "0", "--out", "x"]) == 2
    finally:
        torch.set_num_threads(before)
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
