"""The zoo's tokenizer (`posprobe.zoo.tokenizer`) without training a model: the text fed to the BPE trainer in pieces
gives the merges of the whole text fed at once (the reference: Hugging Face `tokenizers` trained here on the text as
one string), the vocabulary has exactly the size asked, ids 0/1 are the end and padding tokens, and any text
round-trips. Seconds.

Plants seen failing: pieces cut mid-line (the size reached, not the next newline); the last piece dropped; the
special tokens swapped; the bytes alphabet left out (a character not in the text becomes unknown); 257 accepted; a
one-character last piece dropped."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import posprobe.zoo.tokenizer as T
from posprobe.zoo.tokenizer import EOT, PAD, train_tokenizer

TEXT = ("".join(f"line {i}: the cat sat on mat number {i * 7 % 13}, then left.\n" for i in range(400))
        + "no newline at the end " * 20)


def _whole_text_vocab(text: str, size: int) -> dict:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=[EOT, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    return tok.get_vocab()


def test_pieces_cut_after_newlines_and_cover_the_text():
    pieces = list(T._lines(TEXT, size=100))
    assert "".join(pieces) == TEXT and len(pieces) > 100
    assert all(p.endswith("\n") for p in pieces[:-1]) and len(pieces[-1]) > 400
    assert all(len(p) > 100 for p in pieces[:-1])  # each piece runs past `size` to the next newline
    assert list(T._lines("", size=5)) == [] and list(T._lines("ab", size=5)) == ["ab"]
    assert list(T._lines("ab\nc", size=1)) == ["ab\n", "c"]  # a one-character last piece is kept


def test_merges_equal_the_whole_text_trained_at_once(monkeypatch):
    want = _whole_text_vocab(TEXT, 320)
    real = T._lines
    monkeypatch.setattr(T, "_lines", lambda text: real(text, size=50))  # many pieces
    tok = train_tokenizer(TEXT, 320)
    assert tok.get_vocab() == want and len(want) == 320


def test_special_ids_bytes_and_round_trip():
    tok = train_tokenizer(TEXT, 300)
    assert tok.convert_ids_to_tokens([0, 1]) == [EOT, PAD]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (EOT, EOT, PAD)
    odd = "Zoë's naïve café — 東京 🚀\n\ttabs"  # nothing of this is in TEXT's merges: bytes carry it
    assert tok.unk_token_id is None and tok.decode(tok(odd)["input_ids"]) == odd
    with pytest.raises(ValueError, match="vocab_size must be >= 258"):
        train_tokenizer(TEXT, 257)
    assert len(train_tokenizer(TEXT, 258).get_vocab()) == 258
