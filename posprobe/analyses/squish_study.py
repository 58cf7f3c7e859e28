"""The key-squishing study: does an instruction whose keys are squished still steer the model, and more globally?

Every cell is (placement, distance, instruction, condition) over the same questions: the prompt is rendered with the
tokenizer's chat template, the instruction located in it, and the greedy answer scored by the instruction's
checker (no judge model). Measures per answer: followed (the checker), acknowledged (the answer talks about the
instruction), the KL (nats) of the first answer token's distribution from the no-instruction prompt's, the mean
log-prob (nats/token) of the question's reference answer, and the attention (fraction, mean over layers and heads)
the last prompt token pays to the instruction. Per cell: adherence with a Wilson interval and an exact McNemar test
against the normal-position condition on the same questions.

Generation is `core.batch_decode` (plain HF model, shared prefix encoded once under the condition's plan, rows
batched with the model's own KV cache); surgery presets run one prompt at a time through the long-context engine.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch

from posprobe.analyses.configs import SquishStudyConfig, parse_condition
from posprobe.backend.facts import hf_facts
from posprobe.backend.kind import is_bridge
from posprobe.backend.model import hf_model_name, model_name, tokenizer_of, weights_fingerprint
from posprobe.core import long_engine
from posprobe.core.batch_decode import decode_batch, require_decodable
from posprobe.core.presets import preset_pairs
from posprobe.core.stats import mcnemar_exact, wilson_ci
from posprobe.core.surgery import key_squish
from posprobe.data.instructions import Instruction, acknowledges, builtin_instructions, validate_checkers
from posprobe.data.questions import FILLER_TURNS, Question, builtin_questions
from posprobe.report.checkpoint import Checkpoint, run_key
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256

__all__ = ["SquishStudyConfig", "StudyPrompt", "render_study_prompt", "run_squish_study"]


class StudyError(ValueError):
    """A study that cannot run as asked (a placement the template cannot express, an instruction it hides)."""


@dataclass(frozen=True)
class StudyPrompt:
    """A rendered prompt: token ids, the instruction's token span [a, b) (None without one), the first token of
    the question's turn, and the text."""

    tokens: list[int]
    span: tuple[int, int] | None
    question_start: int
    text: str


def _messages(placement: str, distance: int, instruction: str | None, question: str) -> list[dict]:
    filler = [FILLER_TURNS[i % len(FILLER_TURNS)] for i in range(distance)]
    turns: list[dict] = []
    if placement == "system" and instruction is not None:
        turns.append({"role": "system", "content": instruction})
    for n, (user, assistant) in enumerate(filler):
        first = n == 0 and placement == "user" and instruction is not None
        turns += [{"role": "user", "content": f"{instruction}\n{user}" if first else user},
                  {"role": "assistant", "content": assistant}]
    first = not filler and placement == "user" and instruction is not None
    turns.append({"role": "user", "content": f"{instruction}\n{question}" if first else question})
    return turns


def render_study_prompt(tokenizer: Any, placement: str, distance: int, instruction: str | None,
                        question: str) -> StudyPrompt:
    """The prompt for one cell through the tokenizer's chat template: the instruction as the system message or at
    the start of the first user turn, `distance` filler turns (user + assistant) before the question. Raises
    StudyError where the template cannot express the placement or does not show the instruction verbatim."""
    if not getattr(tokenizer, "chat_template", None):
        raise StudyError("the squish study needs a chat model: this tokenizer has no chat template")
    msgs = _messages(placement, distance, instruction, question)
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja raises its own TemplateError for roles a template refuses
        raise StudyError(f"the chat template cannot express placement {placement!r} ({e})") from e
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = enc["offset_mapping"]

    def tokens_of(lo: int, hi: int) -> list[int]:
        return [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]

    span = None
    if instruction is not None:
        at = text.find(instruction)
        if at < 0 or text.find(instruction, at + 1) >= 0:
            raise StudyError(f"the chat template does not show the instruction {instruction!r} exactly once "
                             f"(placement {placement!r})")
        idx = tokens_of(at, at + len(instruction))
        span = (idx[0], idx[-1] + 1)
    q_at = text.rfind(question)
    if q_at < 0:
        raise StudyError(f"the chat template does not show the question {question!r} verbatim")
    return StudyPrompt(list(enc["input_ids"]), span, tokens_of(q_at, q_at + len(question))[0], text)


def _common_prefix(rows: Sequence[list[int]]) -> int:
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return n - 1  # keep one token of each row after the prefix


def _decode_text(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def _unit(placement: str, distance: int, instruction: str, condition: str) -> str:
    return f"{placement}|{distance}|{instruction}|{condition}"


@torch.no_grad()
def _run_cell(hf: Any, tok: Any, prompts: list[StudyPrompt], cond: dict, questions: list[Question],
              cfg: SquishStudyConfig) -> dict:
    """Answers and per-answer measures of one cell (one instruction or none, one condition, every question)."""
    stop = tok.eos_token_id
    refs = [torch.tensor(tok(q.reference, add_special_tokens=False)["input_ids"]) for q in questions]
    if cond["kind"] == "preset":
        rule = preset_pairs(cond["preset"])
        answers, ref_nll = [], []
        for p, ref in zip(prompts, refs):
            ids = torch.tensor(p.tokens)
            answers.append(long_engine.greedy_decode(hf, ids, rule, cfg.max_new_tokens, stop_token=stop).tolist())
            nll = long_engine.token_nll(hf, torch.cat([ids, ref]), rule)
            ref_nll.append(_mean_nll(-nll[len(p.tokens) - 1:]))
        return {"answers": answers, "ref_nll": ref_nll, "first_logprobs": None, "span_attention": None}
    c = _common_prefix([p.tokens for p in prompts])
    span = prompts[0].span
    if span is not None and (span[1] > c or any(p.span != span for p in prompts)):
        raise StudyError("the instruction's tokens differ between questions (the tokenizer merges them with what "
                         "follows): cannot share its encoding")
    prefix = torch.tensor(prompts[0].tokens[:c])
    rests = [torch.tensor(p.tokens[c:]) for p in prompts]
    plan = None
    if cond["kind"] == "squish":
        assert span is not None
        plan = key_squish(c, span, to=cond["to"], range_=cond["range_"], variant=cond["variant"],
                          query_start=float(span[1]) + cond["moved"])
    out = decode_batch(hf, prefix, rests, plan=plan, max_new_tokens=cfg.max_new_tokens, stop_token=stop,
                       references=refs, attend_span=span, batch_size=cfg.batch_size)
    return {"answers": out.tokens, "ref_nll": [_mean_nll(lp) for lp in out.reference_logprobs or []],
            "first_logprobs": out.first_logprobs.half(), "span_attention": out.span_attention}


def _mean_nll(logprobs: torch.Tensor) -> float:
    # A question without a reference answer (a user's plain-text file) has no loss to report.
    return float(-logprobs.mean()) if logprobs.numel() else float("nan")


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> list[float]:
    """KL(p || q) per row in nats, from log-probabilities."""
    p_log, q_log = p_log.float(), q_log.float()
    return (p_log.exp() * (p_log - q_log)).sum(-1).tolist()


def _summary(answers: pd.DataFrame) -> pd.DataFrame:
    rows = []
    keys = ["model", "placement", "distance", "instruction", "concerned", "condition"]
    normal = answers[answers.condition == "normal"].set_index(["placement", "distance", "instruction", "question"])
    for key, part in answers.groupby(keys, sort=False):
        k = part.followed.sum()
        lo, hi = wilson_ci(int(k), len(part))
        row = dict(zip(keys, key), n=len(part), adherence=k / len(part), ci_low=lo, ci_high=hi,
                   acknowledged=part.acknowledged.mean(), kl_first=part.kl_first.mean(), ref_nll=part.ref_nll.mean(),
                   span_attention=part.span_attention.mean(), distance_tokens=part.distance_tokens.mean())
        p = float("nan")
        if key[5] not in ("normal", "none"):
            base = normal.loc[[(key[1], key[2], key[3], q) for q in part.question]].followed.to_numpy()
            now = part.followed.to_numpy()
            # Discordant pairs on the same questions: followed normally but not here (b), and the reverse (c).
            p = mcnemar_exact(int((base & ~now).sum()), int((~base & now).sum()))
        row["p_vs_normal"] = p
        rows.append(row)
    return pd.DataFrame(rows)


def run_squish_study(model: Any, config: SquishStudyConfig | None = None, *, tokenizer: Any = None,
                     instructions: Sequence[Instruction] | None = None, questions: Sequence[Question] | None = None,
                     name: str | None = None, work: str | None = None, fresh: bool = False) -> Result:
    """The squish study: instructions followed or not, per placement, distance and condition.

    Every prompt is rendered, every instruction located and every checker tried before the first forward.

    Args:
        model: a plain HF chat model with its `tokenizer`, or a TransformerBridge (its HF model runs).
        config: the analysis's options (None: its Config's defaults).
        tokenizer: the tokenizer of a plain HF `model` (required there); for a bridge it defaults to the
            bridge's.
        instructions: the instructions tested (default: the built-in suite; `config.instructions` picks by name).
        questions: the questions asked (default: the first `config.questions` built-in ones).
        name: the model's name in the tables (default: the model's own).
        work: a folder keeping each finished cell; calling again resumes with the same tables (None: no
            checkpoint).
        fresh: discard what `work` holds and start again.

    Returns:
        A Result with tables `squish_answers` (one row per question x placement x distance x instruction x
            condition: the answer, followed, acknowledged, kl_first in nats, ref_nll in nats/token,
            span_attention as a fraction, and `concerned`: False where a topic instruction meets a question of
            another topic, whose `followed` then counts a leak) and `squish_adherence` (per cell, concerned and
            unconcerned questions apart: adherence with a 95 % Wilson interval, the exact McNemar p against
            `normal`, and the cell means).

    Examples:
        >>> import posprobe as pp
        >>> model = pp.load_model("tiny-rope")  # random weights; a chat template makes the byte tokenizer a chat one
        >>> model.tokenizer.chat_template = "{% for m in messages %}<{{m.role}}>{{m.content}}{% endfor %}<assistant>"
        >>> cfg = pp.SquishStudyConfig(questions=2, placements=("user",), distances=(0,),
        ...                            conditions=("normal", "squish:0"), max_new_tokens=2, progress=False)
        >>> result = pp.run_squish_study(model, cfg)
        >>> sorted(result.tables)
        ['squish_adherence', 'squish_answers']
        >>> sorted(result.tables["squish_adherence"].condition.unique())
        ['normal', 'squish:0']
    """
    cfg = config or SquishStudyConfig()
    if is_bridge(model):
        from posprobe.backend.fast_attention import hf_model_inside

        with hf_model_inside(model) as hf:
            return run_squish_study(hf, cfg, tokenizer=tokenizer or tokenizer_of(model), instructions=instructions,
                                    questions=questions, name=name or model_name(model), work=work, fresh=fresh)
    if tokenizer is None:
        raise ValueError("give the tokenizer (run_squish_study(model, config, tokenizer=...))")
    hf, tok = model, tokenizer
    insts = list(instructions) if instructions is not None else builtin_instructions(cfg.instructions)
    qs = list(questions) if questions is not None else builtin_questions(cfg.questions)
    if not insts or not qs:
        raise ValueError("the study needs at least one instruction and one question")
    validate_checkers(insts)
    conds = [parse_condition(c) for c in cfg.conditions]
    require_decodable(hf)
    for c in conds:
        if c["kind"] == "preset":
            preset_pairs(c["preset"])
    name = name or hf_model_name(hf)
    cells, prompts = _plan(tok, cfg, insts, conds, qs)
    texts = "\n".join(p.text for ps in prompts.values() for p in ps)
    data = data_meta("built-in questions" if questions is None else "questions", n_items=len(qs), unit="questions",
                     sha256=text_sha256(texts))
    facts = hf_facts(hf, name)
    key_extra = {"instructions": [(i.name, i.text) for i in insts]}
    ckpt = Checkpoint(work, run_key("squish-study", model={"facts": facts.summary(),
                                                            "weights": weights_fingerprint(hf)},
                                    data=data, config=cfg, **key_extra), fresh=fresh)
    units = [_unit(p, d, i.name if i else "", c["name"]) for p, d, i, c in cells]
    done = ckpt.announce(units, "squish-study", "cells")
    if cfg.progress:
        print(f"squish-study: {len(units)} cells (placement x distance x instruction x condition) of {len(qs)} "
              f"prompts, {cfg.max_new_tokens} greedy tokens each", file=sys.stderr)
    start, computed = time.perf_counter(), 0
    results: dict[str, dict] = {}
    for (placement, distance, inst, c), unit in zip(cells, units):
        fresh_cell = not ckpt.has(unit)
        ps = prompts[(placement, distance, inst.name if inst else "")]
        results[unit] = ckpt.compute(unit, lambda: _run_cell(hf, tok, ps, c, qs, cfg))
        if fresh_cell:
            done, computed = done + 1, computed + 1
            if cfg.progress:
                left = (time.perf_counter() - start) / computed * (len(units) - done)
                print(f"\rsquish-study: {placement}, {distance} turns, {inst.name if inst else '-'}, {c['name']}: "
                      f"cell {done}/{len(units)}, ETA {left:.0f} s   ", end="" if done < len(units) else "\n",
                      file=sys.stderr)
    answers = _answers(results, cells, units, prompts, qs, tok, name, cfg)
    scored = pd.concat([answers[answers.condition != "none"], *_by_chance(answers, insts, qs, cfg)],
                       ignore_index=True)
    summary = _summary(scored)
    cfg_meta = asdict(cfg)
    meta = make_meta(
        "squish-study", model=facts.summary(), data=data, config=cfg_meta,
        instructions={i.name: i.text for i in insts}, conditions={c["name"]: c for c in conds},
        measures={"followed": "the instruction's checker on the greedy answer",
                  "acknowledged": "the answer mentions the instruction (its `mentions` phrases)",
                  "kl_first": "KL(no instruction || condition) of the first answer token's distribution, nats",
                  "ref_nll": "mean NLL of the question's reference answer after the prompt, nats/token",
                  "span_attention": "attention of the last prompt token to the instruction's tokens, mean over "
                                    "layers and heads (fraction)",
                  "ci": "95 % Wilson interval of the adherence (0/1 answers)",
                  "p_vs_normal": "exact McNemar test on the same questions against the normal condition"},
        checkpoint={"folder": str(work) if work is not None else None, "resumed_units": ckpt.resumed})
    return Result({"squish_answers": answers, "squish_adherence": summary}, meta)


def _plan(tok: Any, cfg: SquishStudyConfig, insts: list[Instruction], conds: list[dict], qs: list[Question]
          ) -> tuple[list[tuple[str, int, Instruction | None, dict]], dict[tuple[str, int, str], list[StudyPrompt]]]:
    """(the study's cells: placement x distance x instruction x condition, None where the condition has no
    instruction; every prompt rendered, by placement, distance and instruction name, "" for none)."""
    cells: list[tuple[str, int, Instruction | None, dict]] = []
    prompts: dict[tuple[str, int, str], list[StudyPrompt]] = {}
    for placement in cfg.placements:
        for distance in cfg.distances:
            prompts[(placement, distance, "")] = [render_study_prompt(tok, placement, distance, None, q.text)
                                                 for q in qs]
            for inst in insts:
                prompts[(placement, distance, inst.name)] = [
                    render_study_prompt(tok, placement, distance, inst.text, q.text) for q in qs]
            for c in conds:
                targets: list[Instruction | None] = [None] if c["kind"] == "none" else list(insts)
                cells += [(placement, distance, inst, c) for inst in targets]
    return cells, prompts


def _answers(results: dict[str, dict], cells: list, units: list[str], prompts: dict, qs: list[Question], tok: Any,
             name: str, cfg: SquishStudyConfig) -> pd.DataFrame:
    """One row per question of every cell: the decoded answer and the measures (the `squish_answers` table)."""
    rows = []
    for (placement, distance, inst, c), unit in zip(cells, units):
        got = results[unit]
        none = results[_unit(placement, distance, "", "none")] if "none" in cfg.conditions else None
        ps = prompts[(placement, distance, inst.name if inst else "")]
        kl = ([float("nan")] * len(qs) if none is None or got["first_logprobs"] is None
              or none["first_logprobs"] is None else _kl(none["first_logprobs"], got["first_logprobs"]))
        for qi, (q, p, ans) in enumerate(zip(qs, ps, got["answers"])):
            text = _decode_text(tok, ans)
            rows.append(dict(
                model=name, placement=placement, distance=distance,
                distance_tokens=(p.question_start - p.span[1]) if p.span else float("nan"),
                instruction=inst.name if inst else "none", condition=c["name"], question=qi,
                concerned=inst is None or inst.topic is None or q.topic == inst.topic, answer=text,
                followed=bool(inst.check(text)) if inst else False,
                acknowledged=bool(acknowledges(inst, text)) if inst else False, kl_first=kl[qi],
                ref_nll=got["ref_nll"][qi],
                span_attention=got["span_attention"][qi] if got["span_attention"] is not None else float("nan"),
                n_answer_tokens=len(ans)))
    return pd.DataFrame(rows)


def _by_chance(answers: pd.DataFrame, insts: list[Instruction], qs: list[Question], cfg: SquishStudyConfig
               ) -> list[pd.DataFrame]:
    """The no-instruction answers scored by each instruction's checker: how often an answer "follows" by chance
    (one frame per instruction; none without the `none` condition)."""
    base_rows = []
    if "none" in cfg.conditions:
        for inst in insts:
            part = answers[answers.condition == "none"].copy()
            part["instruction"] = inst.name
            part["followed"] = [bool(inst.check(a)) for a in part.answer]
            part["acknowledged"] = [bool(acknowledges(inst, a)) for a in part.answer]
            part["concerned"] = [inst.topic is None or q.topic == inst.topic for q in (qs[i] for i in part.question)]
            base_rows.append(part)
    return base_rows


def adherence_table(result: Result) -> pd.DataFrame:
    """Adherence (0..1) per instruction x condition at each distance, the mean of the placements' cells, over the
    questions each instruction concerns (a topic instruction's leak onto other questions is not adherence; see
    the report's leak table): the study's headline table, rows instruction, columns (condition, distance)."""
    df = result.tables["squish_adherence"]
    df = df[df.concerned]
    return df.pivot_table(index="instruction", columns=["condition", "distance"], values="adherence",
                          aggfunc="mean")


def persistence(result: Result) -> pd.DataFrame:
    """Adherence (0..1) vs distance (filler turns) per condition, pooled over instructions and placements, over the
    questions each instruction concerns (leaks are not adherence), with Wilson intervals over all pooled answers;
    `distance_tokens`: the mean count of tokens between the instruction's last token and the question's first."""
    df = result.tables["squish_answers"]
    df = df[(df.condition != "none") & df.concerned]
    rows = []
    for (cond, dist), part in df.groupby(["condition", "distance"], sort=False):
        k = int(part.followed.sum())
        lo, hi = wilson_ci(k, len(part))
        rows.append(dict(condition=cond, distance=dist, distance_tokens=float(np.nanmean(part.distance_tokens)),
                         n=len(part), adherence=k / len(part), ci_low=lo, ci_high=hi))
    return pd.DataFrame(rows)
