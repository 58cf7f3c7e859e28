"""The zoo atlas (`posprobe zoo atlas`, `run_zoo_atlas`): every section runs on every member or names why not, its
numbers equal an independent Hugging Face computation (head similarity from HF's eager attention weights, perplexity
from HF's cross-entropy, the learned member's shift from HF with position ids moved) or the standalone analysis, a
model outside the zoo is compared too (refused with posprobe's reason where an analysis refuses it), and the report
draws offline."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from posprobe.analyses.configs import ZOO_ATLAS_SECTIONS, ZooAtlasConfig
from posprobe.zoo.config import ZooConfig

TINY = dict(d_model=32, n_layers=2, n_heads=2, length=64, vocab_size=300, batch_size=4, steps=40, warmup=4,
            checkpoint_every=20, progress=False, members=("learned", "rope", "nope", "alibi"), seeds=(0, 1))
L = TINY["length"]
CFG = ZooAtlasConfig(window=32, max_windows=3, ks=(0, 8, 16), shift_window=16, max_pairs=2, probe_tokens=300,
                     similarity_windows=4, extrapolation_tokens=4 * L, factors=(1, 2), progress=False)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def zoo_atlas(tmp_path_factory):
    from posprobe.analyses.atlas_many import run_zoo_atlas
    from posprobe.data import builtin_corpus
    from posprobe.zoo.run import train_zoo

    out = tmp_path_factory.mktemp("zatlas") / "zoo"
    train_zoo(ZooConfig(**TINY), builtin_corpus(), out)
    return out, run_zoo_atlas([str(out), "minilm"], CFG)


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def _rows(folder: Path, text: str, window: int, n: int) -> torch.Tensor:
    # The inputs every model reads: the text's tokens cut into windows, each after the tokenizer's BOS.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    step = window - len(bos)
    return torch.tensor([bos + ids[i * step:(i + 1) * step] for i in range(n)])


def _brute_jsd(p: np.ndarray, r: np.ndarray) -> float:
    m = (p + r) / 2
    total = 0.0
    for a in (p, r):
        nz = a > 0  # 0 log 0 = 0; m > 0 wherever a > 0
        total += 0.5 * float((a[nz] * np.log(a[nz] / m[nz])).sum())
    return total


def test_every_section_ran_on_every_model_or_says_why(zoo_atlas):
    out, result = zoo_atlas
    t = result.tables
    labels = [f"{m}-s{s}" for s in (0, 1) for m in TINY["members"]] + ["minilm"]
    assert sorted(t["models"].model) == sorted(labels)
    assert result.meta["sections"] == list(ZOO_ATLAS_SECTIONS)
    section_tables = {"extrapolation": "perplexity", "shift": "shift_perplexity", "probes": "probes",
                      "heads": "head_classes", "sinks": "sink_overall", "geometry": "pos_token_subspace",
                      "decomposition": "decomposition", "frequency": "bands", "similarity": "head_similarity_layer",
                      "passkey": "passkey_window"}
    refused = t["refused"]
    for section, table in section_tables.items():
        measured = set(t[table].model) if table in t else set()
        said = set(refused[refused.section == section].model)
        assert measured | said == set(labels), (section, set(labels) - measured - said)
        assert not measured & said, section
        assert (refused[refused.section == section].why.str.len() > 10).all()
    why = refused.set_index(["model", "section"]).why
    assert "no LM head" in why[("minilm", "extrapolation")]
    assert "vocabular" in why[("minilm", "similarity")]
    assert "distance alone" in why[("alibi-s0", "shift")] and "no positional" in why[("nope-s1", "shift")]
    assert "not trained with the passkey skill" in why[("rope-s0", "passkey")]
    assert set(t["pos_token_subspace"].model) == {"learned-s0", "learned-s1", "minilm"}
    assert set(t["bands"].member) == {"rope"}
    # The training curves come from the zoo's own training folder.
    assert set(t["training"].member) == set(TINY["members"]) and len(t["training_members"]) == 8


def test_head_similarity_equals_hugging_face_eager_attention(zoo_atlas):
    # Independent: HF's own eager attention weights, the JSD in numpy per (input, query), the nearest head by a loop.
    out, result = zoo_atlas
    text = (out / "eval.txt").read_text()
    rows = _rows(out / "nope-s0", text, CFG.window, CFG.similarity_windows)
    pats = {}
    for name in ("nope-s0", "rope-s0", "nope-s1"):
        with torch.no_grad():
            pats[name] = [a.double().numpy() for a in _hf(out / name)(rows, output_attentions=True).attentions]
    t = result.tables["head_similarity_layer"].set_index(["model", "other", "layer"]).jsd_min
    for a, b in (("nope-s0", "rope-s0"), ("rope-s0", "nope-s0"), ("nope-s0", "nope-s1")):
        for layer in range(TINY["n_layers"]):
            pa, pb = pats[a][layer], pats[b][layer]
            per_head = []
            for h in range(pa.shape[1]):
                d = [np.mean([_brute_jsd(pa[i, h, q], pb[i, k, q]) for i in range(len(rows))
                              for q in range(1, rows.shape[1])]) for k in range(pb.shape[1])]
                per_head.append(min(d))
            assert t[(a, b, layer)] == pytest.approx(np.mean(per_head), abs=1e-6), (a, b, layer)
    assert t[("nope-s0", "rope-s0", 0)] > 0  # not vacuous: two different models


def test_extrapolation_equals_hugging_face_cross_entropy(zoo_atlas):
    from transformers import AutoTokenizer

    out, result = zoo_atlas
    df = result.tables["perplexity"].set_index(["model", "protocol", "length"])
    text = (out / "eval.txt").read_text()
    for name in ("rope-s1", "alibi-s0"):
        ids = torch.tensor(AutoTokenizer.from_pretrained(out / name)(text, add_special_tokens=False)["input_ids"])
        for n in (L, 2 * L):
            chunks = ids[:CFG.extrapolation_tokens // n * n].view(-1, n)
            with torch.no_grad():
                logits = _hf(out / name)(input_ids=chunks).logits.double()
            want = float(torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), chunks[:, 1:]))
            assert df.loc[(name, "chunks", n), "nll"] == pytest.approx(want, abs=1e-5), (name, n)
    assert df.loc[("learned-s0", "chunks", 2 * L), "status"] == "cannot run"


def test_learned_members_shift_equals_hugging_face_with_moved_positions(zoo_atlas):
    # The learned member's perplexity at k: HF's forward with position_ids 0..n-1 + k on the same windows (the
    # tokenizer's end-of-text token before each, moved with the window).
    from transformers import AutoTokenizer

    out, result = zoo_atlas
    folder = out / "learned-s0"
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok((out / "eval.txt").read_text(), add_special_tokens=False)["input_ids"]
    prefix = tok.convert_tokens_to_ids("<|endoftext|>")
    w = CFG.shift_window
    rows = torch.tensor([[prefix] + ids[i * w:(i + 1) * w] for i in range(CFG.max_windows)])
    hf = _hf(folder)
    t = result.tables["shift_perplexity"]
    got = t[t.model == "learned-s0"].set_index("k").mean_loss
    assert sorted(got.index) == [0, 8, 16]
    for k in (0, 8, 16):
        pos = torch.arange(rows.shape[1]).expand_as(rows) + k
        with torch.no_grad():
            logits = hf(input_ids=rows, position_ids=pos).logits.double()
        want = float(torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), rows[:, 1:]))
        assert got[k] == pytest.approx(want, abs=1e-4), k
    assert abs(got[16] - got[0]) > 1e-4  # a learned table: the shift moves the loss (the test is not vacuous)


def test_per_model_sections_equal_the_standalone_analyses(zoo_atlas):
    from posprobe.analyses.configs import ProbeConfig, SinksConfig
    from posprobe.analyses.probes import run_probes
    from posprobe.analyses.sinks import run_sinks
    from posprobe.backend.loading import load_model

    out, result = zoo_atlas
    text = (out / "eval.txt").read_text()
    model = load_model(str(out / "rope-s1"))
    windows = -(-CFG.probe_tokens // CFG.window)  # as many windows as the sampled tokens need
    probes = run_probes(model, text, ProbeConfig(points=("resid_pre", "resid_post"), n_splits=3, window=CFG.window,
                                                 max_windows=windows, max_tokens=CFG.probe_tokens, seed=CFG.seed,
                                                 progress=False)).tables["probes"]
    embedding = probes[(probes.point == "resid_pre") & (probes.layer == 0)].assign(layer=-1)
    probes = pd.concat([embedding, probes[probes.point == "resid_post"]])
    want = probes.groupby(["layer", "condition", "metric"]).value.mean()
    t = result.tables["probes"]
    got = t[t.model == "rope-s1"].set_index(["layer", "condition", "metric"]).value
    pd.testing.assert_series_equal(got.sort_index(), want.sort_index(), check_names=False)
    sinks = run_sinks(model, text, SinksConfig(length=CFG.window, random_samples=8, max_windows=CFG.max_windows,
                                               ablate_heads=0, seed=CFG.seed, progress=False))
    s = result.tables["sink_overall"]
    assert s[s.model == "rope-s1"].set_index("condition").value.to_dict() == pytest.approx(sinks.meta["sink_share"])


def test_attention_window_on_planted_offsets():
    from posprobe.analyses.heads import attention_window

    row = lambda head, d, v: dict(model="m", layer=0, head=head, rel_pos=d, value=v)  # noqa: E731
    offsets = pd.DataFrame([row(0, d, v) for d, v in enumerate([.5, .3, .15, .05])]
                           + [row(1, d, v) for d, v in enumerate([.2, .2, .2])])
    w = attention_window(offsets).set_index("head")
    assert w.loc[0, "value"] == 2 and w.loc[0, "covered"]  # 0.5 + 0.3 < 0.9 <= 0.5 + 0.3 + 0.15
    assert math.isnan(w.loc[1, "value"]) and not w.loc[1, "covered"]  # 0.6 measured: wider than the offsets seen


def test_report_has_a_paragraph_and_figure_per_section_and_a_headline(zoo_atlas, tmp_path):
    from posprobe.report.zoo_atlas import headline_table, similarity_matrix

    _, result = zoo_atlas
    paths = result.save(tmp_path / "za")
    page = paths["report"].read_text()
    for heading in ("Perplexity past the training length", "Shift test", "Position probes per layer",
                    "Head similarity across members", "Attention sinks", "Add or concatenate?",
                    "Layer-0 score decomposition", "RoPE frequency usage", "Training", "Refused"):
        assert heading in page, heading
    assert "Haviv et al." in page and "Kazemnejad et al." in page and "cannot run" in page
    assert paths["report"].stat().st_size < 15e6
    head = headline_table(result).set_index("member")
    assert set(head.index) == set(TINY["members"]) | {"minilm"}
    assert head.loc["learned", "ratio_2L"] == "cannot run"
    mat = similarity_matrix(result.tables["head_similarity_layer"])
    assert mat.loc["nope", "rope"] > 0 and set(mat.index) == set(TINY["members"])
    again = type(result).load(tmp_path / "za")
    assert len(again.figures()) == len(result.figures()) >= 8


def test_training_caption_names_the_training_text_and_sink_shares_keep_their_axis(zoo_atlas):
    """Catches: the training-loss caption naming the text the atlas measured (eval.txt) instead of the zoo's training
    text; the sinks chart drawn on plotly's empty -1..1 axis when every share is 0, with no word why."""
    from posprobe.report.result import Result
    from posprobe.report.zoo_atlas import sections

    _, result = zoo_atlas
    trained_on = result.meta["training_data"]["source"]
    assert trained_on == "built-in corpus" and result.meta["data"]["source"] != trained_on

    def figure(res, heading):
        sec = next(s for s in sections(res) if s.heading == heading)
        return sec.figures[0]

    cap = _caption(figure(result, "Training"))
    assert f"Data: {trained_on}" in cap and result.meta["data"]["source"] not in cap, cap
    zero = result.tables["sink_overall"].assign(value=0.0)
    for values, note in ((zero, True), (zero.assign(value=0.25), False)):
        fig = figure(Result({**result.tables, "sink_overall": values}, result.meta),
                     "Attention sinks and massive activations")
        assert tuple(fig.layout.yaxis.range) == (0, 1)
        assert any("no model has a sink" in (a.text or "") for a in fig.layout.annotations) == note


def _caption(fig) -> str:
    from posprobe.report.style import get_caption

    return get_caption(fig)


@pytest.mark.browser
def test_zoo_atlas_report_draws_offline_in_chromium(zoo_atlas, tmp_path):
    from browser_util import load_page, require_chromium
    from test_report_browser import _REPORT_PROBE

    require_chromium()
    _, result = zoo_atlas
    paths = result.save(tmp_path / "za")
    n_figs = len(result.report_figures())
    rep = load_page(paths["report"], _REPORT_PROBE, width=1280, timeout=90,
                    until=lambda v: bool(v) and len(v["figs"]) == n_figs and all(f["drawn"] for f in v["figs"]))
    assert rep.errors == [], rep.errors
    assert rep.ok, rep.value
    for f in rep.value["figs"]:
        assert f["traces"] >= 1 and "Data:" in f["caption"], f


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "posprobe", "zoo", "atlas", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_cli_runs_chosen_sections_and_refuses_bad_input_before_loading(zoo_atlas, tmp_path):
    out, _ = zoo_atlas
    # --sections as posprobe atlas spells it; --section, the old spelling, still accepted.
    p = _cli(str(out / "nope-s0"), str(out / "rope-s0"), "--sections", "probes", "--section", "similarity",
             "--window", "24", "--max-windows", "2", "--probe-tokens", "200", "--similarity-windows", "2",
             "--out", str(tmp_path / "za"))
    assert p.returncode == 0, p.stderr
    assert "probe_mae_last" in p.stdout and "nope" in p.stdout and "wrote" in p.stdout
    assert "atlas: probes [1/2]" in p.stderr
    assert (tmp_path / "za" / "head_similarity_layer.parquet").is_file()
    p = _cli(str(out), "--section", "shfit", "--out", str(tmp_path / "bad"))
    assert p.returncode != 0 and "shfit" in p.stderr and "Loading" not in p.stderr
    assert not (tmp_path / "bad").exists()
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    p = _cli(str(out), "--text", str(empty), "--out", str(tmp_path / "bad"))
    assert p.returncode != 0 and "empty" in p.stderr.lower() and not (tmp_path / "bad").exists()
