"""posprobe/core/long_engine.py against `paper_rules.pairwise_logits` (issue #36's mutation testing): HF's own
modules with the attention recomputed in plain float64 torch under the paper's rule, including masked heads, the
recorded attention weights and greedy decoding with a KV cache. float32 model: tolerance 1e-4 on NLL / logits,
1e-5 on attention weights (CPU)."""

from __future__ import annotations

import pytest
import torch
from paper_rules import pairwise_logits, preset_reference
from paper_rules import token_nll as reference_nll

from posprobe.backend.bridge import plain_hf_model
from posprobe.core import long_engine as LE
from posprobe.core.presets import preset_pairs


def _ref(model, spec, n):
    hf = plain_hf_model(model)
    cfg = hf.config
    rel, freqs, factor = preset_reference(spec, n, cfg)
    return hf, rel, freqs, factor


def _ids(n, seed=0):
    return torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("spec", ["self-extend:group=2,window=4", "streaming:sink=1,window=5", "pi:scale=2",
                                  "yarn:scale=3,original=8"])
def test_masked_heads_and_small_logit_chunks_equal_the_reference(tiny_rope, spec):
    n = 17
    hf, rel, freqs, factor = _ref(tiny_rope, spec, n)
    ids = _ids(n, 1)
    masked = {0: (1,), 1: (0, 3)}
    want = reference_nll(pairwise_logits(hf, ids, rel, freqs=lambda l: freqs, score_factor=lambda l: factor,
                                         masked=masked), ids)
    got = LE.token_nll(hf, ids, preset_pairs(spec), chunk=4, logit_chunk=3, masked=masked)
    assert got.shape == (n - 1,) and (got.double() - want).abs().max() <= 1e-4
    unmasked = reference_nll(pairwise_logits(hf, ids, rel, freqs=lambda l: freqs, score_factor=lambda l: factor),
                             ids)
    assert (unmasked - want).abs().max() > 1e-3  # masking mattered


def test_preset_none_with_masked_heads_runs_through_the_engine_at_the_models_positions(tiny_rope):
    n = 12
    hf, rel, freqs, _ = _ref(tiny_rope, "none", n)
    ids = _ids(n, 2)
    want = reference_nll(pairwise_logits(hf, ids, rel, freqs=lambda l: freqs, masked={1: (2,)}), ids)
    got = LE.token_nll(hf, ids, preset_pairs("none"), masked={1: (2,)})
    assert (got.double() - want).abs().max() <= 1e-4
    plain = LE.token_nll(hf, ids, preset_pairs("none"))  # the model's own forward
    assert (plain.double() - reference_nll(pairwise_logits(hf, ids, rel, freqs=lambda l: freqs), ids)).abs().max() \
        <= 1e-4


@pytest.mark.parametrize("spec", ["rerope:window=3", "streaming:sink=2,window=4", "none"])
def test_greedy_decoding_with_a_cache_equals_the_reference_argmax_step_by_step(tiny_rope, spec):
    n, new = 10, 6
    prompt = _ids(n, 3)
    hf = plain_hf_model(tiny_rope)
    seq = prompt.clone()
    want = []
    for _ in range(new):
        _, rel, freqs, factor = _ref(tiny_rope, spec, len(seq))
        logits = pairwise_logits(hf, seq, rel, freqs=lambda l: freqs, score_factor=lambda l: factor)
        tok = int(logits[-1].argmax())
        want.append(tok)
        seq = torch.cat([seq, torch.tensor([tok])])
    rows = []
    got = LE.greedy_decode(hf, prompt, preset_pairs(spec), new, chunk=3,
                           record=lambda layer, w: rows.append((layer, w.clone())))
    assert got.dtype == torch.long and got.tolist() == want
    # the recorded weights: one row per layer per forward (the prompt, then each new token but the last)
    assert [l for l, _ in rows] == [0, 1] * new
    _, rel, freqs, factor = _ref(tiny_rope, spec, n + new - 1)
    weights = {}
    pairwise_logits(hf, seq[:-1], rel, freqs=lambda l: freqs, score_factor=lambda l: factor, weights=weights)
    for layer in (0, 1):
        last = rows[-2 + layer][1]
        assert last.shape == (weights[layer].shape[0], n + new - 1)
        assert (last.double() - weights[layer][:, -1]).abs().max() <= 1e-5


def test_greedy_decoding_stops_where_asked(tiny_rope):
    hf = plain_hf_model(tiny_rope)
    prompt = _ids(8, 4)
    rule = preset_pairs("rerope:window=3")
    full = LE.greedy_decode(hf, prompt, rule, 5).tolist()
    assert len(full) == 5
    assert LE.greedy_decode(hf, prompt, rule, 5, stop_token=full[1]).tolist() == full[:full.index(full[1]) + 1]
    assert LE.greedy_decode(hf, prompt, rule, 5, stop=lambda toks: len(toks) == 3).tolist() == full[:3]
    assert LE.greedy_decode(hf, prompt, rule, 1).tolist() == full[:1]


def test_long_attention_refusals(tiny_rope):
    hf = plain_hf_model(tiny_rope)
    with pytest.raises(ValueError, match="preset 'none' runs the model's own forward"):
        with LE.long_attention(hf, preset_pairs("none")):
            pass
    with pytest.raises(ValueError, match="chunk must be >= 1; got 0"):
        with LE.long_attention(hf, preset_pairs("pi:scale=2"), chunk=0):
            pass
    assert LE.zero_positions(3).tolist() == [[0, 0, 0]] and LE.zero_positions(2).dtype == torch.long


def test_memory_estimate_grows_with_length_cache_and_chunk_and_refusals_name_the_remedy(tiny_rope):
    hf = plain_hf_model(tiny_rope)
    plain, chunked = preset_pairs("pi:scale=2"), preset_pairs("self-extend:group=2,window=4")
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    e = LE.estimate_bytes
    assert weights < e(hf, 10, plain) < e(hf, 1000, plain) < e(hf, 1000, plain, cache=True)
    assert e(hf, 1000, plain, chunk=1) == e(hf, 1000, plain, chunk=512)  # one view, no selector: nothing chunked
    assert e(hf, 1000, chunked, chunk=1) < e(hf, 1000, chunked, chunk=64) < e(hf, 1000, chunked, chunk=512)
    assert e(hf, 1000, chunked, chunk=2000) == e(hf, 1000, chunked, chunk=1000)  # a chunk is at most the length
    need = e(hf, 1000, chunked, chunk=256)
    assert LE.check_memory(hf, 1000, chunked, chunk=256, available=int(need / 0.9) + 1) == need
    with pytest.raises(ValueError, match=r"use --chunk \d+ or smaller") as ex:
        LE.check_memory(hf, 1000, chunked, chunk=256, available=int(need / 0.9) - 1)
    fits = int(str(ex.value).split("--chunk ")[1].split()[0])
    assert 1 <= fits < 256 and e(hf, 1000, chunked, chunk=fits) <= 0.9 * (int(need / 0.9) - 1)
    assert e(hf, 1000, chunked, chunk=fits + 1) > 0.9 * (int(need / 0.9) - 1)  # the largest that fits
    with pytest.raises(ValueError, match="--chunk does not change this estimate"):
        LE.check_memory(hf, 1000, plain, available=1000)
    with pytest.raises(ValueError, match="even --chunk 1 needs about"):
        LE.check_memory(hf, 1000, chunked, chunk=256, available=weights)
    with pytest.raises(ValueError, match="; use a shorter length$"):
        LE.check_memory(hf, 1000, chunked, chunk=1, available=weights)


@pytest.mark.parametrize("spec,cache,chunk", [("pi:scale=2", False, 256), ("self-extend:group=2,window=4", True, 64),
                                              ("streaming:sink=1,window=8", False, 5000)])
def test_memory_terms_are_the_documented_budget(tiny_rope, spec, cache, chunk):
    # The estimate's terms as _memory_terms' comment states them, from HF's config: the budget check_memory refuses
    # by, so a changed constant changes which lengths are refused.
    hf = plain_hf_model(tiny_rope)
    cfg = hf.config
    rule = preset_pairs(spec)
    T, e = 3000, 4
    D, F_, H, KV = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, L, V = D // H, cfg.num_hidden_layers, cfg.vocab_size
    chunked = len(rule.views) > 1 or rule.select is not None
    want = {
        "weights": sum(p.numel() * p.element_size() for p in hf.parameters()),
        "activations": 1.5 * T * (8 * D + 3 * F_ + 4 * (H + 2 * KV) * hd + 2 * H * hd) * e,
        "scores": min(chunk, T) * T * H * 4 * (len(rule.views) + 3) if chunked else 0,
        "logits": min(1024, T) * V * 4 * 3,
        "kv": 3 * L * T * KV * hd * e if cache else 0,
        "hidden": 2 * T * D * e,
    }
    got = LE._memory_terms(hf, T, rule, chunk=chunk, cache=cache)
    assert got == pytest.approx(want, rel=1e-15)
    assert LE.estimate_bytes(hf, T, rule, chunk=chunk, cache=cache) == int(sum(want.values()))
    assert LE._memory_terms(hf, 500, rule, chunk=chunk, logit_chunk=100, cache=cache)["logits"] == 100 * V * 12


def test_sliding_window_layers_make_the_engine_chunk_every_rule():
    # Gemma 3's sliding layers: the engine applies the window itself, chunk by chunk, even for a one-view rule.
    from families import tiny_family

    bridge, _ = tiny_family("gemma3")
    hf = plain_hf_model(bridge)
    cfg = hf.config
    assert cfg.sliding_window and cfg.layer_types
    got = LE._memory_terms(hf, 1000, preset_pairs("pi:scale=2"), chunk=32)
    assert got["scores"] == 32 * 1000 * cfg.num_attention_heads * 4 * (1 + 3)
    assert got["activations"] == 1.5 * 1000 * (8 * cfg.hidden_size + 3 * cfg.intermediate_size + 4 * (
        cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim + 2 * cfg.num_attention_heads
        * cfg.head_dim) * 4


def test_prefill_leaves_every_layers_keys_unrotated_in_the_cache(tiny_rope):
    # Inside the engine the model runs at position 0 (HF's rotation is the identity), so the cache holds each layer's
    # keys as HF's k_proj makes them from that layer's input, and its values likewise.
    from transformers import DynamicCache

    hf = plain_hf_model(tiny_rope)
    ids = _ids(9, 6)
    cache = DynamicCache()
    with torch.no_grad(), LE.long_attention(hf, preset_pairs("rerope:window=3")):
        LE.prefill(hf, ids[None], cache)
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states  # the input of every layer
    cfg = hf.config
    kv, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    # Under ReRoPE the first query rows see the keys as the plain model does: layer 0's input is the embedding, so
    # its keys are exact; later layers' inputs differ (ReRoPE moved far pairs), so only layer 0 is compared.
    attn, norm = hf.model.layers[0].self_attn, hf.model.layers[0].input_layernorm
    with torch.no_grad():
        x = norm(hidden[0])
        k = attn.k_proj(x).view(1, 9, kv, hd).transpose(1, 2)
        v = attn.v_proj(x).view(1, 9, kv, hd).transpose(1, 2)
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert keys.shape == k.shape and (keys - k).abs().max() <= 1e-6 and (values - v).abs().max() <= 1e-6
    assert cache.get_seq_length() == 9 and len(cache.layers) == cfg.num_hidden_layers


def test_hf_rope_presets_take_hfs_table_for_the_config(tiny_rope):
    # HF's linear scaling by 2 is Position Interpolation by 2: every relative position halved (paper_rules' "pi").
    n = 14
    hf, rel, freqs, _ = _ref(tiny_rope, "pi:scale=2", n)
    ids = _ids(n, 7)
    want = reference_nll(pairwise_logits(hf, ids, rel, freqs=lambda l: freqs), ids)
    got = LE.token_nll(hf, ids, preset_pairs("hf-linear:factor=2"), chunk=4)
    assert (got.double() - want).abs().max() <= 1e-4


def test_a_sliding_window_model_sees_only_its_window_under_any_rule():
    # A plain HF Mistral with a 5-token sliding window: the engine applies the window itself (chunked path).
    import transformers as T

    torch.manual_seed(0)
    cfg = T.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=128, sliding_window=5, vocab_size=200,
                          attn_implementation="eager")
    hf = T.MistralForCausalLM(cfg).eval()
    n = 16
    ids = _ids(n, 8)
    for spec in ("pi:scale=2", "rerope:window=3"):
        rel, freqs, _ = preset_reference(spec, n, cfg)
        want = reference_nll(pairwise_logits(hf, ids, rel, freqs=lambda l: freqs, window=5), ids)
        got = LE.token_nll(hf, ids, preset_pairs(spec), chunk=3)
        assert (got.double() - want).abs().max() <= 1e-4, spec
        full = reference_nll(pairwise_logits(hf, ids, rel, freqs=lambda l: freqs), ids)
        assert (full - want).abs().max() > 1e-3, spec  # the window mattered


def test_memory_refusals_state_gib_count_the_cache_and_advise_the_largest_chunk(tiny_rope):
    hf = plain_hf_model(tiny_rope)
    rule = preset_pairs("self-extend:group=2,window=4")
    T = 200_000  # an estimate of a few GiB for the tiny model: the numbers in the message are readable
    e = LE.estimate_bytes
    need, have = e(hf, T, rule, chunk=256), int(e(hf, T, rule, chunk=256) / 0.9) - 1
    with pytest.raises(ValueError) as ex:
        LE.check_memory(hf, T, rule, chunk=256, available=have)
    assert str(ex.value).startswith(f"length {T} under 'self-extend:group=2,window=4' needs about "
                                    f"{need / 2**30:.1f} GiB (estimate) but only {have / 2**30:.1f} GiB is "
                                    "available; use --chunk ")
    assert 1.0 < need / 2**30 < 100.0
    # the cache counts: enough memory without it is not enough with it
    plain = e(hf, T, rule, chunk=256)
    assert e(hf, T, rule, chunk=256, cache=True) > plain
    with pytest.raises(ValueError):
        LE.check_memory(hf, T, rule, chunk=256, cache=True, available=int(plain / 0.9) + 1)
    assert LE.check_memory(hf, T, rule, chunk=256, cache=True, available=int(e(hf, T, rule, chunk=256, cache=True)
                                                                            / 0.9) + 1) > plain
    # the advice is the largest chunk that fits, found by brute force here; and 1 where only 1 fits
    for avail in (int(e(hf, T, rule, chunk=37, cache=True) / 0.9) + 1, int(e(hf, T, rule, chunk=1, cache=True) / 0.9)
                  + 1):
        best = max(c for c in range(1, 257) if e(hf, T, rule, chunk=c, cache=True) <= 0.9 * avail)
        with pytest.raises(ValueError, match=f"use --chunk {best} or smaller"):
            LE.check_memory(hf, T, rule, chunk=256, cache=True, available=avail)
    assert best == 1


@pytest.mark.parametrize("gqa", [True, False])
def test_the_one_view_path_on_either_sdpa_equals_the_reference(tiny_rope, monkeypatch, gqa):
    # One view, no selector: the engine hands the rotated q/k to PyTorch's SDPA, with enable_gqa (PyTorch >= 2.5) or,
    # on an older PyTorch (posprobe supports >= 2.1), with keys and values repeated per query head.
    monkeypatch.setattr(LE, "_SDPA_GQA", gqa)
    n = 13
    hf, rel, freqs, factor = _ref(tiny_rope, "yarn:scale=2,original=8", n)
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads  # grouped-query attention
    ids = _ids(n, 9)
    want = reference_nll(pairwise_logits(hf, ids, rel, freqs=lambda l: freqs, score_factor=lambda l: factor), ids)
    got = LE.token_nll(hf, ids, preset_pairs("yarn:scale=2,original=8"))
    assert (got.double() - want).abs().max() <= 1e-4
    seq, toks = ids[:8], []
    for _ in range(3):  # decode steps: one query against every key (not causal-masked)
        _, rel_s, freqs_s, factor_s = _ref(tiny_rope, "yarn:scale=2,original=8", len(seq))
        tok = int(pairwise_logits(hf, seq, rel_s, freqs=lambda l: freqs_s, score_factor=lambda l: factor_s)[-1]
                  .argmax())
        toks.append(tok)
        seq = torch.cat([seq, torch.tensor([tok])])
    assert LE.greedy_decode(hf, ids[:8], preset_pairs("yarn:scale=2,original=8"), 3).tolist() == toks
