"""Static figure export (Result.save(figure_formats=...)): files, sizes, captions, clear failures, atomicity."""

from __future__ import annotations

import re
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_util import require_chromium  # noqa: E402

from posprobe.report import export  # noqa: E402
from posprobe.report.export import EXPORT_WIDTH, PNG_SCALE, FigureExportError, parse_formats  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 30


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def _pdf_page(path: Path) -> tuple[float, float]:
    data = path.read_bytes()
    assert data[:5] == b"%PDF-", "not a PDF"
    box = re.search(rb"/MediaBox\s*\[\s*([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*\]", data)
    assert box, "PDF has no MediaBox"
    x0, y0, x1, y1 = map(float, box.groups())
    return x1 - x0, y1 - y0


def _shift(model, text=None):
    from posprobe.analyses.shift import ShiftConfig, run_shift_test
    from posprobe.data import builtin_pairs

    return run_shift_test(model, builtin_pairs(max_pairs=2), text=text,
                          config=ShiftConfig(ks=(3,), n_bootstrap=20, window=16, max_windows=2, progress=False))


def _check_exports(paths: dict, result, out: Path) -> None:
    import plotly.graph_objects as go

    figs = result.report_figures()
    keys = sorted(k for k in paths if k.startswith("figures/"))
    assert len(keys) == 3 * len(figs)
    assert {Path(k).suffix for k in keys} == {".svg", ".pdf", ".png"}
    assert all(re.fullmatch(r"figures/\d\d-[a-z0-9-]+\.(svg|pdf|png)", k) for k in keys), keys
    assert not [p for p in out.rglob(".*")], "temp files left"
    for i, fig in enumerate(figs, 1):
        stem = next(k for k in keys if k.startswith(f"figures/{i:02d}-"))[:-4]
        png, pdf, svg = (paths[f"{stem}.{ext}"] for ext in ("png", "pdf", "svg"))
        ready, height = export.for_export(go.Figure(fig))
        assert height > (fig.layout.height or export.DEFAULT_HEIGHT), "no room made for the caption"
        assert _png_size(png) == (EXPORT_WIDTH * PNG_SCALE, height * PNG_SCALE)
        w, h = _pdf_page(pdf)
        assert abs(w - EXPORT_WIDTH * 0.75) < 2 and abs(h - height * 0.75) < 2, (w, h)  # CSS px -> pt
        text = svg.read_text(encoding="utf-8")
        assert text.startswith("<svg") and f'width="{EXPORT_WIDTH}"' in text and f'height="{height}"' in text
        assert result.meta["model"]["name"] in text, "caption not printed in the exported figure"
        assert png.stat().st_size > 5000 and pdf.stat().st_size > 2000


@pytest.mark.browser
def test_shift_report_exports_svg_pdf_png(tiny_ape, tmp_path):
    require_chromium()
    result = _shift(tiny_ape, TEXT)
    paths = result.save(tmp_path / "shift", figure_formats="svg,pdf,png")
    _check_exports(paths, result, tmp_path / "shift")
    assert {"meta", "report", "shift_pairs.parquet"} <= set(paths)


@pytest.mark.browser
def test_frequency_report_exports_svg_pdf_png(tiny_rope, tmp_path):
    require_chromium()
    from posprobe.analyses.frequency import FrequencyConfig, run_frequency

    result = run_frequency(tiny_rope, TEXT, FrequencyConfig(window=24, max_windows=2, ablate_windows=1, top_heads=1,
                                                             queries=8, progress=False))
    paths = result.save(tmp_path / "freq", figure_formats=("svg", "pdf", "png"))
    _check_exports(paths, result, tmp_path / "freq")


def test_formats_are_checked_before_anything_is_written(tiny_ape, tmp_path):
    assert parse_formats("svg, PDF,png,svg") == ("svg", "pdf", "png") and parse_formats(()) == ()
    with pytest.raises(ValueError, match="unknown figure format 'gif'.*svg, pdf, png"):
        _shift(tiny_ape).save(tmp_path / "x", figure_formats="png,gif")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("missing", ["kaleido", "browser"])
def test_missing_exporter_is_one_clear_error_and_writes_nothing(missing, tiny_ape, tmp_path, monkeypatch):
    import builtins

    if missing == "kaleido":
        real_import = builtins.__import__

        def no_kaleido(name, *a, **k):
            if name == "kaleido" or name.startswith("kaleido."):
                raise ImportError("No module named 'kaleido'")
            return real_import(name, *a, **k)

        monkeypatch.setattr(builtins, "__import__", no_kaleido)
        expect = r"needs the kaleido package.*pip install 'posprobe\[figures\]'"
    else:
        monkeypatch.setattr(export, "find_browser", lambda: None)
        expect = r"needs Chrome or Chromium.*apt-get install chromium.*BROWSER_PATH"
    result = _shift(tiny_ape)
    out = tmp_path / "new"
    with pytest.raises(FigureExportError, match=expect):
        result.save(out, figure_formats="png")
    assert not out.exists(), "a failed export left files behind"
    # An existing folder keeps its previous bundle untouched.
    result.save(tmp_path / "old")
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}
    with pytest.raises(FigureExportError):
        result.save(tmp_path / "old", figure_formats="svg")
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == before


def test_save_without_formats_needs_no_exporter(tiny_ape, tmp_path, monkeypatch):
    monkeypatch.setattr(export, "find_browser", lambda: None)
    paths = _shift(tiny_ape).save(tmp_path / "plain")
    assert not [k for k in paths if k.startswith("figures/")] and not (tmp_path / "plain" / "figures").exists()
