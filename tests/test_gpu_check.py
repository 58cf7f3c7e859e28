"""benchmarks/gpu_check.py runs end to end on whatever device is present (here the CPU) with --quick,
and every identity it checks passes its stated tolerance."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_gpu_check_quick_runs_and_passes(capsys):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--quick", "--device", "auto", "--dtypes", "float32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for check in ("default-plan", "rope-shift", "bands=scores", "frequency pass", "scoring k=100",
                  "zoo research learned", "zoo research rope-llama", "zoo emergence"):
        assert check in out
    assert "FAIL" not in out


def test_device_auto_resolves_to_a_present_device():
    import torch

    from posprobe.cli.args import best_device, resolve_device

    best = resolve_device("auto")
    assert best == best_device() and best in ("cuda", "mps", "cpu")
    torch.empty(1, device=best)  # present
