"""Needle-in-a-haystack prompts at exact token lengths, from a model's own tokenizer and a seed, and their scoring.

Tasks follow RULER's NIAH variants (Hsieh et al. 2024; names as in their task list) and the key-value retrieval task
of "Lost in the Middle" (Liu et al. 2023): a needle "One of the special magic numbers for <key> is: <value>." hidden
in a haystack (`noise`: the passkey filler; `text`: sentences of a given text; `needles`: other needles only), and
a question asking for the values of one or more keys. Scoring is RULER's `string_match_all`: the fraction of the
expected values found in the answer, case-insensitive; no judge model. Pieces are tokenised separately (needles and
haystack sentences keep their own token boundaries) and the haystack is cut to make the prompt exactly `length`
tokens. Torch-free.
"""

from __future__ import annotations

import json
import random
import re
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["NeedleTask", "NeedlePrompt", "Needle", "TASKS", "needle_prompt", "string_match_all", "task_names",
           "PASSKEY", "SHORT_PASSKEY", "PasskeyFormat", "PasskeyPrompt", "passkey_at", "passkey_filler",
           "passkey_prompt",
           "PASSKEY_INTRO", "PASSKEY_FILLER", "PASSKEY_NEEDLE", "PASSKEY_QUESTION"]

# RULER's prompt format (its NIAH template), and the key-value retrieval format of Liu et al.
_INTRO = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
          "I will quiz you about the {kind} afterwards.\n")
_NEEDLE = " One of the special magic {kind} for {key} is:"  # then " {value}." (its own piece: the value's tokens)
_VALUE = " {value}."
_QUESTION = "\nWhat are all the special magic {kind} for {query} mentioned in the provided text?"
_ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"
_KV_INTRO = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{"
_KV_QUESTION = "}}\n\nKey: \"{key}\"\nCorresponding value:"
_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_ADJECTIVES = ("ancient bitter brave calm clever cold curious damp eager early fancy fierce gentle giant glad "
               "golden grumpy happy hollow honest huge icy jolly kind late lazy little lively loud lucky mellow "
               "modern narrow noisy odd pale plain polite proud quick quiet rapid rare rich rough round royal rusty "
               "sharp shiny silent silly slow smooth soft solid sour spicy steady sticky strange sweet swift tall "
               "tender tiny vast warm wild wise witty young").split()
_NOUNS = ("anchor apple arrow badge barrel basket beacon berry blanket bottle bridge bucket button cabin camera "
          "candle canyon carpet castle cellar chimney cloud compass cookie copper cradle crystal curtain desert "
          "dragon engine falcon feather forest fountain garden glacier guitar hammer harbor helmet island jacket "
          "kettle ladder lantern lemon library magnet meadow mirror monkey needle orchard palace parrot pencil "
          "pepper pillow planet pocket puzzle rabbit ribbon river rocket saddle shadow shelter spider statue "
          "teapot thunder tiger tunnel violin wagon whistle window").split()
_KINDS = {"numbers": "numbers", "words": "words", "uuids": "uuids"}


@dataclass(frozen=True)
class NeedleTask:
    """One needle task: haystack ("noise", "text", "needles", or "json" for key-value retrieval), the kinds of keys
    and values ("words", "numbers", "uuids"), needles with distinct keys (`keys`: the extra ones are distractors),
    values per asked key (`values`), keys asked (`queries`)."""

    name: str
    haystack: str
    key_kind: str = "words"
    value_kind: str = "numbers"
    keys: int = 1
    values: int = 1
    queries: int = 1

    @property
    def answers(self) -> int:
        """How many values the answer must contain."""
        return self.values * self.queries

    def answer_tokens(self) -> int:
        """Greedy tokens to decode for an answer (generous: a uuid takes up to ~30 tokens, a number ~8)."""
        per = {"numbers": 10, "words": 6, "uuids": 32}[self.value_kind]
        return self.answers * per + 4


#: RULER's eight NIAH tasks (single_1: noise haystack; the others: text), a single task with word values, and the
#: key-value retrieval of Liu et al.
TASKS: dict[str, NeedleTask] = {t.name: t for t in (
    NeedleTask("niah_single_1", "noise"),
    NeedleTask("niah_single_2", "text"),
    NeedleTask("niah_single_3", "text", value_kind="uuids"),
    NeedleTask("niah_single_word", "text", value_kind="words"),
    NeedleTask("niah_multikey_1", "text", keys=4),
    NeedleTask("niah_multikey_2", "needles"),
    NeedleTask("niah_multikey_3", "needles", key_kind="uuids", value_kind="uuids"),
    NeedleTask("niah_multivalue", "text", values=4),
    NeedleTask("niah_multiquery", "text", keys=4, queries=4),
    NeedleTask("kv_retrieval", "json", key_kind="uuids", value_kind="uuids"),
)}


def task_names() -> tuple[str, ...]:
    """Every needle task's name ("passkey" is the long-context harness's own)."""
    return tuple(TASKS)


@dataclass(frozen=True)
class Needle:
    """One needle in a prompt: token span [start, end), its key and value, whether the question asks for it, and the
    span [value_start, value_end) of the value's own tokens (what an answer copies)."""

    start: int
    end: int
    key: str
    value: str
    asked: bool
    value_start: int = -1
    value_end: int = -1


@dataclass(frozen=True)
class NeedlePrompt:
    """Token ids of one prompt (exactly `length` tokens), the values the answer must contain, and every needle."""

    task: str
    ids: list[int]
    targets: tuple[str, ...]
    needles: tuple[Needle, ...]
    depth: float


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer: Any) -> list[int]:
    return list(tokenizer("", add_special_tokens=True)["input_ids"])


def _draw(rng: random.Random, kind: str, taken: set[str]) -> str:
    for _ in range(1000):
        if kind == "numbers":
            v = str(rng.randint(1_000_000, 9_999_999))  # RULER's 7-digit values
        elif kind == "words":
            v = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        else:
            v = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if v not in taken:
            taken.add(v)
            return v
    raise ValueError(f"cannot draw another distinct {kind} value")


def _sentences(tokenizer: Any, text: str | None) -> list[list[int]]:
    if not text or not text.strip():
        raise ValueError(f"a text haystack needs a text (--text); got {'none' if text is None else 'an empty one'}")
    parts = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if s]
    return [_encode(tokenizer, " " + s) for s in parts]


def _haystack(tokenizer: Any, task: NeedleTask, n: int, text: str | None, rng: random.Random,
              taken: set[str]) -> list[list[int]]:
    # Sentences (token lists) totalling at least n tokens.
    if task.haystack == "noise":
        unit = [_encode(tokenizer, " " + s) for s in re.split(r"(?<=\.)\s+", _NOISE)]
    elif task.haystack == "text":
        unit = _sentences(tokenizer, text)
    else:  # "needles": the haystack is made of needles with other keys (RULER multikey_2 / 3)
        out, total = [], 0
        kind = _KINDS[task.value_kind]
        while total < n:
            key, value = _draw(rng, task.key_kind, taken), _draw(rng, task.value_kind, taken)
            piece = sum(_needle_tokens(tokenizer, kind, key, value), [])
            out.append(piece)
            total += len(piece)
        return out
    if not sum(map(len, unit)):
        raise ValueError("the haystack text encodes to no tokens")
    out, total, i = [], 0, 0
    while total < n:
        out.append(unit[i % len(unit)])
        total += len(unit[i % len(unit)])
        i += 1
    return out


def _needle_tokens(tokenizer: Any, kind: str, key: str, value: str) -> tuple[list[int], list[int]]:
    # The needle as (text up to "is:", the value and its full stop): two pieces, so the value's tokens are known.
    return _encode(tokenizer, _NEEDLE.format(kind=kind, key=key)), _encode(tokenizer, _VALUE.format(value=value))


def needle_prompt(tokenizer: Any, task: str | NeedleTask, length: int, depth: float, seed: int,
                  text: str | None = None) -> NeedlePrompt:
    """The prompt of `task` with exactly `length` tokens ([BOS] intro, haystack with the needles, question, answer
    prefix): the first asked needle after the fraction `depth` of the haystack (snapped to a sentence boundary),
    the other needles at seeded random depths. Keys and values are drawn from `seed`. ValueError for an unknown task,
    a depth outside [0, 1], a length too short for the fixed parts, or a text haystack without text."""
    t = TASKS.get(task) if isinstance(task, str) else task
    if t is None:
        raise ValueError(f"unknown needle task {task!r}; tasks: passkey, {', '.join(TASKS)}")
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be within [0, 1]; got {depth}")
    rng = random.Random(f"{t.name}|{length}|{depth}|{seed}")
    if t.haystack == "json":
        return _kv_prompt(tokenizer, t, length, depth, rng)
    taken: set[str] = set()
    kind = _KINDS[t.value_kind]
    keys = [_draw(rng, t.key_kind, taken) for _ in range(max(t.keys, t.queries))]
    asked = keys[:t.queries]
    pairs = [(k, _draw(rng, t.value_kind, taken)) for k in keys for _ in range(t.values if k in asked else 1)]
    query = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
    head = _bos(tokenizer) + _encode(tokenizer, _INTRO.format(kind=kind))
    tail = _encode(tokenizer, _QUESTION.format(kind=kind, query=query)) + _encode(
        tokenizer, _ANSWER.format(kind=kind, query=query))
    split = [_needle_tokens(tokenizer, kind, k, v) for k, v in pairs]
    pieces = [a + b for a, b in split]
    n_fill = length - len(head) - len(tail) - sum(map(len, pieces))
    if n_fill < 0:
        raise ValueError(f"a {t.name} prompt needs at least {length - n_fill} tokens; got length {length}")
    hay = _haystack(tokenizer, t, n_fill, text, rng, taken)
    flat = [tok for s in hay for tok in s][:n_fill]
    bounds = [0]
    for s in hay:
        bounds.append(min(bounds[-1] + len(s), n_fill))
    # The first needle at the depth, the others at random sentence boundaries; equal boundaries keep the draw order.
    slots = [min(bounds, key=lambda b: abs(b - depth * n_fill))] + [rng.choice(bounds) for _ in pairs[1:]]
    order = sorted(range(len(pairs)), key=lambda i: (slots[i], i))
    ids, needles, last = list(head), [], 0
    for i in order:
        ids += flat[last:slots[i]]
        last = slots[i]
        k, v = pairs[i]
        at = len(ids) + len(split[i][0])
        needles.append(Needle(len(ids), len(ids) + len(pieces[i]), k, v, k in asked, at, at + len(split[i][1])))
        ids += pieces[i]
    ids += flat[last:] + tail
    targets = tuple(v for k, v in pairs if k in asked)
    return NeedlePrompt(t.name, ids, targets, tuple(needles), depth)


def _kv_prompt(tokenizer: Any, t: NeedleTask, length: int, depth: float, rng: random.Random) -> NeedlePrompt:
    # Key-value retrieval: as many uuid pairs as fit, the gold pair at index round(depth * (N - 1)), the JSON padded
    # with newlines (still valid JSON) to the exact length.
    taken: set[str] = set()
    head = _bos(tokenizer) + _encode(tokenizer, _KV_INTRO)
    lines: list[tuple[str, str, list[int]]] = []

    def line_of(k: str, v: str, last: bool) -> list[int]:
        return _encode(tokenizer, f"\n{json.dumps(k)}:") + value_of(v, last)

    def value_of(v: str, last: bool) -> list[int]:
        return _encode(tokenizer, f" {json.dumps(v)}" + ("" if last else ","))

    # Pairs while they fit beside the longest question a drawn key could need; the last pair has no comma.
    while True:
        k, v = _draw(rng, "uuids", taken), _draw(rng, "uuids", taken)
        line = line_of(k, v, False)
        ask = max([len(_encode(tokenizer, _KV_QUESTION.format(key=x[0]))) for x in lines] + [0, len(
            _encode(tokenizer, _KV_QUESTION.format(key=k)))])
        if len(head) + sum(len(x[2]) for x in lines) + len(line) + ask > length:
            break
        lines.append((k, v, line))
    if not lines:
        raise ValueError(f"a kv_retrieval prompt needs more than {length} tokens for one pair")
    k, v, _ = lines[-1]
    lines[-1] = (k, v, line_of(k, v, True))
    gold = round(depth * (len(lines) - 1))
    key, value, _ = lines[gold]
    tail = _encode(tokenizer, _KV_QUESTION.format(key=key))
    pad = _encode(tokenizer, "\n")
    n_pad = length - len(head) - sum(len(x[2]) for x in lines) - len(tail)
    if n_pad < 0 or (n_pad and not pad):
        raise ValueError(f"cannot fit a kv_retrieval prompt into exactly {length} tokens")
    ids = list(head) + (pad * (n_pad // len(pad) + 1))[:n_pad]
    needles = []
    for i, (k, v, line) in enumerate(lines):
        n_value = len(value_of(v, i == len(lines) - 1))
        needles.append(Needle(len(ids), len(ids) + len(line), k, v, i == gold, len(ids) + len(line) - n_value,
                              len(ids) + len(line)))
        ids += line
    ids += tail
    return NeedlePrompt(t.name, ids, (value,), tuple(needles), depth)


# The standard passkey prompt (Mohtashami & Jaggi 2023; Chen et al. 2023's Table 4; Self-Extend, LongLoRA, ...).
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there.\n\n")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyFormat:
    """The pieces of a passkey prompt: intro (after any BOS), filler (repeated), needle (`{key}` filled in), question
    (ending where the answer " <key>" follows)."""

    intro: str
    filler: str
    needle: str
    question: str


#: The standard prompt (the long-context harness's).
PASSKEY = PasskeyFormat(PASSKEY_INTRO, PASSKEY_FILLER, PASSKEY_NEEDLE, PASSKEY_QUESTION)
#: The zoo's compact prompt: no intro, the needle's first sentence only, Chen et al.'s question (with a 512-token
#: byte-level BPE: needle 14 tokens, question 18, so at L = 64 the key sits 25 to 51 tokens before the answer;
#: the standard one's fixed parts alone take 130).
SHORT_PASSKEY = PasskeyFormat("", PASSKEY_FILLER, " The pass key is {key}.", " What is the pass key? The pass key is")


@dataclass(frozen=True)
class PasskeyPrompt:
    """Token ids of one passkey prompt (exactly `length` tokens), its key, where the needle starts, the depth asked,
    the answer's token ids (" <key>", tokenised on its own: what a greedy answer must produce) and where the key's
    tokens sit inside the needle (`key_pos`; -1 when the needle does not hold them as the answer's tokens)."""

    ids: list[int]
    key: str
    needle_pos: int
    depth: float
    answer: tuple[int, ...] = ()
    key_pos: int = -1

    @property
    def distance(self) -> int:
        """Tokens from the key's first token in the needle to the answer's first token (= len(ids)): how far back
        the answer must look; -1 when the key's position is unknown."""
        return len(self.ids) - self.key_pos if self.key_pos >= 0 else -1


def passkey_prompt(tokenizer: Any, length: int, depth: float, key: str, fmt: PasskeyFormat = PASSKEY
                   ) -> PasskeyPrompt:
    """The passkey prompt of exactly `length` tokens: [BOS] intro, filler with the needle after the fraction
    `depth` of it (snapped to the boundary of a whole filler unit), question. Pieces are tokenised separately."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be within [0, 1]; got {depth}")
    unit, n_fill = _passkey_room(tokenizer, length, key, fmt)
    cut = min(round(depth * n_fill / len(unit)) * len(unit), n_fill)
    return passkey_at(tokenizer, length, cut, key, fmt, depth=depth)


def passkey_at(tokenizer: Any, length: int, before: int, key: str, fmt: PasskeyFormat = PASSKEY, *,
               depth: float | None = None) -> PasskeyPrompt:
    """The passkey prompt of exactly `length` tokens with exactly `before` filler tokens between the intro and the
    needle (the filler is one stream, cut at any token; the rest of it lies between needle and question). ValueError
    when the fixed parts do not fit or `before` exceeds the filler."""
    unit, n_fill = _passkey_room(tokenizer, length, key, fmt)
    if not 0 <= before <= n_fill:
        raise ValueError(f"before must be within [0, {n_fill}] (the filler of a {length}-token prompt); got {before}")
    head = _bos(tokenizer) + _encode(tokenizer, fmt.intro)
    needle = _encode(tokenizer, fmt.needle.format(key=key))
    answer = _encode(tokenizer, " " + key)
    filler = (unit * (n_fill // len(unit) + 1))[:n_fill]
    ids = head + filler[:before] + needle + filler[before:] + _encode(tokenizer, fmt.question)
    pos = len(head) + before
    at = next((i for i in range(len(needle) - len(answer) + 1) if needle[i:i + len(answer)] == answer), -1)
    return PasskeyPrompt(ids, key, pos, before / n_fill if depth is None and n_fill else depth or 0.0,
                         tuple(answer), pos + at if at >= 0 else -1)


def passkey_filler(tokenizer: Any, length: int, key: str, fmt: PasskeyFormat = PASSKEY) -> int:
    """The filler tokens of a `length`-token passkey prompt with `key` (`passkey_at`'s `before` ranges over 0..this).
    ValueError when the fixed parts do not fit."""
    return _passkey_room(tokenizer, length, key, fmt)[1]


def _passkey_room(tokenizer: Any, length: int, key: str, fmt: PasskeyFormat) -> tuple[list[int], int]:
    # (the filler unit's tokens, the filler tokens a prompt of `length` has)
    fixed = (len(_bos(tokenizer)) + len(_encode(tokenizer, fmt.intro)) + len(_encode(tokenizer, fmt.needle.format(
        key=key))) + len(_encode(tokenizer, fmt.question)))
    if length < fixed:
        raise ValueError(f"a passkey prompt needs at least {fixed} tokens; got length {length}")
    unit = _encode(tokenizer, fmt.filler)
    if not unit:
        raise ValueError("the passkey filler encodes to no tokens")
    return unit, length - fixed


def string_match_all(prediction: str, targets: Sequence[str]) -> float:
    """RULER's score of one answer: the fraction of `targets` that occur in `prediction`, case-insensitive."""
    if not targets:
        raise ValueError("no expected values to score against")
    low = prediction.lower()
    return sum(t.lower() in low for t in targets) / len(targets)
