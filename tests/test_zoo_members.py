"""The zoo's members as built (no training): every Hugging Face model checked against what docs/zoo.md and
`posprobe.zoo.members` promise, written out here from the papers and the classes' documented fields — the same
widths, no dropout anywhere, tied embeddings, the MLP widths (4d for GELU, 8d/3 for SwiGLU so that the blocks hold
the same MLP weights), base 10000, the partial share, SmolLM3's every-4th-layer NoPE pattern, Llama's proportional
p-RoPE with a quarter of the frequencies, T5's 32 buckets to 128, and the parameter counts that follow. Seconds.

Plants seen failing (one at a time): a dropout of 0.1 left in one class; the GELU MLP at 3d; the SwiGLU width
rounded down; the hybrid's NoPE layer moved to the first of four; rope_theta 10001; p-RoPE's share 0.5; T5's
buckets 16; an untied output head; bos/eos ids swapped with pad; BLOOM's head count left at its default."""

from __future__ import annotations

import pytest
import torch

from posprobe.zoo.members import MEMBERS, Widths, member, member_names
from posprobe.zoo.train import build_model

W = Widths(d_model=64,  # 8d/3 = 170.67: rounding is seen
           n_layers=8, n_heads=4, length=40, vocab_size=300)
PAD, BOS = 1, 0


class _Tok:
    pad_token_id, bos_token_id = PAD, BOS


@pytest.fixture(scope="module")
def built():
    return {name: build_model(m, None, _Tok(), seed=0, widths=W) for name, m in MEMBERS.items()}


def _dropouts(cfg) -> dict:
    # GPT-2's summary_first_dropout and GPT-NeoX's classifier_dropout belong to heads a causal LM does not have.
    heads = ("summary_first_dropout", "classifier_dropout")
    return {k: v for k, v in cfg.to_dict().items() if "drop" in k and k not in heads and isinstance(v, (int, float))}


def test_every_member_has_the_shared_widths_no_dropout_and_tied_embeddings(built):
    assert member_names() == tuple(MEMBERS) and len(MEMBERS) == 10
    for name, model in built.items():
        cfg = model.config
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        assert tuple(emb.shape) == (W.vocab_size, W.d_model), name
        assert head.data_ptr() == emb.data_ptr(), name  # tied: one matrix
        drops = _dropouts(cfg)
        assert drops and all(v == 0 for v in drops.values()), (name, drops)
        assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (PAD, BOS, BOS), name
        blocks = [m for m in model.modules() if type(m).__name__.endswith(("Block", "Layer", "DecoderLayer"))
                  and "Norm" not in type(m).__name__]
        assert len(blocks) >= W.n_layers, name
        assert model.training and not any(p.dtype != torch.float32 for p in model.parameters()), name
        heads = next(getattr(cfg, k) for k in ("n_head", "num_attention_heads", "attention_heads", "num_heads")
                     if getattr(cfg, k, None) is not None)
        layers = next(getattr(cfg, k) for k in ("n_layer", "num_hidden_layers", "num_layers")
                      if getattr(cfg, k, None) is not None)
        assert (heads, layers) == (W.n_heads, W.n_layers), name


def _mlp_weights(model) -> int:
    # The feed-forward matrices (XGLM names them fc1 / fc2, every other class puts them under .mlp.), no biases.
    return sum(p.numel() for n, p in model.named_parameters()
               if p.ndim == 2 and any(k in n for k in (".mlp.", ".fc1.", ".fc2.")))


def test_mlp_widths_are_4d_for_gelu_and_8d_over_3_for_swiglu(built):
    d = W.d_model
    swiglu = round(8 * d / 3)  # Shazeer (2020): three d x f matrices at f = 8d/3 hold the GELU block's 2 x d x 4d
    for name, model in built.items():
        per_layer = _mlp_weights(model) // W.n_layers
        want = 2 * d * 4 * d if MEMBERS[name].block == "gpt" else 3 * d * swiglu
        assert per_layer == want, (name, per_layer, want)


def test_positions_are_the_families_own_settings():
    # Each member's config built here, not read from the module fixture: mutmut runs a test for a builder's mutant
    # only when the test itself calls the builder (a fixture's calls count for its first test alone).
    c = {n: m.hf_config(W, pad_id=PAD, bos_id=BOS) for n, m in MEMBERS.items()}
    for name in ("rope", "partial", "rope-llama", "hybrid", "p-rope"):
        assert c[name].rope_parameters["rope_theta"] == 10000.0, name
    assert c["rope"].rope_parameters["partial_rotary_factor"] == 1.0
    assert c["partial"].rope_parameters["partial_rotary_factor"] == 0.25
    assert c["p-rope"].rope_parameters["rope_type"] == "proportional"
    assert c["p-rope"].rope_parameters["partial_rotary_factor"] == 0.25
    # SmolLM3: 1 = rotary, 0 = NoPE; the hybrid's every 4th layer (4th, 8th) is NoPE
    assert c["rope-llama"].no_rope_layers == [1] * 8
    assert c["nope"].no_rope_layers == [0] * 8
    assert c["hybrid"].no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    # T5 (Raffel et al.): 32 buckets, offsets past 128 share the last; SiLU gate = the llama block's SwiGLU
    assert (c["t5"].relative_attention_num_buckets, c["t5"].relative_attention_max_distance) == (32, 128)
    assert c["t5"].dense_act_fn == "silu" and c["t5"].is_decoder
    for name in ("learned", "sinusoidal", "rope", "partial"):
        act = getattr(c[name], "activation_function", None) or getattr(c[name], "hidden_act", None)
        assert act == "gelu_pytorch_tanh", name
    assert c["sinusoidal"].scale_embedding is True
    assert c["rope"].use_parallel_residual is False and c["partial"].use_parallel_residual is False
    for name in ("learned", "sinusoidal", "rope", "partial", "rope-llama", "nope", "hybrid", "p-rope"):
        n_pos = getattr(c[name], "n_positions", None) or c[name].max_position_embeddings
        assert n_pos == W.length, name


def test_parameter_counts_differ_only_where_stated(built):
    d, h, L = W.d_model, W.n_heads, W.length
    n = {name: sum(p.numel() for p in model.parameters()) for name, model in built.items()}
    assert n["partial"] == n["rope"] == n["sinusoidal"]
    assert n["alibi"] == n["rope"] + 2 * d  # BLOOM's LayerNorm on the embedding (scale and bias)
    assert n["learned"] == n["rope"] + L * d  # the position table
    assert n["nope"] == n["hybrid"] == n["rope-llama"] == n["p-rope"]
    # The T5 class also holds cross-attention weights no decoder-only forward uses; the bias table is 32 x heads.
    used = sum(p.numel() for k, p in built["t5"].named_parameters() if "encoder_decoder_attention" not in k)
    assert used == n["rope-llama"] + 32 * h


def test_member_lookup_names_the_known_members():
    assert member("t5").model_type == "pix2struct_text_model"
    with pytest.raises(ValueError, match="unknown zoo member 'fire'; known: learned, sinusoidal"):
        member("fire")
