"""Instructions and their checkers, IFEval loading, and the neutral questions of the key squishing study (#40).

Every checker is tried on hand-written answers that follow it and that do not, edge cases included."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from posprobe.data.instructions import (
    BUILTIN_INSTRUCTIONS,
    END_PHRASE,
    IFEvalLoad,
    Instruction,
    acknowledges,
    builtin_instructions,
    custom_instruction,
    detect_language,
    load_ifeval,
    stopword_counts,
    validate_checkers,
)
from posprobe.data.questions import (
    BUILTIN_QUESTIONS,
    FILLER_TURNS,
    Question,
    builtin_questions,
    load_questions,
)


def check(name: str, answer: str) -> bool:
    result = BUILTIN_INSTRUCTIONS[name].check(answer)
    assert type(result) is bool, (name, answer, result)
    return result


FRENCH = "Le ciel est bleu parce que la lumière du soleil est diffusée par l'air."
SPANISH = "El cielo es azul porque la luz del sol se dispersa en el aire."
GERMAN = "Der Himmel ist blau, weil das Sonnenlicht in der Luft gestreut wird."
ENGLISH = "The sky is blue because sunlight is scattered by the air."

# (instruction, answers that follow it, answers that do not)
CASES = {
    "french": (
        [FRENCH, "La capitale du Japon est Tokyo.", "Oui, c'est vrai.", "Je ne sais pas.",
         "C’est l’heure du déjeuner."],  # typographic apostrophes, as models write them
        ["", "   ", ENGLISH, SPANISH, GERMAN, "Tokyo.", "Bonjour!",
         "The French say bonjour when they meet, and it is a friendly word.",
         "Sure, here is my answer in French: Tokyo is the capital of Japan.",
         "La capital de Japón es Tokio."],
    ),
    "spanish": (
        [SPANISH, "La capital de Japón es Tokio.", "¡Hola! Estoy aquí para ayudarte.", "Un gato negro y un perro."],
        ["", ENGLISH, FRENCH, GERMAN, "La casa de la playa.",  # shared words only, no accent: undecided
         "In Spanish, the word for cat is gato."],
    ),
    "german": (
        [GERMAN, "Die Hauptstadt von Japan ist Tokio.", "Hallo, ich bin ein Roboter.", "Ja, das stimmt."],
        ["", ENGLISH, FRENCH, SPANISH, "I would answer in German, but the sky is blue."],
    ),
    "lowercase": (
        ["the sky is blue.", "i think so, yes! 42 times.", "über alles: ça va."],
        ["", "   ", "123 !?", "The sky is blue.", "the sky is BLUE", "the sky is blue. I think."],
    ),
    "capitals": (
        ["THE SKY IS BLUE.", "IT COSTS 15 DOLLARS, 100% SURE!", "ÇA VA?", "OK"],
        ["", "42!", "THE SKY IS BLUe.", "The Sky Is Blue.", "the sky is blue."],
    ),
    "keyword": (
        ["Banana bread is tasty.", "I like a banana.", "A BANANA!", "The banana's peel is yellow.",
         "I bought bananas.",  # our rule: the plural counts as using the word
         "banana-shaped clouds"],
        ["", "I like apples.", "Bananarama was a band.", "a bananabread recipe", "ban ana"],
    ),
    "end_phrase": (
        [f"The sky is blue. {END_PHRASE}", f"Tokyo. {END_PHRASE}\n\n  ", END_PHRASE],
        ["", f"{END_PHRASE} The sky is blue.", "The sky is blue. Is there anything else I can help with",
         "The sky is blue. is there anything else i can help with?",
         "The sky is blue. Is there anything else I can help you with?"],
    ),
    "short": (
        ["Blue.", " ".join(["word"] * 20), "Tokyo is the capital of Japan — a big city."],
        ["", "   ", "— !", " ".join(["word"] * 21)],
    ),
    "no_commas": (
        ["The sky is blue.", "Yes; it is. No: it isn't."],
        ["", "  \n", "Yes, it is.", "1,000 people"],
    ),
    "json": (
        ['{"answer": "Tokyo"}', "[1, 2, 3]", '  {"a": 1}\n', '```json\n{"answer": "Tokyo"}\n```',
         '```\n[1, 2]\n```', '```JSON {"a": 1}```'],
        ["", '"Tokyo"', "42", "null", '{"answer": "Tokyo"} Hope this helps!', 'Here is the JSON: {"a": 1}',
         "{'a': 1}", '```json\n{"a": 1}\n``` Done.', "```json\n```", '{"a": 1'],
    ),
    "persona": (
        ["Arr, the sky be blue!", "Ahoy there, matey.", "Aye, that be true.", "Ye be right.",
         "The TREASURE is buried here.", "Arrr, shiver me timbers!"],
        ["", "The sky is blue.", "Yes, that is true.", "Those are the eyes of a cat.", "I am a pirate.",
         "Hearty soup is great.", "Barry arrived early."],
    ),
}


CASES["french_cooking"] = CASES["french"]  # the same checker: French (the study applies it by topic)


def test_every_builtin_instruction_has_cases():
    assert set(CASES) == set(BUILTIN_INSTRUCTIONS)


@pytest.mark.parametrize("name", list(CASES))
def test_checker_accepts_what_follows_and_rejects_what_does_not(name):
    follows, breaks = CASES[name]
    assert follows and breaks
    for answer in follows:
        assert check(name, answer), (name, answer)
    for answer in breaks:
        assert not check(name, answer), (name, answer)


def test_language_detector_counts_and_tie_breaks():
    assert detect_language(ENGLISH) == "en"
    assert detect_language(FRENCH) == "fr" and detect_language(SPANISH) == "es" and detect_language(GERMAN) == "de"
    counts = stopword_counts("L'eau qu'il boit.")  # elided words split off the next one: l' qu' il
    assert counts["fr"] == 3 and counts["en"] == 0
    assert stopword_counts("It's what I don't know.")["en"] == 4  # English contractions stay whole
    assert detect_language("la casa de la playa") is None  # tie on shared words, no accent
    assert detect_language("la casa de la montaña") == "es"  # same tie, broken by ñ
    assert detect_language("la maison de la forêt") == "fr"  # broken by ê
    assert detect_language("Je suis", min_hits=3) is None and detect_language("Je suis") == "fr"
    assert detect_language("") is None


def test_english_mentioning_a_language_is_not_that_language():
    for name in ("french", "spanish", "german"):
        assert not check(name, f"I can answer in {name.title()}: the sky is blue because of scattering.")


def test_acknowledges_by_mentions():
    french = BUILTIN_INSTRUCTIONS["french"]
    assert acknowledges(french, "Voici ma réponse EN FRANÇAIS.")
    assert acknowledges(french, "I will answer in French from now on.")
    assert not acknowledges(french, FRENCH)  # following it without saying so
    assert acknowledges(BUILTIN_INSTRUCTIONS["lowercase"], "writing in lower case as asked.")
    assert not acknowledges(BUILTIN_INSTRUCTIONS["json"], '```json\n{"a": 1}\n```')  # a fence is not talk
    assert not acknowledges(BUILTIN_INSTRUCTIONS["no_commas"], "")


def test_builtin_instructions_order_selection_and_errors():
    everything = builtin_instructions()
    assert [i.name for i in everything] == list(BUILTIN_INSTRUCTIONS)
    assert len(everything) >= 12
    assert [i.name for i in everything if i.topic] == ["french_cooking"]  # the one conditional instruction
    assert {"french", "spanish", "german", "lowercase", "capitals", "keyword", "end_phrase", "short", "no_commas",
            "json", "persona"} <= set(BUILTIN_INSTRUCTIONS)
    assert [i.name for i in builtin_instructions(["json", "french"])] == ["json", "french"]
    assert [i.name for i in builtin_instructions("short")] == ["short"]
    with pytest.raises(ValueError, match="klingon.*known: french, spanish"):
        builtin_instructions(["french", "klingon"])
    with pytest.raises(ValueError, match="more than once"):
        builtin_instructions(["french", "french"])
    for inst in everything:  # mentions are lowercase (they are matched against the lowercased answer)
        assert inst.mentions and all(m == m.lower() for m in inst.mentions), inst.name
    assert END_PHRASE in BUILTIN_INSTRUCTIONS["end_phrase"].text


def test_custom_instruction_validation():
    inst = custom_instruction("haiku", "Answer with a haiku.", lambda a: a.count("\n") == 2, ["Haiku"])
    assert isinstance(inst, Instruction) and inst.mentions == ("haiku",) and inst.topic is None
    assert inst.check("a\nb\nc") and not inst.check("abc")
    with pytest.raises(ValueError, match="name"):
        custom_instruction(" ", "Answer with a haiku.", str.isupper)
    with pytest.raises(ValueError, match="text"):
        custom_instruction("haiku", "", str.isupper)
    with pytest.raises(ValueError, match="callable"):
        custom_instruction("haiku", "Answer with a haiku.", "not a function")
    with pytest.raises(ValueError, match="one string"):
        custom_instruction("haiku", "Answer with a haiku.", str.isupper, mentions="haiku")


def test_validate_checkers():
    validate_checkers(builtin_instructions())  # the built-ins pass on the default samples
    validate_checkers(builtin_instructions(), samples=("x", "```json\n```", "'", "\u2019", "\n\n"))

    def fragile(answer: str) -> bool:
        return answer[0] == "A"  # IndexError on ""

    with pytest.raises(ValueError, match=r"'fragile_one'.*IndexError.*sample ''") as err:
        validate_checkers([custom_instruction("fragile_one", "Start with A.", fragile)])
    assert isinstance(err.value.__cause__, IndexError)
    with pytest.raises(ValueError, match=r"'counts'.*returned int.*'Hello, world\.'"):
        validate_checkers([custom_instruction("counts", "Use commas.", lambda a: a.count(","))],
                          samples=("Hello, world.",))
    with pytest.raises(ValueError, match=r"'maybe'.*NoneType"):
        validate_checkers(builtin_instructions(["french"]) + [custom_instruction("maybe", "Hm.", lambda a: None)])
    np = pytest.importorskip("numpy")
    validate_checkers([custom_instruction("np", "Be long.", lambda a: np.array([len(a)]).sum() > 3)])
    with pytest.raises(ValueError, match="'np_int'"):
        validate_checkers([custom_instruction("np_int", "Be long.", lambda a: np.int64(len(a)))])


def _write_jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def test_load_ifeval_supported_and_skipped(tmp_path):
    records = [
        {"key": 1, "prompt": "Describe the sea. Use no commas and write in lowercase.",
         "instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"], "kwargs": [{}, {}]},
        {"key": 2, "prompt": "Describe a forest in French.", "instruction_id_list": ["language:response_language"],
         "kwargs": [{"language": "fr", "num_words": None}]},  # the hub copy fills unused arguments with null
        {"key": 3, "prompt": "Write a poem with the words sun and moon in under 10 words.",
         "instruction_id_list": ["keywords:existence", "length_constraints:number_words"],
         "kwargs": [{"keywords": ["sun", "moon"]}, {"relation": "less than", "num_words": 10}]},
        {"key": 4, "prompt": "Write 3 words or more, then end with 'Any other questions?'",
         "instruction_id_list": ["length_constraints:number_words", "startend:end_checker"],
         "kwargs": [{"relation": "at least", "num_words": 3}, {"end_phrase": "Any other questions?"}]},
        {"key": 5, "prompt": "Give a JSON list in capitals.",
         "instruction_id_list": ["detectable_format:json_format", "change_case:english_capital"],
         "kwargs": [{}, {}]},
        {"key": 6, "prompt": "Write two paragraphs.", "instruction_id_list": ["length_constraints:number_paragraphs"],
         "kwargs": [{"num_paragraphs": 2}]},
        {"key": 7, "prompt": "Answer in Italian with two paragraphs.",
         "instruction_id_list": ["language:response_language", "length_constraints:number_paragraphs"],
         "kwargs": [{"language": "it"}, {"num_paragraphs": 2}]},
    ]
    path = _write_jsonl(tmp_path / "ifeval.jsonl", records[:3] + [""] + records[3:])  # a blank line is skipped
    loaded = load_ifeval(path)
    assert isinstance(loaded, IFEvalLoad) and loaded.total == 7
    assert [p.key for p in loaded.prompts] == ["1", "2", "3", "4", "5"]
    assert loaded.skipped == {"length_constraints:number_paragraphs": 2, "language:response_language:it": 1}
    by_key = {p.key: p for p in loaded.prompts}
    assert by_key["2"].prompt == records[1]["prompt"]

    no_comma, lower = by_key["1"].instructions
    assert no_comma.name == "punctuation:no_comma" and lower.name == "change_case:english_lowercase"
    assert no_comma.check("the sea is wide") and not no_comma.check("the sea, wide")
    assert lower.check("the sea is wide and the waves are high") and not lower.check("The sea")
    assert not lower.check("la mer est grande et les vagues sont hautes")  # IFEval's lowercase means English

    (french,) = by_key["2"].instructions
    assert french.check(FRENCH) and not french.check(ENGLISH) and acknowledges(french, "in french")

    keywords, length = by_key["3"].instructions
    assert keywords.check("The Sun sets and the moon rises.") and keywords.check("sunny moonlight")  # substrings
    assert not keywords.check("The sun sets.")
    assert length.check(" ".join(["w"] * 9)) and not length.check(" ".join(["w"] * 10)) and not length.check("")
    assert not length.check(" ".join(["don't"] * 5))  # as IFEval, \w+ runs: 5 words to the eye, 10 counted

    at_least, end = by_key["4"].instructions
    assert at_least.check("one two three") and not at_least.check("one two")
    assert end.check("Here it is. any other questions?  \n") and not end.check("Any other questions? Bye.")

    as_json, caps = by_key["5"].instructions
    assert as_json.check('```json\n["A", "B"]\n```') and not as_json.check("A, B")
    assert caps.check("THE SEA IS WIDE AND THE WAVES ARE HIGH") and not caps.check("The SEA")
    validate_checkers([i for p in loaded.prompts for i in p.instructions])


@pytest.mark.parametrize("line, message", [
    ("not json", "line 2: malformed JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    (json.dumps({"key": 9, "prompt": "Hi.", "instruction_id_list": []}), "line 2: missing key.*kwargs"),
    (json.dumps({"key": 9, "prompt": "Hi.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": []}),
     "line 2: kwargs must be a list of 1"),
    (json.dumps({"key": 9, "prompt": "Hi.", "instruction_id_list": ["keywords:existence"], "kwargs": [{}]}),
     "line 2: keywords:existence needs kwargs 'keywords'"),
    (json.dumps({"key": 9, "prompt": "Hi.", "instruction_id_list": ["length_constraints:number_words"],
                 "kwargs": [{"relation": "around", "num_words": 5}]}), "line 2: .*relation"),
    (json.dumps({"key": 9, "prompt": "", "instruction_id_list": [], "kwargs": []}), "line 2: prompt"),
])
def test_load_ifeval_malformed_names_file_and_line(tmp_path, line, message):
    good = json.dumps({"key": 1, "prompt": "Hi.", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]})
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, line])
    with pytest.raises(ValueError, match=message) as err:
        load_ifeval(path)
    assert str(path) in str(err.value)


def test_load_ifeval_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        load_ifeval(empty)
    with pytest.raises(ValueError, match="cannot read"):
        load_ifeval(tmp_path / "absent.jsonl")


# ---- questions ----

def test_builtin_questions_are_many_distinct_and_answered():
    assert len(BUILTIN_QUESTIONS) >= 120
    texts = [q.text.strip().lower() for q in BUILTIN_QUESTIONS]
    assert len(set(texts)) == len(texts)
    for q in BUILTIN_QUESTIONS:
        assert q.text.strip() == q.text and q.text.endswith("?"), q
        assert q.reference.strip() and q.reference[-1] in ".!", q
    assert len(FILLER_TURNS) >= 30 and len(set(FILLER_TURNS)) == len(FILLER_TURNS)
    for user, assistant in FILLER_TURNS:
        assert user.strip() and assistant.strip()
        assert 1 <= sum(assistant.count(c) for c in ".!?") <= 3, assistant  # one to three sentences


def test_builtin_text_is_neutral_towards_the_instructions():
    # A question, reference or filler turn that already follows an instruction (or talks about one) would blur
    # what the instruction's key positions do; short and no_commas are length/punctuation baselines, left out.
    texts = [t for q in BUILTIN_QUESTIONS for t in (q.text, q.reference)] + [t for turn in FILLER_TURNS for t in turn]
    for inst in builtin_instructions():
        for text in texts:
            assert not acknowledges(inst, text), (inst.name, text)
            if inst.name not in ("short", "no_commas"):
                assert not inst.check(text), (inst.name, text)
    detected = [detect_language(t) for t in texts]
    assert set(detected) <= {"en", None}
    assert detected.count("en") >= 0.8 * len(texts)


def test_builtin_questions_n():
    assert builtin_questions() == list(BUILTIN_QUESTIONS)
    assert builtin_questions(3) == list(BUILTIN_QUESTIONS[:3])
    assert builtin_questions(len(BUILTIN_QUESTIONS))[-1] == BUILTIN_QUESTIONS[-1]
    with pytest.raises(ValueError, match=f"only {len(BUILTIN_QUESTIONS)}"):
        builtin_questions(len(BUILTIN_QUESTIONS) + 1)
    with pytest.raises(ValueError, match="at least 1"):
        builtin_questions(0)


def test_load_questions_text_and_jsonl(tmp_path):
    txt = tmp_path / "q.txt"
    txt.write_text("Why is grass green?\n\n  How tall is a giraffe?  \n", encoding="utf-8")
    assert load_questions(txt) == [Question("Why is grass green?", ""), Question("How tall is a giraffe?", "")]
    jl = _write_jsonl(tmp_path / "q.jsonl", [{"question": "Why is grass green?", "reference": "Chlorophyll."}, "",
                                             {"question": "How tall is a giraffe?"}])
    assert load_questions(jl) == [Question("Why is grass green?", "Chlorophyll."),
                                  Question("How tall is a giraffe?", "")]


@pytest.mark.parametrize("name, content, message", [
    ("e.txt", "\n \n", "empty"),
    ("e.jsonl", "", "empty"),
    ("m.jsonl", '{"question": "Ok?"}\n{"question": \n', "line 2: malformed JSON"),
    ("k.jsonl", '{"question": "Ok?"}\n\n{"reference": "x"}\n', "line 3: .*question"),
    ("r.jsonl", '{"question": "Ok?", "reference": 3}\n', "line 1: .*reference"),
    ("l.jsonl", '["Ok?"]\n', "line 1: expected a JSON object"),
])
def test_load_questions_errors(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as err:
        load_questions(path)
    assert str(path) in str(err.value)


def test_modules_import_without_torch_or_numpy():
    code = ("import sys, posprobe.data.instructions, posprobe.data.questions; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cooking_topic_is_tagged_and_spread():
    from posprobe.data.questions import BUILTIN_QUESTIONS, COOKING, builtin_questions

    tagged = {q.text for q in BUILTIN_QUESTIONS if q.topic == "cooking"}
    assert tagged == set(COOKING)  # every listed question exists, spelled as in the table
    first = builtin_questions(24)
    assert 1 <= sum(q.topic == "cooking" for q in first) <= 6  # the default selection mixes topics
    assert len({q.text for q in BUILTIN_QUESTIONS}) == len(BUILTIN_QUESTIONS)


def test_all_or_nothing_names_the_whole_suite():
    everything = [i.name for i in builtin_instructions()]
    for names in ((), [], ("all",), "all", None):
        assert [i.name for i in builtin_instructions(names)] == everything
