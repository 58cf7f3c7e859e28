"""The loop of the atlas over many models (`atlas_many.compare_models`) with sections written here, on posprobe's tiny
random models: each model loaded once, every per-model section run on it in order, a section that does not apply or
raises is an outcome saying why (never dropped), a model that cannot load is refused by every section, the models
are kept for a cross-model section only when it reads them, and time is counted per section. Seconds.

Plants seen failing (one at a time): `keep` inverted; a raising section's outcome not marked failed; outcomes of an
unloadable model dropped; the progress line counting from 0; timings charged to the wrong section; `model_row`
marking a refused model "loaded"; `_tag` dropping the member columns; run_zoo_atlas measuring the zoo's text instead
of the one given, ignoring the device, losing the source, the progress lines, a section's page, the first-line rule
for failures, empty tables dropped, headlines keyed by model, the ratios table, the extrapolation settings."""

from __future__ import annotations

import pandas as pd
import pytest

from posprobe.analyses.atlas_many import _tag, compare_models, model_row
from posprobe.analyses.configs import ZooAtlasConfig
from posprobe.analyses.sections import AtlasSection, CompareRun, ModelEntry

SPECS = [("tiny-rope", None), ("no-such-model-anywhere", None), ("tiny-ape", None)]
RUN = CompareRun(ZooAtlasConfig(sections=("heads",), progress=False), "some text", ())


def _per_model(name: str, behaviour) -> AtlasSection:
    return AtlasSection(name, name, None, None, None, compare=behaviour)


def _sections(reads_models: bool, seen: dict) -> dict:
    def counts(m, run):  # a table and a headline from the loaded model
        return {"t": pd.DataFrame({"n_layers": [m.facts.n_layers]})}, {"layers": m.facts.n_layers}

    def picky(m, run):  # does not apply to one model, fails on another
        if m.label == "tiny-ape":
            return "learned positions: not this section's family"
        raise ValueError("cannot measure\nsecond line of the traceback")

    def across(models, run):
        seen["loaded"] = [m.label for m in models if m.model is not None]
        return {"x": pd.DataFrame({"k": [len(models)]})}, {"tiny-ape": "left out on purpose"}

    return {"counts": _per_model("counts", counts), "picky": _per_model("picky", picky),
            "cross": AtlasSection("cross", "cross", None, None, None, across=across,
                                  across_reads_models=reads_models)}


@pytest.mark.parametrize("reads_models", [True, False])
def test_every_model_and_section_is_an_outcome_in_order(reads_models):
    seen: dict = {}
    said: list = []
    models, outcomes, timings = compare_models(SPECS, _sections(reads_models, seen), RUN, say=said.append)
    assert [m.label for m in models] == ["tiny-rope", "no-such-model-anywhere", "tiny-ape"]
    assert [(o.section, o.label) for o in outcomes] == [
        ("counts", "tiny-rope"), ("picky", "tiny-rope"), ("counts", "no-such-model-anywhere"),
        ("picky", "no-such-model-anywhere"), ("counts", "tiny-ape"), ("picky", "tiny-ape"),
        ("cross", ""), ("cross", "tiny-ape")]
    ok, failed, unloadable, no_load2, ok2, not_here, cross, left = outcomes
    assert ok.why is None and ok.headline == {"layers": models[0].facts.n_layers} and len(ok.tables["t"]) == 1
    assert failed.failed and failed.why.startswith("cannot measure") and not failed.tables
    assert not unloadable.failed and unloadable.why == models[1].why and "no-such-model-anywhere" in models[1].why
    assert no_load2.why == models[1].why  # every section says so, not only the first
    assert not_here.why == "learned positions: not this section's family" and not not_here.failed
    assert cross.tables["x"].k.tolist() == [3] and left.why == "left out on purpose"
    # the models stay in memory only for a cross-model section that reads them
    assert seen["loaded"] == (["tiny-rope", "tiny-ape"] if reads_models else [])
    assert set(timings) == {"counts", "picky", "cross"} and all(v >= 0 for v in timings.values())
    assert said[0] == "atlas: counts [1/3] tiny-rope ..." and said[-1] == "atlas: cross of " + (
        "2 models ..." if reads_models else "0 models ...")
    assert not any("no-such-model-anywhere" in s for s in said)  # nothing is run on a model that did not load


def test_time_is_charged_to_the_section_that_spent_it(monkeypatch):
    import posprobe.analyses.atlas_many as am

    clock = iter(range(0, 1000, 5))  # every perf_counter call advances 5 s
    monkeypatch.setattr(am.time, "perf_counter", lambda: next(clock))
    secs = {"counts": _per_model("counts", lambda m, run: ({}, None)),
            "picky": _per_model("picky", lambda m, run: "never applies")}
    _, _, timings = compare_models([SPECS[0], SPECS[2]], secs, RUN)
    assert timings == {"counts": 10.0, "picky": 10.0}  # summed over the two models


def test_model_rows_and_tags_carry_the_member_and_status():
    loaded = compare_models([("tiny-rope", None)], {}, RUN)[0][0]
    row = model_row(loaded)
    assert (row["model"], row["status"], row["why"], row["member"]) == ("tiny-rope", "loaded", "", "tiny-rope")
    assert row["n_layers"] == loaded.facts.n_layers and row["positional_kind"] == loaded.facts.positional_kind
    gone = ModelEntry("m-s1", "/zoo/m-s1", {"member": "rope", "family": "rotary", "block": "gpt", "seed": 1},
                      why="could not read")
    row = model_row(gone)
    assert (row["status"], row["why"], row["member"], row["seed"]) == ("refused", "could not read", "rope", 1)
    assert "n_layers" not in row
    tagged = _tag(pd.DataFrame({"v": [1, 2]}), gone)
    assert tagged[["model", "member", "family", "block", "seed"]].drop_duplicates().values.tolist() == [
        ["m-s1", "rope", "rotary", "gpt", 1]]


def test_run_zoo_atlas_assembles_what_its_sections_returned(monkeypatch, capsys):
    """`run_zoo_atlas` end to end on two tiny models with its sections replaced by ones written here: the text given
    is the text measured (its sha256 computed here), the device given is the device loaded on, a failed section is a
    `refused` row with the first line of its error, a section that does not apply keeps its whole reason, headlines
    and tables are kept per section and model, `ratios` follows a `perplexity` table, and meta names each section's
    page function, the extrapolation settings and the time per section."""
    import hashlib
    import importlib

    import posprobe.analyses.atlas_many as am
    import posprobe.backend.loading as loading
    from posprobe.analyses.sections import section

    def heads(m, run):
        if m.label == "tiny-ape":
            raise ValueError("cannot measure this one\nTraceback line")
        return {"head_classes": pd.DataFrame({"layer": [0], "head": [1]}), "empty": pd.DataFrame()}, {"n": 1}

    def sinks(m, run):
        if m.label == "tiny-rope":
            return "does not apply: rotary\n(the reason, whole: not cut at its first line)"
        return {"perplexity": pd.DataFrame({"protocol": ["chunks", "chunks"], "factor": [1.0, 2.0], "length": [8, 16],
                                            "ppl_ratio": [1.0, 1.5], "status": ["ok", "ok"], "why": ["", ""]})}, None

    real = {"heads": section("heads"), "sinks": section("sinks")}
    fakes = {"heads": AtlasSection("heads", "Heads", None, None, None, compare=heads,
                                   compare_page=real["heads"].compare_page),
             "sinks": AtlasSection("sinks", "Sinks", None, None, None, compare=sinks, compare_page=None)}
    monkeypatch.setattr(am, "section", lambda name: fakes[name])
    devices = []
    real_load = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda spec, **kw: devices.append(kw.get("device")) or real_load(
        spec, **kw))
    text = "a text written for this test, measured by no section here.\n" * 3
    cfg = ZooAtlasConfig(sections=("heads", "sinks"), progress=True)
    r = am.run_zoo_atlas(["tiny-rope", "tiny-ape"], cfg, text=text, source="mine", device="cpu")
    assert devices == ["cpu", "cpu"]
    meta = r.meta
    assert meta["data"]["sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert meta["data"]["source"] == "mine" and meta["data"]["n_items"] == len(text)
    assert meta["data"]["unit"] == "characters" and meta["analysis"] == "zoo-atlas"
    # two models a user named, no zoo: the models' own names and their vocabulary (issue #66)
    assert meta["model"] == {"name": "tiny-rope, tiny-ape", "positional_kind": "several",
                             "models": ["tiny-rope", "tiny-ape"]}
    assert meta["vocabulary"] == "models"
    assert r.tables["models"].spec.tolist() == ["tiny-rope", "tiny-ape"]
    assert meta["sections"] == ["heads", "sinks"] and set(meta["seconds"]) == {"heads", "sinks"}
    assert meta["training_data"] is None and meta["headline"] == {"heads": {"tiny-rope": {"n": 1}}}
    mod, fn = meta["pages"]["heads"].split(":")
    assert getattr(importlib.import_module(mod), fn) is real["heads"].compare_page and meta["pages"]["sinks"] is None
    assert meta["extrapolation"] == {"factors": list(cfg.factors), "protocols": ["chunks", "sliding"],
                                     "max_tokens": cfg.extrapolation_tokens}
    assert r.tables["refused"].values.tolist() == [
        ["tiny-rope", "sinks", "does not apply: rotary\n(the reason, whole: not cut at its first line)"],
        ["tiny-ape", "heads", "cannot measure this one"]]
    hc = r.tables["head_classes"]
    assert hc[["model", "member", "layer", "head"]].values.tolist() == [["tiny-rope", "tiny-rope", 0, 1]]
    assert "empty" not in r.tables  # an empty table is not a table
    ratios = r.tables["ratios"]
    assert ratios[["member", "factor", "ppl_ratio"]].values.tolist() == [["tiny-ape", 1.0, 1.0], ["tiny-ape", 2.0, 1.5]]
    assert r.tables["models"].model.tolist() == ["tiny-rope", "tiny-ape"]
    err = capsys.readouterr().err
    assert "atlas: heads [1/2] tiny-rope ..." in err and "atlas: sinks [2/2] tiny-ape ..." in err
    r2 = am.run_zoo_atlas(["tiny-rope"], ZooAtlasConfig(sections=("heads",), progress=False), text=text)
    assert r2.meta["data"]["source"] == "text" and capsys.readouterr().err == ""


def test_zoo_eval_records_the_text_and_source_it_was_given():
    """`evaluate_zoo`'s meta: the analysis, the models and the text as given (source, length, sha256 computed here)."""
    import hashlib

    from posprobe.analyses.atlas_many import evaluate_zoo
    from posprobe.analyses.configs import ExtrapolationConfig
    from posprobe.data import BUILTIN_TEXT

    cfg = ExtrapolationConfig(train_length=16, factors=(1, 2), max_tokens=64, progress=False)
    r = evaluate_zoo(["tiny-rope"], cfg, text=BUILTIN_TEXT, source="mine")
    assert r.meta["analysis"] == "zoo-eval"
    assert r.meta["model"] == {"name": "zoo", "positional_kind": "several", "models": ["tiny-rope"]}
    assert r.meta["data"]["source"] == "mine" and r.meta["data"]["unit"] == "characters"
    assert r.meta["data"]["sha256"] == hashlib.sha256(BUILTIN_TEXT.encode("utf-8")).hexdigest()
    assert r.tables["perplexity"].length.tolist()[:2] == [16, 32]
