"""posprobe's own minimal pairs, generated from templates so the shift test runs offline."""

from __future__ import annotations

import random

from posprobe.data.pairs import MinimalPair, check_max_pairs

BUILTIN_SOURCE = "posprobe-builtin-templates-v1"
BUILTIN_PAIRS_PER_PARADIGM = 200

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
    check_max_pairs(max_pairs)
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
