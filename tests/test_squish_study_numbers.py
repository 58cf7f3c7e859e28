"""The squish study's numbers, each against a computation written out here from something the study does not
compute: the first-token KL and the reference answer's loss from plain Hugging Face logits, the tokens between the
instruction and the question from the rendered text, and the two summary tables (`adherence_table`,
`persistence`) from the per-answer rows with numpy.

Each test names in its docstring the planted bug it was seen to catch. Tolerances: the study keeps first-token
log-probs in float16 (KL to 5e-4 nats; measured up to 3.4e-4); losses in float32 to 1e-4; counts and fractions
exactly (1e-12)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from test_squish_variants import tiny  # noqa: F401  (the seeded tiny chat Llama fixture)

from posprobe.analyses import squish_study as S
from posprobe.analyses.configs import SquishStudyConfig
from posprobe.data.instructions import custom_instruction
from posprobe.data.questions import Question
from posprobe.report.result import Result

QUESTIONS = [Question("Why is bread crusty?", "Heat dries it.", "cooking"),
             Question("Why is the sea salty?", "Rivers carry salt."),
             Question("What do bees make?", "Honey.")]


def _instructions():
    # Checkers that random bytes pass about half the time, so adherence is neither 0 nor 1; one topic instruction.
    return [custom_instruction("even", "Answer in an even number of letters.", lambda a: len(a) % 2 == 0),
            custom_instruction("cook3", "On cooking questions, use a multiple of three letters.",
                               lambda a: len(a) % 3 == 0, topic="cooking")]


@pytest.fixture(scope="module")
def study(tiny):  # noqa: F811
    model, tok = tiny
    cfg = SquishStudyConfig(questions=3, placements=("system", "user"), distances=(0, 1), max_new_tokens=4,
                            progress=False, conditions=("none", "normal", "squish:0:qk"))
    return S.run_squish_study(model, cfg, tokenizer=tok, instructions=_instructions(), questions=QUESTIONS)


def _hf_logits(model, tokens: list[int], span: tuple[int, int] | None, condition: str) -> np.ndarray:
    """float64 logits of every position from a plain HF forward; "squish:0:qk": position_ids 0 on the span."""
    pos = torch.arange(len(tokens))
    if condition == "squish:0:qk":
        pos[span[0]:span[1]] = 0
    with torch.no_grad():
        out = model(torch.tensor(tokens)[None], position_ids=pos[None]).logits[0]
    return out.double().numpy()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _prompt(tok, row, inst_text: str | None):
    return S.render_study_prompt(tok, row.placement, row.distance, inst_text, QUESTIONS[row.question].text)


def test_kl_first_is_kl_from_no_instruction(study, tiny):  # noqa: F811
    """kl_first = KL(no instruction || condition) = sum_v p_none(v) (log p_none(v) - log p_cond(v)) of the first
    answer token, as the docstring, meta and README promise. Catches: KL reversed (KL(condition || none))."""
    model, tok = tiny
    texts = {i.name: i.text for i in _instructions()}
    answers = study.tables["squish_answers"]
    rows = answers[answers.condition.isin(["normal", "squish:0:qk"])]
    gaps = []
    for row in rows.itertuples():
        none = _prompt(tok, row, None)
        cond = _prompt(tok, row, texts[row.instruction])
        p = _log_softmax(_hf_logits(model, none.tokens, None, "none")[-1])
        q = _log_softmax(_hf_logits(model, cond.tokens, cond.span, row.condition)[-1])
        forward, reverse = float((np.exp(p) * (p - q)).sum()), float((np.exp(q) * (q - p)).sum())
        assert row.kl_first == pytest.approx(forward, abs=5e-4), (row.condition, row.placement, row.question)
        gaps.append(abs(forward - reverse))
    # Not vacuous: on several rows the two directions differ by more than twice the tolerance (up to ~0.009 here).
    assert len(gaps) == 2 * 2 * 2 * 2 * 3 and sum(g > 1e-3 for g in gaps) >= 3


def test_ref_nll_is_mean_cross_entropy_of_the_reference(study, tiny):  # noqa: F811
    """ref_nll = mean over the reference answer's tokens of -log p(token | prompt, earlier reference tokens), nats
    per token, cross-entropy written out from HF logits. Catches: the sum over tokens instead of the mean."""
    model, tok = tiny
    texts = {i.name: i.text for i in _instructions()}
    answers = study.tables["squish_answers"]
    checked = 0
    for row in answers.itertuples():
        inst = None if row.condition == "none" else texts[row.instruction]
        p = _prompt(tok, row, inst)
        ref = list(QUESTIONS[row.question].reference.encode("utf-8"))  # the byte tokenizer: one token per byte
        assert tok(QUESTIONS[row.question].reference, add_special_tokens=False)["input_ids"] == ref
        logits = _hf_logits(model, p.tokens + ref, p.span, row.condition)
        n = len(p.tokens)
        steps = logits[n - 1:n - 1 + len(ref)]
        m = steps.max(-1)
        ce = m + np.log(np.exp(steps - m[:, None]).sum(-1)) - steps[np.arange(len(ref)), ref]
        assert row.ref_nll == pytest.approx(float(ce.mean()), abs=1e-4), (row.condition, row.question)
        checked += 1
    assert checked == len(answers) > 0 and len({len(q.reference) for q in QUESTIONS}) > 1


def test_distance_tokens_counted_from_the_text(study, tiny):  # noqa: F811
    """distance_tokens = tokens strictly between the instruction's last token and the question's first, counted
    here from the rendered text (the byte tokenizer: one token per UTF-8 byte of the text between the two);
    persistence's distance_tokens column is their mean per (condition, distance). Catches: the count taken from
    the instruction's start (span[0] for span[1]), one token too many (+1)."""
    _, tok = tiny
    texts = {i.name: i.text for i in _instructions()}
    answers = study.tables["squish_answers"]
    want = []
    for row in answers.itertuples():
        if row.condition == "none":
            assert math.isnan(row.distance_tokens)
            want.append(float("nan"))
            continue
        text = _prompt(tok, row, texts[row.instruction]).text
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == len(text.encode("utf-8"))
        end = text.find(texts[row.instruction]) + len(texts[row.instruction])
        between = text[end:text.rfind(QUESTIONS[row.question].text)]
        want.append(float(len(between.encode("utf-8"))))
    np.testing.assert_array_equal(answers.distance_tokens.to_numpy(), np.array(want))
    # The system placement has "</system><user>" between (15 bytes); one filler turn adds its two messages.
    assert {w for w in want if w == w} > {15.0}
    pers = S.persistence(study).set_index(["condition", "distance"])
    for (cond, dist), got in pers.distance_tokens.items():
        part = [w for w, r in zip(want, answers.itertuples()) if r.condition == cond and r.distance == dist
                and r.concerned]
        assert got == pytest.approx(sum(part) / len(part), abs=1e-12)


def _random_answers(seed: int = 0) -> pd.DataFrame:
    """Per-answer rows of a made-up study: 2 placements x 2 distances x 2 instructions (one topic) x 3 conditions,
    cells of unequal size (equal across conditions), followed drawn at random."""
    rng = np.random.default_rng(seed)
    rows = []
    for placement in ("system", "user"):
        for distance in (0, 2):
            for inst in ("a", "topic"):
                n = int(rng.integers(5, 12))  # the same questions under every condition (the paired test's)
                for cond in ("normal", "squish:0", "squish:0:qk"):
                    for q in range(n):
                        concerned = inst == "a" or q % 3 == 0
                        rows.append(dict(model="m", placement=placement, distance=distance, instruction=inst,
                                         concerned=concerned, condition=cond, question=q,
                                         followed=bool(rng.random() < 0.5), acknowledged=bool(rng.random() < 0.3),
                                         kl_first=float(rng.random()), ref_nll=float(rng.random()),
                                         span_attention=float(rng.random()),
                                         distance_tokens=float(3 + 20 * distance + (placement == "user")
                                                               + rng.integers(0, 3))))
    return pd.DataFrame(rows)


def _wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return centre - half, centre + half


def test_persistence_by_hand():
    """persistence: per (condition, distance), pooled over instructions and placements, the concerned answers only:
    n, adherence = followed / n, the 95 % Wilson interval (formula written out), the mean distance_tokens.
    Catches (each planted and seen failing): leaks (unconcerned answers) counted as adherence, the interval on
    n + 1 answers, the median distance_tokens instead of the mean."""
    answers = _random_answers()
    got = S.persistence(Result({"squish_answers": answers, "squish_adherence": S._summary(answers)}, {}))
    assert len(got) == 3 * 2
    for r in got.itertuples():
        mine = [x for x in answers.itertuples() if x.condition == r.condition and x.distance == r.distance
                and x.concerned]
        k, n = sum(x.followed for x in mine), len(mine)
        assert r.n == n and r.adherence == pytest.approx(k / n, abs=1e-12)
        assert (r.ci_low, r.ci_high) == pytest.approx(_wilson(k, n), abs=1e-12)
        assert r.distance_tokens == pytest.approx(np.mean([x.distance_tokens for x in mine]), abs=1e-12)
    # Not vacuous: cells differ in size, so a mean of cell fractions differs from the pooled fraction somewhere.
    assert answers.groupby(["placement", "distance", "instruction", "condition"]).size().nunique() > 1


def test_adherence_table_by_hand():
    """adherence_table: rows instruction, columns (condition, distance), value = the mean over placements of each
    cell's adherence (followed / answers over the questions the instruction concerns), computed here from the
    per-answer rows. Catches (each planted and seen failing): concerned and leak cells averaged together, the max
    over placements instead of the mean, columns by placement (pooled over distances)."""
    answers = _random_answers(1)
    got = S.adherence_table(Result({"squish_answers": answers, "squish_adherence": S._summary(answers)}, {}))
    assert sorted(got.index) == ["a", "topic"]
    assert sorted(got.columns) == sorted((c, d) for c in ("normal", "squish:0", "squish:0:qk") for d in (0, 2))
    for inst in ("a", "topic"):
        for cond in ("normal", "squish:0", "squish:0:qk"):
            for dist in (0, 2):
                per_placement = []
                for placement in ("system", "user"):
                    cell = [x.followed for x in answers.itertuples() if x.instruction == inst
                            and x.condition == cond and x.distance == dist and x.placement == placement
                            and x.concerned]
                    per_placement.append(sum(cell) / len(cell))
                assert got.loc[inst, (cond, dist)] == pytest.approx(np.mean(per_placement), abs=1e-12)
