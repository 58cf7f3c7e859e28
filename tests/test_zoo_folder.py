"""The zoo folder format (`posprobe.zoo.folder`), read on folders written here by hand: which folders are members,
what a record says, which text a zoo is evaluated on, and what is refused before any model loads. Pure file work, no
model: each check is the documented layout (docs/zoo.md, the module docstring) written out in the test.

Plants seen failing (one at a time, in a scratch copy): a zoo's members not sorted; a member folder without
config.json accepted; an extended member accepted by read_zoo; member_info averaging an extended member with its
source (no "+method"); the member folder's own eval.txt preferred over the zoo's (parent) when both exist; an empty
eval.txt taken as the text; whitespace taken as a text; training_tables reading a folder without meta.json; a
hub name not in the cache let through; packaged weights assembled by a name check; a spec before a zoo dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from posprobe.report.result import Result
from posprobe.zoo.folder import (
    EVAL_FILE,
    MEMBER_COLUMNS,
    TRAINING_FOLDER,
    ZOO_FILE,
    default_text,
    extended_folder_name,
    member_folder_name,
    member_info,
    read_zoo,
    resolve_text,
    training_tables,
    zoo_models,
)

WIDTHS = {"d_model": 8, "n_layers": 1, "n_heads": 1, "length": 16, "vocab_size": 32}


def _member(zoo: Path, name: str, seed: int, *, config: bool = True, **extra) -> Path:
    folder = zoo / f"{name}-s{seed}"
    folder.mkdir(parents=True)
    record = {"member": name, "family": "rotary", "block": "llama", "seed": seed, "widths": WIDTHS, **extra}
    (folder / ZOO_FILE).write_text(json.dumps(record), encoding="utf-8")
    if config:
        (folder / "config.json").write_text("{}", encoding="utf-8")
    return folder


def test_folder_names_are_member_dash_s_seed_and_method():
    assert member_folder_name("rope-llama", 3) == "rope-llama-s3"
    assert extended_folder_name("rope-llama", 3, "yarn") == "rope-llama-s3-yarn"
    assert MEMBER_COLUMNS == ("member", "family", "block", "seed")


def test_read_zoo_lists_members_sorted_with_their_records_and_nothing_else(tmp_path):
    zoo = tmp_path / "zoo"
    for name, seed in (("rope", 1), ("alibi", 0), ("rope", 0)):
        _member(zoo, name, seed)
    (zoo / "training").mkdir()  # a subfolder without zoo.json is not a member
    (zoo / "notes").mkdir()
    (zoo / "notes" / "config.json").write_text("{}")
    (zoo / EVAL_FILE).write_text("held out")
    got = read_zoo(zoo)
    assert [f.name for f, _ in got] == ["alibi-s0", "rope-s0", "rope-s1"]
    assert [(r["member"], r["seed"]) for _, r in got] == [("alibi", 0), ("rope", 0), ("rope", 1)]
    # a member folder stands for itself
    assert [f.name for f, _ in read_zoo(zoo / "rope-s1")] == ["rope-s1"]
    assert read_zoo(str(zoo)) == got


@pytest.mark.parametrize("case, says", [
    ("missing", "no such folder"),
    ("file", "no such folder"),
    ("empty", "is not a zoo folder"),
    ("no config", "no config.json or no widths"),
    ("no widths", "no config.json or no widths"),
    ("no member", "no config.json or no widths"),
    ("extended", "already an extended member (pi)"),
])
def test_read_zoo_refuses_what_is_not_a_zoo_with_one_sentence(tmp_path, case, says):
    zoo = tmp_path / "zoo"
    if case == "file":
        zoo.write_text("x")
    elif case == "empty":
        zoo.mkdir()
    elif case == "no config":
        _member(zoo, "rope", 0, config=False)
    elif case in ("no widths", "no member"):
        f = _member(zoo, "rope", 0)
        rec = json.loads((f / ZOO_FILE).read_text())
        del rec["widths" if case == "no widths" else "member"]
        (f / ZOO_FILE).write_text(json.dumps(rec))
    elif case == "extended":
        _member(zoo, "rope", 0, extension={"method": "pi"}, method="pi")
    with pytest.raises(ValueError) as e:
        read_zoo(zoo)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_zoo_models_expands_zoos_keeps_other_specs_and_refuses_the_rest_before_loading(tmp_path):
    zoo = tmp_path / "zoo"
    _member(zoo, "rope", 1)
    _member(zoo, "nope", 0)
    plain = tmp_path / "plain"  # a Hugging Face folder that is not a zoo member
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    got = zoo_models([str(zoo), "tiny-rope", str(plain)])
    assert [Path(s).name if r else s for s, r in got] == ["nope-s0", "rope-s1", "tiny-rope", str(plain)]
    assert [r and r["member"] for _, r in got] == ["nope", "rope", None, None]
    (tmp_path / "empty-dir").mkdir()
    for bad, says in (("not-here", "not-here"), ("empty-dir", "empty-dir is not a zoo folder")):
        with pytest.raises(ValueError) as e:
            zoo_models([str(zoo), str(tmp_path / bad)])
        assert says in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no models"):
        zoo_models([])
    # a spec named before a zoo keeps its place (the zoo's members are added, not put in its stead)
    assert [s for s, _ in zoo_models(["tiny-rope", str(zoo)])] == ["tiny-rope", str(zoo / "nope-s0"),
                                                                    str(zoo / "rope-s1")]


def test_a_hub_name_that_cannot_be_had_offline_is_refused_before_anything_loads(monkeypatch):
    """A repo id that is not in the local cache is asked of the resolver (which refuses it offline with the
    alternatives) and comes back as one ValueError naming it; packaged weights are only looked up, never assembled
    (gemma3-270m's GGUF is written out when a model loads, not when a name is checked)."""
    import posprobe.backend.sources as sources

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        zoo_models(["some-org/a-model-nobody-has-cached"])
    assert str(e.value).startswith("some-org/a-model-nobody-has-cached: ")
    asked = []
    real = sources._packaged
    monkeypatch.setattr(sources, "_packaged", lambda alias, *, assemble=True: asked.append(assemble) or real(
        alias, assemble=False))
    assert zoo_models(["gemma3-270m"]) == [("gemma3-270m", None)] and asked == [False]


def test_the_default_text_is_the_zoos_eval_txt_found_from_a_member_too(tmp_path):
    zoo = tmp_path / "zoo"
    m = _member(zoo, "rope", 0)
    assert default_text([str(zoo)]) is None
    (zoo / EVAL_FILE).write_text("", encoding="utf-8")  # empty: not a text
    assert default_text([str(zoo)]) is None
    (zoo / EVAL_FILE).write_text("the zoo's", encoding="utf-8")
    assert default_text([str(zoo)]) == ("the zoo's", str(zoo / EVAL_FILE))
    assert default_text([str(m)]) == ("the zoo's", str(zoo / EVAL_FILE))  # a member reads its zoo's
    (m / EVAL_FILE).write_text("the member's", encoding="utf-8")
    assert default_text([str(m)]) == ("the member's", str(m / EVAL_FILE))  # its own first
    other = tmp_path / "other"
    other.mkdir()
    (other / EVAL_FILE).write_text("other's")
    assert default_text(["tiny-rope", str(other), str(zoo)])[0] == "other's"  # the first path that has one


def test_resolve_text_takes_the_given_text_else_the_zoos_and_refuses_none_or_blank(tmp_path):
    zoo = tmp_path / "zoo"
    _member(zoo, "rope", 0)
    with pytest.raises(ValueError, match="no text: pass --text"):
        resolve_text([str(zoo)], None, None)
    (zoo / EVAL_FILE).write_text("kept text", encoding="utf-8")
    assert resolve_text([str(zoo)], None, None) == ("kept text", str(zoo / EVAL_FILE))
    assert resolve_text([str(zoo)], "given", "mine") == ("given", "mine")
    for blank in ("", " \n\t "):
        with pytest.raises(ValueError, match="the text is empty"):
            resolve_text([str(zoo)], blank, None)


def test_member_info_names_the_member_and_keeps_extended_methods_apart():
    rec = {"member": "rope", "family": "rotary", "block": "llama", "seed": 2, "widths": WIDTHS}
    assert member_info("rope-s2", rec) == {"member": "rope", "family": "rotary", "block": "llama", "seed": 2}
    assert member_info("x", {**rec, "method": "yarn"})["member"] == "rope+yarn"
    assert member_info("gpt2", None) == {"member": "gpt2", "family": None, "block": None, "seed": None}
    assert member_info("m", {"family": "alibi"}) == {"member": "m", "family": "alibi", "block": None, "seed": None}


def test_training_tables_read_the_first_zoo_that_has_them(tmp_path):
    assert training_tables([str(tmp_path / "none"), "tiny-rope"]) == ({}, None)
    zoo = tmp_path / "zoo"
    (zoo / TRAINING_FOLDER).mkdir(parents=True)  # a folder without meta.json is not a saved Result
    assert training_tables([str(zoo)]) == ({}, None)
    curve = pd.DataFrame({"model": ["rope-s0"], "step": [10], "loss": [3.5]})
    members = pd.DataFrame({"model": ["rope-s0"], "seconds": [1.0]})
    data = {"source": "valid.txt", "n_items": 9, "unit": "tokens"}
    Result({"training": curve, "members": members}, {"analysis": "zoo", "data": data}).save(
        zoo / TRAINING_FOLDER)
    tables, got = training_tables([str(tmp_path / "none"), str(zoo)])
    assert set(tables) == {"training", "training_members"} and got == data
    pd.testing.assert_frame_equal(tables["training"], curve)
    pd.testing.assert_frame_equal(tables["training_members"], members)
