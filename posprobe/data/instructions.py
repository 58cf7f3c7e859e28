"""Instructions with automatic checkers, for the key squishing study (issue 40).

An `Instruction` is a piece of text put in a chat prompt ("Always answer in French.") and a checker that says
whether an answer follows it; no judge model. `mentions` are lowercase phrases whose presence in an answer means
the answer talks about the instruction ("in french"), for an acknowledgement rate beside the following rate.

The built-in suite (`BUILTIN_INSTRUCTIONS`) was written for posprobe. Its language checkers use a small detector
of their own (`detect_language`: counts of common function words per language, accented letters breaking ties),
so no language-identification package is needed. `load_ifeval` maps the supported instruction ids of an IFEval
file onto checkers of the same kind.

Pure Python (numpy is not needed): the study validates every checker before any model loads.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from posprobe.data.records import DataError, json_records, read_lines

__all__ = [
    "BUILTIN_INSTRUCTIONS", "END_PHRASE", "IFEVAL_SUPPORTED", "IFEvalLoad", "IFEvalPrompt", "Instruction", "KEYWORD",
    "LANGUAGES", "acknowledges", "builtin_instructions", "custom_instruction", "detect_language", "load_ifeval",
    "stopword_counts", "validate_checkers",
]


@dataclass(frozen=True)
class Instruction:
    """An instruction: `name` (short id), `text` (exactly what goes in the prompt), `check` (answer -> True when it
    follows), `mentions` (lowercase phrases that show an answer talks about it) and `topic` (None: it concerns every
    question; a topic: only questions of that topic, and on the others its checker measures a leak)."""

    name: str
    text: str
    check: Callable[[str], bool] = field(repr=False)
    mentions: tuple[str, ...] = ()
    topic: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("an instruction needs a non-empty name")
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError(f"instruction {self.name!r} needs a non-empty text")
        if not callable(self.check):
            raise ValueError(f"instruction {self.name!r}: check must be callable, got {type(self.check).__name__}")
        if isinstance(self.mentions, str):  # a bare string would become a tuple of its characters
            raise ValueError(f"instruction {self.name!r}: mentions must be a sequence of phrases, not one string")
        mentions = tuple(self.mentions)
        if not all(isinstance(m, str) and m.strip() for m in mentions):
            raise ValueError(f"instruction {self.name!r}: mentions must be non-empty strings")
        # acknowledges() matches against the lowercased answer, so a phrase with capitals could never match.
        object.__setattr__(self, "mentions", tuple(m.lower() for m in mentions))


# ---------------------------------------------------------------------------------------------------------------
# Language detection: function words are frequent in any text of a language and rarely borrowed, so their counts
# separate english, french, spanish and german on a sentence or two. Words shared by two languages ("la", "de",
# "en", "es") count for both and cancel out; the distinctive ones decide.

_STOPWORDS: dict[str, frozenset[str]] = {
    "en": frozenset((
        "the a an and or but is are was were be been it its it's this that these those of to in on for with as at "
        "by from you your i me my he she him her we us our they not no do does can will would have has what which "
        "there if so don't i'm").split()),
    "fr": frozenset((
        "le la les un une des du de et ou mais est sont était être a ai il elle ils elles nous vous je tu on ce "
        "cette ces qui que dans en pour avec sur par pas ne plus au aux se son sa ses leur très oui suis mon ma mes "
        "votre vos l' d' j' c' qu' n' s'").split()),
    "es": frozenset((
        "el él la los las un una unos unas de del al y o a pero es son está están era ser en con por para que se "
        "no lo le su sus como más muy este esta hay yo tú usted nosotros ellos también cuando porque sí mi me te "
        "nos soy estoy").split()),
    "de": frozenset((
        "der die das den dem des ein eine einen einem einer und oder aber ist sind war waren sein haben hat ich "
        "du er sie es wir ihr nicht mit von zu auf für im in an auch wie dass kann wird werden sich bei nach aus "
        "um noch ja nein bin bist mir dir mich uns weil wenn").split()),
}
#: Letters that only one of the four languages writes commonly (é is french and spanish: left out).
_ACCENTS = {"en": "", "fr": "èêëàâçîïôûùœ", "es": "ñáíóú¿¡", "de": "äöüß"}
#: French elided articles and pronouns ("l'eau", "qu'il") are words of their own.
_ELISIONS = frozenset("c d j l m n s t qu".split())
_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)*")

#: ISO code -> language name, for the languages `detect_language` knows.
LANGUAGES = {"en": "English", "fr": "French", "es": "Spanish", "de": "German"}


def _tokens(text: str) -> list[str]:
    tokens: list[str] = []
    for word in _WORD.findall(text.lower().replace("\u2019", "'")):
        while "'" in word:
            head, _, tail = word.partition("'")
            if head not in _ELISIONS:
                break
            tokens.append(head + "'")
            word = tail
        tokens.append(word)
    return tokens


def stopword_counts(text: str) -> dict[str, int]:
    """Return, per language code ("en", "fr", "es", "de"), how many words of `text` are its common function words."""
    tokens = _tokens(text)
    return {lang: sum(t in words for t in tokens) for lang, words in _STOPWORDS.items()}


def detect_language(text: str, min_hits: int = 2) -> str | None:
    """Return the language code of `text` ("en", "fr", "es", "de"), or None when undecided: no language has
    `min_hits` function words, or the top languages tie on function words and on distinctive accented letters."""
    counts = stopword_counts(text)
    best = max(counts.values())
    if best < min_hits:
        return None
    tied = [lang for lang, n in counts.items() if n == best]
    if len(tied) == 1:
        return tied[0]
    low = text.lower()
    accents = {lang: sum(low.count(ch) for ch in _ACCENTS[lang]) for lang in tied}
    top = max(accents.values())
    winners = [lang for lang, n in accents.items() if n == top]
    return winners[0] if top > 0 and len(winners) == 1 else None


def _in_language(code: str) -> Callable[[str], bool]:
    def check(answer: str) -> bool:
        return detect_language(answer) == code

    check.__name__ = f"in_{code}"
    return check


# ---------------------------------------------------------------------------------------------------------------
# Checkers. Each returns a plain bool; an empty or whitespace answer follows none of them.

KEYWORD = "banana"
END_PHRASE = "Is there anything else I can help with?"
_MAX_WORDS = 20
# The plural counts: the instruction is about using the word, and "bananas" shows the model did.
_KEYWORD_RE = re.compile(r"\bbananas?\b", re.IGNORECASE)
_PIRATE_RE = re.compile(
    r"\b(?:arr+|ahoy|avast|mateys?|hearties|ye|aye|treasure|landlubbers?|scallywags?|buccaneers?|booty|plunder|"
    r"grog|shiver me timbers|yo[- ]ho)\b", re.IGNORECASE)
_FENCE_RE = re.compile(r"\A```[ \t]*(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```\Z", re.IGNORECASE | re.DOTALL)


def _is_lowercase(answer: str) -> bool:
    return any(c.isalpha() for c in answer) and not any(c.isupper() for c in answer)


def _is_capitals(answer: str) -> bool:
    return any(c.isalpha() for c in answer) and not any(c.islower() for c in answer)


def _has_keyword(answer: str) -> bool:
    return _KEYWORD_RE.search(answer) is not None


def _ends_with_phrase(answer: str) -> bool:
    return answer.rstrip().endswith(END_PHRASE)


def _word_count(answer: str) -> int:
    """Whitespace-separated pieces holding a letter or digit (a lone dash or emoji is not a word)."""
    return sum(any(c.isalnum() for c in piece) for piece in answer.split())


def _is_short(answer: str) -> bool:
    return 1 <= _word_count(answer) <= _MAX_WORDS


def _no_commas(answer: str) -> bool:
    return bool(answer.strip()) and "," not in answer


def _is_json(answer: str) -> bool:
    body = answer.strip()
    fenced = _FENCE_RE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        value = json.loads(body)
    except ValueError:  # JSONDecodeError, and an empty body
        return False
    return isinstance(value, (dict, list))


def _speaks_pirate(answer: str) -> bool:
    return _PIRATE_RE.search(answer) is not None


_LANGUAGE_MENTIONS = {
    "en": ("english",),
    "fr": ("in french", "en français", "french", "français"),
    "es": ("in spanish", "en español", "spanish", "español"),
    "de": ("in german", "auf deutsch", "german", "deutsch"),
}
_CASE_MENTIONS = {
    "lowercase": ("lowercase", "lower case", "lower-case", "small letters"),
    "capitals": ("capital letters", "uppercase", "upper case", "upper-case", "all caps", "in capitals"),
}
_JSON_MENTIONS = ("in json", "as json", "json format", "json object", "valid json")
_END_MENTIONS = ("end with", "ending with", "end every answer", "end my answer", "finish with", "finish every")

#: The built-in suite, in its fixed order (the order `builtin_instructions()` returns).
BUILTIN_INSTRUCTIONS: dict[str, Instruction] = {i.name: i for i in (
    Instruction("french", "Always answer in French.", _in_language("fr"), _LANGUAGE_MENTIONS["fr"]),
    Instruction("spanish", "Always answer in Spanish.", _in_language("es"), _LANGUAGE_MENTIONS["es"]),
    Instruction("german", "Always answer in German.", _in_language("de"), _LANGUAGE_MENTIONS["de"]),
    Instruction("lowercase", "Write all your answers in lowercase letters only, with no capital letters at all.",
                _is_lowercase, _CASE_MENTIONS["lowercase"]),
    Instruction("capitals", "Write all your answers entirely in capital letters.", _is_capitals,
                _CASE_MENTIONS["capitals"]),
    Instruction("keyword", f'Use the word "{KEYWORD}" somewhere in every answer.', _has_keyword,
                (f"the word {KEYWORD}", f'"{KEYWORD}"', f"'{KEYWORD}'", "the word you asked")),
    Instruction("end_phrase", f'Finish every answer with the sentence "{END_PHRASE}"', _ends_with_phrase,
                _END_MENTIONS),
    Instruction("short", f"Keep every answer to {_MAX_WORDS} words or fewer.", _is_short,
                (f"{_MAX_WORDS} words", "twenty words", "word limit", f"under {_MAX_WORDS}",
                 f"fewer than {_MAX_WORDS}")),
    Instruction("no_commas", "Do not use any commas in your answers.", _no_commas, ("comma",)),
    Instruction("json", "Reply only with valid JSON and nothing else.", _is_json, _JSON_MENTIONS),
    Instruction("persona", "You are a pirate. Talk like a pirate in every answer.", _speaks_pirate, ("pirate",)),
    # Conditional: followed on cooking questions; on the others its checker counts French where English was asked,
    # the "more global" effect a fine-tune would have and a conversational instruction should not.
    Instruction("french_cooking", "When a question is about cooking or food, answer it in French; answer every "
                "other question in English.", _in_language("fr"), _LANGUAGE_MENTIONS["fr"], topic="cooking"),
)}


def builtin_instructions(names: Sequence[str] | str | None = None) -> list[Instruction]:
    """Return the built-in instructions: all of them in their fixed order (`names` None, empty or "all"), or those
    named, in the order named. A single name may be given as a string. Raises ValueError for an unknown or repeated
    name."""
    if isinstance(names, str):
        names = [names]
    if not names or list(names) == ["all"]:
        return list(BUILTIN_INSTRUCTIONS.values())
    unknown = [n for n in names if n not in BUILTIN_INSTRUCTIONS]
    if unknown:
        raise ValueError(f"unknown instruction(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(BUILTIN_INSTRUCTIONS)}")
    repeated = sorted(n for n, k in Counter(names).items() if k > 1)
    if repeated:
        raise ValueError(f"instruction(s) named more than once: {', '.join(repeated)}")
    return [BUILTIN_INSTRUCTIONS[n] for n in names]


def custom_instruction(name: str, text: str, check: Callable[[str], bool], mentions: Sequence[str] = (), *,
                       topic: str | None = None) -> Instruction:
    """Return an `Instruction` of your own; raises ValueError for an empty name or text, a check that is not
    callable, or mentions that are not non-empty strings. Run `validate_checkers` on it before generating."""
    return Instruction(name, text, check, tuple(mentions) if not isinstance(mentions, str) else mentions,
                       topic)


def _is_bool(value: Any) -> bool:
    # numpy's bool scalar is accepted without importing numpy: its type is numpy.bool_ (named "bool" in numpy 2).
    t = type(value)
    return isinstance(value, bool) or (t.__module__ == "numpy" and t.__name__ in ("bool", "bool_"))


def validate_checkers(instructions: Iterable[Instruction],
                      samples: Sequence[str] = ("", "Hello, world.", "Bonjour, le monde.")) -> None:
    """Call every checker on every sample before any generation; return None when all give a bool. Raises
    ValueError naming the instruction and the sample where a checker raises (the exception chained) or returns
    something other than a bool (numpy's bool included)."""
    for inst in instructions:
        for sample in samples:
            try:
                result = inst.check(sample)
            except Exception as exc:
                raise ValueError(f"instruction {inst.name!r}: its checker raised {type(exc).__name__} "
                                 f"on sample {sample!r}: {exc}") from exc
            if not _is_bool(result):
                raise ValueError(f"instruction {inst.name!r}: its checker returned {type(result).__name__} "
                                 f"{result!r} on sample {sample!r}; a checker must return a bool")


def acknowledges(instruction: Instruction, answer: str) -> bool:
    """Return True when the lowercased `answer` contains one of `instruction.mentions` (it talks about it)."""
    low = answer.lower()
    return any(m in low for m in instruction.mentions)


# ---------------------------------------------------------------------------------------------------------------
# IFEval (Zhou et al. 2023): each prompt already contains its instructions, so nothing is placed separately; an
# IFEval `Instruction` carries the IFEval id as its name and the id with its arguments as its text. The checkers
# follow IFEval's rules where the built-ins differ (keywords as substrings, end phrase case-insensitive, words as
# \w+ runs) but keep three of posprobe's: an empty answer follows nothing (IFEval passes it for no_comma and "less
# than"), JSON must be an object or array, and languages come from `detect_language`, not langdetect.

_IFEVAL_KEYS = ("key", "prompt", "instruction_id_list", "kwargs")

#: IFEval instruction ids `load_ifeval` maps to checkers (response_language: only the codes in LANGUAGES).
IFEVAL_SUPPORTED = (
    "change_case:english_lowercase", "change_case:english_capital", "punctuation:no_comma",
    "detectable_format:json_format", "keywords:existence", "startend:end_checker",
    "length_constraints:number_words", "language:response_language",
)


@dataclass(frozen=True)
class IFEvalPrompt:
    """One IFEval prompt: its `key`, the `prompt` (which already states the instructions) and their checkers."""

    key: str
    prompt: str
    instructions: tuple[Instruction, ...]


class IFEvalLoad(NamedTuple):
    """What `load_ifeval` returns: the supported `prompts`; `skipped`, unsupported id -> how many prompts were
    left out for it (a prompt with two unsupported ids counts for both); `total`, the prompts in the file."""

    prompts: list[IFEvalPrompt]
    skipped: dict[str, int]
    total: int


def _not_english(answer: str) -> bool:
    return detect_language(answer) not in ("en", None)


def _ifeval_instruction(iid: str, kw: dict[str, Any], where: str) -> Instruction | str:
    """The checker for IFEval id `iid`, or the label under which an unsupported one is counted."""

    def need(key: str, kind: type | tuple[type, ...]) -> Any:
        value = kw.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise DataError(f"{where}: {iid} needs kwargs {key!r} ({getattr(kind, '__name__', kind)}), "
                            f"got {value!r}")
        return value

    if iid == "change_case:english_lowercase":
        # IFEval also asks for English; here: not detected as another language (undecided passes, as there).
        return Instruction(iid, iid, lambda a: _is_lowercase(a) and not _not_english(a),
                           _CASE_MENTIONS["lowercase"])
    if iid == "change_case:english_capital":
        return Instruction(iid, iid, lambda a: _is_capitals(a) and not _not_english(a), _CASE_MENTIONS["capitals"])
    if iid == "punctuation:no_comma":
        return Instruction(iid, iid, _no_commas, ("comma",))
    if iid == "detectable_format:json_format":
        return Instruction(iid, iid, _is_json, _JSON_MENTIONS)
    if iid == "keywords:existence":
        keywords = need("keywords", list)
        if not keywords or not all(isinstance(k, str) and k.strip() for k in keywords):
            raise DataError(f"{where}: {iid} needs a non-empty list of keywords, got {keywords!r}")
        # As IFEval: each keyword anywhere in the answer, case-insensitive (a substring, not a whole word).
        words = tuple(k.lower() for k in keywords)
        return Instruction(iid, f"{iid} (keywords={list(keywords)!r})",
                           lambda a: all(k in a.lower() for k in words))
    if iid == "startend:end_checker":
        phrase = need("end_phrase", str).strip()
        if not phrase:
            raise DataError(f"{where}: {iid} needs a non-empty end_phrase")
        # As IFEval: case-insensitive, surrounding whitespace ignored.
        return Instruction(iid, f"{iid} (end_phrase={phrase!r})",
                           lambda a: bool(a.strip()) and a.strip().lower().endswith(phrase.lower()), _END_MENTIONS)
    if iid == "length_constraints:number_words":
        relation, n = need("relation", str), need("num_words", int)
        if relation not in ("less than", "at least"):
            raise DataError(f"{where}: {iid} relation must be 'less than' or 'at least', got {relation!r}")

        # As IFEval: words are runs of word characters (its nltk RegexpTokenizer(r"\w+")).
        def check(a: str, relation: str = relation, n: int = n) -> bool:
            count = len(re.findall(r"\w+", a))
            return 0 < count < n if relation == "less than" else count >= n

        return Instruction(iid, f"{iid} (relation={relation!r}, num_words={n})", check,
                           (f"{n} words", "word limit"))
    if iid == "language:response_language":
        code = need("language", str)
        if code not in LANGUAGES:
            return f"{iid}:{code}"
        return Instruction(iid, f"{iid} (language={code!r})", _in_language(code), _LANGUAGE_MENTIONS[code])
    return iid


def load_ifeval(path: str | Path) -> IFEvalLoad:
    """Read a local IFEval jsonl file; return `IFEvalLoad(prompts, skipped, total)` (a named tuple).

    A prompt is kept only when every one of its instruction ids is supported (`IFEVAL_SUPPORTED`); otherwise it is
    left out and counted in `skipped` under each unsupported id (a response_language with a code other than
    en/fr/es/de is counted as "language:response_language:<code>"). The instructions are already inside each
    prompt's text: nothing is placed separately, and `Instruction.text` holds the id and its arguments. Raises
    DataError (a ValueError) naming the file and line for an unreadable or empty file, a line that is not a JSON
    object, a missing key, or arguments a supported id cannot use.
    """
    origin = f"IFEval file {path}"
    prompts: list[IFEvalPrompt] = []
    skipped: Counter[str] = Counter()
    total = 0
    for where, rec in json_records(read_lines(path, origin), origin, _IFEVAL_KEYS):
        ids, kwargs, prompt = rec["instruction_id_list"], rec["kwargs"], rec["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{where}: prompt must be a non-empty string")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise DataError(f"{where}: instruction_id_list must be a list of strings")
        if not isinstance(kwargs, list) or len(kwargs) != len(ids):
            raise DataError(f"{where}: kwargs must be a list of {len(ids)} objects, one per instruction id")
        total += 1
        found: list[Instruction | str] = []
        for iid, kw in zip(ids, kwargs):
            if kw is not None and not isinstance(kw, dict):
                raise DataError(f"{where}: the kwargs of {iid} must be a JSON object, got {type(kw).__name__}")
            found.append(_ifeval_instruction(iid, kw or {}, where))
        unsupported = [f for f in found if isinstance(f, str)]
        if unsupported:
            skipped.update(set(unsupported))
            continue
        prompts.append(IFEvalPrompt(str(rec["key"]), prompt, tuple(f for f in found if isinstance(f, Instruction))))
    if total == 0:
        raise DataError(f"{origin}: no prompts (the file is empty)")
    return IFEvalLoad(prompts, dict(skipped), total)
