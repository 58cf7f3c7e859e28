"""Open a generated report in REAL headless Chromium, networking off.

Needs Debian's chromium (`apt-get install -y chromium chromium-driver`).
Missing Chromium => skip locally, but FAIL when $CI is set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # robust to tests/__init__.py or not
import browser_util  # noqa: E402
from browser_util import load_page, require_chromium  # noqa: E402

from posprobe.report.result import Result, environment_meta  # noqa: E402

# JS run in the page: per plotly div, what actually got drawn.
_PROBE = """(() => {
  const figs = {};
  for (const d of document.querySelectorAll('div.plotly-graph-div')) {
    figs[d.id] = {
      main_svg: d.querySelectorAll('svg.main-svg').length,
      container: !!d.querySelector('.plot-container'),
      traces: (d._fullData || []).length,
      error_bars: d.querySelectorAll('g.errorbar').length,
      line_paths: d.querySelectorAll('.scatterlayer path.js-line').length,
      heatmap_images: d.querySelectorAll('.heatmaplayer image').length,
      bars: d.querySelectorAll('.barlayer .point path').length,
    };
  }
  return {plotly: typeof Plotly === 'undefined' ? null : Plotly.version, figs};
})()"""


def _all_drawn(n: int):
    def ok(v) -> bool:
        figs = (v or {}).get("figs") or {}
        return len(figs) == n and all(f["main_svg"] > 0 and f["container"] for f in figs.values())

    return ok


def _figures() -> list[go.Figure]:
    pos = np.arange(16)
    rng = np.random.default_rng(0)
    mean = np.exp(-pos / 6.0)
    line = go.Figure(
        go.Scatter(x=pos, y=mean, mode="lines+markers", error_y=dict(type="data", array=0.05 + 0.02 * rng.random(16)))
    )
    line.update_layout(title="Loss by position (± s.e.)", xaxis_title="position", yaxis_title="loss")
    heat = go.Figure(go.Heatmap(z=rng.random((12, 16)), x=pos, y=[f"L{i}" for i in range(12)], colorscale="Viridis"))
    heat.update_layout(title="Attention to BOS by layer × position")
    bar = go.Figure(go.Bar(x=[f"head {i}" for i in range(8)], y=rng.random(8)))
    bar.update_layout(title="Per-head score")
    return [line, heat, bar]


@pytest.mark.browser
def test_report_renders_offline_in_chromium(tmp_path):
    require_chromium()
    df = pd.DataFrame({"position": np.arange(16), "value": np.linspace(0, 1, 16), "metric": "loss"})
    import sys
    import types

    from posprobe.report import pages
    from posprobe.report.html import Section

    # A page module of its own, registered as posprobe's analyses register theirs.
    figs = _figures()
    page = types.SimpleNamespace(title=lambda r: "Browser smoke test", figures=lambda r: figs,
                                 sections=lambda r: [Section("Summary", html="<p>three figures</p>", figures=figs)])
    pages.PAGES["browser-demo"] = "posprobe_test_browser_page"
    sys.modules["posprobe_test_browser_page"] = page
    meta = {"analysis": "browser-demo", "model": "toy", **environment_meta()}
    try:
        paths = Result({"demo": df}, meta).save(tmp_path)
    finally:
        del pages.PAGES["browser-demo"], sys.modules["posprobe_test_browser_page"]
    rep = load_page(paths["report"], _PROBE, until=_all_drawn(3), timeout=60)

    assert rep.errors == [], f"console errors: {rep.errors}"
    assert rep.ok, f"not every figure rendered: {rep.value}"
    assert rep.value["plotly"], "plotly.js did not load"
    figs = rep.value["figs"]
    assert sorted(figs) == ["posprobe-fig-0", "posprobe-fig-1", "posprobe-fig-2"]
    line, heat, bar = (figs[f"posprobe-fig-{i}"] for i in range(3))
    assert all(f["traces"] == 1 for f in figs.values()), figs
    assert line["line_paths"] >= 1 and line["error_bars"] == 16, line
    assert heat["heatmap_images"] >= 1, heat
    assert bar["bars"] == 8, bar


# ---- every analysis's own report, as a reader sees it at 1280 px -------------

TEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 30

# JS run in the page: every figure drawn and captioned, and every table (collapsed ones opened) fits the page.
_REPORT_PROBE = """(() => {
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  const figs = [...document.querySelectorAll('div.plotly-graph-div')].map(d => {
    const fig = d.closest('figure');
    const cap = fig ? fig.querySelector('figcaption') : null;
    const box = d.getBoundingClientRect();
    return {id: d.id, drawn: d.querySelectorAll('svg.main-svg').length > 0 && !!d.querySelector('.plot-container'),
            traces: (d._fullData || []).length, caption: cap ? cap.textContent.trim() : '',
            width: Math.round(box.width), height: Math.round(box.height)};
  });
  const page = document.documentElement.clientWidth;
  const tables = [...document.querySelectorAll('table')].map(t => {
    const wrap = t.closest('.pp-table-wrap') || t.parentElement;
    const sec = t.closest('section') || document.body;
    return {right: Math.round(t.getBoundingClientRect().right), section_right: Math.round(sec.getBoundingClientRect().right),
            scroll: wrap.scrollWidth, client: wrap.clientWidth, header: t.querySelector('th') ? t.querySelector('th').textContent : ''};
  });
  return {figs, tables, page, doc_scroll: document.documentElement.scrollWidth,
          title: document.title, index_header: [...document.querySelectorAll('th')].some(th => th.textContent === '' || th.textContent === 'index')};
})()"""


def _run_analysis(name: str, tiny_ape, tiny_rope):
    """Each analysis on a tiny model with a small config (seconds each); shift-test-control is the RoPE run."""
    if name in ("shift-test", "shift-test-control"):
        from posprobe.analyses.shift import ShiftConfig, run_shift_test
        from posprobe.data import builtin_pairs

        model = tiny_ape if name == "shift-test" else tiny_rope
        return run_shift_test(model, builtin_pairs(max_pairs=3), text=TEXT if name == "shift-test" else None,
                              config=ShiftConfig(ks=(3, 40), n_bootstrap=50, window=16, max_windows=2, progress=False))
    if name == "atlas":
        from posprobe.analyses.atlas import run_atlas
        from posprobe.analyses.configs import AtlasConfig

        return run_atlas(tiny_rope, None, AtlasConfig(window=24, max_windows=3, max_pairs=2, probe_tokens=120,
                                                      induction_len=4, progress=False))
    # The other analyses run as the schema test runs them: one place to follow API changes.
    from test_schema import RUNS

    return RUNS[name](tiny_ape, tiny_rope)



ANALYSES = (
    "shift-test",
    "shift-test-control",
    "frequency",
    "decompose",
    "probes",
    "geometry",
    "squish",
    "surgery-eval",
    "heads",
    "atlas",
)


@pytest.mark.browser
@pytest.mark.parametrize("name", ANALYSES)
def test_analysis_report_in_chromium(name, tiny_ape, tiny_rope, tmp_path):
    """Every figure drawn with a caption, no console errors, no table or page wider than 1280 px."""
    require_chromium()
    result = _run_analysis(name, tiny_ape, tiny_rope)
    paths = result.save(tmp_path / name)
    n_figs = len(result.report_figures())
    assert n_figs >= 1
    shots = os.environ.get("POSPROBE_SCREENSHOTS")  # a folder: keep a full-page PNG per report to look at
    shot = Path(shots) / f"{name}.png" if shots else None
    if shot is not None:
        shot.parent.mkdir(parents=True, exist_ok=True)
    rep = load_page(paths["report"], _REPORT_PROBE, width=1280, timeout=90, screenshot=shot,
                    until=lambda v: bool(v) and len(v["figs"]) == n_figs and all(f["drawn"] for f in v["figs"]))
    assert rep.errors == [], f"console errors: {rep.errors}"
    assert rep.ok, f"not every figure rendered: {rep.value}"
    v = rep.value
    model = result.meta["model"]["name"]
    for f in v["figs"]:
        assert f["traces"] >= 1 and f["width"] > 300 and f["height"] > 200, f
        assert model in f["caption"] and "Data:" in f["caption"], (
            f"{f['id']} lacks a caption naming model and data: {f}"
        )
    assert v["doc_scroll"] <= v["page"] <= 1280, f"page scrolls horizontally: {v['doc_scroll']} > {v['page']}"
    for t in v["tables"]:
        assert t["scroll"] <= t["client"] + 1 and t["right"] <= t["section_right"], f"table wider than the page: {t}"
    assert not v["index_header"], "a table has an empty header (a pandas index column)"


@pytest.mark.browser
def test_atlas_folder_shares_one_local_plotly_and_every_report_draws(tiny_rope, tmp_path):
    """An atlas folder holds one plotly.min.js (was inlined in every report: 47 MB for SmolLM2, now 8.4 MB); the
    atlas page and a section page load it by relative path, offline, and draw every figure."""
    require_chromium()
    result = _run_analysis("atlas", None, tiny_rope)
    paths = result.save(tmp_path / "atlas")
    js = list((tmp_path / "atlas").rglob("plotly*.js"))
    assert js == [tmp_path / "atlas" / "plotly.min.js"]
    for key, part in (("report", result), ("heads/report", result.parts["heads"])):
        html = paths[key].read_text(encoding="utf-8")
        assert "Plotly.newPlot" in html and len(html) < 1_000_000  # the figures, not plotly.js itself
        n_figs = len(part.report_figures())
        rep = load_page(paths[key], _REPORT_PROBE, width=1280, timeout=90,
                        until=lambda v, n=n_figs: bool(v) and len(v["figs"]) == n and all(f["drawn"] for f in v["figs"]))
        assert rep.errors == [] and rep.ok, (key, rep.errors, rep.value)


def test_control_report_plots_its_own_quantity(tiny_rope):
    """The RoPE shift control plots max |Δ log p| vs k with the tolerance band, not an empty flips chart."""
    result = _run_analysis("shift-test-control", None, tiny_rope)
    titles = [f.layout.title.text for f in result.figures()]
    assert not any("flips" in t.lower() for t in titles), titles
    fig = next(f for f in result.figures() if "log-probability" in f.layout.title.text)
    assert fig.layout.yaxis.type == "log" and len(fig.layout.shapes) >= 1  # the shaded tolerance band
    assert any("tolerance" in (a.text or "") for a in fig.layout.annotations)
    ks = sorted(set(result.tables["shift_pairs"].k) - {0})
    assert list(fig.data[0].x) == ks and max(fig.data[0].customdata) < 1e-3  # inside the band
    html = result.to_html()
    assert "No pair changed its judgement" in html and "[&#x27;" not in html  # prefix not a list repr


# ---- negative controls: prove the harness CAN fail ---------------------------


@pytest.mark.browser
def test_detects_uncaught_exception(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><p id="p">x</p><script>throw new Error("boom")</script></body></html>')
    rep = load_page(page, "document.getElementById('p') !== null")
    assert rep.ok
    assert any("boom" in e for e in rep.errors), rep.errors


@pytest.mark.browser
def test_detects_console_error(tmp_path):
    page = tmp_path / "console.html"
    page.write_text('<!DOCTYPE html><html><body><script>console.error("kaboom", 42)</script></body></html>')
    rep = load_page(page)
    assert any("kaboom 42" in e for e in rep.errors), rep.errors


@pytest.mark.browser
def test_network_is_off(tmp_path):
    # a CDN-hosted plotly must NOT load; the failed fetch must surface as an error
    page = tmp_path / "cdn.html"
    page.write_text(
        '<!DOCTYPE html><html><head><script src="https://cdn.plot.ly/plotly-2.35.2.min.js"></script></head>'
        '<body><div id="d"></div><script>window.done = true; Plotly.newPlot("d", [{y: [1, 2]}]);</script></body></html>'
    )
    rep = load_page(page, "window.done === true && typeof Plotly === 'undefined'")
    assert rep.ok, rep.value
    assert any("cdn.plot.ly" in e or "ERR_" in e for e in rep.errors), rep.errors
    assert any("Plotly is not defined" in e for e in rep.errors), rep.errors


@pytest.mark.browser
def test_missing_figure_is_detected(tmp_path):
    # a plotly div whose newPlot never runs must fail the rendered-check
    page = tmp_path / "empty.html"
    page.write_text('<!DOCTYPE html><html><body><div id="f" class="plotly-graph-div"></div></body></html>')
    rep = load_page(page, _PROBE, until=_all_drawn(1), timeout=3)
    assert not rep.ok and rep.value["figs"]["f"]["main_svg"] == 0


# ---- the skip/fail policy itself (no browser needed) -------------------------


@pytest.mark.parametrize("ci, expect", [(None, "skip"), ("", "skip"), ("true", "fail"), ("1", "fail")])
def test_missing_chromium_policy(monkeypatch, ci, expect):
    monkeypatch.setattr(browser_util, "find_chromium", lambda: None)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    exc = pytest.skip.Exception if expect == "skip" else pytest.fail.Exception
    with pytest.raises(exc, match="apt-get install -y chromium"):
        require_chromium()


@pytest.mark.browser
def test_a_page_copied_out_of_its_folder_says_why_its_figures_are_blank(tmp_path):
    """A report that loads plotly.js from its folder, opened without it (report.html copied elsewhere), shows one
    sentence naming the missing file instead of empty figure boxes; beside plotly.min.js it shows no such line.
    Catches: the check removed or inverted (a banner on every page, or blank figures and no word)."""
    require_chromium()
    from posprobe.report.html import PLOTLY_JS, Section, render_html, write_plotlyjs

    page = render_html("copied", [Section("Figures", figures=_figures()[:1])], plotly_src=PLOTLY_JS)
    probe = "(() => { const p = document.getElementById('pp-missing-plotly'); return p ? p.textContent : ''; })()"
    alone, home = tmp_path / "alone", tmp_path / "home"
    for folder in (alone, home):
        folder.mkdir()
        (folder / "report.html").write_text(page, encoding="utf-8")
    write_plotlyjs(str(home / PLOTLY_JS))
    rep = load_page(alone / "report.html", probe, until=bool, timeout=60)
    assert rep.ok and "plotly.min.js" in rep.value and "copy the whole folder" in rep.value, rep.value
    rep = load_page(home / "report.html", "(() => [!!window.Plotly, !!document.getElementById('pp-missing-plotly')])()",
                    until=lambda v: bool(v) and v[0], timeout=60)
    assert rep.ok and rep.value == [True, False] and rep.errors == [], (rep.value, rep.errors)
