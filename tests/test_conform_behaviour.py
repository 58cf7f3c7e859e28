"""`posprobe conform`, check 2 (behaviour against position): the per-position metrics against torch's own KL, the
three verdicts on planted arrays, and llama.cpp itself (llama-cpp-python, built by .ci/setup --test) on the packaged
SmolLM2 GGUF against posprobe's dequantised HF reference of the same file: flat at its quantisation floor as it is,
differing everywhere with a wrong scale; the README's command end to end.

Planted bugs seen failing (each by editing posprobe/, running this file, then reverting):
- KL with its arguments swapped (engine || HF): test_metrics_are_torchs_kl fails.
- The trend read from the first quarter alone (late = floor): the growing array is called position-flat.
- The engine given ids shifted by one (`ids[1:n + 1]`): SmolLM2 differs everywhere (top-1 ~0.0x).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import need_package

from posprobe.analyses.conform_behaviour import behaviour_tables, position_metrics


def test_metrics_are_torchs_kl():
    g = torch.Generator().manual_seed(0)
    h = torch.log_softmax(torch.randn(40, 50, generator=g, dtype=torch.float64), -1)
    e = torch.log_softmax(h + 0.3 * torch.randn(40, 50, generator=g, dtype=torch.float64), -1)
    kl, top1 = position_metrics(h.numpy(), e.numpy())
    want = torch.nn.functional.kl_div(e, h, log_target=True, reduction="none").sum(-1)  # KL(h || e)
    assert np.allclose(kl, want.numpy(), rtol=1e-12, atol=1e-15)
    assert np.array_equal(top1, (h.argmax(-1) == e.argmax(-1)).double().numpy())
    with pytest.raises(ValueError, match="log-probabilities"):
        position_metrics(h.numpy(), e.numpy()[:, :10])


def test_the_three_verdicts():
    rng = np.random.default_rng(0)
    n = 1024
    flat = 0.003 * (1 + 0.1 * rng.standard_normal(n))
    agree = (rng.random(n) < 0.97).astype(float)
    bins, row = behaviour_tables(flat, agree, length=n, bins=8)
    assert row["verdict"] == "position-flat" and len(bins) == 8 and bins["positions"].sum() == n
    assert bins["kl"].iloc[0] == pytest.approx(flat[:128].mean())
    grows = flat * (1 + np.arange(n) / 400)
    assert behaviour_tables(grows, agree, length=n)[1]["verdict"] == "grows with position"
    off = (rng.random(n) < 0.6).astype(float)
    _, row = behaviour_tables(flat * 200, off, length=n)
    assert row["verdict"] == "differs everywhere" and "top-1 agreement 0.6" in row["why"]


@pytest.fixture(scope="module")
def llama():
    need_package("llama_cpp", "pip install llama-cpp-python (bash .ci/setup --test builds it)")


def test_llama_cpp_on_smollm2_is_flat_and_a_wrong_scale_differs_everywhere(llama):
    from posprobe.analyses.configs import ConformConfig
    from posprobe.analyses.conform import run_conform

    ok = run_conform("smollm2", ConformConfig(lengths=(512,), bins=8))
    s = ok.tables["behaviour_summary"].iloc[0]
    assert ok.meta["verdict"] == "conforms" and s["verdict"] == "position-flat"
    assert s["floor_kl"] < 0.02 and s["top1_first"] > 0.9  # 4-bit quantisation: small, not zero
    assert 0 < s["floor_kl"]
    bad = run_conform("smollm2", ConformConfig(lengths=(512,), bins=8, engine_options=("rope_freq_scale=0.5",)))
    s = bad.tables["behaviour_summary"].iloc[0]
    assert s["verdict"] == "differs everywhere" and s["floor_kl"] > 20 * ok.tables["behaviour_summary"]["floor_kl"][0]
    assert bad.meta["verdict"] == "differs: scale off, behaviour differs everywhere at 512 tokens"


def test_the_readme_command_conforms_and_a_planted_base_is_named(llama, tmp_path, capsys):
    from posprobe.cli import main

    assert main(["conform", "smollm2", "--length", "2048", "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(": conforms") and "[behaviour] 2048 tokens: position-flat" in out
    assert main(["conform", "smollm2", "--length", "2048", "--engine-option", "rope_freq_base=101000",
                 "--out", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    assert "differs: base off" in out.splitlines()[0] and "engine base 101000, HF's 100000" in out


def test_a_missing_engine_is_one_sentence(monkeypatch, tmp_path, capsys):
    import builtins

    from posprobe.cli import main

    real = builtins.__import__

    def no_llama(name, *a, **k):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError("no llama_cpp")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    assert main(["conform", "smollm2", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "pip install llama-cpp-python" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()
    assert main(["conform", "smollm2", "--check", "declared", "--out", str(tmp_path / "y")]) == 0
