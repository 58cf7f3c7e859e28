"""The CLI's analysis flags are generated from the Config dataclasses: one flag per field, the field's help,
and a command line without options gives exactly the Config's defaults (notebook and shell agree)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from posprobe.analyses import configs as C
from posprobe.cli.args import config_from_args
from posprobe.cli.main import build_parser
from posprobe.core.config import option_help

COMMANDS = {
    "shift-test": (C.ShiftConfig, ["tiny-ape"]),
    "freq-report": (C.FrequencyConfig, ["tiny-rope", "--out", "x"]),
    "decompose": (C.DecomposeConfig, ["tiny-ape", "--out", "x"]),
    "probe": (C.ProbeConfig, ["tiny-ape", "--out", "x"]),
    "geometry": (C.GeometryConfig, ["tiny-ape", "--out", "x"]),
    "squish": (C.SquishConfig, ["tiny-rope", "--instruction", "i", "--prompt", "p"]),
    "surgery-eval": (C.SurgeryEvalConfig, ["tiny-rope", "--text", "t.txt"]),
    "long-context": (C.LongContextConfig, ["tiny-rope", "--text", "t.txt", "--out", "x"]),
    "squish-study": (C.SquishStudyConfig, ["smollm2", "--out", "x"]),
    "brittleness": (C.BrittlenessConfig, ["smollm2", "--out", "x"]),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_defaults_and_help_come_from_the_config(command):
    cls, argv = COMMANDS[command]
    parser = build_parser()
    args = parser.parse_args([command, *argv])
    assert config_from_args(cls, args) == cls()
    sub = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == command)[1]
    dests = {a.dest: a for a in sub._actions}
    for f in fields(cls):
        if f.metadata.get("cli", True):
            assert f.name in dests, f"{command}: no flag for {cls.__name__}.{f.name}"
            assert option_help(f).replace("%", "%%") in dests[f.name].help


def test_flags_reach_the_config():
    parser = build_parser()
    args = parser.parse_args(
        ["shift-test", "tiny-ape", "--k", "5,7", "--k", "9", "--prefix", "bos", "--bootstrap", "10"]
    )
    cfg = config_from_args(C.ShiftConfig, args)
    assert cfg.ks == (5, 7, 9) and cfg.prefix == "bos" and cfg.n_bootstrap == 10 and cfg.all_ks() == [0, 5, 7, 9]
    args = parser.parse_args(["surgery-eval", "tiny-rope", "--text", "t", "--preset", "none",
                              "--preset", "self-extend:group=2,window=8", "--no-progress"])
    assert config_from_args(C.SurgeryEvalConfig, args).presets == ("none", "self-extend:group=2,window=8")
    args = parser.parse_args(["probe", "tiny-ape", "--out", "x", "--points", "resid_pre,resid_post", "--folds", "3",
                              "--layers", "0", "1"])
    cfg = config_from_args(C.ProbeConfig, args)
    assert cfg.points == ("resid_pre", "resid_post") and cfg.n_splits == 3 and cfg.layers == (0, 1)
    args = parser.parse_args(["freq-report", "tiny-rope", "--out", "x", "--no-ablate", "--queries", "0"])
    cfg = config_from_args(C.FrequencyConfig, args)
    assert cfg.ablate is False and cfg.queries is None
    with pytest.raises(ValueError, match="not both"):
        config_from_args(C.SquishConfig, parser.parse_args(["squish", "m", "--instruction", "i", "--prompt", "p",
                                                            "--squish-to", "0", "--squish-range", "0", "4"]))


def test_a_tuple_of_choices_takes_each_choice_and_refuses_others(capsys):
    parser = build_parser()
    for argv, want in ((["--placement", "user"], ("user",)), (["--placement", "system", "user"], ("system", "user")),
                       (["--placement", "user,system"], ("user", "system"))):
        args = parser.parse_args(["squish-study", "smollm2", "--out", "x", *argv])
        assert config_from_args(C.SquishStudyConfig, args).placements == want
    with pytest.raises(SystemExit):
        parser.parse_args(["squish-study", "smollm2", "--out", "x", "--placement", "system,assistant"])
    assert "'assistant' is not one of: system, user" in capsys.readouterr().err


def test_zoo_atlas_and_zoo_eval_score_the_same_tokens_by_default():
    """'ppl at L' is printed by `zoo eval` and `zoo atlas`: by default both score the same number of tokens per length.
    Catches: the atlas's own default (4,096 tokens) giving another number under the same name (8,192 in zoo eval)."""
    from posprobe.analyses.configs import ExtrapolationConfig, ZooAtlasConfig

    assert ZooAtlasConfig().extrapolation_tokens == ExtrapolationConfig().max_tokens == 8192
    assert ZooAtlasConfig().factors == ExtrapolationConfig().factors
