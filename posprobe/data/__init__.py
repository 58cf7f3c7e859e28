"""Evaluation data: minimal pairs (BLiMP files, built-in templates), plain text and token windows.

Pure Python (torch only inside `random_token_ids`, when called): the CLI validates data with these before any
model loads.
"""

from posprobe.data.builtin import (
    BUILTIN_CORPUS_SOURCE,
    BUILTIN_PAIRS_PER_PARADIGM,
    BUILTIN_SOURCE,
    BUILTIN_TEXT,
    builtin_corpus,
    builtin_pairs,
)
from posprobe.data.pairs import MinimalPair, load_blimp, pairs_fingerprint
from posprobe.data.records import DataError
from posprobe.data.text import (
    detokenize_wikitext,
    framed_windows,
    looks_like_wikitext,
    random_token_ids,
    read_text,
    token_windows,
)

__all__ = [
    "BUILTIN_CORPUS_SOURCE", "BUILTIN_PAIRS_PER_PARADIGM", "BUILTIN_SOURCE", "BUILTIN_TEXT", "DataError", "MinimalPair",
    "builtin_corpus", "builtin_pairs",
    "detokenize_wikitext", "framed_windows", "load_blimp", "looks_like_wikitext", "pairs_fingerprint",
    "random_token_ids", "read_text", "token_windows",
]
