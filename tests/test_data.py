"""Tests for posprobe.data: BLiMP loading, built-in pairs, text reading and token windows."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from posprobe.data import (
    BUILTIN_PAIRS_PER_PARADIGM,
    BUILTIN_SOURCE,
    DataError,
    MinimalPair,
    builtin_pairs,
    detokenize_wikitext,
    load_blimp,
    looks_like_wikitext,
    pairs_fingerprint,
    read_text,
    token_windows,
)

REAL_BLIMP = (Path(__file__).parents[1] / ".." / "shared" / "data" / "blimp").resolve()


def _record(uid: str, i: int, field: str = "syntax", term: str = "island_effects") -> dict:
    return {
        "sentence_good": f"Good sentence {uid} {i}.",
        "sentence_bad": f"Bad sentence {uid} {i}.",
        "field": field,
        "linguistics_term": term,
        "UID": uid,
        "simple_LM_method": True,
        "one_prefix_method": False,
        "two_prefix_method": False,
        "lexically_identical": False,
        "pairID": str(i),
    }


def _write(path: Path, records: list[dict | str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def blimp_dir(tmp_path: Path) -> Path:
    d = tmp_path / "blimp"
    d.mkdir()
    _write(d / "alpha.jsonl", [_record("alpha", i) for i in range(30)])
    _write(d / "beta.jsonl", [_record("beta", i, "morphology", "anaphor_agreement")
                              for i in range(20)])
    _write(d / "gamma.jsonl", [_record("gamma", i, "semantics", "quantifiers") for i in range(5)])
    (d / "notes.txt").write_text("not a paradigm")
    return d


# ------------------------------------------------------------------------ load_blimp


def test_load_blimp_folder(blimp_dir: Path) -> None:
    pairs = load_blimp(blimp_dir)
    assert len(pairs) == 55
    assert Counter(p.paradigm for p in pairs) == {"alpha": 30, "beta": 20, "gamma": 5}
    first = pairs[0]
    assert first == MinimalPair("Good sentence alpha 0.", "Bad sentence alpha 0.", "alpha",
                                "syntax", "island_effects", "0")


def test_load_blimp_single_file(blimp_dir: Path) -> None:
    pairs = load_blimp(blimp_dir / "beta.jsonl")
    assert {p.paradigm for p in pairs} == {"beta"}
    assert [p.pair_id for p in pairs] == [str(i) for i in range(20)]
    assert pairs[0].phenomenon == "anaphor_agreement"


def test_load_blimp_paradigm_and_field_filters(blimp_dir: Path) -> None:
    pairs = load_blimp(blimp_dir, paradigms=["gamma", "alpha"])
    assert Counter(p.paradigm for p in pairs) == {"alpha": 30, "gamma": 5}
    assert {p.paradigm for p in load_blimp(blimp_dir, paradigms="beta")} == {"beta"}
    by_field = load_blimp(blimp_dir, fields=["morphology", "semantics"])
    assert Counter(p.paradigm for p in by_field) == {"beta": 20, "gamma": 5}


def test_load_blimp_unknown_paradigm_lists_available(blimp_dir: Path) -> None:
    with pytest.raises(ValueError, match="nope") as info:
        load_blimp(blimp_dir, paradigms=["alpha", "nope"])
    assert isinstance(info.value, DataError)
    assert "alpha, beta, gamma" in str(info.value)


def test_load_blimp_empty_after_filter(blimp_dir: Path) -> None:
    with pytest.raises(DataError, match="no BLiMP pairs left"):
        load_blimp(blimp_dir, paradigms=["alpha"], fields=["semantics"])


def test_load_blimp_max_pairs_deterministic(blimp_dir: Path) -> None:
    a = load_blimp(blimp_dir, max_pairs=10, seed=3)
    b = load_blimp(blimp_dir, max_pairs=10, seed=3)
    assert a == b
    assert Counter(p.paradigm for p in a) == {"alpha": 10, "beta": 10, "gamma": 5}
    for name in ("alpha", "beta"):
        ids = [int(p.pair_id) for p in a if p.paradigm == name]
        assert ids == sorted(ids)  # sample kept in file order
    c = load_blimp(blimp_dir, max_pairs=10, seed=4)
    assert [p.pair_id for p in a] != [p.pair_id for p in c]
    # A paradigm's sample does not depend on which other paradigms are loaded.
    alone = load_blimp(blimp_dir, paradigms=["beta"], max_pairs=10, seed=3)
    assert alone == [p for p in a if p.paradigm == "beta"]


def test_load_blimp_skips_blank_lines(tmp_path: Path) -> None:
    f = _write(tmp_path / "p.jsonl", [_record("p", 0), "", "   ", _record("p", 1)])
    assert [p.pair_id for p in load_blimp(f)] == ["0", "1"]


def test_load_blimp_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    _write(tmp_path / "broken.jsonl", [_record("broken", 0), "", '{"sentence_good": "x",'])
    with pytest.raises(DataError, match=r"broken\.jsonl, line 3: malformed JSON") as info:
        load_blimp(tmp_path)
    assert str(info.value).startswith(f"BLiMP folder {tmp_path}: broken.jsonl, line 3")


def test_load_blimp_malformed_line_keeps_the_full_parser_message(tmp_path: Path) -> None:
    f = _write(tmp_path / "cut.jsonl", ['{"sentence_good": "unterminated'])
    with pytest.raises(DataError) as info:
        load_blimp(f)
    msg = str(info.value)
    # The position is part of the message; exc.msg alone ends at "starting at".
    assert msg.startswith(f"BLiMP file {f}, line 1: malformed JSON: ")
    assert "Unterminated string starting at: line 1 column 19 (char 18)" in msg


def test_load_blimp_missing_key(tmp_path: Path) -> None:
    rec = _record("p", 1)
    del rec["UID"]
    _write(tmp_path / "p.jsonl", [_record("p", 0), rec])
    with pytest.raises(DataError, match=r"p\.jsonl, line 2: missing key\(s\) UID"):
        load_blimp(tmp_path)


def test_load_blimp_non_object_line(tmp_path: Path) -> None:
    _write(tmp_path / "p.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match=r"p\.jsonl, line 1: expected a JSON object"):
        load_blimp(tmp_path)


def test_load_blimp_missing_or_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_blimp(tmp_path / "absent")
    with pytest.raises(DataError, match="no .jsonl files"):
        load_blimp(tmp_path)


def test_load_blimp_bad_max_pairs(blimp_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_pairs"):
        load_blimp(blimp_dir, max_pairs=0)


def test_load_real_blimp() -> None:
    from conftest import require_shared

    pairs = load_blimp(require_shared(REAL_BLIMP, "the real BLiMP in ../shared/data/blimp"))
    counts = Counter(p.paradigm for p in pairs)
    assert len(counts) == 67
    assert set(counts.values()) == {1000}
    assert all(p.good and p.bad for p in pairs)
    # The official release has a handful of pairs with good == bad; they are loaded as-is.
    assert sum(p.good == p.bad for p in pairs) < 50
    sample = load_blimp(REAL_BLIMP, paradigms=["adjunct_island"], max_pairs=50)
    assert len(sample) == 50 and sample[0].phenomenon == "island_effects"


# ------------------------------------------------------------------------ built-in pairs


def _diff_positions(good: str, bad: str) -> list[int]:
    g, b = good.split(), bad.split()
    assert len(g) == len(b), (good, bad)
    return [i for i, (x, y) in enumerate(zip(g, b)) if x != y]


def test_builtin_pairs_counts_and_paradigms() -> None:
    pairs = builtin_pairs()
    counts = Counter(p.paradigm for p in pairs)
    assert len(counts) >= 5
    assert set(counts.values()) == {BUILTIN_PAIRS_PER_PARADIGM}
    assert all(name.startswith("posprobe_") for name in counts)
    assert {"posprobe_sv_agreement_simple", "posprobe_sv_agreement_across_pp",
            "posprobe_det_noun_agreement", "posprobe_anaphor_number_agreement",
            "posprobe_anaphor_gender_agreement"} <= set(counts)
    assert {p.field for p in pairs} <= {"morphology", "syntax"}


def test_builtin_pairs_are_well_formed_minimal_pairs() -> None:
    pairs = builtin_pairs(max_pairs=10_000)
    for p in pairs:
        assert len(_diff_positions(p.good, p.bad)) == 1, p
        for s in (p.good, p.bad):
            assert s[0].isupper() and s.endswith(".") and "  " not in s, s
    for name in {p.paradigm for p in pairs}:
        own = [p for p in pairs if p.paradigm == name]
        assert len({(p.good, p.bad) for p in own}) == len(own)  # distinct pairs
        assert len({p.pair_id for p in own}) == len(own)
        assert len(own) >= BUILTIN_PAIRS_PER_PARADIGM


def test_builtin_pairs_examples() -> None:
    pairs = {(p.good, p.bad): p for p in builtin_pairs(max_pairs=100_000)}
    assert ("The student smiles.", "The student smile.") in pairs
    assert ("The students smile.", "The students smiles.") in pairs
    assert ("The boys saw themselves.", "The boys saw himself.") in pairs
    assert ("Alice praised herself.", "Alice praised himself.") in pairs
    assert ("Emma bought this book.", "Emma bought these book.") in pairs
    assert ("Adam broke the vase.", "Adam broken the vase.") in pairs


def test_builtin_pairs_deterministic_and_seeded() -> None:
    assert builtin_pairs(seed=1) == builtin_pairs(seed=1)
    assert builtin_pairs(seed=1) != builtin_pairs(seed=2)
    small = builtin_pairs(max_pairs=7, seed=1)
    assert Counter(p.paradigm for p in small) == {
        name: 7 for name in {p.paradigm for p in builtin_pairs()}}
    assert set(small) <= set(builtin_pairs(seed=1))  # smaller samples nest in larger ones


def test_builtin_pairs_balanced_number() -> None:
    pairs = builtin_pairs(max_pairs=20)
    simple = [p for p in pairs if p.paradigm == "posprobe_sv_agreement_simple"]
    singular_subjects = sum(p.good.endswith("s.") for p in simple)  # 3sg verbs end in -s
    assert singular_subjects == 10


def test_builtin_pairs_bad_max_pairs() -> None:
    with pytest.raises(ValueError):
        builtin_pairs(max_pairs=0)


def test_pairs_fingerprint() -> None:
    pairs = builtin_pairs(max_pairs=5)
    fp = pairs_fingerprint(pairs)
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert fp == pairs_fingerprint(builtin_pairs(max_pairs=5))
    assert fp != pairs_fingerprint(pairs[::-1])
    assert fp != pairs_fingerprint(builtin_pairs(max_pairs=5, seed=1))
    assert BUILTIN_SOURCE == "posprobe-builtin-templates-v1"


# ------------------------------------------------------------------------ text


def test_detokenize_wikitext_examples() -> None:
    src = (
        " = Robert <unk> = \n"
        " \n"
        " = = Career = = \n"
        " He had a guest @-@ starring role , in 2000 . It cost 1 @,@ 000 ( about 3 @.@ 5 % ) ; "
        "\" Teddy 's Story \" didn 't air : the players ' union wo n't sign ! \n"
    )
    out = detokenize_wikitext(src).split("\n")
    assert out[0] == "Robert <unk>"
    assert out[1] == ""
    assert out[2] == "Career"
    assert out[3] == ("He had a guest-starring role, in 2000. It cost 1,000 (about 3.5%); "
                      "\"Teddy's Story\" didn't air: the players' union won't sign!")


def test_looks_like_wikitext() -> None:
    assert looks_like_wikitext("a guest @-@ starring role")
    assert looks_like_wikitext("a , b , c , d .")
    assert not looks_like_wikitext("Plain prose, with commas, as usual, everywhere.")


def test_read_text(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("Hello , world. Ünïcode stays.\n", encoding="utf-8")
    assert read_text(plain) == "Hello , world. Ünïcode stays.\n"  # one " , " is not WikiText
    assert read_text(plain, detokenize=True).startswith("Hello, world.")
    wiki = tmp_path / "wiki.txt"
    wiki.write_text(" A two @-@ part episode , aired .\n", encoding="utf-8")
    assert read_text(wiki) == "A two-part episode, aired.\n"
    assert read_text(wiki, detokenize=False) == " A two @-@ part episode , aired .\n"


def test_read_text_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        read_text(tmp_path / "absent.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\t\n", encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        read_text(empty)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(DataError, match="UTF-8"):
        read_text(binary)


# ------------------------------------------------------------------------ token_windows


def test_token_windows_basic() -> None:
    ids = list(range(10))
    assert token_windows(ids, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # tail [9] dropped
    assert token_windows(ids, 5) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert token_windows(ids, 10) == [ids]
    assert token_windows(ids, 4, stride=2) == [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7],
                                                [6, 7, 8, 9]]
    assert token_windows(ids, 2, stride=4) == [[0, 1], [4, 5], [8, 9]]
    assert token_windows(ids, 2, max_windows=2) == [[0, 1], [2, 3]]
    assert token_windows(tuple(ids), 2, max_windows=100) == [[i, i + 1] for i in range(0, 10, 2)]


def test_token_windows_returns_plain_ints() -> None:
    import numpy as np  # a hard dependency of posprobe: never a skip
    out = token_windows(np.arange(6, dtype=np.int64), 3)
    assert out == [[0, 1, 2], [3, 4, 5]]
    assert all(type(t) is int for w in out for t in w)


@pytest.mark.parametrize(
    "ids, window, kwargs, exc",
    [
        ([1, 2, 3], 1, {}, ValueError),
        ([1, 2, 3], 0, {}, ValueError),
        ([1, 2, 3], 4, {}, DataError),
        ([], 2, {}, DataError),
        ([1, 2, 3], 2, {"stride": 0}, ValueError),
        ([1, 2, 3], 2, {"max_windows": 0}, ValueError),
    ],
)
def test_token_windows_errors(ids: list[int], window: int, kwargs: dict, exc: type) -> None:
    with pytest.raises(exc):
        token_windows(ids, window, **kwargs)
