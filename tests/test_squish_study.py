"""The key-squishing study (posprobe.analyses.squish_study): prompts through the chat template, answers equal to
independent generation (HF `generate` for normal positions; the TransformerLens-hook path one prompt at a time for
squished keys), per-cell statistics against scipy, resume, and bad input refused before any forward.

Tolerances: answers are compared as token ids / decoded text exactly (greedy decoding)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from posprobe.analyses import squish_study as S
from posprobe.analyses.configs import SquishStudyConfig
from posprobe.data.instructions import builtin_instructions, custom_instruction
from posprobe.data.questions import Question
from posprobe.report.checkpoint import CheckpointMismatch

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
NO_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
             "<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")


@pytest.fixture(scope="module")
def tiny_chat():
    """A random tiny Llama over bytes with a chat template: the study's plumbing, in a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posprobe.backend.tiny import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=259, max_position_embeddings=4096, bos_token_id=256,
                      eos_token_id=257, pad_token_id=258)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
    model.posprobe_name = "tiny-chat"
    return model, tok


QUESTIONS = [Question("Why is the sea salty?", "Rivers carry dissolved salts into it."),
             Question("What do bees make?", "Honey."),
             Question("How many legs has a spider?", "Eight.")]
SMALL = dict(instructions=("french",), questions=3, distances=(0, 1), max_new_tokens=4, progress=False,
             conditions=("none", "normal", "squish:0", "moved:30:keys"))


def test_prompt_places_the_instruction(smollm2):
    tok = smollm2.tokenizer
    for placement in ("system", "user"):
        near = S.render_study_prompt(tok, placement, 0, "Answer in French.", "Why is the sea salty?")
        far = S.render_study_prompt(tok, placement, 3, "Answer in French.", "Why is the sea salty?")
        for p in (near, far):
            a, b = p.span
            assert tok.decode(p.tokens[a:b]).strip() == "Answer in French."
            assert tok.decode(p.tokens[p.question_start:]).startswith("Why is the sea salty?")
        assert far.question_start - far.span[1] > near.question_start - near.span[1] + 60  # three turns between
    none = S.render_study_prompt(tok, "system", 0, None, "Why is the sea salty?")
    assert none.span is None and "Answer in French." not in none.text


def test_placement_the_template_cannot_express(tiny_chat):
    _, tok = tiny_chat
    bare = type(tok).from_pretrained(tok.name_or_path)
    bare.chat_template = NO_SYSTEM
    with pytest.raises(S.StudyError, match="cannot express placement 'system'"):
        S.render_study_prompt(bare, "system", 0, "Be brief.", "Why?")
    bare.chat_template = TEMPLATE.replace("{{ m.content }}", "{{ m.content | lower }}")
    with pytest.raises(S.StudyError, match="does not show the instruction"):
        S.render_study_prompt(bare, "user", 0, "Be BRIEF.", "why?")
    bare.chat_template = None
    with pytest.raises(S.StudyError, match="no chat template"):
        S.render_study_prompt(bare, "user", 0, "Be brief.", "Why?")


def test_bad_input_refused_before_any_forward(tiny_chat, monkeypatch):
    model, tok = tiny_chat

    def boom(*a, **k):
        raise AssertionError("a forward ran before the input was checked")

    monkeypatch.setattr(S, "decode_batch", boom)
    bad = custom_instruction("crashes", "Say hi.", lambda answer: answer[0] == "H")  # IndexError on ""
    with pytest.raises(ValueError, match="crashes"):
        S.run_squish_study(model, SquishStudyConfig(**SMALL), tokenizer=tok, instructions=[bad], questions=QUESTIONS)
    not_bool = custom_instruction("counts", "Say hi.", lambda answer: len(answer))
    with pytest.raises(ValueError, match="counts"):
        S.run_squish_study(model, SquishStudyConfig(**SMALL), tokenizer=tok, instructions=[not_bool],
                           questions=QUESTIONS)
    with pytest.raises(ValueError, match="at least one"):
        S.run_squish_study(model, SquishStudyConfig(**SMALL), tokenizer=tok, questions=[])
    with pytest.raises(ValueError, match="unknown study condition"):
        SquishStudyConfig(conditions=("normal", "squash:0"))
    with pytest.raises(ValueError, match="must include 'normal'"):
        SquishStudyConfig(conditions=("none", "squish:0"))


def test_resume_gives_the_same_tables(tiny_chat, tmp_path):
    model, tok = tiny_chat
    cfg = SquishStudyConfig(**SMALL)
    work = tmp_path / "w"
    first = S.run_squish_study(model, cfg, tokenizer=tok, questions=QUESTIONS, work=str(work))
    units = sorted((work / "units").iterdir())
    assert len(units) == 2 * (1 + 3)  # distances x (none + 3 conditions x 1 instruction)
    units[0].unlink()  # as if killed before that cell finished
    again = S.run_squish_study(model, cfg, tokenizer=tok, questions=QUESTIONS, work=str(work))
    assert again.meta["checkpoint"]["resumed_units"] == len(units) - 1
    for name in first.tables:
        pd.testing.assert_frame_equal(first.tables[name], again.tables[name])
    with pytest.raises(CheckpointMismatch, match="max_new_tokens"):
        S.run_squish_study(model, SquishStudyConfig(**{**SMALL, "max_new_tokens": 5}), tokenizer=tok,
                           questions=QUESTIONS, work=str(work))


def test_answers_equal_independent_generation(smollm2):
    """Normal positions: HF's own `generate` on a freshly loaded model, one prompt at a time. Squished keys (cache
    and keys variants, queries moved out): posprobe's TL-hook generation over the full prompt, one at a time."""
    from posprobe.backend.loading import load_hf_model
    from posprobe.core.generation import generate
    from posprobe.core.surgery import key_squish

    tok = smollm2.tokenizer
    questions = [Question("Why is the sea salty?", "Rivers carry salt."), Question("What do bees make?", "Honey.")]
    cfg = SquishStudyConfig(**{**SMALL, "max_new_tokens": 8, "distances": (0,)})
    result = S.run_squish_study(smollm2, cfg, questions=questions)
    answers = result.tables["squish_answers"]
    hf, _ = load_hf_model("smollm2")
    inst = builtin_instructions(["french"])[0]
    for row in answers.itertuples():
        q = questions[row.question].text
        p = S.render_study_prompt(tok, row.placement, row.distance, None if row.condition == "none" else inst.text, q)
        ids = torch.tensor(p.tokens)
        if row.condition in ("none", "normal"):
            out = hf.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                              max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.eos_token_id)[0, ids.numel():]
        else:
            variant = "keys" if row.condition.endswith(":keys") else "cache"
            moved = 30.0 if row.condition.startswith("moved") else 0.0
            plan = key_squish(ids.numel(), p.span, to=0.0, variant=variant, query_start=p.span[1] + moved)
            out = generate(smollm2, ids, max_new_tokens=8, plan=plan, stop_token=tok.eos_token_id).new_tokens[0]
        want = out.tolist()
        if tok.eos_token_id in want:
            want = want[:want.index(tok.eos_token_id) + 1]
        assert row.answer == tok.decode(want, skip_special_tokens=True), (row.condition, row.question)
        assert row.n_answer_tokens == len(want)
    by = answers.groupby("condition").answer.apply(list)
    assert by["normal"] != by["none"]  # the instruction changed the answers: the comparison is not vacuous


def test_cell_statistics_against_scipy():
    from scipy.stats import binomtest

    rows = []
    normal = [1, 1, 1, 1, 1, 0, 1, 0]
    squished = [0, 0, 0, 0, 1, 0, 1, 1]
    for cond, fol in (("normal", normal), ("squish:0", squished)):
        for q, f in enumerate(fol):
            rows.append(dict(model="m", placement="system", distance=0, instruction="x", concerned=True,
                             condition=cond, question=q,
                             followed=bool(f), acknowledged=False, kl_first=0.1 * q, ref_nll=1.0, span_attention=0.5,
                             distance_tokens=5.0))
    summary = S._summary(pd.DataFrame(rows)).set_index("condition")
    sq = summary.loc["squish:0"]
    assert sq.adherence == 3 / 8 and sq.n == 8
    ci = binomtest(3, 8).proportion_ci(method="wilson")
    assert (sq.ci_low, sq.ci_high) == pytest.approx((ci.low, ci.high), abs=1e-9)
    # Discordant pairs on the same questions: normal-only 4 (q0-q3), squished-only 1 (q7).
    assert sq.p_vs_normal == pytest.approx(binomtest(1, 5, 0.5).pvalue)
    assert summary.loc["squish:0"].kl_first == pytest.approx(0.35)


def test_topic_instruction_marks_unconcerned_questions(tiny_chat):
    model, tok = tiny_chat
    qs = [Question("Why is bread crusty?", "Heat.", "cooking"), Question("Why is the sea salty?", "Rivers.")]
    inst = custom_instruction("cook_x", "On cooking questions, say x.", lambda a: "x" in a, topic="cooking")
    cfg = SquishStudyConfig(**{**SMALL, "distances": (0,), "conditions": ("none", "normal")})
    r = S.run_squish_study(model, cfg, tokenizer=tok, instructions=[inst], questions=qs)
    ans = r.tables["squish_answers"]
    normal = ans[ans.condition == "normal"].set_index("question")
    assert normal.concerned.tolist() == [True, False]
    cells = r.tables["squish_adherence"]
    assert sorted(cells[cells.condition == "normal"].concerned.tolist()) == [False, True]
    assert (cells.n == 1).all()


def test_summary_names_placement_and_leak_of_each_significant_cell():
    from posprobe.report.result import Result
    from posprobe.report.squish_study import summary_text

    rows = []
    for placement in ("system", "user"):
        for concerned in (True, False):
            for cond, fol in (("normal", [1] * 8), ("squish:0:keys", [0] * 8)):
                rows += [dict(model="m", placement=placement, distance=0, instruction="x", concerned=concerned,
                              condition=cond, question=q, followed=bool(f), acknowledged=False, kl_first=0.0,
                              ref_nll=1.0, span_attention=0.5, distance_tokens=5.0)
                         for q, f in enumerate(fol, start=0 if concerned else 8)]  # a question is one or the other
    answers = pd.DataFrame(rows)
    r = Result({"squish_answers": answers, "squish_adherence": S._summary(answers)},
               {"instructions": {"x": "X."}, "config": {"conditions": ["normal", "squish:0:keys"]}})
    line = next(x for x in summary_text(r).split("\n") if x.startswith("differs"))
    p = "p = 0.008"  # 8 discordant pairs all one way: 2 * 0.5**8
    for tag in ("system", "system, leak", "user", "user, leak"):
        assert f"x squish:0:keys ({tag}) at 0 turns (0.00 vs 1.00 normal, {p})" in line
    assert line.count("squish:0:keys") == 4
