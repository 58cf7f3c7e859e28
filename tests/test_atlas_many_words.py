"""The atlas over several models speaks of what was compared (issue #66): for models a user named, models (title,
captions, axis titles, sentences), no zoo, members or seeds, the layers collapsed by kind with counts, and stdout one
sentence per section comparing the models, a shift ratio that is 1 by construction said as such; for a zoo, its
members and seeds. Checked on the page's visible text (scripts and the meta footer left out) and on stdout.

Planted bugs seen failing (each by editing posprobe/, running this file, then reverting):
- the title left as "Zoo atlas: ..." for every run: test_two_models_read_as_models fails.
- compare_caption adding "mean over seeds" whatever was compared: the same.
- the layers column joined per layer again: the collapsed-layers assertion fails.
"""

from __future__ import annotations

import re

import pytest

from posprobe.analyses.atlas_many import collapse_layers

ZOO_WORDS = re.compile(r"\b(zoo|members?|seeds|mean over seeds)\b", flags=re.I)


def _visible(page: str) -> str:
    page = re.sub(r"<footer.*?</footer>", "", page, flags=re.S)
    texts = re.findall(r'"(?:text|title)":"([^"]*)"', page)  # plotly's titles and axis titles
    return re.sub(r"<script.*?</script>", "", page, flags=re.S) + "\n".join(texts)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    import contextlib
    import io

    from posprobe.cli import main

    out = tmp_path_factory.mktemp("two") / "atlas"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["atlas", "tiny-rope", "tiny-ape", "--quick", "--out", str(out)]) == 0
    return out, buf.getvalue()


def test_two_models_read_as_models(two):
    out, stdout = two
    page = (out / "report.html").read_text(encoding="utf-8")
    words = ZOO_WORDS.findall(_visible(page))
    assert not words, words
    assert "<h1>Atlas of 2 models side by side" in page
    assert "rotary 100% of head dim, half-split pairing, base 10000 ×2" in page  # 2 layers, one description
    assert "Model: tiny-rope, tiny-ape" in page  # the captions name the models
    assert not ZOO_WORDS.findall(stdout), stdout
    lines = stdout.splitlines()
    assert any(line.startswith("[shift] ") and "tiny-rope invariant under the shift (rotary" in line for line in lines)
    probe = next(line for line in lines if line.startswith("[probes] ") and "first block" in line)
    assert "tiny-rope" in probe and "tiny-ape" in probe and "(lowest: " in probe
    assert lines[lines.index("") + 1].split()[0] == "model"  # then the table, headed by model


def test_a_zoo_keeps_its_words(two):
    from posprobe.report import zoo_atlas
    from posprobe.report.result import Result

    out, _ = two
    r = Result.load(out)
    models = r.tables["models"].assign(seed=[0, 0], family=["rope", "learned"])
    zoo = Result({**r.tables, "models": models}, {**r.meta, "vocabulary": "zoo"})
    assert zoo_atlas.title(zoo).startswith("Zoo atlas")
    html = " ".join((s.html or "") + " ".join(getattr(f, "layout").title.text or "" for f in (s.figures or []))
                    for s in zoo_atlas.sections(zoo))
    assert "Members are averaged over their seeds" in html and "per member (mean over seeds)" in html
    assert zoo_atlas.printed(zoo).splitlines()[0].split()[0] == "member"  # the zoo's table, as before
    legacy = Result({**r.tables, "models": models}, {k: v for k, v in r.meta.items() if k != "vocabulary"})
    assert zoo_atlas.title(legacy).startswith("Zoo atlas")  # a result saved before the vocabulary: its seeds say


def test_layers_collapse_by_kind_with_counts():
    gemma = ["local 1e4, sliding window 512"] * 5 + ["global 1e6"] + ["local 1e4, sliding window 512"] * 5 + \
        ["global 1e6"] * 1
    assert collapse_layers(gemma) == "local 1e4, sliding window 512 ×10; global 1e6 ×2"
    assert collapse_layers(["a"]) == "a" and collapse_layers([]) == ""
