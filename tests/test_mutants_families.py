"""posprobe/backend/families: detection from HF configs, GGUF headers and TL names, labels and ALiBi phrasing, by
hand (issue #36's mutation testing). Each expectation is what the config / header / paper says, written out here."""

from __future__ import annotations

import pytest
import torch

from posprobe.backend import families as F
from posprobe.backend.families import alibi


@pytest.mark.parametrize("cfg,want", [
    ({"alibi": True, "rope_theta": 10000.0}, "alibi"),  # Falcon-RW: every Falcon config carries rope_theta
    ({"alibi": False, "rope_theta": 10000.0}, "rotary"),
    ({"position_embedding_type": "absolute"}, "learned_absolute"),  # BERT
    ({"position_embedding_type": "ABSOLUTE"}, "learned_absolute"),  # read case-blind
    ({"position_embedding_type": "relative_key"}, "unknown"),  # BERT's relative variants are not learned absolute
    ({"position_embedding_type": "relative_key_query"}, "unknown"),
    ({"position_embedding_type": "rotary"}, "rotary"),  # e.g. RoFormer-style configs
    ({"position_embedding_type": "Rope"}, "rotary"),
    ({"rope_theta": 1e4}, "rotary"),
    ({"partial_rotary_factor": 0.5}, "rotary"),
    ({"rotary_pct": 0.25}, "rotary"),
    ({"rotary_dim": 64}, "rotary"),
    ({"rope_theta": 1e4, "no_rope_layers": [0, 0, 0]}, "nope"),  # SmolLM3 flags: 1 = rotary layer
    ({"rope_theta": 1e4, "no_rope_layers": [1, 0, 1]}, "rotary"),  # a hybrid: rotary where it rotates
    ({"rope_theta": 1e4, "no_rope_layers": []}, "rotary"),
    ({"no_rope_layers": [0, 0]}, "unknown"),  # no rotary keys at all: nothing says RoPE
    ({}, "unknown"),
])
def test_kind_from_an_hf_config_by_hand(cfg, want):
    assert F.from_hf_config(cfg, None) == want


def test_the_architecture_row_names_the_family_where_the_config_does_not():
    for fam in (F.family("alibi"), F.family("learned_absolute"), F.family("sinusoidal")):
        assert F.from_hf_config({}, fam) == fam.kind
    assert F.from_hf_config({"position_embedding_type": "relative_key"}, F.family("learned_absolute")) == "unknown"


@pytest.mark.parametrize("arch,meta,want", [
    ("llama", {"llama.rope.freq_base": 1e4, "llama.context_length": 2048}, "rotary"),
    ("qwen2", {"qwen2.rope.dimension_count": 64}, "rotary"),
    ("llama", {"llama.context_length": 2048}, "unknown"),  # no rope key: nothing says RoPE
    ("llama", {"qwen2.rope.freq_base": 1e4}, "unknown"),  # another architecture's key does not count
    ("bloom", {"bloom.context_length": 2048}, "alibi"),
    ("mpt", {}, "alibi"),
    ("gpt2", {}, "learned_absolute"),
    ("bert", {}, "learned_absolute"),
    ("mamba", {}, "unknown"),
])
def test_kind_from_a_gguf_header_by_hand(arch, meta, want):
    assert F.from_gguf(arch, meta) == want


@pytest.mark.parametrize("tl,want", [("rotary", "rotary"), ("standard", "learned_absolute"), ("alibi", "alibi"),
                                     ("relative_positional_bias", "relative_bias"), ("shortformer", "shortformer")])
def test_kind_from_a_transformerlens_name_by_hand(tl, want):
    assert F.from_tl(tl) == want


def test_tl_names_and_labels_by_hand():
    assert F.tl_name("rotary") == "rotary" and F.tl_name("learned_absolute") == "standard"
    assert F.tl_name("relative_bias") == "relative_bias"  # the smaller of TL's two names, stable across runs
    assert F.label("rotary") == "RoPE" and F.label("alibi") == "ALiBi" and F.label("nope") == "NoPE"
    assert F.label("sinusoidal") == "fixed sinusoidal" and F.label("learned_absolute") == "learned absolute"
    assert F.label("something-else") == "something-else"


def test_alibi_phrase_by_hand():
    assert alibi.phrase((0.5, 0.25, 2 ** -8)) == "ALiBi (slopes 2^-1 … 2^-8, measured)"
    assert alibi.phrase((0.3, 2 ** -3)) == "ALiBi (slopes 0.3 … 2^-3, measured)"
    assert alibi.phrase((2 ** -1 * (1 + 5e-5), 0.25)) == "ALiBi (slopes 2^-1 … 2^-2, measured)"  # within 1e-4 of 2^e
    assert alibi.phrase((0.0, 0.25)) == "ALiBi (slopes 2^-2 … 0, measured)"  # a zero slope is no power of two
    assert alibi.phrase(()) == "ALiBi (no heads)"


def test_alibi_distance_bias_is_float64_and_exact():
    got = alibi.distance_bias((0.1, 1 / 3), n_q=3, n_k=7)
    assert got.dtype == torch.float64
    for h, s in enumerate((0.1, 1 / 3)):
        for qi, i in enumerate((4, 5, 6)):
            for j in range(7):
                assert got[h, qi, j].item() == -s * (i - j)  # float64 product, exactly

