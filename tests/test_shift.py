"""Shift-by-k test: checks before scoring, invariance on RoPE, change on learned APE, HF agreement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shared_data
from hf_util import hf_of

from posprobe.analyses.shift import ShiftConfig, ShiftError, run_shift_test, summarize_pairs
from posprobe.core.scoring import TLScorer
from posprobe.data import DataError, builtin_pairs

ROOT = Path(__file__).resolve().parents[1]
PAIRS = builtin_pairs(max_pairs=6, seed=0)
FAST = dict(n_bootstrap=100, progress=False)


def test_k_past_context_raises_before_scoring_and_names_longest(tiny_ape, monkeypatch):
    for method in ("token_logprobs", "pair_logprobs"):
        monkeypatch.setattr(TLScorer, method, lambda *a, **k: pytest.fail("scored before checking"))
    with pytest.raises(ShiftError, match=r"k=250 plus the longest sentence \(\d+ tokens.*largest allowed k is \d+"):
        run_shift_test(tiny_ape, PAIRS, config=ShiftConfig(ks=(250,), **FAST))


def test_bad_inputs(tiny_ape):
    with pytest.raises(ShiftError, match=">= 0"):
        run_shift_test(tiny_ape, PAIRS, config=ShiftConfig(ks=(-3,), **FAST))
    with pytest.raises(DataError, match="Empty input"):
        run_shift_test(tiny_ape, [], config=ShiftConfig(ks=(5,), **FAST))


def test_learned_absolute_scores_change_with_k_and_match_manual_embedding(tiny_ape):
    r = run_shift_test(tiny_ape, PAIRS, config=ShiftConfig(ks=(0, 100), **FAST))
    p0, p100 = (r.pairs[r.pairs.k == k].logp_good.to_numpy() for k in (0, 100))
    assert np.abs(p100 - p0).max() > 1e-2
    # Independent: BOS + sentence at positions 100, 101, ... given to the wrapped HF GPT-2 as position_ids.
    s = PAIRS[0].good
    ids = torch.tensor([[tiny_ape.tokenizer.bos_token_id] + tiny_ape.tokenizer(s, add_special_tokens=False).input_ids])
    logits = hf_of(tiny_ape)(ids, position_ids=torch.arange(ids.shape[1])[None] + 100).logits
    lp = logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).sum()
    assert abs(float(lp) - p100[0]) < 1e-4
    assert r.meta["prefix"]["kind"] == "bos" and r.meta["model"]["positional_kind"] == "learned_absolute"


def test_summary_counts_flips_and_mcnemar_by_hand():
    import pandas as pd
    from scipy.stats import binomtest

    rows = []
    truth0 = [True, True, False, True, False, True]
    truthk = [False, True, True, False, False, True]
    for k, truth in ((0, truth0), (7, truthk)):
        for i, c in enumerate(truth):
            rows.append(dict(paradigm="p", field="f", phenomenon="x", pair_id=str(i), k=k, logp_good=0.0,
                             logp_bad=-1.0 if c else 1.0, margin=1.0 if c else -1.0, correct=c))
    s = summarize_pairs(pd.DataFrame(rows), n_boot=200, seed=0)
    row = s[(s.k == 7) & (s.level == "overall")].iloc[0]
    assert (row.flips_to_wrong, row.flips_to_correct, row.flips) == (2, 1, 3)
    assert row.mcnemar_p == pytest.approx(binomtest(1, 3, 0.5).pvalue)
    assert row.accuracy == pytest.approx(0.5) and row.ci_low <= 0.5 <= row.ci_high


def test_a_loaded_bridge_scores_through_its_own_weights_with_hf(smollm2):
    # The atlas's shift section: the bridge it already holds, scored by HF's own forward (no reload).
    import pandas as pd

    from posprobe.backend.bridge import plain_hf_model

    cfg = ShiftConfig(ks=(0, 100), **FAST)
    by_name = run_shift_test("smollm2", PAIRS[:4], config=cfg)
    loaded = run_shift_test(smollm2, PAIRS[:4], config=cfg, backend="hf")
    assert loaded.meta["model"]["backend"] == "hf" and loaded.meta["model"]["rotary_dim"] == 64
    pd.testing.assert_frame_equal(by_name.pairs, loaded.pairs)  # same weights, same HF forward: bit-equal
    twin = plain_hf_model(smollm2)
    assert {p.data_ptr() for p in twin.parameters()} <= {p.data_ptr() for p in hf_of(smollm2).parameters()}


def test_hf_backend_on_a_loaded_model_agrees_with_the_hook_path_and_refuses_encoders(tiny_ape, minilm):
    cfg = ShiftConfig(ks=(0, 40), **FAST)
    hooks, native = (run_shift_test(tiny_ape, PAIRS, config=cfg, backend=b) for b in ("tl", "hf"))
    both = hooks.pairs.merge(native.pairs, on=["paradigm", "pair_id", "k"], suffixes=("_tl", "_hf"))
    assert len(both) == len(hooks.pairs) and np.abs(both.logp_good_tl - both.logp_good_hf).max() <= 1e-4
    assert np.abs(both.logp_good_tl[both.k == 40].to_numpy() - both.logp_good_tl[both.k == 0].to_numpy()).max() > 1e-3
    with pytest.raises(ShiftError, match="decoder with an LM head"):
        run_shift_test(minilm, PAIRS, config=cfg, backend="hf")


@pytest.mark.real
def test_rope_shift_is_invariant_on_smollm2_and_matches_plain_hf(smollm2):
    from posprobe.backend.loading import load_hf_model

    hf, tok = load_hf_model("smollm2")
    r = run_shift_test("smollm2", PAIRS, config=ShiftConfig(ks=(0, 100), **FAST))
    assert r.meta["model"]["backend"] == "hf" and r.meta["prefix"]["tokens"] == ["<|endoftext|>"]
    a0, a100 = (r.pairs[r.pairs.k == k] for k in (0, 100))
    assert (a0.correct.to_numpy() == a100.correct.to_numpy()).all()
    assert np.abs(a0.logp_good.to_numpy() - a100.logp_good.to_numpy()).max() <= 1e-3
    assert max(r.meta["max_abs_logp_change_vs_k0"].values()) <= 1e-3 and "invariance control" in r.meta["note"]
    # Independent computation: one unbatched HF forward with full logits at positions 100...
    s = PAIRS[2].bad
    ids = torch.tensor([[0] + tok(s, add_special_tokens=False).input_ids])
    logits = hf(ids, position_ids=torch.arange(ids.shape[1])[None] + 100).logits
    ref = logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().item()
    got = r.pairs[(r.pairs.k == 100) & (r.pairs.pair_id == PAIRS[2].pair_id) & (r.pairs.paradigm == PAIRS[2].paradigm)]
    assert abs(got.logp_bad.item() - ref) <= 1e-3
    # ... and the TransformerLens path (hooks) agrees with the HF path.
    tl = run_shift_test(smollm2, PAIRS[:4], config=ShiftConfig(ks=(0, 100), **FAST))
    both = tl.pairs.merge(r.pairs, on=["paradigm", "pair_id", "k"], suffixes=("_tl", "_hf"))
    assert np.abs(both.logp_good_tl - both.logp_good_hf).max() <= 1e-3


@pytest.mark.real
def test_encoder_without_lm_head_reports_representation_drift(minilm):
    r = run_shift_test(minilm, PAIRS[:8], config=ShiftConfig(ks=(0, 100), **FAST))
    d = r.drift.set_index(["k", "layer"]).cosine_to_k0
    assert d.loc[(0, "pooled")] == pytest.approx(1.0, abs=1e-6)
    assert d.loc[(100, "embeddings")] < 0.999 and d.loc[(100, "pooled")] < 1.0
    assert len(r.pairs) == 0 and r.meta["model"]["positional_kind"] == "learned_absolute"
    # Independent: HF's BertModel with position_ids shifted by hand, mean-pooled last layer, cosine to k=0.
    from transformers import AutoTokenizer, BertModel

    from posprobe.backend.sources import resolve

    folder = resolve("minilm").path
    hf, tok = BertModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    cos = []
    with torch.no_grad():
        for p in PAIRS[:8]:
            ids = tok(p.good, return_tensors="pt").input_ids
            h0, h100 = (hf(ids, position_ids=torch.arange(ids.shape[1])[None] + k).last_hidden_state[0].mean(0)
                        for k in (0, 100))
            cos.append(torch.cosine_similarity(h0, h100, dim=0).item())
    assert d.loc[(100, "pooled")] == pytest.approx(float(np.mean(cos)), abs=1e-5)


@pytest.mark.real
def test_runs_on_shared_blimp(tmp_path):
    from posprobe.data import load_blimp

    pairs = load_blimp(shared_data("blimp"), paradigms=["anaphor_number_agreement", "determiner_noun_agreement_1"],
                       max_pairs=15, seed=0)
    r = run_shift_test("smollm2", pairs, config=ShiftConfig(ks=(0, 50), **FAST), data_source="blimp")
    overall = r.summary[(r.summary.level == "overall") & (r.summary.k == 0)].iloc[0]
    assert overall.n_pairs == 30 and overall.accuracy > 0.7  # a real LM gets easy agreement mostly right


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "posprobe", "shift-test", *args], capture_output=True, text=True,
                          env=env, cwd=cwd)


def test_cli_malformed_blimp_line_names_file_and_line_and_writes_nothing(tmp_path):
    blimp = tmp_path / "blimp"
    blimp.mkdir()
    good = json.dumps(dict(sentence_good="A dog runs.", sentence_bad="A dog run.", field="morphology",
                           linguistics_term="agr", UID="toy", pairID="0"))
    (blimp / "toy.jsonl").write_text(good + "\n{not json\n")
    done = _cli("tiny-ape", "--k", "10", "--blimp", str(blimp), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and "toy.jsonl" in done.stderr and "line 2" in done.stderr
    assert not (tmp_path / "out").exists()
    done = _cli("tiny-ape", "--k", "-5", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and ">= 0" in done.stderr and not (tmp_path / "out").exists()


def test_offline_gpt2_points_to_a_learned_position_model_that_can_be_made_here(tmp_path, capsys):
    """`shift-test gpt2` offline (no GPT-2 weights on any registry) names the zoo's learned member, with commands that
    parse as given. Catches: the generic hub message alone, or a hint whose commands have gone stale."""
    import shlex

    from posprobe.cli import main
    from posprobe.cli.main import build_parser

    assert main(["shift-test", "gpt2", "--k", "100"]) == 2
    err = capsys.readouterr().err
    assert "Cannot download 'gpt2'" in err and "posprobe zoo train --member learned" in err, err
    commands = [c for c in err.split("`") if c.startswith("posprobe ")][-2:]
    assert len(commands) == 2, err
    parsed = [build_parser().parse_args(shlex.split(c)[1:]) for c in commands]
    assert parsed[0].zoo_command == "train" and parsed[0].members == ["learned"]
    assert parsed[1].command == "shift-test" and parsed[1].model == f"{parsed[0].out}/learned-s0"


@pytest.mark.browser
def test_cli_report_renders_offline_in_chromium(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from browser_util import load_page

    text = tmp_path / "t.txt"
    text.write_text(" ".join(["The children who live near the river often swim there in summer."] * 40))
    done = _cli(
        "tiny-ape",
        "--k",
        "0",
        "30",
        "--max-pairs",
        "5",
        "--text",
        str(text),
        "--window",
        "32",
        "--max-windows",
        "4",
        "--bootstrap",
        "50",
        "--out",
        str(tmp_path / "out"),
        "--no-progress",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "McNemar" in done.stdout
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} >= {"report.html", "meta.json", "shift_pairs.parquet", "shift_summary.csv",
                                                "shift_tokens.parquet"}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["data"]["builtin"] and meta["config"]["ks"] == [0, 30]
    probe = ("Array.from(document.querySelectorAll('div.plotly-graph-div'))"
             ".map(d => d.querySelectorAll('svg.main-svg').length > 0)")
    rep = load_page(out / "report.html", probe, until=lambda v: bool(v) and all(v), timeout=60)
    assert rep.errors == [], rep.errors
    assert rep.ok and len(rep.value) == 6, rep.value


def test_notebook_executes(tmp_path):
    from conftest import run_notebook

    text, _ = run_notebook("shift_test", tmp_path, timeout=300)
    assert "McNemar" in text
