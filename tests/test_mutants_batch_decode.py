"""Tests written to kill the mutants benchmarks/mutation.py found alive in posprobe/core/batch_decode.py (#53).

Sliding-window layers (Gemma 3: rows grouped by length, the window in the span attention), a span whose width
differs from the head count, and the refusals, each against Hugging Face: `generate` and the eager attention
weights of a plain HF twin (tests/families.py), and HF's own rope types. Tiny models; seconds.
"""

from __future__ import annotations

import pytest
import torch
from families import _COMMON

from posprobe.core.batch_decode import decode_batch, require_decodable
from posprobe.core.positions import PositionError


def _hf(name: str, seed: int):
    """A plain seeded HF model with tests/families.py's tiny config `name`, every weight random (no bridge, and not
    every family's config: building those takes half a minute)."""
    import transformers as T

    from posprobe.backend.tiny import randomize_

    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=128, **_COMMON)
    cfg, cls = {
        "gemma3": (lambda: T.Gemma3TextConfig(num_hidden_layers=3, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                              query_pre_attn_scalar=8, **small), T.Gemma3ForCausalLM),
        "llama": (lambda: T.LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, attention_bias=True,
                                        rope_theta=1e5, **small), T.LlamaForCausalLM),
        "cohere": (lambda: T.CohereConfig(num_hidden_layers=2, num_key_value_heads=2, **small), T.CohereForCausalLM),
        "gpt2": (lambda: T.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **_COMMON), T.GPT2LMHeadModel),
    }[name]
    cfg = cfg()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg).eval()
    randomize_(model, seed)
    return model


def _eager(reference):
    eager = type(reference)(reference.config).eval()
    eager.load_state_dict(reference.state_dict())
    eager.set_attn_implementation("eager")
    return eager


def _hf_greedy(hf, ids: torch.Tensor, new: int) -> list[int]:
    out = hf.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long), max_new_tokens=new,
                      min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, ids.numel():].tolist()


@torch.no_grad()
def _span_mass(eager, ids: torch.Tensor, span: tuple[int, int]) -> float:
    """The last token's attention onto key columns `span`: sum over the span, mean over heads, mean over layers, from
    HF's eager attention weights (its own sliding-window mask on the sliding layers)."""
    att = eager(ids[None], output_attentions=True).attentions
    n = ids.numel()
    return float(torch.stack([a[0, :, n - 1, span[0]:span[1]].sum(-1).mean() for a in att]).mean())


def test_sliding_window_rows_grouped_by_length_and_span_attention_inside_the_window():
    hf = _hf("gemma3", seed=5)
    assert [hf.config.layer_types[i] for i in range(3)] == ["sliding_attention", "sliding_attention",
                                                           "full_attention"] and hf.config.sliding_window == 8
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(5, 250, (12,), generator=g)
    rests = [torch.randint(5, 250, (n,), generator=g) for n in (3, 1, 3, 2)]
    span = (4, 9)  # five columns (not the four heads); the window of the last query cuts into it by row length
    got = decode_batch(hf, prefix, rests, max_new_tokens=3, attend_span=span, batch_size=2)
    eager = _eager(hf)
    for rest, toks, mass in zip(rests, got.tokens, got.span_attention):
        ids = torch.cat([prefix, rest])
        assert toks == _hf_greedy(hf, ids, 3)
        assert mass == pytest.approx(_span_mass(eager, ids, span), abs=1e-4)
    # not vacuous: for the 15-token rows the window (keys j > 14 - 8) cuts columns 4..6 out of the span
    with torch.no_grad():
        att = eager(torch.cat([prefix, rests[0]])[None], output_attentions=True).attentions
    assert att[0][0, :, -1, 4:7].abs().max() == 0 and att[0][0, :, -1, 7:9].min() > 0
    assert att[2][0, :, -1, 4:7].min() > 0  # the full-attention layer sees them


def test_adjacent_pairs_prefix_keys_rotated_as_hugging_face_does():
    """Cohere rotates adjacent dims (2b, 2b + 1): the cached prefix keys must be rotated the same way."""
    hf = _hf("cohere", seed=2)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(5, 250, (9,), generator=g)
    rests = [torch.randint(5, 250, (n,), generator=g) for n in (2, 4)]
    got = decode_batch(hf, prefix, rests, max_new_tokens=4)
    for rest, toks, lp in zip(rests, got.tokens, got.first_logprobs):
        ids = torch.cat([prefix, rest])
        assert toks == _hf_greedy(hf, ids, 4)
        with torch.no_grad():
            want = torch.log_softmax(hf(ids[None]).logits[0, -1].float(), -1)
        torch.testing.assert_close(lp, want, atol=1e-4, rtol=0)


def test_span_attention_of_a_span_as_wide_as_not_the_heads():
    hf = _hf("llama", seed=3)
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(5, 250, (10,), generator=g)
    rests = [torch.randint(5, 250, (n,), generator=g) for n in (2, 4)]
    got = decode_batch(hf, prefix, rests, max_new_tokens=1, attend_span=(1, 8))
    eager = _eager(hf)
    for rest, mass in zip(rests, got.span_attention):
        assert mass == pytest.approx(_span_mass(eager, torch.cat([prefix, rest]), (1, 8)), abs=1e-4)


def test_refusals_name_the_caller_and_the_length_rule():
    gpt2 = _hf("gpt2", seed=0)
    with pytest.raises(PositionError, match="^Batched squish decoding rotate"):
        require_decodable(gpt2)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=259, max_position_embeddings=64,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    dynamic = LlamaForCausalLM(cfg).eval()
    with pytest.raises(NotImplementedError, match="layer 0 of LlamaForCausalLM rebuilds its rotary table"):
        require_decodable(dynamic)
    with pytest.raises(NotImplementedError, match="rebuilds its rotary table"):
        decode_batch(dynamic, torch.tensor([5, 6]), [torch.tensor([7])], max_new_tokens=1)
