"""The decoder-only T5-bias class (Pix2StructTextModel) on posprobe's bridge adapter, against Hugging Face.

The references are independent of posprobe: a separate HF model with the same weights (`tiny_family`), T5's bucket
rule transcribed from Raffel et al. / Mesh TensorFlow in plain Python (`paper_rules.t5_bucket`), and HF's own
forward with its layer-0 bias computed from planned offsets by that rule."""

from __future__ import annotations

import pytest
import torch
from families import tiny_family
from paper_rules import t5_bucket

from posprobe.backend import t5_decoder
from posprobe.backend.facts import model_facts
from posprobe.backend.hooks import hook_name, hooked
from posprobe.core.positions import PositionError, PositionPlan, bucket_positions, token_positions

N = 20


@pytest.fixture(scope="module")
def t5():
    return tiny_family("pix2struct")


def _ids(n: int = N, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def _table(hf) -> torch.Tensor:
    return hf.layer[0].self_attention.attention.relative_attention_bias.weight.detach()


def _hf_with_offsets(hf, rel: torch.Tensor):
    """HF's forward with the layer-0 bias of key-minus-query offsets `rel` [q, k], bucketed by the paper's rule."""
    cfg, table = hf.config, _table(hf)
    buckets = torch.tensor([[t5_bucket(int(r), cfg.relative_attention_num_buckets,
                                       cfg.relative_attention_max_distance) for r in row] for row in rel.tolist()])
    attn = hf.layer[0].self_attention.attention

    def compute_bias(query_length, key_length, device=None, past_seen_tokens=0):
        return table[buckets[:query_length, :key_length]].permute(2, 0, 1)[None]

    attn.compute_bias = compute_bias
    return attn


def test_the_bridge_is_hugging_faces_forward_with_live_hooks():
    bridge, ref = tiny_family("pix2struct")  # booted here, not in a fixture: mutation testing attributes the boot
    ids = _ids()
    ref.set_attn_implementation("eager")  # HF returns attention weights from its eager path only
    with torch.no_grad():
        out = ref(input_ids=ids, output_attentions=True, output_hidden_states=True)
        logits, cache = bridge.run_with_cache(ids)
    assert torch.allclose(logits, out.logits, atol=1e-5)
    table, n = _table(ref), ids.shape[1]
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    cfg = ref.config
    bias = table[torch.tensor([[t5_bucket(int(r), cfg.relative_attention_num_buckets,
                                          cfg.relative_attention_max_distance) for r in row]
                               for row in rel.tolist()])].permute(2, 0, 1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(cfg.num_layers):
        assert torch.allclose(cache[f"blocks.{layer}.attn.hook_pattern"], out.attentions[layer], atol=1e-6)
        block = ref.layer[layer]
        with torch.no_grad():
            x = block.self_attention.layer_norm(out.hidden_states[layer])
        a = block.self_attention.attention
        q = (x @ a.query.weight.T).view(2, n, 4, 8).transpose(1, 2)
        k = (x @ a.key.weight.T).view(2, n, 4, 8).transpose(1, 2)
        want = q @ k.transpose(2, 3) + bias  # T5: no 1/sqrt(d_head)
        got = cache[f"blocks.{layer}.attn.hook_attn_scores"]
        assert torch.allclose(got[..., causal], want[..., causal], atol=1e-4)
        assert (got[..., ~causal] <= torch.finfo(got.dtype).min / 2).all()
        # The hooks the score decomposition reads: q per head, and the norm's scale as RMS (T5 does not centre).
        assert torch.allclose(cache[f"blocks.{layer}.attn.hook_q"], q.transpose(1, 2), atol=1e-5)
        h = out.hidden_states[layer]
        rms = (h.pow(2).mean(-1, keepdim=True) + block.self_attention.layer_norm.variance_epsilon).sqrt()
        assert torch.allclose(cache[f"blocks.{layer}.ln1.hook_scale"], rms, atol=1e-6)
    assert torch.equal(cache["pos_embed.hook_out"], bias.permute(1, 2, 0))  # [query, key, head]: the table's rows


def test_score_edits_reach_the_output(t5):
    bridge, _ = t5
    ids = _ids()

    def zero_last_key(scores, hook):
        return scores.masked_fill(torch.arange(N) == 0, torch.finfo(scores.dtype).min)

    with torch.no_grad():
        plain = bridge(ids)
        with hooked(bridge, [(hook_name("scores", 1), zero_last_key)]):
            edited = bridge(ids)
    assert not torch.allclose(plain[:, 1:], edited[:, 1:], atol=1e-3)


def test_the_bucket_function_is_the_papers(t5):
    _, ref = t5
    for nb, md in ((32, 128), (8, 16), (16, 64)):
        cfg = type("C", (), dict(relative_attention_num_buckets=nb, relative_attention_max_distance=md))
        rel = -torch.arange(400)
        got = t5_decoder.bucket_ids(rel, cfg)
        assert got.tolist() == [t5_bucket(int(r), nb, md) for r in rel]
    assert t5_decoder.bucket_ids(torch.tensor([3, 1]), ref.config).tolist() == [0, 0]  # future keys: bucket 0


def test_facts_name_the_family_and_its_shared_table(t5):
    facts = model_facts(t5[0])
    assert facts.positional_kind == "relative_bias" and facts.unsupported is None
    assert facts.attention_unsupported is None
    assert all("T5 relative buckets" in p for p in facts.layer_positions)


@pytest.mark.parametrize("plan_name", ["identity", "shift", "keys-doubled", "queries-only", "far"])
def test_bucket_position_control_equals_hugging_face_with_those_offsets(t5, plan_name):
    bridge, ref = t5
    ids = _ids()
    p = torch.arange(N, dtype=torch.float64)
    q, k = {"identity": (p, p), "shift": (p + 7, p + 7), "keys-doubled": (2 * p, 2 * p),
            "queries-only": (p + 5, p), "far": (p + 100, p)}[plan_name]
    with torch.no_grad(), bucket_positions(bridge, PositionPlan(q, k.clone())):
        got = bridge(ids)
    attn = _hf_with_offsets(ref, (k[None, :] - q[:, None]).long())
    try:
        with torch.no_grad():
            want = ref(input_ids=ids).logits
    finally:
        del attn.compute_bias
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    with torch.no_grad():
        plain = bridge(ids)
    if plan_name in ("identity", "shift"):
        assert torch.equal(got, plain)  # offsets unchanged: the delta is exactly zero
    else:
        assert not torch.allclose(got, plain, atol=1e-3)  # the control is not vacuous


def test_batched_plans_and_token_positions_place_each_row(t5):
    bridge, ref = t5
    ids = _ids()
    p = torch.arange(N, dtype=torch.float64)
    rows = torch.stack([p, 3 * p])
    with torch.no_grad(), token_positions(bridge, rows):
        got = bridge(ids)
    for r in range(2):
        attn = _hf_with_offsets(ref, (rows[r][None, :] - rows[r][:, None]).long())
        try:
            with torch.no_grad():
                want = ref(input_ids=ids[r:r + 1]).logits
        finally:
            del attn.compute_bias
        assert torch.allclose(got[r:r + 1], want, atol=1e-5)


def test_bucket_control_refuses_what_buckets_cannot_take(t5):
    bridge, _ = t5
    p = torch.arange(N, dtype=torch.float64)
    with pytest.raises(PositionError, match="whole-token"):
        with bucket_positions(bridge, PositionPlan(p + 0.5, p)):
            pass
    with pytest.raises(PositionError, match="covers 20 tokens"), torch.no_grad():
        with bucket_positions(bridge, PositionPlan(p, p)):
            bridge(_ids(N + 1))


def test_the_mask_is_hugging_faces_in_every_form_it_arrives():
    # Eager attention gets an additive float mask, SDPA a boolean one or None (plain causal): each gives the scores
    # HF's eager recipe gives. Checked by hand on a 2-query x 3-key block (queries are the last two positions).
    from posprobe.backend.t5_decoder import _masked

    s = torch.arange(6, dtype=torch.float32).view(1, 1, 2, 3)
    low = torch.finfo(torch.float32).min
    causal = torch.tensor([[True, True, False], [True, True, True]])
    want = torch.where(causal, s, torch.full_like(s, low))
    assert torch.equal(_masked(s, None), want)
    assert torch.equal(_masked(s, causal[None, None]), want)
    additive = torch.where(causal, 0.0, low)[None, None]
    wide = torch.cat([additive, torch.zeros(1, 1, 2, 2)], -1)  # HF may hand a wider mask: cut to the keys
    assert torch.equal(_masked(s, wide), s + additive)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_bridge_follows_hf_whichever_attention_hf_was_loaded_with(implementation):
    from hf_util import independent_hf
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend.tiny import byte_tokenizer

    _, ref = tiny_family("pix2struct", seed=3)
    hf = independent_hf(ref)
    hf.set_attn_implementation(implementation)
    t5_decoder.register()
    bridge = TransformerBridge.boot_transformers("posprobe-tiny-t5", hf_model=hf, tokenizer=byte_tokenizer())
    ids = _ids(seed=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: HF builds a padding mask (boolean for SDPA, additive for eager)
    with torch.no_grad():
        got = bridge(ids, attention_mask=mask)
        want = ref(input_ids=ids, attention_mask=mask).logits
        unmasked = ref(input_ids=ids).logits
    assert torch.allclose(got[0], want[0], atol=1e-5)
    assert torch.allclose(got[1, 3:], want[1, 3:], atol=1e-5)  # padded queries are undefined in both
    assert not torch.allclose(want[1, 3:], unmasked[1, 3:], atol=1e-3)  # the padding mask mattered


@pytest.mark.parametrize("cell", ["facts", "position control", "shift-test", "decompose", "heads", "sinks", "probes"])
def test_the_support_matrix_cells_hold_on_this_class(t5, cell):
    # The same cells as docs/support-matrix.md's pix2struct row (each against HF), here so the adapter's own tests
    # carry them (the mutation run of backend/t5_decoder.py selects this file).
    from matrix_cells import run_cell

    assert run_cell(t5[0], cell) == "ok"


def test_the_adapter_names_every_component_as_transformerlens_does():
    # TL's usual names for the MLP, final norm and unembedding reach HF's modules: their hooks fire with HF's values.
    bridge, ref = tiny_family("pix2struct")
    ids = _ids()
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
        out = ref(input_ids=ids, output_hidden_states=True)
    for name in ("hook_embed", "blocks.0.mlp.gate.hook_out", "blocks.0.mlp.in.hook_out", "blocks.0.mlp.out.hook_in",
                 "blocks.1.mlp.hook_out", "ln_final.hook_out", "unembed.hook_out"):
        assert name in cache, name
    mlp = ref.layer[1].mlp
    with torch.no_grad():
        mid = cache["blocks.1.hook_resid_mid"]
        want = mlp.DenseReluDense(mlp.layer_norm(mid))
    assert torch.allclose(cache["blocks.1.mlp.hook_out"], want, atol=1e-5)
    assert torch.allclose(cache["ln_final.hook_out"], out.hidden_states[-1], atol=1e-5)
    assert torch.allclose(cache["unembed.hook_out"], logits)


def test_bridged_tells_the_t5_adapter_from_any_other_model(t5):
    assert t5_decoder.bridged(t5[0])
    assert not t5_decoder.bridged(tiny_family("llama")[0]) and not t5_decoder.bridged(object())


def test_a_config_with_hfs_cache_and_incremental_decoding_match_hf():
    # With use_cache=True (as checkpoints may set it) HF's forward hands every layer a cache. The bridge's attention
    # joins cached keys as HF does: a full forward and a prefill-then-one-token decode both equal HF's.
    import transformers as T
    from hf_util import independent_hf
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend.tiny import byte_tokenizer, randomize_

    cfg = T.Pix2StructTextConfig(hidden_size=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=259,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                 dense_act_fn="silu", is_decoder=True, initializer_range=0.1, pad_token_id=258,
                                 decoder_start_token_id=258, use_cache=True)
    cfg.architectures = [t5_decoder.ARCHITECTURE]  # what a saved folder's config says; the bridge picks by it
    hf = T.Pix2StructTextModel(cfg).eval()
    randomize_(hf, 5)
    ref = independent_hf(hf)
    t5_decoder.register()
    bridge = TransformerBridge.boot_transformers("posprobe-tiny-t5-cache", hf_model=hf, tokenizer=byte_tokenizer())
    ids = _ids(seed=5)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        assert torch.allclose(bridge(ids), want, atol=1e-5)
        wired = bridge.original_model  # runs the bridge's components (TL rewires the HF model in place)
        first = wired(input_ids=ids[:, :-1], use_cache=True)
        assert first.cache.get_seq_length() == N - 1  # the prefix's keys were stored
        last = wired(input_ids=ids[:, -1:], cache=first.cache, use_cache=True).logits
    assert torch.allclose(last[:, -1], want[:, -1], atol=1e-5)


def test_the_class_run_as_an_encoder_is_refused_before_any_forward():
    # is_decoder=False makes Pix2Struct's text model attend both ways: every analysis refuses it with one message.
    import transformers as T
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend.tiny import byte_tokenizer

    cfg = T.Pix2StructTextConfig(hidden_size=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=259,
                                 dense_act_fn="silu", is_decoder=False, initializer_range=0.1, pad_token_id=258,
                                 decoder_start_token_id=258)
    cfg.architectures = [t5_decoder.ARCHITECTURE]
    t5_decoder.register()
    bridge = TransformerBridge.boot_transformers("posprobe-tiny-t5-enc", hf_model=T.Pix2StructTextModel(cfg).eval(),
                                                 tokenizer=byte_tokenizer())
    forwards = []
    bridge.register_forward_pre_hook(lambda *a: forwards.append(1))
    with pytest.raises(NotImplementedError, match="is_decoder=False"):
        model_facts(bridge)
    assert forwards == []
