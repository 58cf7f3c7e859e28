"""The docs site (mkdocs.yml over docs/): it builds in strict mode and offline, its API reference covers every public
export and is the generated one, and every command's --help ends with its page."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import docs_api
import docs_tutorials
import pytest
from conftest import IN_CI

ROOT = Path(__file__).resolve().parents[1]


def _need_mkdocs() -> None:
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python") if not _has(m)]
    if missing:
        msg = f"{missing} not installed (pip install -e '.[docs]', or bash .ci/setup --docs)"
        if IN_CI:  # CI installs the test extra, which includes the docs extra
            pytest.fail(msg)
        pytest.skip(msg)


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_api_pages_are_the_generated_ones():
    expected = docs_api.render()
    committed = {p.name: p.read_text(encoding="utf-8") for p in docs_api.API.glob("*.md")}
    assert committed == expected, "docs/api/ is stale: python tests/docs_api.py"


def test_api_reference_has_every_public_export():
    import posprobe

    exported = set(posprobe.__all__) - {"__version__"}
    documented = docs_api.documented_names()
    assert exported - documented == set(), f"public names missing from docs/api/: {sorted(exported - documented)}"
    extra = {p.rsplit(".", 1)[1] for _, p in docs_api.EXTRA}
    assert documented - exported - extra == {"rope_theory"}  # the module page of the formulas


def test_every_docs_page_is_in_the_nav():
    """mkdocs' own check (validation.nav.omitted_files) warns, and the strict build fails on it; this says which."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if p not in nav] == []


#: The tutorial the site tests check with its outputs: the cheapest notebook (tiny-ape, ~10 s) that draws figures.
TUTORIAL = "shift_test"


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    """The site as `mkdocs build --strict` writes it: (folder, return code, log). The tutorial checked here is
    rendered from an executed copy: test_shift's notebook test keeps one; where it has not run yet (another xdist
    worker, a -k selection) it is executed here, once, ~10 s."""
    _need_mkdocs()
    if docs_tutorials.executed(TUTORIAL) is None:
        docs_tutorials.execute(TUTORIAL)
    site = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                           "-d", str(site)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    return site, done.returncode, done.stdout + done.stderr


def test_site_builds_strict_and_offline(built_site):
    """`mkdocs build --strict` (a broken link or anchor, a page outside the nav, an API name that does not resolve
    fail it), in seconds; the HTML loads no script, stylesheet or font from the web (no CDN: works offline)."""
    site, code, log = built_site
    assert code == 0, log[-4000:]
    assert not re.search(r"^(WARNING|ERROR)", log, flags=re.M), log[-4000:]
    html = {p: p.read_text(encoding="utf-8") for p in site.rglob("*.html")}
    assert len(html) >= 25
    remote = re.compile(r"""<(?:script|img|iframe)\b[^>]*\bsrc=["']?(?:https?:)?//"""
                        r"""|<link\b[^>]*\bhref=["']?(?:https?:)?//""")
    for path, text in html.items():
        heads = [m.group(0) for m in remote.finditer(text)]
        assert heads == [], f"{path.relative_to(site)} loads {heads[:3]} from the web"
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, path
    for css in site.rglob("*.css"):
        assert not re.search(r"@import\s+url\(\s*['\"]?(?:https?:)?//", css.read_text(encoding="utf-8")), css
    # The landing page routes; an API page carries the rendered docstrings of the names it lists.
    index = html[site / "index.html"]
    assert "I want to" in index and 'href="atlas.html"' in index
    api = html[site / "api" / "analyses.html"]
    for path in ("posprobe.analyses.heads.run_heads", "posprobe.analyses.configs.HeadsConfig",
                 "posprobe.analyses.retrieval.run_retrieval", "posprobe.analyses.rope_tables.rope_theory_table"):
        assert f'id="{path}"' in api, path
    assert api.count('doc-section-title">Examples') >= 14  # every run_* on the page shows its (doctested) example
    assert "critical_dimension" in html[site / "api" / "rope-theory.html"]
    # Every notebook is a tutorial page; the one executed above carries its outputs and figures, plotly.js is local.
    for name, _, _ in docs_tutorials.TUTORIALS:
        assert site / "tutorials" / f"{name}.html" in html, name
    page = html[site / "tutorials" / f"{TUTORIAL}.html"]
    assert "McNemar p" in page and page.count("Plotly.newPlot(") >= 2, "the executed outputs are missing"
    assert '<script src="../assets/javascripts/plotly.min.js">' in page
    assert (site / docs_tutorials.PLOTLY_JS).stat().st_size > 1_000_000


def test_tutorials_nav_is_the_notebooks_in_order():
    """mkdocs.yml's Tutorials section lists every notebook of analyses/, in tests/docs_tutorials.py's order."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    listed = re.findall(r"^\s+- .*: tutorials/(\w+)\.md$", nav, flags=re.M)
    assert listed == [n for n, _, _ in docs_tutorials.TUTORIALS]
    assert sorted(listed) == sorted(p.stem for p in (ROOT / "analyses").glob("*.py"))
    for name, title, _ in docs_tutorials.TUTORIALS:
        assert re.search(rf"^\s+- \"?{re.escape(title)}\"?: tutorials/{name}\.md$", nav, flags=re.M), title


def test_a_tutorial_without_an_executed_copy_says_so(tmp_path, monkeypatch):
    """A fresh clone (no .tutorials/) still builds: the page is the notebook's code with a note how to fill it."""
    monkeypatch.setattr(docs_tutorials, "CACHE", tmp_path)
    page = docs_tutorials.render("shift_test")
    assert page.startswith("# Shift-by-k test") and "not executed yet" in page and "Plotly" not in page
    assert "```python\nimport os" in page and "python tests/docs_tutorials.py shift_test" in page


#: Material's JavaScript ran (it publishes its observables on window), and the page's own content is there.
_PROBE = """({material: typeof document$ !== 'undefined' && typeof component$ !== 'undefined',
  h1: (document.querySelector('article h1') || {}).textContent || '',
  nav: document.querySelectorAll('nav.md-nav a').length,
  tables: document.querySelectorAll('article table').length,
  code: document.querySelectorAll('article pre code').length,
  api: document.querySelectorAll('.doc-object').length,
  font: getComputedStyle(document.body).fontFamily})"""


#: A tutorial's figures: plotly.js loaded (from the site), and the figures drawn (an SVG with data traces each).
_FIGURES = """({plotly: typeof Plotly !== 'undefined',
  figures: document.querySelectorAll('.pp-tutorial-figure').length,
  drawn: Array.from(document.querySelectorAll('.pp-tutorial-figure')).filter(
    d => d.querySelector('svg.main-svg') && d.querySelectorAll('.trace, .point, path.point').length > 0).length,
  output: Array.from(document.querySelectorAll('article pre code')).some(c => c.textContent.includes('McNemar p'))})"""


@pytest.mark.browser
@pytest.mark.parametrize("page", ["index.html", "api/analyses.html", f"tutorials/{TUTORIAL}.html"])
def test_site_renders_offline_in_chromium(built_site, page, tmp_path):
    """The landing page, an API page and a tutorial, opened from disk in headless Chromium with the network off: no
    console error, the theme's script ran, the navigation, tables, code, (API) rendered docstrings and (tutorial)
    the notebook's printed output and its plotly figures, drawn, are on the page."""
    from browser_util import load_page, require_chromium

    require_chromium()
    site, code, log = built_site
    assert code == 0, log[-4000:]
    tutorial = page.startswith("tutorials/")
    probe = f"Object.assign({_PROBE}, {_FIGURES})" if tutorial else _PROBE
    ready = (lambda v: bool(v and v["material"] and v["drawn"] >= 2)) if tutorial else (
        lambda v: bool(v and v["material"]))
    rep = load_page(site / page, probe, until=ready, timeout=60, screenshot=tmp_path / "page.png")
    # Chromium refuses the search index's web worker on file:// pages (a served site has search); nothing else.
    errors = [e for e in rep.errors if "search" not in e.lower() and "worker" not in e.lower()]
    assert errors == [], errors
    assert rep.ok, rep.value
    v = rep.value
    assert v["nav"] >= 20 and v["code"] >= 1, v
    if page == "index.html":
        assert v["h1"].startswith("posprobe") and v["tables"] >= 2, v
    elif tutorial:
        assert v["h1"].startswith("Shift-by-k test") and v["plotly"] and v["output"], v
        assert v["figures"] == v["drawn"] == 2, v
    else:
        assert "Analyses" in v["h1"] and v["api"] >= 30, v
    assert (tmp_path / "page.png").stat().st_size > 10_000


def test_every_command_help_ends_with_its_docs_page():
    from posprobe.cli.main import DOCS_PAGES, SUBCOMMANDS, build_parser

    assert set(DOCS_PAGES) == set(SUBCOMMANDS)
    for page in DOCS_PAGES.values():
        for path in re.findall(r"docs/[\w./-]+\.md", page):
            assert (ROOT / path).is_file(), path
    parser = build_parser()
    top = parser.format_help()
    assert "docs/index.md" in top.split("options:")[-1] and "mkdocs serve" in top
    for name in ("heads", "info", "long-context"):
        text = " ".join(parser._subparsers._group_actions[0].choices[name].format_help().split())
        assert text.endswith(".") and DOCS_PAGES[name].split()[0] in text.rsplit("Docs:", 1)[1], name
    zoo = parser._subparsers._group_actions[0].choices["zoo"]
    train = zoo._subparsers._group_actions[0].choices["train"]
    assert "docs/zoo.md" in train.format_help().rsplit("Docs:", 1)[1]


def test_nothing_the_old_readme_quoted_was_dropped():
    """Every command, flag and number the README quoted before it became a landing page is on the README or a docs
    page (tests/data/readme_claims.tsv; a number counts where it stands as a whole token)."""
    from test_readme import doc_text

    text = doc_text().replace("\\\n", " ")
    flat = " ".join(text.split())
    missing = []
    for line in (ROOT / "tests" / "data" / "readme_claims.tsv").read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        kind, claim = line.split("\t", 1)
        if kind in ("command", "flag"):
            found = claim in flat
        else:
            found = re.search(r"(?<![\w.])" + re.escape(claim) + r"(?![\w])", text) is not None
        if not found:
            missing.append(f"{kind} {claim}")
    assert missing == [], f"dropped from README + docs/ (restore, or retire in the .tsv with a reason): {missing[:20]}"
