"""Emergence over training (issue 65): checkpoints every K steps, `MODEL@REVISION`, and the emergence table.

The table's numbers are checked against each analysis run directly on the checkpoint's folder (loaded by its plain
path, not through `@step<N>`), so a checkpoint measured under another step's label, a step's tokens miscounted or a
metric read off the wrong table fails; the tokens against step x batch x L computed here from the flags."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from posprobe.data import BUILTIN_TEXT

STEPS, EVERY, BATCH, L = 20, 10, 4, 64


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    from posprobe import ZooConfig, train_zoo

    out = tmp_path_factory.mktemp("emergence") / "zoo"
    cfg = ZooConfig(members=("learned",), d_model=32, n_layers=2, n_heads=2, length=L, vocab_size=300,
                    batch_size=BATCH, steps=STEPS, save_every=EVERY, progress=False)
    train_zoo(cfg, BUILTIN_TEXT, out)
    return out


def _cfg(**kw):
    from posprobe import EmergenceConfig

    return EmergenceConfig(window=32, max_windows=2, sink_samples=4, shift_window=16, ks=(0, 16), max_pairs=3,
                           progress=False, **kw)


def test_a_member_is_measured_at_every_saved_step_then_at_its_last(zoo):
    from posprobe.analyses.emergence import emergence_models

    plan = emergence_models([str(zoo)])
    member = zoo / "learned-s0"
    assert plan["spec"].tolist() == [f"{member}@step0", f"{member}@step10", str(member)]
    assert plan["step"].tolist() == [0, 10, 20]
    assert plan["tokens"].tolist() == [s * BATCH * L for s in (0, 10, 20)]
    assert json.loads((member / "checkpoints" / "step10" / "zoo.json").read_text())["tokens"] == 10 * BATCH * L
    # A model named at a revision: its step from the name, its tokens from tokens_per_step (unknown without it).
    named = emergence_models([f"{member}@step10"], tokens_per_step=1000)
    assert (named["step"].tolist(), named["tokens"].tolist()) == ([10], [10_000])
    assert math.isnan(emergence_models([f"{member}@step10"])["tokens"].iloc[0])


def test_the_table_is_each_analysis_run_on_that_checkpoint(zoo):
    import posprobe as pp
    from posprobe.analyses.configs import HeadsConfig, ShiftConfig, SinksConfig
    from posprobe.analyses.heads import run_heads
    from posprobe.analyses.shift import run_shift_test
    from posprobe.analyses.sinks import run_sinks
    from posprobe.data import builtin_pairs

    text = (zoo / "eval.txt").read_text()
    cfg = _cfg()
    r = pp.run_emergence([str(zoo)], cfg)
    em = r.tables["emergence"]
    assert list(em.columns) == ["model", "member", "seed", "step", "tokens", "section", "metric", "value"]
    assert r.tables["refused"].empty, r.tables["refused"].to_string()
    for step, folder in ((0, zoo / "learned-s0" / "checkpoints" / "step0"), (10, zoo / "learned-s0" / "checkpoints"
                                                                              / "step10"), (20, zoo / "learned-s0")):
        got = em[em.step == step].set_index("metric")["value"]
        assert set(em[em.step == step]["tokens"]) == {step * BATCH * L}
        model = pp.load_model(str(folder))
        sinks = run_sinks(model, text, SinksConfig(length=32, random_samples=4, max_windows=2, ablate_heads=0,
                                                   seed=0, progress=False))
        assert got["sink_share_random"] == pytest.approx(sinks.meta["sink_share"]["random"], abs=0)
        assert got["sink_share_text"] == pytest.approx(sinks.meta["sink_share"]["text"], abs=0)
        m = sinks.tables["massive_activations"]
        assert got["massive_ratio"] == pytest.approx(m[(m.condition == "random")]["ratio"].max(), rel=1e-12)
        heads = run_heads(model, text, HeadsConfig(window=32, max_windows=2, induction_len=24, seed=0,
                                                   progress=False))
        per_class = pd.Series([c for cs in heads.tables["head_classes"]["classes"] for c in cs.split(",") if c])
        assert got["heads_previous_token"] == (per_class == "previous-token").sum()
        assert got["heads_induction"] == (per_class == "induction").sum()
        shift = run_shift_test(model, builtin_pairs(max_pairs=3, seed=0), text=text, config=ShiftConfig(
            ks=(0, 16), window=16, max_windows=2, n_bootstrap=200, seed=0, progress=False))
        s = shift.summary
        acc = s[s.level == "overall"].set_index("k")["accuracy"]
        assert got["shift_accuracy_k0"] == acc[0] and got["shift_drop_k16"] == pytest.approx(acc[0] - acc[16])


def test_the_page_draws_every_metric_and_the_command_prints_steps_as_columns(zoo, tmp_path, capsys):
    from posprobe.cli.main import main

    assert main(["zoo", "emergence", str(zoo), "--sections", "heads", "--window", "32", "--max-windows", "2",
                 "--no-progress", "--out", str(tmp_path / "em")]) == 0
    out = capsys.readouterr().out
    assert "step 0" in out and "step 10" in out and "step 20" in out and "heads_previous_token" in out
    html = (tmp_path / "em" / "report.html").read_text()
    assert "Positional metrics over training" in html and "previous-token heads" in html


def test_revisions_resolve_to_saved_steps_and_bad_ones_are_one_sentence(zoo, monkeypatch):
    from posprobe.backend.sources import ModelLoadError, resolve

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    member = zoo / "learned-s0"
    src = resolve(f"{member}@step10")
    assert src.kind == "hf-dir" and src.path == (member / "checkpoints" / "step10").resolve()
    assert src.name == "learned-s0@step10"
    with pytest.raises(ModelLoadError, match="has no checkpoint 'step5'; its saved steps: step0, step10"):
        resolve(f"{member}@step5")
    with pytest.raises(ModelLoadError, match="no saved steps"):
        resolve(f"{zoo / 'learned-s0' / 'checkpoints' / 'step0'}@step3")
    with pytest.raises(ModelLoadError, match="has no revisions"):
        resolve("tiny-rope@step3")
    with pytest.raises(ModelLoadError, match="unreachable"):
        resolve("EleutherAI/pythia-70m@step1000")
    with pytest.raises(ModelLoadError, match="needs both parts"):
        resolve("EleutherAI/pythia-70m@")


def test_only_the_sections_the_table_reads_are_taken():
    with pytest.raises(ValueError, match="emergence table reads the sections"):
        _cfg(sections=("probes",))
    with pytest.raises(ValueError, match="tokens_per_step must be > 0"):
        _cfg(tokens_per_step=0)


@pytest.mark.parametrize("files, weights", [(["config.json", "model.safetensors", "pytorch_model.bin"],
                                             "*.safetensors"),
                                            (["config.json", "pytorch_model.bin"], "*.bin")])
def test_a_hub_revision_downloads_one_copy_of_the_weights_at_that_revision(monkeypatch, tmp_path, files, weights):
    """The download path, with the hub stood in (no network here): the revision is passed through, one weight format
    is asked for, and the snapshot folder becomes a local source."""
    import huggingface_hub

    from posprobe.backend.sources import Source, fetch_revision

    asked = {}
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, revision=None: files)

    def download(repo, revision=None, allow_patterns=None):
        asked.update(repo=repo, revision=revision, patterns=allow_patterns)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    got = fetch_revision(Source("hub", "EleutherAI/pythia-70m@step1000"))
    assert (got.kind, got.path, got.name) == ("hf-dir", tmp_path, "EleutherAI/pythia-70m@step1000")
    assert (asked["repo"], asked["revision"]) == ("EleutherAI/pythia-70m", "step1000")
    assert weights in asked["patterns"] and ({"*.safetensors", "*.bin"} - {weights}).isdisjoint(asked["patterns"])
    assert fetch_revision(Source("hub", "EleutherAI/pythia-70m")) == Source("hub", "EleutherAI/pythia-70m")
