"""Unit tests for posprobe.report.html (offline HTML) and posprobe.report.result (atomic save)."""

from __future__ import annotations

import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
from plotly.offline import get_plotlyjs

from posprobe.report import result as results_mod
from posprobe.report.html import Section, render_html
from posprobe.report.result import Result, environment_meta

PLOTLYJS = get_plotlyjs()


class _Tags(HTMLParser):
    """Collect start tags; <script>/<style> bodies are CDATA, so JS string
    literals inside the inlined plotly.js are NOT mistaken for tags."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(html: str) -> list[tuple[str, dict]]:
    p = _Tags()
    p.feed(html)
    p.close()
    return p.tags


def _figs(n: int = 2) -> list[go.Figure]:
    out = []
    for i in range(n):
        f = go.Figure(go.Scatter(x=[0, 1, 2], y=[i, i + 1, i * 2], error_y=dict(array=[0.1, 0.2, 0.1])))
        f.update_layout(title=f"fig {i}")
        out.append(f)
    return out


def _df() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "layer": np.repeat([0, 1], 3),
            "position": np.tile([0, 1, 2], 2),
            "metric": ["loss"] * 6,
            "value": np.linspace(0.0, 1.0, 6),
        }
    )


@pytest.fixture(scope="module")
def page() -> str:
    sections = [
        Section("Intro <b>", html="<p>hello</p>"),
        Section("Plots", figures=_figs(2), table=_df()),
        Section("More", figures=_figs(1)),
    ]
    meta = {"model": "gpt2<script>", "versions": {"torch": "2.3"}, "n": 3}
    return render_html("My <title> & co", sections, meta=meta)


def _outside_bundle(html: str) -> str:
    assert html.count(PLOTLYJS) == 1
    return html.replace(PLOTLYJS, "")


def test_no_external_urls(page):
    for tag, attrs in _tags(page):
        for attr in ("src", "href", "data", "action", "poster"):
            val = (attrs.get(attr) or "").strip().lower()
            assert not val.startswith(("http:", "https:", "//")), (tag, attr, val)
    # plotly.js itself contains URL string literals (e.g. its logo link,
    # map-tile URLs) that are never fetched for our traces; everything WE emit
    # must be URL-free.
    rest = _outside_bundle(page).lower()
    for needle in ('src="http', "src='http", 'href="http', "href='http", "http://", "https://", "@import"):
        assert needle not in rest, needle
    assert "mathjax" not in rest
    assert "cdn.plot.ly" not in rest


def test_plotlyjs_inlined_once_in_head(page):
    assert page.count(PLOTLYJS) == 1
    head_end = page.index("</head>")
    assert page.index(PLOTLYJS) < head_end
    scripts = [a for t, a in _tags(page) if t == "script"]
    assert all("src" not in a for a in scripts)
    assert len(scripts) == 1 + 3  # the bundle + one newPlot call per figure
    assert page.lstrip().lower().startswith("<!doctype html>")
    assert '<meta charset="utf-8">' in page


def test_one_div_per_figure(page):
    divs = [a for t, a in _tags(page) if t == "div" and "plotly-graph-div" in (a.get("class") or "")]
    assert [d["id"] for d in divs] == ["posprobe-fig-0", "posprobe-fig-1", "posprobe-fig-2"]
    for i in range(3):
        assert len(re.findall(rf'Plotly\.newPlot\(\s*"posprobe-fig-{i}"', page)) == 1


def test_table_and_escaping(page):
    assert 'class="pp-table"' in page and "<th>index</th>" not in page
    assert "<title>My &lt;title&gt; &amp; co</title>" in page
    assert "<h2>Intro &lt;b&gt;</h2>" in page
    assert "<p>hello</p>" in page  # Section.html is trusted, inserted verbatim
    assert "gpt2&lt;script&gt;" in page and "gpt2<script>" not in page
    assert "torch=2.3" in page


def test_render_without_figures_or_meta():
    html = render_html("t", [Section("only text", html="x")])
    assert html.count(PLOTLYJS) == 1
    assert "plotly-graph-div" not in html and "<footer>" not in html


# ------------------------------------------------------------------ Result.save


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture
def demo_page(monkeypatch):
    """Register a page module for analysis "demo" whose figures/summary the test chooses."""
    import sys
    import types

    from posprobe.report import pages

    page = types.SimpleNamespace(figs=[], summary="", title=lambda r: "Loss")
    page.figures = lambda r: list(page.figs)
    page.sections = lambda r: [Section("Summary", html=page.summary), Section("Figures", figures=page.figures(r))]
    monkeypatch.setitem(pages.PAGES, "demo", "posprobe_test_demo_page")
    monkeypatch.setitem(sys.modules, "posprobe_test_demo_page", page)
    return page


def test_save_writes_all_files(tmp_path, demo_page):  # noqa: D103
    demo_page.figs, demo_page.summary = _figs(2), "<p>sum</p>"
    meta = {"analysis": "demo", "seed": 0, "layers": [0, 1], "env": environment_meta()}
    res = Result({"loss": _df()}, meta)
    paths = res.save(tmp_path / "out")
    assert set(paths) == {"loss.parquet", "loss.csv", "meta", "report"}
    assert sorted(os.listdir(tmp_path / "out")) == ["loss.csv", "loss.parquet", "meta.json", "report.html"]
    for p in paths.values():
        assert p.is_file() and p.stat().st_size > 0
    pd.testing.assert_frame_equal(pd.read_parquet(paths["loss.parquet"]), res.df)
    pd.testing.assert_frame_equal(pd.read_csv(paths["loss.csv"]), res.df)
    html = paths["report"].read_text(encoding="utf-8")
    assert html.count(PLOTLYJS) == 1 and html.count('class="plotly-graph-div"') == 2
    assert "<p>sum</p>" in html and "<title>Loss</title>" in html


def test_big_tables_are_parquet_only_unless_asked(tmp_path, demo_page):
    from posprobe.report.result import CSV_MAX_ROWS

    big = pd.DataFrame({"position": range(CSV_MAX_ROWS + 1), "value": 0.5})
    res = Result({"loss": _df(), "big": big}, {"analysis": "demo"})
    auto = res.save(tmp_path / "auto")
    assert "loss.csv" in auto and "big.csv" not in auto and not (tmp_path / "auto" / "big.csv").exists()
    meta = json.loads(auto["meta"].read_text())
    assert meta["csv_tables"] == ["loss"] and meta["tables"] == ["loss", "big"]
    assert "parquet only" in auto["report"].read_text(encoding="utf-8")
    every = res.save(tmp_path / "all", csv="all")
    pd.testing.assert_frame_equal(pd.read_csv(every["big.csv"]), big)
    assert not {k for k in res.save(tmp_path / "none", csv="none") if k.endswith(".csv")}
    with pytest.raises(ValueError, match="csv must be"):
        res.save(tmp_path / "bad", csv="some")
    assert not (tmp_path / "bad").exists()


def test_a_report_can_load_a_shared_local_plotly(tmp_path, demo_page):
    demo_page.figs = _figs(1)
    html = Result({"loss": _df()}, {"analysis": "demo"}).to_html(plotly_src="../plotly.min.js")
    assert PLOTLYJS not in html and '<script type="text/javascript" src="../plotly.min.js"' in html


def test_meta_json_roundtrip(tmp_path):
    meta = {"z": 1, "a": {"y": [1, 2.5, None], "b": "x"}, "flag": True, "path": Path("/tmp/x")}
    res = Result({"r": _df()}, meta)
    paths = res.save(tmp_path)
    text = paths["meta"].read_text(encoding="utf-8")
    loaded = json.loads(text)
    assert loaded == {**meta, "path": "/tmp/x", "tables": ["r"], "csv_tables": ["r"]}  # default=str for non-JSON
    assert list(loaded) == sorted(loaded)  # sorted keys
    # numpy scalars/arrays become plain JSON numbers/lists
    Result({"r": _df()}, {"x": np.float64(0.5), "arr": np.arange(3)}).save(tmp_path)
    assert json.loads(paths["meta"].read_text()) == {"arr": [0, 1, 2], "x": 0.5, "tables": ["r"], "csv_tables": ["r"]}
    back = Result.load(tmp_path)
    pd.testing.assert_frame_equal(back.df, res.df)
    assert back.meta["x"] == 0.5 and list(back.tables) == ["r"]


class _ExplodingFigure(go.Figure):
    def to_html(self, *a, **k):
        raise RuntimeError("figure rendering failed")


@pytest.mark.parametrize("where", ["figure", "parquet", "commit"])
def test_save_is_atomic(tmp_path, monkeypatch, where, demo_page):
    out = tmp_path / "out"
    Result({"r": _df()}, {"run": 1}).save(out)  # previous good state
    (out / "keep.txt").write_text("mine")
    before = _snapshot(out)

    df, figs = _df(), _figs(1)
    if where == "figure":
        figs = [*figs, _ExplodingFigure()]
    elif where == "parquet":
        df = df.assign(bad=[1, "a", 2.0, None, b"x", object()])  # pyarrow cannot convert
    else:  # fail on the 3rd rename, after two targets were already replaced
        real, calls = os.replace, []

        def flaky(src, dst):
            calls.append(dst)
            if len(calls) == 3:
                raise OSError("simulated crash mid-commit")
            return real(src, dst)

        monkeypatch.setattr(results_mod.os, "replace", flaky)

    demo_page.figs = figs
    with pytest.raises(Exception):
        Result({"r": df}, {"run": 2, "analysis": "demo"}).save(out)
    assert _snapshot(out) == before  # no new/temp files, old files untouched


def test_save_failure_into_new_dir_leaves_nothing(tmp_path, demo_page):
    out = tmp_path / "fresh"
    demo_page.figs = [_ExplodingFigure()]
    with pytest.raises(RuntimeError):
        Result({"r": _df()}, {"analysis": "demo"}).save(out)
    assert not out.exists()


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "a\\b", "meta", "report"])
def test_save_rejects_bad_names(tmp_path, name):
    with pytest.raises(ValueError):
        Result({name: _df()}, {}).save(tmp_path)
    assert os.listdir(tmp_path) == []


def test_environment_meta():
    env = environment_meta()
    keys = {
        "python",
        "torch",
        "transformer-lens",
        "transformers",
        "numpy",
        "pandas",
        "posprobe",
        "platform",
        "timestamp_utc",
    }
    assert keys <= set(env)
    assert env["numpy"] == np.__version__ and env["pandas"] == pd.__version__
    assert env["timestamp_utc"].endswith("+00:00")
    json.dumps(env)


# ------------------------------------------------------------------ tables and captions


def test_tables_read_like_a_paper_table():
    from posprobe.report.html import format_table, table_html

    df = pd.DataFrame({"k": [0, 100], "accuracy": [0.905712, 0.9], "mcnemar_p": [1.0, 0.000123456],
                       "margin": [12.3456789, -0.5], "correct": [True, False], "tokens": [["<bos>", "a"], ["b"]],
                       "tiny": [1.5e-7, 2e-6]}, index=[5, 9])  # a filtered frame: unnamed, non-range index
    t = format_table(df)
    assert list(t.columns) == [
        "k (start position)",
        "accuracy",
        "McNemar p",
        "margin (nats)",
        "correct",
        "tokens",
        "tiny",
    ]
    assert t.iloc[0].tolist() == ["0", "0.9057", "1", "12.35", "yes", "<bos>, a", "1.50e-07"]
    assert t.iloc[1].tolist() == ["100", "0.9000", "0.000123", "-0.50", "no", "b", "2.00e-06"]
    html = table_html(df)
    assert "<th>index</th>" not in html and "[&#x27;" not in html and "&lt;bos&gt;, a" in html
    assert 'title="mcnemar_p"' in html  # the data column's name stays one hover away
    piv = pd.DataFrame({"layer": [0, 0, 1], "metric": ["a", "b", "a"], "value": [1.0, 2.0, 3.0]}).pivot_table(
        index="layer", columns="metric", values="value")
    assert list(format_table(piv).columns) == ["layer", "a", "b"]  # a named index is data: kept as a column
    long = table_html(pd.DataFrame({"x": range(60)}))
    assert "<details" in long and "Show all 60 rows" in long


def test_figures_get_the_theme_and_a_caption_under_them():
    from posprobe.report import style

    meta = {"model": {"name": "m1", "positional_kind": "rotary"},
            "data": {"source": "wiki.txt", "n_items": 8, "unit": "windows"}, "config": {"seed": 3, "ks": [0, 100]}}
    cap = style.caption(meta, {"k =": [0, 100], "unused": None})
    assert cap == "Model: m1 (rotary positions). Data: wiki.txt, N = 8 windows; seed 3; k = 0, 100."
    fig = style.style(go.Figure(go.Scatter(y=[1, 2])), caption=cap)
    assert style.get_caption(fig) == cap and fig.layout.template.layout.paper_bgcolor == "white"
    page = render_html("t", [Section("s", figures=[fig, go.Figure(go.Bar(y=[1]))])])
    assert page.count("<figcaption") == 1 and "N = 8 windows" in page
    assert page.count('<figure class="pp-figure">') == 2  # un-styled figures are themed too


def test_shift_control_page_plots_the_deviation_not_empty_flips():
    from posprobe.report import shift

    rows = []
    for k in (0, 3, 50):
        for i in range(4):
            rows.append({"model": "m", "paradigm": "p", "field": "f", "phenomenon": "x", "pair_id": str(i), "k": k,
                         "logp_good": -10.0 - i + (1e-6 * k), "logp_bad": -12.0 - i, "n_tokens_good": 5,
                         "n_tokens_bad": 5, "margin": 2.0, "correct": True})
    pairs = pd.DataFrame(rows)
    d = shift.logp_change(pairs)
    assert d.k.tolist() == [3, 50] and np.allclose(d["max"], [3e-6, 5e-5])
    fig = shift.logp_change_figure(pairs, {"note": "RoPE", "model": {"name": "m"}})
    assert fig.layout.yaxis.type == "log" and "Invariance control" in style_caption(fig)
    assert any("tolerance" in (a.text or "") for a in fig.layout.annotations)
    meta = {"prefix": {"tokens": ["<|endoftext|>"], "kind": "eot", "position": "with-sentence"}}
    assert shift.prefix_text(meta) == "<|endoftext|> (eot, with-sentence)"


def style_caption(fig) -> str:
    from posprobe.report.style import get_caption

    return get_caption(fig) or ""


def test_a_large_cosine_map_is_drawn_thinned_in_float32_and_the_table_keeps_every_value():
    from posprobe.report.geometry import MAP_POSITIONS, geometry_figures

    n = 512
    rng = np.random.default_rng(0)
    cos = rng.uniform(-1, 1, (n, n))
    a, b = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    rows = [pd.DataFrame(dict(source="W_pos", layer=np.nan, metric="cosine", pos=a.ravel(), pos2=b.ravel(), k=np.nan,
                              value=cos.ravel()))]
    for k in range(2):
        rows.append(pd.DataFrame(dict(source="W_pos", layer=np.nan, metric="pc_score", pos=np.arange(n), pos2=np.nan,
                                      k=k, value=rng.normal(size=n))))
        rows.append(pd.DataFrame(dict(source="W_pos", layer=np.nan, metric=["explained_variance", "sin_period",
                                                                             "sin_r2"], pos=np.nan, pos2=np.nan, k=k,
                                      value=[0.5, 10.0, 0.9])))
    rows.append(pd.DataFrame(dict(source="W_pos", layer=np.nan, metric="norm", pos=np.arange(n), pos2=np.nan, k=np.nan,
                                  value=1.0)))
    df = pd.concat(rows, ignore_index=True)
    heat = [f for f in geometry_figures(df) if isinstance(f.data[0], go.Heatmap)]
    assert len(heat) == 1
    z = np.asarray(heat[0].data[0].z)
    assert z.shape == (MAP_POSITIONS, MAP_POSITIONS) and "every 2 positions" in heat[0].layout.title.text
    assert z.dtype == np.float32 and np.array_equal(z, cos[::2, ::2].astype(np.float32))
    assert len(df[df.metric == "cosine"]) == n * n  # the table is untouched


@pytest.mark.parametrize("points", [("resid_post",), ("resid_pre", "resid_post"), ("resid_pre", "resid_mid",
                                                                                    "resid_post")])
def test_the_probe_axis_names_the_points_plotted_at_the_offsets_they_are_plotted(points):
    # The atlas probes resid_post alone: the axis must not promise three points; each point named sits where its
    # trace is drawn.
    from fractions import Fraction

    from posprobe.report.probes import probe_figures

    rows = [dict(model="m", point=p, layer=l, condition=c, metric=m, value=0.5 + l, fold=f)
            for p in points for l in range(3) for c in ("probe", "control", "chance") for m in ("mae", "accuracy")
            for f in range(2)]
    for fig in probe_figures(pd.DataFrame(rows)):
        title = fig.layout.xaxis.title.text
        named = re.findall(r"(resid_\w+)(?: at L(?:\+(\d+/\d+))?)?", title)
        assert [p for p, _ in named] == list(points), title
        for point, offset in named:
            trace = next(t for t in fig.data if t.name == f"probe ({point})")
            want = [l + float(Fraction(offset or 0)) for l in range(3)]
            assert np.allclose(list(trace.x), want, rtol=0, atol=1e-12), (title, point)


def test_the_heads_summary_says_when_no_layer_has_sink_heads(tiny_rope):
    from posprobe.analyses.configs import HeadsConfig
    from posprobe.analyses.heads import run_heads
    from posprobe.report.heads import summary_text

    cfg = dict(window=16, max_windows=2, induction_len=0, progress=False)
    none = summary_text(run_heads(tiny_rope, None, HeadsConfig(sink_threshold=1.0, **cfg)))
    assert "no layer has a sink head" in none and "in no layer" not in none
    some = summary_text(run_heads(tiny_rope, None, HeadsConfig(sink_threshold=0.0, **cfg)))
    assert "most sink heads in layer" in some and "no layer has a sink head" not in some


def test_gu_et_al_is_cited_with_one_year_across_posprobe():
    # "When Attention Sink Emerges in Language Models: An Empirical View" (ICLR 2025; arXiv 2024): one paper, one
    # citation everywhere it is named with a year.
    import posprobe

    root = Path(posprobe.__file__).parent
    years = [m.group(1) for f in root.rglob("*.py")
             for m in re.finditer(r"Gu\s+et\s+al\.?,?\s+\(?(\d{4})", f.read_text(encoding="utf-8"))]
    assert len(years) >= 5 and set(years) == {"2025"}, sorted(set(years))
