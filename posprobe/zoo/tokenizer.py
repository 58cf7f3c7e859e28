"""The zoo's tokenizer: a small byte-level BPE trained on the training text with Hugging Face `tokenizers`, saved
with every member (`AutoTokenizer` loads it). Byte-level, so any text encodes without unknown tokens; the same text
and size give the same merges (the trainer is deterministic)."""

from __future__ import annotations

from typing import Any

__all__ = ["EOT", "PAD", "character_tokenizer", "train_tokenizer"]

#: Document separator (also BOS/EOS) and padding; ids 0 and 1 of every zoo vocabulary.
EOT = "<|endoftext|>"
PAD = "<pad>"


def train_tokenizer(text: str, vocab_size: int) -> Any:
    """A `PreTrainedTokenizerFast` with a byte-level BPE of `vocab_size` entries (257 at least: 256 bytes + EOT/PAD
    and merges) trained on `text`; ids 0/1 are EOT/PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"vocab_size must be >= 258 (256 bytes and two special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_lines(text), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=PAD,
                                   model_max_length=1_000_000_000)


def character_tokenizer(vocab: dict[str, int], special: list[str], unk: str) -> Any:
    """A `PreTrainedTokenizerFast` reading one token per character over the fixed `vocab` (token -> id; ids 0/1 must
    be EOT/PAD, as in every zoo vocabulary), with the multi-character tokens `special` (EOT, PAD, `unk`, ...) kept
    whole; a character outside `vocab` reads as `unk`. Every member and seed of a synthetic task reads the same ids.

    Args:
        vocab: every token and its id.
        special: the tokens that are not single characters (written as they are, never split).
        unk: the token of characters outside `vocab`.

    Returns:
        The tokenizer (BOS = EOS = EOT, padding PAD)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab.get(EOT) != 0 or vocab.get(PAD) != 1:
        raise ValueError("a zoo vocabulary has EOT at id 0 and PAD at id 1")
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(special))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=PAD, unk_token=unk,
                                   model_max_length=1_000_000_000)


def _lines(text: str, size: int = 1 << 16) -> Any:
    # Pieces of about `size` characters cut after a newline: the pre-tokenizer never joins across a newline, so the
    # word counts (and the merges) are those of the whole text.
    start = 0
    while start < len(text):
        cut = text.find("\n", start + size)
        end = len(text) if cut < 0 else cut + 1
        yield text[start:end]
        start = end
