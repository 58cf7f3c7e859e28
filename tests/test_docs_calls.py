"""Every inline Python call to a public posprobe function on the README and the docs pages binds to its signature:
a call shown as `pp.run_decompose(model, text, pp.DecomposeConfig())` that would raise TypeError is a defect of the
page (issue #64). Fenced blocks run elsewhere (tests/test_readme.py); this reads the inline spans, which nothing
executes: each call is parsed, its function looked up in `posprobe`, and its arguments bound to the signature
(values stand in as None: the shape is what a reader copies). Planted: the decomposition page's old 3-argument call
fails this test."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import posprobe

ROOT = Path(__file__).resolve().parents[1]
SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def _calls(text: str):
    for span in SPAN.findall(FENCE.sub("", text)):
        if not re.match(r"(pp\.|posprobe\.)?[A-Za-z_]\w*\(", span):
            continue
        try:
            node = ast.parse(span.strip(), mode="eval").body
        except SyntaxError:
            continue
        if isinstance(node, ast.Call):
            yield span, node


def _public(node: ast.Call):
    f = node.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("pp", "posprobe"):
        name = f.attr
    elif isinstance(f, ast.Name):
        name = f.id
    else:
        return None
    return getattr(posprobe, name, None) if name in posprobe.__all__ else None


def test_every_inline_call_binds_to_its_signature():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad, seen = [], 0
    for page in pages:
        for span, node in _calls(page.read_text(encoding="utf-8")):
            fn = _public(node)
            if fn is None or not callable(fn) or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            seen += 1
            elided = any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in node.args)
            kw = {k.arg: None for k in node.keywords if k.arg is not None}
            try:  # `f(..., key=v)` elides the leading arguments: only its keywords are checked
                sig = inspect.signature(fn)
                sig.bind_partial(**kw) if elided else sig.bind(*[None] * len(node.args), **kw)
            except TypeError as e:
                bad.append(f"{page.relative_to(ROOT)}: `{span}`: {e}")
    assert seen >= 10, seen  # the pages do show calls: a parser that finds none is broken
    assert not bad, "\n".join(bad)


def test_the_landing_pages_name_every_analysis_of_another_shape():
    """README and docs/index.md say most `run_*` take (model, data, config): every exported one that does not is named
    there, with a call that binds (the test above)."""
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        text = page.read_text(encoding="utf-8")
        para = text[text.index("Most analyses have this shape"):].split("\n\n")[0]
        named = {m for m in re.findall(r"`(run_\w+)\(", para)}
        for name in (n for n in posprobe.__all__ if n.startswith("run_")):
            ps = [p.name for p in inspect.signature(getattr(posprobe, name)).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(ps) < 3 or ps[2] != "config":
                assert name in named, f"{page.name}: {name}({', '.join(ps)}) has another shape and is not named"


def test_the_sites_home_shows_the_readmes_sections():
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    import docs_index

    stale = "docs/index.md drifted from README: python tests/docs_index.py"
    assert docs_index.current() == docs_index.rendered(), stale
