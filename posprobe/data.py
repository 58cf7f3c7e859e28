"""Evaluation data: BLiMP minimal pairs, built-in minimal pairs, plain text and token windows.

Nothing here touches the network: BLiMP is read from local ``.jsonl`` files and the
built-in pairs are generated from templates so the shift test can run offline.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUILTIN_PAIRS_PER_PARADIGM", "BUILTIN_SOURCE", "DataError", "MinimalPair", "builtin_pairs",
    "detokenize_wikitext", "load_blimp", "looks_like_wikitext", "pairs_fingerprint", "read_text",
    "token_windows",
]

BUILTIN_SOURCE = "posprobe-builtin-templates-v1"
BUILTIN_PAIRS_PER_PARADIGM = 200

_BLIMP_KEYS = ("sentence_good", "sentence_bad", "field", "linguistics_term", "UID", "pairID")


class DataError(ValueError):
    """Input data is missing, malformed or empty after filtering."""


@dataclass(frozen=True)
class MinimalPair:
    """One grammatical/ungrammatical sentence pair."""

    good: str
    bad: str
    paradigm: str
    field: str
    phenomenon: str
    pair_id: str


# --------------------------------------------------------------------------- BLiMP


def _blimp_files(path: Path) -> list[Path]:
    if not path.exists():
        raise DataError(f"BLiMP path does not exist: {path}")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
    if not files:
        raise DataError(f"no .jsonl files in BLiMP folder: {path}")
    return files


def _read_blimp_file(file: Path) -> list[MinimalPair]:
    pairs: list[MinimalPair] = []
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{file.name}: cannot read file: {exc}") from exc
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{file.name}, line {lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: malformed JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        missing = [k for k in _BLIMP_KEYS if k not in rec]
        if missing:
            raise DataError(f"{where}: missing key(s) {', '.join(missing)}")
        good, bad = rec["sentence_good"], rec["sentence_bad"]
        if not isinstance(good, str) or not isinstance(bad, str):
            raise DataError(f"{where}: sentence_good and sentence_bad must be strings")
        pairs.append(MinimalPair(good, bad, str(rec["UID"]), str(rec["field"]),
                                 str(rec["linguistics_term"]), str(rec["pairID"])))
    return pairs


def _check_max_pairs(max_pairs: int | None) -> None:
    if max_pairs is not None and max_pairs < 1:
        raise ValueError(f"max_pairs must be >= 1 or None, got {max_pairs}")


def load_blimp(
    path: str | Path,
    *,
    paradigms: Sequence[str] | None = None,
    fields: Sequence[str] | None = None,
    max_pairs: int | None = None,
    seed: int = 0,
) -> list[MinimalPair]:
    """Load BLiMP minimal pairs from a folder of ``<paradigm>.jsonl`` files or one file.

    Paradigm names are file names without ``.jsonl`` (equal to ``UID`` in the official
    release). ``max_pairs`` applies per paradigm as a seeded random sample kept in file
    order. Returns the pairs, files in sorted name order.
    """
    _check_max_pairs(max_pairs)
    files = _blimp_files(Path(path))
    if paradigms is not None:
        if isinstance(paradigms, str):  # a bare string would be iterated per character
            paradigms = [paradigms]
        by_name = {f.stem: f for f in files}
        unknown = [p for p in paradigms if p not in by_name]
        if unknown:
            raise DataError(f"unknown BLiMP paradigm(s) {', '.join(unknown)}; "
                            f"available: {', '.join(sorted(by_name))}")
        files = [f for f in files if f.stem in set(paradigms)]
    wanted = None if fields is None else {fields} if isinstance(fields, str) else set(fields)
    pairs: list[MinimalPair] = []
    seen_fields: set[str] = set()
    for file in files:
        file_pairs = _read_blimp_file(file)
        seen_fields.update(p.field for p in file_pairs)
        if wanted is not None:
            file_pairs = [p for p in file_pairs if p.field in wanted]
        pairs.extend(file_pairs)
    if max_pairs is not None:
        pairs = _sample_per_paradigm(pairs, max_pairs, seed)
    if not pairs:
        raise DataError(f"no BLiMP pairs left after filtering (paradigms={paradigms}, "
                        f"fields={fields}); fields present: {', '.join(sorted(seen_fields))}")
    return pairs


def _sample_per_paradigm(pairs: list[MinimalPair], k: int, seed: int) -> list[MinimalPair]:
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault(p.paradigm, []).append(i)
    keep: set[int] = set()
    for name, idx in groups.items():
        # Seed per paradigm so a paradigm's sample does not depend on which others are loaded.
        rng = random.Random(f"blimp:{name}:{seed}")
        keep.update(idx if len(idx) <= k else rng.sample(idx, k))
    return [p for i, p in enumerate(pairs) if i in keep]


# --------------------------------------------------------------------------- built-in pairs


def _forms(words: str) -> list[tuple[str, ...]]:
    return [tuple(w.split("/")) for w in words.split()]


# (singular, plural) human nouns, used as agreement controllers.
_PEOPLE = _forms(
    "student/students teacher/teachers doctor/doctors farmer/farmers child/children man/men "
    "woman/women nurse/nurses singer/singers driver/drivers pilot/pilots lawyer/lawyers "
    "baker/bakers artist/artists neighbor/neighbors visitor/visitors waiter/waiters "
    "guest/guests painter/painters tourist/tourists"
)
# (3sg, plural) present-tense verbs: intransitive, then transitive for relative clauses.
_INTRANS = _forms(
    "smiles/smile laughs/laugh waits/wait sings/sing swims/swim dances/dance works/work "
    "eats/eat listens/listen cries/cry shouts/shout walks/walk sleeps/sleep runs/run leaves/leave"
)
_TRANS = _forms("likes/like sees/see knows/know helps/help trusts/trust admires/admire "
                "visits/visit meets/meet")
_PLACES = _forms("door/doors window/windows table/tables car/cars house/houses tree/trees "
                 "bench/benches shop/shops gate/gates wall/walls")
_PREPS = ("near", "behind", "beside")
_THINGS = _forms("book/books chair/chairs apple/apples shirt/shirts box/boxes knife/knives "
                 "dish/dishes glass/glasses photo/photos map/maps lamp/lamps cup/cups "
                 "key/keys coat/coats candle/candles")
_DET_VERBS = "bought found noticed wanted liked saw cleaned carried moved chose".split()
_FEMALE = "Alice Emma Grace Hannah Julia Laura Maria Nora Olivia Rachel Sophie Zoe".split()
_MALE = "Adam Brian Daniel Edward Frank George Henry James Kevin Oliver Peter Thomas".split()
# (singular, plural, gender) for reflexive agreement.
_GENDERED = [(*f, "m") for f in _forms(
    "man/men boy/boys king/kings father/fathers brother/brothers uncle/uncles son/sons "
    "husband/husbands waiter/waiters prince/princes")] + [(*f, "f") for f in _forms(
    "woman/women girl/girls queen/queens mother/mothers sister/sisters aunt/aunts "
    "daughter/daughters wife/wives waitress/waitresses princess/princesses")]
_REFL_VERBS = ("saw hurt praised blamed helped admired criticized described introduced fooled "
               "defended trusted watched surprised questioned").split()
_REFL = {"m": "himself", "f": "herself"}
# past/participle/objects: the two forms differ, so the participle alone is an error.
_IRREGULAR = _forms(
    "broke/broken/vase/window/record ate/eaten/apple/sandwich/soup wrote/written/letter/essay/song "
    "drove/driven/truck/bus/car hid/hidden/key/letter/money stole/stolen/money/car/painting "
    "chose/chosen/book/dress/color froze/frozen/soup/bread/fish took/taken/bus/money/key "
    "drew/drawn/map/picture/horse threw/thrown/ball/stone/key wore/worn/coat/dress/hat "
    "tore/torn/letter/map/shirt sang/sung/song/anthem/hymn drank/drunk/water/tea/milk "
    "forgot/forgotten/key/song/address shook/shaken/bottle/box/tree "
    "bit/bitten/apple/sandwich/carrot "
    "saw/seen/car/painting/bus rode/ridden/horse/bike/bus"
)

_Item = tuple[str, tuple[str, ...], str, str, tuple[str, ...]]  # cond, before, good, bad, after
_SG_PL = ((0, "sg"), (1, "pl"))
_NAMES = _FEMALE + _MALE


def _s(before: tuple[str, ...], word: str, after: tuple[str, ...]) -> str:
    text = " ".join((*before, word, *after))
    return text[0].upper() + text[1:] + "."


def _gen_sv_simple() -> list[_Item]:
    return [(c, ("the", n[i]), v[i], v[1 - i], ())
            for i, c in _SG_PL for n in _PEOPLE for v in _INTRANS]


def _gen_sv_pp() -> list[_Item]:
    # The attractor has the opposite number, so agreeing with the nearest noun is wrong.
    return [(c, ("the", n[i], p, "the", a[1 - i]), v[i], v[1 - i], ())
            for i, c in _SG_PL for n in _PEOPLE for p in _PREPS for a in _PLACES for v in _INTRANS]


def _gen_sv_rc() -> list[_Item]:
    # Three fixed partners per head noun keep the pool ~14k yet varied.
    return [(c, ("the", n[i], "that", "the", m[1 - i], t[1 - i]), v[i], v[1 - i], ())
            for i, c in _SG_PL for k, n in enumerate(_PEOPLE)
            for m in (_PEOPLE[(k + j) % len(_PEOPLE)] for j in (1, 7, 13))
            for t in _TRANS for v in _INTRANS]


def _gen_det_noun() -> list[_Item]:
    return [(c, (name, verb), d[i], d[1 - i], (t[i],))
            for i, c in _SG_PL for d in (("this", "these"), ("that", "those"))
            for name in _NAMES for verb in _DET_VERBS for t in _THINGS]


def _gen_anaphor_number() -> list[_Item]:
    return [(c, ("the", (sg, pl)[i], verb), (_REFL[g], "themselves")[i],
             (_REFL[g], "themselves")[1 - i], ())
            for sg, pl, g in _GENDERED for verb in _REFL_VERBS for i, c in _SG_PL]


def _gen_anaphor_gender() -> list[_Item]:
    return [(g, (name, verb), _REFL[g], _REFL["f" if g == "m" else "m"], ())
            for g, names in (("f", _FEMALE), ("m", _MALE)) for name in names
            for verb in _REFL_VERBS]


def _gen_irregular() -> list[_Item]:
    return [("all", (name,), past, part, ("the", obj))
            for name in _NAMES for past, part, *objs in _IRREGULAR for obj in objs]


# paradigm -> (field, phenomenon, generator); phenomena use BLiMP's terms so they can be compared.
_BUILTIN = {
    "posprobe_sv_agreement_simple": ("morphology", "subject_verb_agreement", _gen_sv_simple),
    "posprobe_sv_agreement_across_pp": ("syntax", "subject_verb_agreement", _gen_sv_pp),
    "posprobe_sv_agreement_across_relative_clause": ("syntax", "subject_verb_agreement",
                                                     _gen_sv_rc),
    "posprobe_det_noun_agreement": ("morphology", "determiner_noun_agreement", _gen_det_noun),
    "posprobe_anaphor_number_agreement": ("morphology", "anaphor_agreement", _gen_anaphor_number),
    "posprobe_anaphor_gender_agreement": ("morphology", "anaphor_agreement", _gen_anaphor_gender),
    "posprobe_irregular_past": ("morphology", "irregular_forms", _gen_irregular),
}


def _balanced_order(items: list[_Item], rng: random.Random) -> list[int]:
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(item[0], []).append(i)
    lists = [rng.sample(groups[c], len(groups[c])) for c in sorted(groups)]
    # Round-robin over conditions so any prefix is balanced (e.g. singular vs plural subjects).
    return [g[j] for j in range(max(map(len, lists))) for g in lists if j < len(g)]


def builtin_pairs(*, max_pairs: int | None = None, seed: int = 0) -> list[MinimalPair]:
    """Generate posprobe's own minimal pairs (no download), ``posprobe_*`` paradigms.

    Returns ``BUILTIN_PAIRS_PER_PARADIGM`` pairs per paradigm (or ``max_pairs``, capped at
    the template pool), a seeded, condition-balanced sample kept in generation order.
    Smaller ``max_pairs`` gives a subset of larger ones for the same seed. ``pair_id`` is
    the index in the paradigm's full template pool, so it is stable across seeds.
    """
    _check_max_pairs(max_pairs)
    n = BUILTIN_PAIRS_PER_PARADIGM if max_pairs is None else max_pairs
    out: list[MinimalPair] = []
    for name, (field, phenomenon, gen) in _BUILTIN.items():
        items = gen()
        rng = random.Random(f"{BUILTIN_SOURCE}:{name}:{seed}")
        for i in sorted(_balanced_order(items, rng)[:n]):
            _, before, good, bad, after = items[i]
            out.append(MinimalPair(_s(before, good, after), _s(before, bad, after),
                                   name, field, phenomenon, str(i)))
    return out


def pairs_fingerprint(pairs: Iterable[MinimalPair]) -> str:
    """Return the sha256 hex digest of the pairs' content, in order (for meta.json)."""
    h = hashlib.sha256()
    for p in pairs:
        rec = [p.paradigm, p.field, p.phenomenon, p.pair_id, p.good, p.bad]
        h.update(json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n")
    return h.hexdigest()


# --------------------------------------------------------------------------- text


_WT_MARKERS = (" @-@ ", " @,@ ", " @.@ ")


def looks_like_wikitext(text: str) -> bool:
    """Return True if ``text`` looks word-tokenised like WikiText (``@-@`` or spaced commas)."""
    if any(m in text for m in _WT_MARKERS):
        return True
    # Ordinary prose almost never puts a space before a comma; tokenised text always does.
    spaced = text.count(" , ")
    return spaced >= 3 and spaced >= 0.5 * text.count(",")


def _detok_line(line: str) -> str:
    line = line.strip()
    # Headings look like "= = Career = =": keep the title, drop the markup.
    if line.startswith("=") and line.endswith("=") and line.strip("= "):
        line = line.strip("= ")
    for marker, repl in zip(_WT_MARKERS, ("-", ",", ".")):
        line = line.replace(marker, repl)
    line = re.sub(r'" (.*?) "', r'"\1"', line)
    line = re.sub(r" (n't|'t|'s|'re|'ve|'ll|'d|'m)\b", r"\1", line)
    line = re.sub(r"(?<=s) '(?= |$)", "'", line)
    line = re.sub(r" ([,.;:!?%)\]}])", r"\1", line)
    line = re.sub(r"([(\[{$]) ", r"\1", line)
    return line


def detokenize_wikitext(text: str) -> str:
    """Return ``text`` with WikiText tokenisation undone (``<unk>`` kept, headings unmarked)."""
    return "\n".join(_detok_line(line) for line in text.split("\n"))


def read_text(path: str | Path, detokenize: bool | None = None) -> str:
    """Return the UTF-8 text of ``path``; detokenised if WikiText (``detokenize=None``: auto)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"text file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {p} as UTF-8 text: {exc}") from exc
    if not text.strip():
        raise DataError(f"text file is empty: {p}")
    if detokenize is None:
        detokenize = looks_like_wikitext(text)
    return detokenize_wikitext(text) if detokenize else text


def token_windows(token_ids: Sequence[int], window: int, *, max_windows: int | None = None,
                  stride: int | None = None) -> list[list[int]]:
    """Return consecutive windows of exactly ``window`` ids, starting every ``stride`` ids.

    ``stride`` defaults to ``window`` (no overlap); a shorter tail is dropped.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    stride = window if stride is None else stride
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    n = len(token_ids)
    if n < window:
        raise DataError(f"need at least {window} tokens for one window, got {n}")
    starts = range(0, n - window + 1, stride)
    if max_windows is not None:
        starts = starts[:max_windows]
    # int() so numpy/torch ids come back as plain Python ints.
    return [[int(t) for t in token_ids[s : s + window]] for s in starts]
