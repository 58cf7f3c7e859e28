"""Bad input a newcomer gives gets one sentence before any weights load, and nothing is written: model paths that do not
exist or are not models, an --out nobody can write in, a --text that is not text. A zoo member among several that
cannot load is listed on stdout and as a row of every table that lists members, never dropped silently."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from posprobe.cli import main


def _refused(capsys, argv: list[str], *needles: str) -> str:
    """Run the CLI in-process; it must exit 2 with one error line naming every needle, and print no results."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, (code, captured.out, captured.err)
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"posprobe {argv[0]}: error: "), captured.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert captured.out == ""
    return lines[0]


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """A working folder with an analysis output (meta.json, no config.json), an empty folder and a reports/ folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports" / "smollm2-freq").mkdir(parents=True)
    (tmp_path / "reports" / "smollm2-freq" / "meta.json").write_text(json.dumps({"analysis": "freq-report"}))
    (tmp_path / "empty").mkdir()
    return tmp_path


@pytest.mark.parametrize("command", ["eval", "atlas"])
@pytest.mark.parametrize(("spec", "needle"), [
    ("reports/not-here-at-all", "No such file or folder: reports/not-here-at-all"),  # shaped like a hub repo id
    ("./not-here", "No such file or folder"),
    ("empty", "not a zoo folder"),
    ("reports/smollm2-freq", "not a zoo folder"),
])
def test_zoo_commands_refuse_a_spec_that_is_not_a_model_before_any_load(folders, capsys, command, spec, needle):
    """Catches: a missing path, an empty folder or an analysis folder evaluated as zero models (an empty report,
    exit 0), a pandas KeyError, or a mistyped relative path sent to the hub as a repo id."""
    line = _refused(capsys, ["zoo", command, spec, "--text", __file__, "--out", "out"], needle, spec)
    assert "download" not in line.lower() and "hub" not in line.lower()
    assert not (folders / "out").exists() and not (folders / "out.work").exists()


def test_a_refusal_stays_one_line_on_a_busy_machine(folders, capsys, monkeypatch):
    """Catches: the busy-machine warning printed before the spec is checked (the refusal then took two lines, and the
    test above failed whenever the suite ran without xdist on a loaded 2-core machine: issue #64)."""
    import os

    import torch

    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))  # every core busy, whatever the machine
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for command in ("eval", "atlas"):
        _refused(capsys, ["zoo", command, "./not-here", "--text", __file__, "--out", "out"], "No such file or folder",
                 "./not-here")


def test_a_mistyped_relative_path_is_not_read_as_a_hub_repo_id(folders):
    """Catches: 'reports/x' (a local folder's child that does not exist) resolved as the repo id 'reports/x'."""
    from posprobe.backend.sources import ModelLoadError, looks_like_repo_id, resolve_local

    assert looks_like_repo_id("reports/not-here")  # shaped like one: only the local folder tells them apart
    with pytest.raises(ModelLoadError, match="names a local path"):
        resolve_local("reports/not-here")
    assert resolve_local("no-such-org/no-such-model") is None  # no local folder 'no-such-org': still a hub name


def test_out_where_nothing_can_be_written_is_refused_before_loading(capsys, tmp_path):
    """/proc takes no new files, even for root (a chmod'ed folder would not stop root). Catches: --out checked only
    for its parent's existence, so the run fails after the weights have loaded ('[Errno 30] ... heads.work')."""
    from posprobe.cli.checks import check_out

    with pytest.raises(ValueError, match="cannot write in /proc"):
        check_out("/proc/posprobe-out")
    _refused(capsys, ["heads", "tiny-rope", "--out", "/proc/posprobe-out"], "cannot write in /proc")
    check_out(str(tmp_path / "fine"))  # a writable parent passes, and the check leaves nothing behind
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("content", "needle"), [("\x00" * 100_000, "NUL bytes"), ("abc\x00def " * 50, "NUL bytes"),
                                                 ("... --- !!! ***\n" * 40, "no letters or digits")])
def test_text_that_is_not_text_is_refused(capsys, tmp_path, content, needle):
    """Catches: 100 kB of NUL bytes accepted as --text and analysed into a confident head report (exit 0)."""
    from posprobe.data import read_text
    from posprobe.data.records import DataError

    path = tmp_path / "t.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=needle):
        read_text(path)
    _refused(capsys, ["heads", "tiny-rope", "--text", str(path), "--out", str(tmp_path / "out")], needle)
    assert not (tmp_path / "out").exists()


def _perplexity_rows() -> pd.DataFrame:
    # Two members measured (rope with two seeds) and one whose only model was refused at load.
    rows = []
    for model, member, seed, ratios in (("rope-s0", "rope", 0, (1.0, 1.2)), ("rope-s1", "rope", 1, (1.0, 1.6)),
                                        ("nope-s0", "nope", 0, (1.0, 3.0))):
        for factor, r in zip((1.0, 2.0), ratios):
            rows.append(dict(model=model, member=member, family=member, block="llama", seed=seed, protocol="chunks",
                             factor=factor, length=int(64 * factor), ppl=10 * r, ppl_ratio=r, status="ok", why=""))
    rows.append(dict(model="alibi-s0", member="alibi", family="alibi", block="llama", seed=0, status="refused",
                     why="could not read model.safetensors: truncated"))
    return pd.DataFrame(rows)


def test_a_refused_member_is_a_row_of_every_member_table_and_a_line_on_stdout():
    """Catches: the ratios table and the printed summary silently listing two members of three."""
    from posprobe.analyses.atlas_many import ratio_summary
    from posprobe.cli.zoo import refused_models
    from posprobe.report.extrapolation import ratio_table
    from posprobe.report.result import Result

    table = _perplexity_rows()
    ratios = ratio_summary(table)
    assert list(dict.fromkeys(ratios["member"])) == ["rope", "nope", "alibi"]
    gone = ratios[ratios["member"] == "alibi"]
    assert len(gone) == 1 and gone["status"].item() == "refused" and "truncated" in gone["why"].item()
    # Mean over seeds (rope at 2L: (1.2 + 1.6) / 2), with the range, beside the refused row.
    rope2 = ratios[(ratios["member"] == "rope") & (ratios["factor"] == 2.0)]
    assert rope2[["ppl_ratio", "ratio_low", "ratio_high", "n_seeds"]].values.tolist() == [[1.4, 1.2, 1.6, 2]]
    wide = ratio_table(Result({"perplexity": table, "ratios": ratios}, {}))
    assert wide["member"].tolist() == ["rope", "nope", "alibi"]
    assert wide.set_index("member").loc["alibi"].tolist() == ["refused", "refused"]
    assert wide.set_index("member").loc["rope", "chunks 2L"] == "1.40 [1.20–1.60]"
    assert refused_models(Result({"perplexity": table}, {})) == [("alibi-s0",
                                                                   "could not read model.safetensors: truncated")]
    # Every model refused: one row per member, no KeyError.
    only = table[table["member"] == "alibi"][["model", "member", "family", "block", "seed", "status", "why"]]
    assert ratio_table(Result({"perplexity": only, "ratios": ratio_summary(only)}, {}))["member"].tolist() == ["alibi"]


def test_zoo_eval_lists_a_member_with_corrupt_weights(tmp_path, capsys):
    """End to end on a two-member zoo whose second member's weights are truncated: the printed table has both
    members, the corrupt one 'refused', and one stdout line gives its reason."""
    from posprobe.data import builtin_corpus
    from posprobe.zoo.config import ZooConfig
    from posprobe.zoo.run import train_zoo

    zoo = tmp_path / "zoo"
    train_zoo(ZooConfig(members=("rope", "nope"), d_model=16, n_layers=1, n_heads=2, length=16, vocab_size=280,
                        batch_size=2, steps=2, warmup=1, checkpoint_every=2, progress=False), builtin_corpus(), zoo)
    weights = zoo / "rope-s0" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    code = main(["zoo", "eval", str(zoo), "--factor", "1", "2", "--max-tokens", "64", "--no-progress", "--out",
                 str(tmp_path / "ev")])
    out = capsys.readouterr().out
    assert code == 0, out
    table = [ln.split()[0] for ln in out.splitlines()[1:3]]
    assert sorted(table) == ["nope", "rope"]
    assert any(ln.startswith("[zoo] refused rope-s0: ") for ln in out.splitlines()), out
    assert "refused" in next(ln for ln in out.splitlines() if ln.split()[0] == "rope")
