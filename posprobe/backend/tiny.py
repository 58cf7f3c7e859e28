"""Built-in tiny random models for demos and tests, with a byte-level tokenizer that needs no download.

Random-init TL models have zero biases and unit LayerNorm weights, which hides bias-handling bugs,
so every parameter here is drawn at random (seeded).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from posprobe.backend.families import LEARNED, from_tl
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


def tiny_hf_config(name: str) -> Any:
    """The Hugging Face config of tiny spec `name`: GPT-2 layout for "tiny-ape", Llama for "tiny-rope"
    (with q/k/v/o and MLP biases, so bias handling is exercised)."""
    import transformers

    if name not in SPECS:
        raise ValueError(f"Unknown tiny spec {name!r}; choose one of {sorted(SPECS)}")
    s = SPECS[name]
    # TL's default init scale (0.8 / sqrt(d_model)), not HF's 0.02: attention far from uniform, as in the
    # HookedTransformer tiny models the tests' effect sizes were set on.
    common = dict(vocab_size=259, bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False,
                  initializer_range=0.8 / s["d_model"] ** 0.5)
    if from_tl(s["positional_embedding_type"]) == LEARNED:
        return transformers.GPT2Config(n_positions=s["n_ctx"], n_embd=s["d_model"], n_layer=s["n_layers"],
                                       n_head=s["n_heads"], n_inner=s["d_mlp"], activation_function=s["act_fn"],
                                       layer_norm_epsilon=1e-5, **common)
    return transformers.LlamaConfig(
        hidden_size=s["d_model"], intermediate_size=s["d_mlp"], num_hidden_layers=s["n_layers"],
        num_attention_heads=s["n_heads"], num_key_value_heads=s["n_key_value_heads"], head_dim=s["d_head"],
        max_position_embeddings=s["n_ctx"], rope_theta=float(s["rotary_base"]), rms_norm_eps=1e-5,
        attention_bias=True, mlp_bias=True, hidden_act=s["act_fn"], **common,
    )


def tiny_hf_model(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A seeded random Hugging Face causal LM for tiny spec `name`, every parameter random (eval mode)."""
    import transformers

    cfg = tiny_hf_config(name)
    cls = transformers.GPT2LMHeadModel if cfg.model_type == "gpt2" else transformers.LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream alone
        torch.manual_seed(seed)
        model = cls(cfg)
    randomize_(model, seed)
    return model.to(dtype).eval()


def randomize_(model: Any, seed: int) -> None:
    """Draw norm weights (1 + 0.2 N(0,1)) and every bias (0.1 N(0,1)) at random, seeded: default inits
    (unit norms, zero biases) would hide bias-handling bugs."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            norm = "Norm" in type(module).__name__
            for pname, p in module.named_parameters(recurse=False):
                if norm and pname in ("w", "weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
                elif pname.startswith("b"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))


def build_tiny(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """A seeded random tiny model ("tiny-ape": GPT-2 layout, "tiny-rope": Llama layout) as a TransformerBridge."""
    from transformer_lens.model_bridge import TransformerBridge

    hf = tiny_hf_model(name, seed=seed, dtype=dtype)
    model = TransformerBridge.boot_transformers(
        name, hf_model=hf, tokenizer=byte_tokenizer(), device=device, dtype=dtype
    )
    model.cfg.model_name = name
    model.has_lm_head = True
    return model
