"""Needle tasks (issue 25, first step): RULER's NIAH variants and key-value retrieval, generated at exact token
lengths from the model's own tokenizer, scored with RULER's string_match_all, through the long-context harness."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posprobe.backend.tiny import byte_tokenizer
from posprobe.data import BUILTIN_TEXT
from posprobe.data.needles import TASKS, needle_prompt, string_match_all


def _tokenizers(smollm2=None):
    out = [("bytes", byte_tokenizer(), 3000)]
    if smollm2 is not None:
        out.append(("smollm2", smollm2.tokenizer, 900))
    return out


@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_is_exact_seeded_and_places_its_needles(task, smollm2):
    for label, tok, length in _tokenizers(smollm2):
        p = needle_prompt(tok, task, length, 0.5, seed=7, text=BUILTIN_TEXT)
        assert len(p.ids) == length, label
        assert p.ids == needle_prompt(tok, task, length, 0.5, seed=7, text=BUILTIN_TEXT).ids  # seeded
        assert p.targets != needle_prompt(tok, task, length, 0.5, seed=8, text=BUILTIN_TEXT).targets
        t = TASKS[task]
        assert len(p.targets) == t.answers and len(set(p.targets)) == t.answers
        text = tok.decode(p.ids)
        for n in p.needles:  # each recorded span holds its own needle, key and value
            piece = tok.decode(p.ids[n.start:n.end])
            assert n.key in piece and n.value in piece, (label, piece)
        asked = [n for n in p.needles if n.asked]
        assert sorted(n.value for n in asked) == sorted(p.targets)
        keys = len({n.key for n in p.needles})  # kv_retrieval: every pair of the JSON is a needle
        assert len({n.key for n in asked}) == t.queries and (keys == max(t.keys, t.queries) or t.haystack == "json")
        tail = text[text.rindex(asked[0].value) + len(asked[0].value):]
        assert all(n.key in tail for n in asked)  # the question names every asked key, after the last needle
        if task == "kv_retrieval":
            body = text[text.index("JSON data:\n") + len("JSON data:\n"):text.index("\n\nKey:")]
            pairs = json.loads(body)
            assert len(pairs) == len(p.needles) and pairs[asked[0].key] == p.targets[0]
            order = [n.key for n in p.needles]
            assert order.index(asked[0].key) == round(0.5 * (len(order) - 1))


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_1", "kv_retrieval"])
def test_the_first_asked_needle_follows_the_depth(task):
    tok = byte_tokenizer()
    pos = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        p = needle_prompt(tok, task, 2500, depth, seed=1, text=BUILTIN_TEXT)
        first = next(n for n in p.needles if n.asked)
        pos.append(first.start / len(p.ids))
    assert pos == sorted(pos) and pos[0] < 0.15 and pos[-1] > 0.75, pos


def test_string_match_all_is_rulers_fraction_of_expected_values_found():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("only 123", ["123", "456"]) == 0.5
    assert string_match_all("UUID: ABC-def", ["abc-DEF"]) == 1.0
    assert string_match_all("", ["1"]) == 0.0
    with pytest.raises(ValueError, match="no expected values"):
        string_match_all("x", [])


def _ruler_string_match_all(pred: str, refs: list[str]) -> float:
    # RULER (scripts/eval/synthetic/constants.py): sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref])
    # / len(ref), per prediction.
    return sum(1.0 if r.lower() in pred.lower() else 0.0 for r in refs) / len(refs)


@pytest.mark.parametrize("answer, targets, want", [
    ("", ["1234567"], 0.0),
    ("", ["12", "34", "56", "78"], 0.0),  # an empty answer finds nothing, however many targets
    ("   \n", ["12", "34"], 0.0),
    ("12 and 56", ["12", "34", "56", "78"], 0.5),
    ("the values: 34", ["12", "34", "56"], 1 / 3),
    ("Alpha-BRAVO, then charlie", ["alpha-bravo", "Charlie", "delta"], 2 / 3),
    ("1234", ["123", "234", "345"], 2 / 3),  # containment, not whole-word match
    ("9", ["9", "9"], 1.0),
    ("7", ["70"], 0.0),  # the target must be in the answer, not the answer in the target
])
def test_string_match_all_scores_partial_multi_value_answers_as_ruler(answer, targets, want):
    assert _ruler_string_match_all(answer, targets) == pytest.approx(want)  # the reference itself, by hand
    assert string_match_all(answer, targets) == pytest.approx(want)


@pytest.mark.parametrize("bad,message", [
    (dict(task="bogus"), "unknown needle task 'bogus'"),
    (dict(depth=1.5), r"depth must be within \[0, 1\]"),
    (dict(length=50), "needs at least"),
    (dict(text=""), r"needs a text \(--text\); got an empty one"),
    (dict(text=None), r"needs a text \(--text\); got none"),
])
def test_bad_needle_input_raises_one_clear_error(bad, message):
    args = dict(task="niah_single_2", length=2000, depth=0.5, seed=0, text=BUILTIN_TEXT) | bad
    with pytest.raises(ValueError, match=message):
        needle_prompt(byte_tokenizer(), **args)


def test_greedy_decode_stops_where_asked_with_the_same_tokens():
    from test_long_context import _byte_llama

    from posprobe.core import long_engine as LA
    from posprobe.core.presets import preset_pairs

    model, _ = _byte_llama()
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0))
    for spec in ("none", "pi:scale=2"):
        full = LA.greedy_decode(model, ids, preset_pairs(spec), 8)
        part = LA.greedy_decode(model, ids, preset_pairs(spec), 8, stop=lambda new: len(new) >= 3)
        assert torch.equal(part, full[:3])


def test_harness_tables_equal_hfs_own_generate_and_rescoring(tmp_path):
    # The needle rows of run_long_context: each answer is HF's own greedy `generate` on the same prompt (preset none),
    # cut where every target had appeared or at the task's budget, and each score is string_match_all recomputed.
    from test_long_context import TEXT, _byte_llama

    from posprobe.analyses.long_context import LongContextConfig, run_long_context
    from posprobe.report.schema import COLUMNS, METRICS

    model, tok = _byte_llama()
    cfg = LongContextConfig(lengths=(64,), presets=("none", "pi:scale=2"), passkey_lengths=(700,), depths=(0.0, 1.0),
                            tasks=("niah_single_1", "kv_retrieval"), needle_tokens=6, progress=False)
    r = run_long_context(model, TEXT, cfg, tokenizer=tok, name="m")
    needles, acc = r.tables["needles"], r.tables["needle_accuracy"]
    assert "passkey" not in r.tables and len(needles) == 2 * 2 * 2 and len(acc) == 8
    assert set(needles.columns) <= set(COLUMNS) and set(acc.columns) <= set(COLUMNS)
    assert set(acc.metric) == {"string_match_all"} <= set(METRICS)
    for a in acc.itertuples():  # a 95% Wilson interval where every trial scored 0 or 1, written out; else none
        scores = needles[(needles.task == a.task) & (needles.preset == a.preset) & (needles.depth == a.depth)].score
        n, p, z = len(scores), scores.mean(), 1.959963984540054
        if not scores.isin([0.0, 1.0]).all():
            assert math.isnan(a.ci_low) and math.isnan(a.ci_high)
            continue
        centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z / (1 + z * z / n) * math.sqrt(
            p * (1 - p) / n + z * z / (4 * n * n))
        assert (a.ci_low, a.ci_high) == (pytest.approx(centre - half), pytest.approx(centre + half))
    for row in needles.itertuples():
        targets = row.targets.split(" | ")
        # RULER's string_match_all written out: the fraction of the targets found in the answer, case-insensitive.
        assert row.score == sum(t.lower() in row.answer.lower() for t in targets) / len(targets)
        if row.preset != "none":
            continue
        p = needle_prompt(tok, row.task, 700, row.depth, cfg.seed * 1000 + row.trial, text=TEXT)
        out = model.generate(torch.tensor([p.ids]), max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.eos_token_id)[0, 700:].tolist()
        # The stop rule written out: the first prefix that ends in <eos> or holds every target, else all 6 tokens.
        cut = next((k for k in range(1, len(out) + 1) if out[k - 1] == tok.eos_token_id or all(
            t.lower() in tok.decode(out[:k], skip_special_tokens=True).lower() for t in targets)), len(out))
        assert row.answer == tok.decode(out[:cut], skip_special_tokens=True)  # exactly: an empty answer fails here
        assert row.answer.strip(), "a 6-token greedy answer of the byte model should not be blank"
    assert r.meta["needle_tasks"]["kv_retrieval"]["haystack"] == "json"
    paths = r.save(tmp_path / "lc")
    assert "needle accuracy" in paths["report"].read_text().lower()


def test_smollm2_finds_a_single_needle_and_the_score_is_rulers(smollm2):
    from posprobe.analyses.long_context import LongContextConfig, run_long_context

    cfg = LongContextConfig(lengths=(256,), passkey_lengths=(1024,), depths=(0.5,),
                            tasks=("niah_single_1", "niah_multivalue"), progress=False)
    r = run_long_context(smollm2, BUILTIN_TEXT * 8, cfg, name="smollm2")
    rows = r.tables["needles"].set_index("task")
    # Measured: the single needle is found (1.0); each score is the fraction of the targets in the answer.
    assert rows.loc["niah_single_1", "score"] == 1.0
    assert rows.loc["niah_single_1", "targets"] in rows.loc["niah_single_1", "answer"]
    mv = rows.loc["niah_multivalue"]
    assert mv.score == sum(t in mv.answer for t in mv.targets.split(" | ")) / 4


def test_an_unknown_task_is_refused_before_any_model_loads(capsys, tmp_path):
    from posprobe.analyses.configs import LongContextConfig
    from posprobe.cli.main import main

    with pytest.raises(ValueError, match="unknown needle task 'bogus'"):
        LongContextConfig(tasks=("bogus",))
    code = main(["long-context", "no-such-model", "--text", "-", "--task", "bogus", "--out", str(tmp_path / "o")])
    assert code == 2 and "unknown needle task 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_3", "niah_multivalue", "kv_retrieval"])
def test_value_spans_hold_exactly_the_value(task, smollm2):
    for label, tok, length in _tokenizers(smollm2):
        p = needle_prompt(tok, task, length, 0.5, seed=3, text=BUILTIN_TEXT)
        for n in p.needles:
            assert n.start < n.value_start < n.value_end == n.end, label
            got = tok.decode(p.ids[n.value_start:n.value_end]).strip().rstrip(".,").strip('"')
            assert got == n.value, (label, got, n.value)
