"""Batched squish decoding (posprobe.core.batch_decode) against independent computations: HF's own `generate` and
forward for the unmodified model, and posprobe's TransformerLens-hook path (one prompt at a time, the full plan over
the whole sequence, a different implementation of the same positions) for squished keys.

Tolerances: token ids are compared exactly (greedy); log-probs and attention fractions in float32 to 1e-4 (the
batched rows carry padding columns, which change summation order only)."""

from __future__ import annotations

import pytest
import torch
from families import tiny_family

from posprobe.core.batch_decode import decode_batch
from posprobe.core.generation import generate
from posprobe.core.positions import PositionError
from posprobe.core.surgery import key_squish


@pytest.fixture(scope="module")
def tiny():
    bridge, reference = tiny_family("llama", seed=3)
    return bridge, reference


def _rows(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(5, vocab, (9,), generator=g)
    rests = [torch.randint(5, vocab, (n,), generator=g) for n in (2, 5, 3, 7)]
    return prefix, rests


def _hf_greedy(hf, ids: torch.Tensor, new: int) -> list[int]:
    out = hf.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long), max_new_tokens=new,
                      min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, ids.numel():].tolist()


def test_unmodified_rows_equal_hf_generate(tiny):
    _, hf = tiny
    prefix, rests = _rows(hf.config.vocab_size)
    got = decode_batch(hf, prefix, rests, max_new_tokens=6, batch_size=3)
    for rest, toks in zip(rests, got.tokens):
        assert toks == _hf_greedy(hf, torch.cat([prefix, rest]), 6)
    assert len({tuple(t) for t in got.tokens}) > 1  # rows differ: each row really saw its own tokens


def test_reference_logprobs_and_span_attention_equal_hf(tiny):
    _, hf = tiny
    prefix, rests = _rows(hf.config.vocab_size, seed=1)
    g = torch.Generator().manual_seed(7)
    refs = [torch.randint(5, hf.config.vocab_size, (n,), generator=g) for n in (3, 1, 4, 2)]
    got = decode_batch(hf, prefix, rests, max_new_tokens=1, references=refs, attend_span=(2, 6))
    eager = type(hf)(hf.config).eval()
    eager.load_state_dict(hf.state_dict())
    eager.set_attn_implementation("eager")
    for i, (rest, ref) in enumerate(zip(rests, refs)):
        ids = torch.cat([prefix, rest, ref])[None]
        out = eager(ids, output_attentions=True)
        lp = torch.log_softmax(out.logits[0].float(), -1)
        n = prefix.numel() + rest.numel()
        want = lp[n - 1:n - 1 + ref.numel()].gather(-1, ref[:, None])[:, 0]
        torch.testing.assert_close(got.reference_logprobs[i], want, atol=1e-4, rtol=0)
        # The last prompt token's attention onto the span, mean over heads and layers (HF's eager weights).
        mass = torch.stack([a[0, :, n - 1, 2:6].sum(-1).mean() for a in out.attentions]).mean()
        assert got.span_attention[i] == pytest.approx(float(mass), abs=1e-4)


@pytest.mark.parametrize("variant,moved", [("cache", 0.0), ("keys", 0.0), ("qk", 0.0), ("cache", 40.0), ("qk", 40.0)])
def test_squished_rows_equal_hook_path(tiny, variant, moved):
    bridge, hf = tiny
    prefix, rests = _rows(hf.config.vocab_size, seed=2)
    span = (3, 7)
    c = prefix.numel()
    plan = key_squish(c, span, to=0.0, variant=variant, query_start=span[1] + moved)
    got = decode_batch(hf, prefix, rests, plan=plan, max_new_tokens=5)
    unsquished = decode_batch(hf, prefix, rests, max_new_tokens=5)
    for rest, toks in zip(rests, got.tokens):
        full = torch.cat([prefix, rest])
        whole = key_squish(full.numel(), span, to=0.0, variant=variant, query_start=span[1] + moved)
        want = generate(bridge, full, max_new_tokens=5, plan=whole).new_tokens[0].tolist()
        assert toks == want
    assert got.tokens != unsquished.tokens  # the plan changed something on these random weights


def test_first_logprobs_differ_only_by_plan(tiny):
    _, hf = tiny
    prefix, rests = _rows(hf.config.vocab_size, seed=4)
    a = decode_batch(hf, prefix, rests, max_new_tokens=1, batch_size=4)
    b = decode_batch(hf, prefix, rests, max_new_tokens=1, batch_size=1)
    torch.testing.assert_close(a.first_logprobs, b.first_logprobs, atol=1e-5, rtol=0)  # batching is invisible
    for rest, row in zip(rests, a.first_logprobs):
        want = torch.log_softmax(hf(torch.cat([prefix, rest])[None]).logits[0, -1].float(), -1)
        torch.testing.assert_close(row, want, atol=1e-4, rtol=0)


def test_bad_input(tiny):
    _, hf = tiny
    prefix, rests = _rows(hf.config.vocab_size)
    with pytest.raises(PositionError, match="covers 5 tokens"):
        decode_batch(hf, prefix, rests, plan=key_squish(5, (1, 3)))
    with pytest.raises(ValueError, match="at least one token"):
        decode_batch(hf, prefix, [torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="inside the prefix"):
        decode_batch(hf, prefix, rests, attend_span=(3, 20))
    with pytest.raises(PositionError, match="whole positions"):
        decode_batch(hf, prefix, rests, plan=key_squish(prefix.numel(), (2, 4), query_start=5.5))


def _chat_rows(tok, instruction: str, questions: list[str]):
    # Gemma 3 270M ships as a base model (no chat template): plain text there.
    texts = [tok.apply_chat_template([{"role": "user", "content": f"{instruction}\n{q}"}], tokenize=False,
                                     add_generation_prompt=True) if tok.chat_template else
             f"{tok.bos_token}{instruction}\nQuestion: {q}\nAnswer:" for q in questions]
    ids = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    c = 0
    while all(x[c] == ids[0][c] for x in ids):
        c += 1
    return ids, c


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_real_weights_unmodified_equal_hf_generate(alias):
    from posprobe.backend.loading import load_hf_model

    hf, tok = load_hf_model(alias)
    questions = ["What is the capital of Italy?", "Why is the sky blue on a clear summer day?"]
    ids, c = _chat_rows(tok, "Answer in French.", questions)
    assert len({x.numel() for x in ids}) == 2  # rows of two lengths: padded (SmolLM2) or run apart (Gemma's windows)
    got = decode_batch(hf, ids[0][:c], [x[c:] for x in ids], max_new_tokens=10)
    for x, toks in zip(ids, got.tokens):
        assert toks == _hf_greedy(hf, x, 10)


def test_smollm2_squished_equals_hook_path(smollm2):
    from posprobe.backend.fast_attention import hf_model_inside

    tok = smollm2.tokenizer
    ids, c = _chat_rows(tok, "Answer in French.", ["What is the capital of Italy?", "Name a yellow fruit."])
    text = tok.decode(ids[0][:c])
    assert "Answer in French." in text
    span = (c - 6, c - 2)  # inside the shared instruction turn
    with hf_model_inside(smollm2) as hf:
        got = decode_batch(hf, ids[0][:c], [x[c:] for x in ids], plan=key_squish(c, span, to=0.0), max_new_tokens=8)
    for x, toks in zip(ids, got.tokens):
        want = generate(smollm2, x, max_new_tokens=8, plan=key_squish(x.numel(), span, to=0.0)).new_tokens[0].tolist()
        assert toks == want
