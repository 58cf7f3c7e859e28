"""`posprobe conform` on the packaged GGUF files (real weights: SmolLM2-135M-Instruct and Gemma 3 270M): llama.cpp's
declared rotation, by llama.cpp's rules on the file's own metadata, conforms to HF's for the same file; planted engine
options are named; the scaling under test reaches both sides; bad input is refused before any work.

The llama.cpp rules are checked here against the file's metadata read by the `gguf` package (not posprobe's header
reader) and against numbers written out: SmolLM2 rotates 64 dims at base 1e5 (32 bands); Gemma 3 270M's global layers
base 1e6 and its local ones base 1e4 (llama.cpp's default for sliding-window layers), 128 bands each.

Planted bugs seen failing (each by editing posprobe/, running this file, then reverting):
- llama.cpp's local layers given the global base (`swa_base = base`): Gemma 3's sliding layers `layer types swapped`.
- The scaling under test not given to the engine (`options_for_scaling` returning {}): the YaRN x2 run `differs`.
- A YaRN ext_factor left at 0 for an explicit yarn type: the YaRN x2 run `differs`.
- `check_proven` not called: the Phi-3 and rope_freqs files below run and report a verdict.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest

from posprobe.analyses.configs import ConformConfig
from posprobe.analyses.conform import run_conform
from posprobe.report.schema import unknown_columns

DECLARED = ("declared",)  # this file checks the declared positions; tests/test_conform_behaviour.py the behaviour


@pytest.fixture(scope="module")
def gguf_meta():
    """Each packaged file's metadata as the `gguf` package (llama.cpp's own Python reader) reads it."""
    from gguf import GGUFReader

    from posprobe.analyses.conform import engine_file

    out = {}
    for spec in ("smollm2", "gemma3-270m"):
        reader = GGUFReader(engine_file(spec, "llama.cpp"))
        meta = {}
        for name, f in reader.fields.items():
            if "rope" in name or "sliding" in name or name.endswith(("key_length", "context_length")):
                meta[name] = f.parts[f.data[0]].tolist()[0] if f.data else None
        out[spec] = meta
    return out


def test_the_files_declare_what_llama_cpp_reads(gguf_meta):
    assert gguf_meta["smollm2"]["llama.rope.freq_base"] == 100000.0
    assert gguf_meta["smollm2"]["llama.rope.dimension_count"] == 64
    g = gguf_meta["gemma3-270m"]
    assert g["gemma3.rope.freq_base"] == 1e6 and g["gemma3.attention.sliding_window"] == 512
    assert "gemma3.rope.freq_base_swa" not in g  # llama.cpp's local base is then its default, 1e4


def test_llama_cpp_conforms_on_both_packaged_files():
    s = run_conform("smollm2", ConformConfig(checks=DECLARED))
    row = s.tables["declared"].iloc[0]
    assert s.meta["verdict"] == "conforms" and row["engine_bands"] == row["hf_bands"] == 32
    bands = s.tables["declared_bands"]
    assert bands["hf_inv_freq"].iloc[1] == pytest.approx(1e5 ** (-2 / 64), rel=1e-6)  # base 1e5, 64 dims
    g = run_conform("gemma3-270m", ConformConfig(checks=(*DECLARED, "precision")))
    p = g.tables["precision"].set_index(["layer_type", "mode"])["first_fast_neighbour_position"]
    # per layer type: bf16 from 257, fp16 from 2,049, float32 and llama.cpp's own float32 product never (4 x 32,768)
    for lt in ("full_attention", "sliding_attention"):
        assert p[(lt, "bfloat16")] == 257 and p[(lt, "float16")] == 2049
        assert pd.isna(p[(lt, "float32")]) and pd.isna(p[(lt, "llama.cpp (its own)")])
    assert all(unknown_columns(t) == [] for t in g.tables.values())
    d = g.tables["declared"].set_index("layer_type")
    assert g.meta["verdict"] == "conforms" and list(d.index) == ["full_attention", "sliding_attention"]
    assert (d.loc["full_attention", "engine_base"], d.loc["sliding_attention", "engine_base"]) == (1e6, 1e4)
    b = g.tables["declared_bands"].set_index(["layer_type", "band"])["hf_inv_freq"]
    assert b[("sliding_attention", 1)] == pytest.approx(1e4 ** (-2 / 256), rel=1e-6)
    assert b[("full_attention", 1)] == pytest.approx(1e6 ** (-2 / 256), rel=1e-6)


@pytest.mark.parametrize("spec,options,scaling,bug,says", [
    ("smollm2", ("rope_freq_base=101000",), None, "base off", "engine base 101000, HF's 100000"),
    ("smollm2", ("rope_freq_scale=0.5",), None, "scale off", "x0.5"),
    ("smollm2", ("yarn_orig_ctx=4096",), {"rope_type": "yarn", "factor": 2.0}, "ramp off", "bands"),
    ("gemma3-270m", ("rope_freq_scale=0.125",), None, "scale off", "x0.125"),
])
def test_planted_engine_options_are_named(spec, options, scaling, bug, says):
    got = run_conform(spec, ConformConfig(checks=DECLARED, engine_options=options, rope_scaling=scaling))
    bad = got.tables["declared"][got.tables["declared"]["verdict"] == "differs"]
    assert list(bad["bug_class"]) == [bug] and says in bad["why"].iloc[0], bad["why"].tolist()
    assert got.meta["verdict"] == f"differs: {bug}"


def test_the_scaling_under_test_reaches_both_sides():
    # YaRN x2 on SmolLM2 (HF's yarn against llama.cpp's yarn options): the same bands and the same multiplier,
    # 1 + 0.1 ln 2 (Peng et al.); linear x8 on Gemma 3 reaches the global layers only, on both sides.
    y = run_conform("smollm2", ConformConfig(checks=DECLARED, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    row = y.tables["declared"].iloc[0]
    assert y.meta["verdict"] == "conforms" and row["hf_multiplier"] == pytest.approx(1 + 0.1 * math.log(2))
    assert y.meta["engine_options"] == {"rope_scaling_type": 2.0, "rope_freq_scale": 0.5}
    g = run_conform("gemma3-270m", ConformConfig(checks=DECLARED, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    d = g.tables["declared"].set_index("layer_type")
    assert g.meta["verdict"] == "conforms"
    assert (d.loc["full_attention", "engine_freq_scale"], d.loc["sliding_attention", "engine_freq_scale"]) == (
        0.125, 1.0)
    with pytest.raises(ValueError, match="llama3 needs per-band factors"):
        run_conform("smollm2", ConformConfig(checks=DECLARED, rope_scaling={"rope_type": "llama3", "factor": 8.0}))


def test_the_command_prints_the_verdict_and_refuses_bad_input(tmp_path, capsys):
    from posprobe.cli import main

    assert main(["conform", "smollm2", "--check", "declared", "--out", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "conforms" in out.splitlines()[0] and (tmp_path / "ok" / "report.html").is_file()
    assert main(["conform", "smollm2", "--check", "declared", "--engine-option", "rope_freq_base=101000",
                 "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "differs: base off" in out and "engine base 101000" in out
    for flags, why in ((["--engine-option", "freq=1"], "expected KEY=VALUE"),
                       (["--engine-option", "rope_freq_base=x"], "is not a number"),
                       (["--rope-scaling", "[1]"], "must be a JSON object"),
                       (["--engine", "vllm"], "unknown engine")):
        assert main(["conform", "smollm2", *flags, "--out", str(tmp_path / "bad")]) == 2, flags
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, (flags, err)
    assert main(["conform", "tiny-rope", "--out", str(tmp_path / "bad")]) == 2
    assert "runs GGUF files" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def _gguf(path, arch: str, tensors: tuple[str, ...] = ("token_embd.weight",), **kv) -> None:
    # A minimal GGUF file written by the `gguf` package (llama.cpp's own writer): metadata and tiny tensors.
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    for k, v in kv.items():
        w.add_string(k, v) if isinstance(v, str) else w.add_float32(k, v)
    for t in tensors:
        w.add_tensor(t, np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_files_and_scalings_the_declared_check_does_not_build_are_refused(tmp_path):
    # A rotation llama.cpp builds from something the check does not read would give a verdict that looks like a
    # result: refused with one sentence before HF's config is read.
    _gguf(tmp_path / "phi3.gguf", "phi3")
    with pytest.raises(ValueError, match="'phi3' is not among them"):
        run_conform(tmp_path / "phi3.gguf", ConformConfig(checks=DECLARED))
    _gguf(tmp_path / "l31.gguf", "llama", ("token_embd.weight", "rope_freqs.weight"))
    with pytest.raises(ValueError, match=r"per-band rope factors \(rope_freqs.weight\)"):
        run_conform(tmp_path / "l31.gguf", ConformConfig(checks=DECLARED))
    _gguf(tmp_path / "lr.gguf", "llama", **{"llama.rope.scaling.type": "longrope"})
    with pytest.raises(ValueError, match="'longrope' is not built"):
        run_conform(tmp_path / "lr.gguf", ConformConfig(checks=DECLARED))
    with pytest.raises(ValueError, match="per-band factor tensors"):
        run_conform("smollm2", ConformConfig(checks=DECLARED, engine_options=("rope_scaling_type=3",)))
