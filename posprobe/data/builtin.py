"""posprobe's own minimal pairs, generated from templates so the shift test runs offline."""

from __future__ import annotations

import functools
import random

from posprobe.data.pairs import MinimalPair, check_max_pairs

BUILTIN_SOURCE = "posprobe-builtin-templates-v1"
BUILTIN_PAIRS_PER_PARADIGM = 200

#: English prose (~800 words, written for posprobe) used when an analysis is given no --text:
#: a lighthouse story, a harbour town, a village. The first sentence is decompose's default sentence.
BUILTIN_TEXT = (
    'The old lighthouse stood at the edge of the cliff, and every night its lamp swept across the dark '
    'water. Fishermen who worked the northern banks had trusted that light for more than a century. When '
    'the keeper retired, the town council voted to replace him with an automatic beacon, but the '
    'villagers objected and raised money to keep the tower staffed. A young engineer named Clara answered'
    ' the advertisement and moved into the cottage at its base. She repaired the clockwork that turned '
    'the lens, cleaned the brass fittings and kept a careful log of passing ships, storms and the hours '
    'of fog. In her first winter a cargo vessel lost its engine during a gale and drifted towards the '
    'rocks. Clara saw its lights, fired the signal rockets and telephoned the lifeboat station in the '
    'harbour. The crew of nine was brought ashore before dawn, cold but unharmed, and the story was '
    'printed in newspapers across the country. Years later the beacon was finally automated, yet the town'
    ' still pays for a keeper, because people say that a machine can watch the sea but cannot care about '
    'the sailors on it. Visitors now climb the spiral stairs in summer, read the old logbooks and look '
    'out over the bay.\n\nThe harbour town woke slowly on winter mornings. Fishing boats came back before '
    'sunrise, and the market opened an hour later, when the first carts rolled down from the hills with '
    'bread, cheese and apples. Children walked to school along the sea wall, counting the gulls that sat '
    'on every post.\n\nIn the old library above the post office, a retired teacher kept a record of the '
    'weather. Every day for forty years she wrote down the temperature, the direction of the wind and the'
    ' height of the tide. Her notebooks filled three shelves. Scientists from the university later used '
    'them to show how the storms had grown stronger and the winters shorter over the decades.\n\nThe town '
    'council argued for a long time about a new bridge across the river. Some people wanted it built of '
    'stone, like the church and the harbour wall; others said steel would be cheaper and would last just '
    'as long. In the end they chose a wooden footbridge, painted green, which the children decorated with'
    ' lanterns every December.\n\nWhen summer came, visitors arrived by train. They rented small rooms '
    'above the shops, swam in the cold water, and ate fried fish on the beach. By September they were '
    'gone again, the cafes closed their shutters, and the town returned to its quiet routine of boats, '
    'markets and weather notes.\n\nThe old lighthouse stood at the end of a narrow spit of land, and for '
    'more than a century its lamp had turned every night without fail. The keepers who lived there kept '
    'careful logs of the weather, the ships that passed, and the birds that rested on the gallery during '
    'the autumn storms. When the light was finally automated, the last keeper packed his books into a '
    'wooden crate and walked back along the shore to the village, where he opened a small shop that sold '
    'maps, rope and tea.\nChildren from the school would visit him on Fridays. He showed them how to read '
    'a chart, how to find the north star on a clear evening, and how to tie a knot that would hold a boat'
    ' in a rising tide. Most of them forgot the knots within a week, but a few remembered the stories '
    'about the winter when the ice closed the harbour and the supply ship could not reach the island for '
    'forty days.\nIn spring the fishing boats went out before dawn and came back in the early afternoon, '
    'their decks covered in nets and silver fish. The market on the square opened at noon. Farmers '
    'brought eggs, cheese and early vegetables, and a baker from the next town sold bread that was still '
    'warm. Visitors often asked why the village had no hotel; the answer was always the same: nobody had '
    'ever thought it needed one.\nScientists later came to study the currents near the spit. They placed '
    'small instruments on the sea floor and measured the temperature and the salt every hour for three '
    'years. Their report showed that the water had grown warmer, slowly but steadily, and that the fish '
    'the boats depended on were moving north. The village council met many times to discuss what could be'
    ' done, and in the end it decided to plant sea grass along the bay and to limit the number of boats '
    "allowed out each season.\nToday the lighthouse is a museum. Its rooms hold the keepers' logs, a brass"
    ' telescope, photographs of wrecks and rescues, and the wooden crate, now empty, in which the last '
    'keeper carried his books home.\n'
)

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

    Args:
        max_pairs: pairs per paradigm (None: ``BUILTIN_PAIRS_PER_PARADIGM``), capped at the template pool; >= 1.
            Smaller ``max_pairs`` gives a subset of larger ones for the same seed.
        seed: the seed of the per-paradigm sample.

    Returns:
        ``BUILTIN_PAIRS_PER_PARADIGM`` (or ``max_pairs``) `MinimalPair`s per paradigm, a seeded,
            condition-balanced sample kept in generation order. ``pair_id`` is the index in the paradigm's full
            template pool, so it is stable across seeds.
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


BUILTIN_CORPUS_SOURCE = "posprobe built-in corpus (CC0)"


@functools.lru_cache(maxsize=1)
def builtin_corpus() -> str:
    """posprobe's built-in corpus: `BUILTIN_TEXT` followed by ~12,000 words of English prose written for posprobe (a
    short story, encyclopedia-style science articles, an essay on everyday technology, a year of letters), dedicated
    to the public domain (CC0 1.0; `posprobe/data/corpus/LICENSE`). Enough for windows of 512 tokens where the
    built-in text alone gives one. Shipped as package data: never a download."""
    from importlib.resources import files

    body = files("posprobe.data").joinpath("corpus", "corpus.txt").read_text(encoding="utf-8")
    return BUILTIN_TEXT + "\n\n" + body.strip() + "\n"
