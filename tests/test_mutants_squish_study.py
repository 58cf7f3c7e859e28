"""Tests written to kill the mutants benchmarks/mutation.py found alive in posprobe/analyses/squish_study.py (#53).

Every column of both study tables, the meta and the progress lines, each against a computation written here: the
prompt rendered by the tokenizer's own chat template from messages built here, greedy answers and attention from a
plain Hugging Face forward (position_ids for the `qk` condition, no KV cache), the checkers and mention phrases
applied to those answers, Wilson intervals and McNemar's test from scipy. The seeded tiny chat Llama of
tests/test_squish_variants.py; the whole file runs in seconds.
"""

from __future__ import annotations

import hashlib
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from test_squish_variants import tiny  # noqa: F401  (the seeded tiny chat Llama fixture)

from posprobe.analyses import squish_study as S
from posprobe.analyses.configs import SquishStudyConfig
from posprobe.data.instructions import custom_instruction
from posprobe.data.questions import FILLER_TURNS, Question
from posprobe.report.result import Result

QUESTIONS = [Question("Why is bread crusty?", "Heat dries it.", "cooking"),
             Question("Why is the sea salty?", "Rivers carry salt.")]
NEW = 4
CONDITIONS = ("none", "normal", "squish:0:qk")


def _instructions():
    # Checkers that random bytes pass about half the time; mention phrases that random answers sometimes contain.
    return [custom_instruction("even", "Answer in an even number of letters.", lambda a: len(a) % 2 == 0,
                               mentions=("\ufffd",)),
            custom_instruction("cook3", "On cooking questions, use a multiple of three letters.",
                               lambda a: len(a) % 3 == 0, mentions=("zz-not-there",), topic="cooking")]


def _config(**kw):
    return SquishStudyConfig(**{**dict(questions=2, placements=("system", "user"), distances=(0, 1),
                                       max_new_tokens=NEW, progress=False, conditions=CONDITIONS), **kw})


# ----------------------------------------------------------------------------------------------- the reference


def _ref_messages(placement, distance, inst, question):
    """The documented prompt: the instruction as the system message, or at the start of the first user turn (the
    first filler turn, or the question without filler), then `distance` (user, assistant) filler turns."""
    msgs = [{"role": "system", "content": inst}] if placement == "system" and inst else []
    turns = [FILLER_TURNS[i % len(FILLER_TURNS)] for i in range(distance)] + [(question, None)]
    for n, (user, assistant) in enumerate(turns):
        content = f"{inst}\n{user}" if (n == 0 and placement == "user" and inst) else user
        msgs.append({"role": "user", "content": content})
        if assistant is not None:
            msgs.append({"role": "assistant", "content": assistant})
    return msgs


def _ref_prompt(tok, placement, distance, inst, question):
    text = tok.apply_chat_template(_ref_messages(placement, distance, inst, question), tokenize=False,
                                   add_generation_prompt=True)
    ids = list(text.encode("utf-8"))  # the byte tokenizer: one id per UTF-8 byte
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    span = None
    if inst:
        a = len(text[:text.find(inst)].encode())
        span = (a, a + len(inst.encode()))
    q = len(text[:text.rfind(question)].encode())
    return text, ids, span, q


@torch.no_grad()
def _ref_answer(eager, ids, span, condition, eos):
    """Greedy answer (no cache, full forward per step), the first step's log-softmax, and the last prompt token's
    attention onto the span (mean over layers and heads) from HF's eager weights."""
    seq = list(ids)
    pos = list(range(len(ids)))
    if condition == "squish:0:qk":
        pos[span[0]:span[1]] = [0] * (span[1] - span[0])
    out, first, mass = [], None, float("nan")
    for step in range(NEW):
        res = eager(torch.tensor(seq)[None], position_ids=torch.tensor(pos)[None], output_attentions=step == 0)
        logits = res.logits[0, -1].float()
        if step == 0:
            first = torch.log_softmax(logits, -1)
            if span is not None:
                n = len(ids)
                mass = float(torch.stack([a[0, :, n - 1, span[0]:span[1]].sum(-1).mean() for a in res.attentions])
                             .mean())
        t = int(logits.argmax())
        out.append(t)
        if t == eos:
            break
        seq.append(t)
        pos.append(pos[-1] + 1)
    return out, first, mass


@torch.no_grad()
def _ref_ref_nll(model, ids, span, condition, ref):
    seq = ids + ref
    pos = list(range(len(seq)))
    if condition == "squish:0:qk":
        pos[span[0]:span[1]] = [0] * (span[1] - span[0])
    lp = torch.log_softmax(model(torch.tensor(seq)[None], position_ids=torch.tensor(pos)[None]).logits[0].double(), -1)
    n = len(ids)
    return float(-torch.stack([lp[n - 1 + i, t] for i, t in enumerate(ref)]).mean())


def _wilson(k, n, z=1.959963984540054):
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return centre - half, centre + half


@pytest.fixture(scope="module")
def reference(tiny):  # noqa: F811
    model, tok = tiny
    eager = type(model)(model.config).eval()
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    rows, texts = [], []
    insts = _instructions()
    for placement in ("system", "user"):
        for distance in (0, 1):
            firsts = {}
            for inst in [None, *insts]:
                for q in QUESTIONS:
                    texts.append(_ref_prompt(tok, placement, distance, inst.text if inst else None, q.text)[0])
            for cond in CONDITIONS:
                for inst in [None] if cond == "none" else insts:
                    for qi, q in enumerate(QUESTIONS):
                        text, ids, span, q_at = _ref_prompt(tok, placement, distance, inst.text if inst else None,
                                                            q.text)
                        ans, first, mass = _ref_answer(eager, ids, span, cond, tok.eos_token_id)
                        firsts[(cond, inst.name if inst else "", qi)] = first
                        answer = tok.decode(ans, skip_special_tokens=True)
                        ref = list(q.reference.encode())
                        rows.append(dict(placement=placement, distance=distance, condition=cond,
                                         instruction=inst.name if inst else "none", question=qi, answer=answer,
                                         n_answer_tokens=len(ans),
                                         distance_tokens=float(q_at - span[1]) if span else float("nan"),
                                         concerned=inst is None or inst.topic is None or q.topic == inst.topic,
                                         followed=bool(inst.check(answer)) if inst else False,
                                         acknowledged=any(m in answer.lower() for m in inst.mentions) if inst
                                         else False,
                                         ref_nll=_ref_ref_nll(model, ids, span, cond, ref),
                                         span_attention=mass if cond != "none" else float("nan"),
                                         _first=first))
            for r in rows[-((len(CONDITIONS) - 1) * len(insts) + 1) * len(QUESTIONS):]:
                none = firsts[("none", "", r["question"])].half().float()
                r["kl_first"] = float((none.exp() * (none - r["_first"].half().float())).sum())  # 0 for none
    return pd.DataFrame(rows).drop(columns="_first"), texts


def test_study_tables_and_meta_against_hugging_face(tiny, reference, tmp_path):  # noqa: F811
    """One study run, checked three ways below. The study runs in this test's body: mutmut attributes a function to
    the tests whose body calls it, so the checks must not read a module fixture's result."""
    model, tok = tiny
    work = tmp_path / "work"
    res = S.run_squish_study(model, _config(), tokenizer=tok, instructions=_instructions(), questions=QUESTIONS,
                             work=str(work))
    _check_answers_table(res, reference)
    _check_adherence_table(res, reference)
    _check_meta(res, work, reference)


def _check_answers_table(res, reference):
    want, _ = reference
    got = res.tables["squish_answers"]
    assert list(got.columns) == ["model", "placement", "distance", "distance_tokens", "instruction", "condition",
                                 "question", "concerned", "answer", "followed", "acknowledged", "kl_first", "ref_nll",
                                 "span_attention", "n_answer_tokens"]
    assert (got.model == "tiny-variants").all() and len(got) == len(want) == 2 * 2 * (1 + 2 * 2) * 2
    keys = ["placement", "distance", "condition", "instruction", "question"]
    g, w = got.set_index(keys).sort_index(), want.set_index(keys).sort_index()
    assert list(g.index) == list(w.index)
    for col in ("answer", "n_answer_tokens", "concerned", "followed", "acknowledged"):
        assert list(g[col]) == list(w[col]), col
    for col, tol in (("distance_tokens", 0), ("ref_nll", 1e-4), ("span_attention", 1e-4), ("kl_first", 5e-4)):
        np.testing.assert_allclose(g[col].to_numpy(float), w[col].to_numpy(float), atol=tol, rtol=0, err_msg=col)
    # not vacuous: the checkers and mention phrases split the answers, and an answer may stop early
    for col in ("followed", "acknowledged"):
        assert got[got.condition != "none"][col].nunique() == 2, col


def _check_adherence_table(res, reference):
    from scipy.stats import binomtest

    want, _ = reference
    insts = {i.name: i for i in _instructions()}
    # the no-instruction answers scored by each instruction's checker form that instruction's `none` cells
    base = []
    for name, inst in insts.items():
        part = want[want.condition == "none"].copy()
        part["instruction"] = name
        part["followed"] = [bool(inst.check(a)) for a in part.answer]
        part["acknowledged"] = [any(m in a.lower() for m in inst.mentions) for a in part.answer]
        part["concerned"] = [inst.topic is None or QUESTIONS[q].topic == inst.topic for q in part.question]
        base.append(part)
    scored = pd.concat([want[want.condition != "none"], *base], ignore_index=True)
    got = res.tables["squish_adherence"]
    assert list(got.columns) == ["model", "placement", "distance", "instruction", "concerned", "condition", "n",
                                 "adherence", "ci_low", "ci_high", "acknowledged", "kl_first", "ref_nll",
                                 "span_attention", "distance_tokens", "p_vs_normal"]
    keys = ["placement", "distance", "instruction", "concerned", "condition"]
    cells = scored.groupby(keys)
    assert len(got) == cells.ngroups and (got.model == "tiny-variants").all()
    # in order of first appearance (placement, distance, instruction, ...), not sorted
    assert list(map(tuple, got[keys].to_numpy())) == list(dict.fromkeys(map(tuple, scored[keys].to_numpy())))
    checked_p = 0
    for row in got.itertuples():
        part = cells.get_group((row.placement, row.distance, row.instruction, row.concerned, row.condition))
        k, n = int(part.followed.sum()), len(part)
        assert row.n == n and row.adherence == pytest.approx(k / n, abs=1e-12)
        assert (row.ci_low, row.ci_high) == pytest.approx(_wilson(k, n), abs=1e-9)
        for col in ("acknowledged", "kl_first", "ref_nll", "span_attention", "distance_tokens"):
            mean = part[col].astype(float).mean()
            assert (math.isnan(mean) and math.isnan(getattr(row, col))) or \
                getattr(row, col) == pytest.approx(mean, abs=5e-4), col
        if row.condition in ("normal", "none"):
            assert math.isnan(row.p_vs_normal)
            continue
        normal = scored[(scored.condition == "normal") & (scored.placement == row.placement)
                        & (scored.distance == row.distance) & (scored.instruction == row.instruction)]
        base_f = normal.set_index("question").followed.loc[list(part.question)].to_numpy()
        now = part.followed.to_numpy()
        b, c = int((base_f & ~now).sum()), int((~base_f & now).sum())
        p = 1.0 if b + c == 0 else binomtest(min(b, c), b + c, 0.5).pvalue
        assert row.p_vs_normal == pytest.approx(p, abs=1e-12)
        checked_p += 1
    assert checked_p == len(got[got.condition == "squish:0:qk"]) > 0
    assert (got[got.condition == "none"].span_attention.isna()).all()


def _check_meta(res, work, reference):
    _, texts = reference
    meta = res.meta
    assert meta["analysis"] == "squish-study"
    assert meta["data"] == {"source": "questions", "sha256": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
                            "n_items": 2, "unit": "questions"}
    assert meta["instructions"] == {i.name: i.text for i in _instructions()}
    assert list(meta["conditions"]) == list(CONDITIONS)
    assert meta["conditions"]["squish:0:qk"]["variant"] == "qk"
    assert set(meta["measures"]) == {"followed", "acknowledged", "kl_first", "ref_nll", "span_attention", "ci",
                                     "p_vs_normal"}
    assert "KL(no instruction || condition)" in meta["measures"]["kl_first"]
    assert meta["checkpoint"] == {"folder": str(work), "resumed_units": 0}
    assert meta["config"]["conditions"] == list(CONDITIONS) or meta["config"]["conditions"] == CONDITIONS
    assert meta["model"]["name"] == "tiny-variants"


def test_progress_lines_and_resume_count(tiny, tmp_path, capsys):  # noqa: F811
    model, tok = tiny
    cfg = _config(placements=("user",), distances=(0,), progress=True, max_new_tokens=2)
    inst = _instructions()[:1]
    work = tmp_path / "w"
    first = S.run_squish_study(model, cfg, tokenizer=tok, instructions=inst, questions=QUESTIONS[:2], work=str(work))
    err = capsys.readouterr().err
    n_cells = 1 + 2  # none + (normal, squish:0:qk) x one instruction
    assert f"squish-study: {n_cells} cells (placement x distance x instruction x condition) of 2 prompts, 2 greedy " \
           "tokens each\n" in err
    lines = err.split("\r")[1:]
    assert len(lines) == n_cells
    want = [("-", "none"), ("even", "normal"), ("even", "squish:0:qk")]
    for i, (line, (name, cond)) in enumerate(zip(lines, want), start=1):
        assert re.fullmatch(rf"squish-study: user, 0 turns, {re.escape(name)}, {re.escape(cond)}: cell {i}/{n_cells}, "
                            rf"ETA \d+ s   " + ("\n" if i == n_cells else ""), line), line
    # a rerun after losing one cell: says so, computes one cell, counts from the resumed ones
    sorted((work / "units").iterdir())[0].unlink()
    again = S.run_squish_study(model, cfg, tokenizer=tok, instructions=inst, questions=QUESTIONS[:2], work=str(work))
    err = capsys.readouterr().err
    assert f"resuming squish-study: {n_cells - 1} of {n_cells} cells already done in {work}" in err
    assert re.search(rf"cell {n_cells}/{n_cells}, ETA \d+ s   \n$", err)
    assert err.count("\r") == 1 and again.meta["checkpoint"]["resumed_units"] == n_cells - 1
    for name in first.tables:
        pd.testing.assert_frame_equal(first.tables[name], again.tables[name])
    # fresh=True recomputes everything
    fresh = S.run_squish_study(model, _config(placements=("user",), distances=(0,), max_new_tokens=2),
                               tokenizer=tok, instructions=inst, questions=QUESTIONS[:2], work=str(work), fresh=True)
    assert fresh.meta["checkpoint"]["resumed_units"] == 0


def test_without_none_condition_kl_is_nan_and_no_base_rows(tiny):  # noqa: F811
    model, tok = tiny
    res = S.run_squish_study(model, _config(placements=("user",), distances=(0,), conditions=("normal",),
                                            max_new_tokens=1), tokenizer=tok, instructions=_instructions(),
                             questions=QUESTIONS)
    a = res.tables["squish_answers"]
    assert set(a.condition) == {"normal"} and a.kl_first.isna().all() and len(a) == 2 * 2
    assert set(res.tables["squish_adherence"].condition) == {"normal"}


def test_a_bridge_runs_its_hugging_face_model_with_every_argument(tiny, reference, tmp_path):  # noqa: F811
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend.tiny import byte_tokenizer

    model, tok = tiny
    twin = type(model)(model.config).eval()
    twin.load_state_dict(model.state_dict())
    btok = byte_tokenizer()
    btok.chat_template = tok.chat_template
    bridge = TransformerBridge.boot_transformers("tiny-variants-bridge", hf_model=twin, tokenizer=btok)
    bridge.cfg.model_name = "bridged"
    bridge.tokenizer.chat_template = tok.chat_template  # the bridge keeps its own copy of the tokenizer
    cfg = _config(placements=("system",), distances=(1,), conditions=("none", "normal"))
    res = S.run_squish_study(bridge, cfg, instructions=_instructions()[:1], questions=QUESTIONS[:2],
                             work=str(tmp_path / "b"))
    got = res.tables["squish_answers"]
    want, _ = reference
    assert (got.model == "bridged").all() and res.meta["model"]["name"] == "bridged"
    assert set(got.instruction) == {"none", "even"} and sorted(set(got.question)) == [0, 1]
    for row in got.itertuples():
        ref = want[(want.placement == "system") & (want.distance == 1) & (want.condition == row.condition)
                   & (want.instruction == row.instruction) & (want.question == row.question)]
        assert row.answer == ref.answer.item()
    assert res.meta["checkpoint"]["folder"] == str(tmp_path / "b")
    again = S.run_squish_study(bridge, cfg, instructions=_instructions()[:1], questions=QUESTIONS[:2],
                               work=str(tmp_path / "b"), fresh=True, name="given")
    assert again.meta["checkpoint"]["resumed_units"] == 0 and (again.tables["squish_answers"].model == "given").all()


# ----------------------------------------------------------------------------------------------- helpers


def test_prompt_spans_and_template_flags_by_hand(tiny):  # noqa: F811
    _, tok = tiny
    for placement in ("system", "user"):
        for distance in (0, 2):
            inst, question = "Be brief.", "Why?"
            p = S.render_study_prompt(tok, placement, distance, inst, question)
            text, ids, span, q_at = _ref_prompt(tok, placement, distance, inst, question)
            assert (p.text, p.tokens, p.span, p.question_start) == (text, ids, span, q_at)
            assert p.text.endswith("<assistant>")  # add_generation_prompt
    # the instruction at the very start of the text (a template with no role markup) is still found
    bare = type(tok).from_pretrained(tok.name_or_path)
    bare.chat_template = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    p = S.render_study_prompt(bare, "system", 0, "Be brief.", "Why?")
    assert p.span == (0, 9) and p.text == "Be brief.|Why?|"
    # special tokens in the text are read as text, never added
    bare.chat_template = "<|endoftext|>" + bare.chat_template
    p = S.render_study_prompt(bare, "user", 0, "Be brief.", "Why?")
    assert p.tokens == list(p.text.encode()) and p.span == (13, 22)
    # a question that appears twice: the last one is the question's turn
    p = S.render_study_prompt(tok, "user", 1, "Be brief.", FILLER_TURNS[0][0])
    assert p.question_start == len(p.text[:p.text.rfind(FILLER_TURNS[0][0])].encode())
    # an instruction shown twice is refused
    with pytest.raises(S.StudyError, match="exactly once"):
        S.render_study_prompt(tok, "user", 0, "Be brief.", "Be brief.")


def test_common_prefix_keeps_one_token_of_each_row():
    assert S._common_prefix([[1, 2, 3], [1, 2, 4]]) == 2
    assert S._common_prefix([[5, 2, 3], [1, 2, 3], [1, 2, 3]]) == 0
    assert S._common_prefix([[1, 2, 3], [1, 2, 3], [1, 9, 3]]) == 1
    assert S._common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # one row is a prefix of the other: keep its last token
    assert S._common_prefix([[1, 2], [1, 2]]) == 1


def test_mean_nll_kl_and_decoding_by_hand(tiny):  # noqa: F811
    _, tok = tiny
    lp = torch.log(torch.tensor([0.5, 0.25, 0.125]))
    assert S._mean_nll(lp) == pytest.approx((math.log(2) + math.log(4) + math.log(8)) / 3, abs=1e-6)
    assert math.isnan(S._mean_nll(torch.tensor([])))
    p = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    q = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.3, 0.3, 0.4]]))
    want = [sum(a * math.log(a / b) for a, b in zip(pp, qq)) for pp, qq in (([0.7, 0.2, 0.1], [0.2, 0.5, 0.3]),
                                                                           ([0.1, 0.1, 0.8], [0.3, 0.3, 0.4]))]
    assert S._kl(p, q) == pytest.approx(want, abs=1e-6)
    assert S._decode_text(tok, list(b"hi") + [tok.eos_token_id]) == "hi"


def test_persistence_and_adherence_keep_the_first_seen_order_and_mean_over_placements():
    rows = []
    for cond in ("squish:0:qk", "normal"):  # not alphabetical
        for dist in (3, 0):
            for placement, fol in (("user", [1, 1, 0, 0]), ("system", [1, 0, 0, 0])):
                for inst, n in (("b", 4), ("a", 2)):
                    for q in range(n):
                        rows.append(dict(model="m", placement=placement, distance=dist, instruction=inst,
                                         concerned=True, condition=cond, question=q, followed=bool(fol[q]),
                                         acknowledged=False, kl_first=0.0, ref_nll=0.0, span_attention=0.0,
                                         distance_tokens=float(dist)))
    answers = pd.DataFrame(rows)
    r = Result({"squish_answers": answers, "squish_adherence": S._summary(answers)}, {})
    pers = S.persistence(r)
    assert list(zip(pers.condition, pers.distance)) == [("squish:0:qk", 3), ("squish:0:qk", 0), ("normal", 3),
                                                        ("normal", 0)]
    table = S.adherence_table(r)
    # b: user 2/4, system 1/4 -> mean over placements 0.375 (the max would be 0.5); a: user 2/2, system 1/2 -> 0.75
    assert table.loc["b", ("normal", 0)] == pytest.approx((0.5 + 0.25) / 2)
    assert table.loc["a", ("squish:0:qk", 3)] == pytest.approx(0.75)


def test_built_in_questions_by_default(tiny):  # noqa: F811
    """Without `questions`, the first `config.questions` built-in questions, recorded as such."""
    from posprobe.data.questions import BUILTIN_QUESTIONS

    model, tok = tiny
    res = S.run_squish_study(model, _config(placements=("user",), distances=(0,), conditions=("normal",),
                                            max_new_tokens=1), tokenizer=tok, instructions=_instructions()[:1])
    assert res.meta["data"]["source"] == "built-in questions" and res.meta["data"]["n_items"] == 2
    texts = [_ref_prompt(tok, "user", 0, None, q.text)[0] for q in BUILTIN_QUESTIONS[:2]]
    texts += [_ref_prompt(tok, "user", 0, _instructions()[0].text, q.text)[0] for q in BUILTIN_QUESTIONS[:2]]
    assert res.meta["data"]["sha256"] == hashlib.sha256("\n".join(texts).encode()).hexdigest()
    assert len(res.tables["squish_answers"]) == 2
