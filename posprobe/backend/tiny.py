"""Built-in tiny random models for demos and tests, with a byte-level tokenizer that needs no download.

Random-init TL models have zero biases and unit LayerNorm weights, which hides bias-handling bugs,
so every parameter here is drawn at random (seeded).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from posprobe.backend.tiny_specs import SPECS  # re-exported: callers read tiny.SPECS


def byte_tokenizer() -> Any:
    """A Hugging Face fast tokenizer over UTF-8 bytes (ids 0-255) plus <bos>=256, <eos>=257, <pad>=258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    vocab.update({"<bos>": 256, "<eos>": 257, "<pad>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    # TL re-loads tokenizers from their folder (to add BOS handling), so give it one on disk.
    from posprobe.backend.sources import cache_dir

    folder = cache_dir() / "byte-tokenizer-v1"
    if not (folder / "tokenizer.json").is_file():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        fast.save_pretrained(tmp)
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _byte_of(ch: str) -> int:
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256+.
    table = _bytes_to_unicode()
    return {v: k for k, v in table.items()}[ch]


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tiny(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """A seeded random HookedTransformer for spec `name` ("tiny-ape" or "tiny-rope"), all weights random."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    if name not in SPECS:
        raise ValueError(f"Unknown tiny spec {name!r}; choose one of {sorted(SPECS)}")
    cfg = HookedTransformerConfig(**SPECS[name], d_vocab=259, seed=seed, dtype=dtype, device=device,
                                  default_prepend_bos=True, model_name=name)
    model = HookedTransformer(cfg, tokenizer=byte_tokenizer())
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith((".w", "ln_final.w")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
            elif pname.split(".")[-1].startswith("b"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    model.has_lm_head = True
    return model
