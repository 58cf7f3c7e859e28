"""Every analysis returns the one Result type whose meta follows the one schema and whose columns are in
the one vocabulary (posprobe/report/schema.py), and writes through the one `Result.save`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posprobe.report.result import Result
from posprobe.report.schema import COLUMNS, unknown_columns, validate_meta

ROOT = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 30


def _shift(tiny_ape, tiny_rope):
    from posprobe.analyses.shift import ShiftConfig, run_shift_test
    from posprobe.data import builtin_pairs

    return run_shift_test(tiny_ape, builtin_pairs(max_pairs=2), text=TEXT,
                          config=ShiftConfig(ks=(3,), n_bootstrap=20, window=16, max_windows=2, progress=False))


def _frequency(tiny_ape, tiny_rope):
    from posprobe.analyses.frequency import FrequencyConfig, run_frequency

    return run_frequency(tiny_rope, TEXT, FrequencyConfig(window=24, max_windows=2, ablate_windows=1, top_heads=1,
                                                           queries=8, progress=False))


def _decompose(tiny_ape, tiny_rope):
    from posprobe.analyses.decompose import DecomposeConfig, run_decompose

    return run_decompose(tiny_ape, DecomposeConfig(progress=False))


def _decompose_data(tiny_ape, tiny_rope):
    from posprobe.analyses.decompose import DecomposeConfig, run_decompose

    return run_decompose(tiny_rope, DecomposeConfig(layer=1, max_windows=4, progress=False))


def _probes(tiny_ape, tiny_rope):
    from posprobe.analyses.probes import ProbeConfig, run_probes

    return run_probes(tiny_ape, TEXT, ProbeConfig(layers=(1,), points=("resid_post",), max_tokens=200, window=32,
                                                  max_windows=8, progress=False))


def _geometry(tiny_ape, tiny_rope):
    from posprobe.analyses.geometry import GeometryConfig, run_geometry

    return run_geometry(tiny_ape, None, GeometryConfig(layers=(1,), components=3, max_windows=4, progress=False))


def _squish(tiny_ape, tiny_rope):
    from posprobe.analyses.squish import squish_generate

    return squish_generate(tiny_rope, "Answer briefly.", "Hi?", max_new_tokens=2, reference="Yes")


def _surgery(tiny_ape, tiny_rope):
    from posprobe.analyses.squish import SurgeryEvalConfig, run_surgery_eval

    return run_surgery_eval(
        tiny_rope, TEXT, SurgeryEvalConfig(presets=("none", "pi:scale=2"), window=16, max_windows=1)
    )


def _heads(tiny_ape, tiny_rope):
    from posprobe.analyses.heads import HeadsConfig, run_heads

    return run_heads(tiny_rope, TEXT, HeadsConfig(window=16, max_windows=2, induction_len=4, progress=False))


RUNS = {
    "heads": _heads,
    "shift-test": _shift,
    "frequency": _frequency,
    "decompose": _decompose,
    "decompose-data": _decompose_data,
    "probes": _probes,
    "geometry": _geometry,
    "squish": _squish,
    "surgery-eval": _surgery,
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_analysis_follows_the_schema(name, tiny_ape, tiny_rope, tmp_path):
    result = RUNS[name](tiny_ape, tiny_rope)
    assert isinstance(result, Result)
    validate_meta(result.meta)
    assert result.analysis == name.replace("-data", "")
    for table, df in result.tables.items():
        assert len(df), table
        assert unknown_columns(df) == [], f"{table}: columns not in posprobe.report.schema.COLUMNS"
    paths = result.save(tmp_path / name)
    from posprobe.report.result import CSV_MAX_ROWS

    csv = {f"{t}.csv" for t, df in result.tables.items() if len(df) <= CSV_MAX_ROWS}  # larger: parquet only
    assert set(paths) == {f"{t}.parquet" for t in result.tables} | csv | {"meta", "report"}
    back = Result.load(tmp_path / name)
    validate_meta(back.meta)
    assert list(back.tables) == list(result.tables) and back.meta["tables"] == list(result.tables)
    assert json.loads(paths["meta"].read_text())["analysis"] == result.analysis
    assert result.figures(), "every analysis has at least one figure"
    assert back.to_html().count("Plotly.newPlot") >= len(result.figures())  # figures rebuilt from saved tables


@pytest.fixture(scope="module")
def doc_bridges():
    """tiny-ape and tiny-rope booted exactly as the TransformerLens docs show a user (boot_transformers with an
    HF model and its tokenizer), not through posprobe's loader."""
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend.tiny import byte_tokenizer, tiny_hf_model

    return tuple(TransformerBridge.boot_transformers(n, hf_model=tiny_hf_model(n), tokenizer=byte_tokenizer())
                 for n in ("tiny-ape", "tiny-rope"))


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_analysis_runs_on_a_bridge_booted_as_the_tl_docs_show(name, doc_bridges):
    from posprobe.backend.hooks import live_hook_count

    ape, rope = doc_bridges
    result = RUNS[name](ape, rope)
    validate_meta(result.meta)
    assert all(len(df) for df in result.tables.values())
    assert live_hook_count(ape) == live_hook_count(rope) == 0


def test_schema_rejects_what_it_should():
    with pytest.raises(ValueError, match="missing 'data'.*model lacks 'positional_kind'"):
        validate_meta({"analysis": "x", "posprobe_version": "0", "created_utc": "t", "model": {"name": "m"},
                       "config": {}, "environment": {}})
    import pandas as pd

    assert unknown_columns(pd.DataFrame(columns=["layer", "quantity"])) == ["quantity"]
    assert all(isinstance(v, str) and v for v in COLUMNS.values())


def test_only_the_backend_touches_transformer_lens():
    hits = subprocess.run(
        [
            "grep",
            "-rlE",
            r"transformer_lens|hook_(q|k|v|z|rot_q|rot_k|attn_scores|pattern|resid|pos_embed|embed|scale|normalized)\b",
            "--include=*.py",
            "posprobe",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert hits and all(h.startswith("posprobe/backend/") for h in hits), hits


def test_only_result_save_writes_results():
    # Every command and analysis writes through Result.save; no module builds bundles or HTML files itself.
    hits = subprocess.run(["grep", "-rnE", r"_write_bundle\(|to_parquet\(|to_csv\(|write_text\(",
                           "--include=*.py", "posprobe"], cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    writers = {h.split(":")[0] for h in hits}
    assert writers <= {"posprobe/report/result.py", "posprobe/report/html.py", "posprobe/backend/tiny.py",
                       "posprobe/data/blimp_hub.py", "posprobe/backend/loading.py",
                       # the zoo writes Hugging Face model folders (zoo.json beside config.json) and its eval text,
                       # and a corpus's token cache in the work folder (resumable mid-stream)
                       "posprobe/zoo/train.py", "posprobe/zoo/run.py", "posprobe/zoo/corpus.py"}, writers


def test_public_names_stay_callable_after_every_analysis_is_imported():
    # A function exported under the same name as a submodule used to be shadowed once the submodule was imported.
    code = ("import importlib, pkgutil, posprobe as pp\n"
            "for m in pkgutil.walk_packages(pp.__path__, 'posprobe.'):\n"
            "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
            "bad = [n for n in pp.__all__ if n != '__version__' and type(getattr(pp, n)).__name__ == 'module']\n"
            "assert not bad, bad\n"
            "assert callable(pp.capture) and callable(pp.generate) and callable(pp.load_model)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]
