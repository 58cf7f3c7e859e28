"""`posprobe zoo extend` (context extension by fine-tuning, #49 step 1): every method's saved folder loads in plain
Hugging Face with the rotary table that HF's own rope init gives for its `rope_parameters` AND that the paper's
formula (written out here) gives; the fine-tuning starts from the unextended weights; a killed run resumes to the
uninterrupted weights; the perplexity curve equals a plain HF forward; steps-to-threshold by hand; refusals before any
training.

Planted bugs seen failing (each by editing posprobe/zoo/, running the test, then reverting):
- PI factor inverted (`factor = 1 / s`): test_each_method_carries_the_papers_table fails for pi on all 5 members.
- YaRN's original length L' instead of L: fails for yarn on 3 of 4 members (the partial member's 2 bands get the same
  ramp either way at this size); test_yarn_gamma_reported_is_hfs_ramp reads the field itself.
- NTK's exponent over the whole head instead of the rotated dims (`d = head_dim`): fails for partial (the other
  members rotate the whole head, p-RoPE's exponent runs over it by design).
- ABF's default multiplier applied once per extension (`b * 50`): fails for abf on all 5 members.
- No look at step 0 before the first optimiser step: test_step_zero_is_the_unextended_member fails.
- The checkpoint scores not restored on resume, or the running loss sum not kept in the state (a resumed run then
  logs another mean at the next logged step): test_killed_extension_resumes_to_the_uninterrupted_weights fails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from zoo_util import Died, dying_state_io

from posprobe.zoo.config import ZooConfig
from posprobe.zoo.extend import ExtendConfig, extend_member, plan_extension, steps_to_threshold

ROTARY = ("rope", "partial", "rope-llama", "hybrid", "p-rope")
TINY = dict(members=(*ROTARY, "alibi", "learned"), d_model=32, n_layers=2, n_heads=2, length=16, vocab_size=300,
            batch_size=8, steps=20, warmup=2, checkpoint_every=10, progress=False)
L, TARGET = 16, 64  # L' = 4L (the default)
S = TARGET / L


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory):
    from posprobe.data import builtin_corpus
    from posprobe.zoo.run import train_zoo

    out = tmp_path_factory.mktemp("extend") / "zoo"
    train_zoo(ZooConfig(**TINY), builtin_corpus(), out)
    return out


@pytest.fixture(scope="module")
def ids_and_tokenizer(tiny_zoo):
    from transformers import AutoTokenizer

    from posprobe.data import builtin_corpus

    tok = AutoTokenizer.from_pretrained(tiny_zoo / "rope-s0")
    return torch.tensor(tok(builtin_corpus()[:30000])["input_ids"]), tok


def _cos_sin(folder: Path, n: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    # The rotary table a plain HF load of the folder uses: its own rotary module, positions 0..n-1.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    emb = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
    with torch.no_grad():
        cos, sin = emb(torch.zeros(1, n, 1), torch.arange(n)[None])
    return cos[0], sin[0], model.config


def _table(inv_freq: torch.Tensor, scale: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    # HF's layout: angles m * inv_freq for each band, the band list twice (half-split pairing), times the factor; in
    # float32 as the model computes them (an angle of ~100 radians carries ~4e-6 of float32 rounding, so a float64
    # table could not be compared at 1e-6: the frequencies are rounded to float32 once, then the same arithmetic).
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq.float()[None]
    ang = torch.cat([ang, ang], dim=-1)
    return (torch.cos(ang) * scale).double(), (torch.sin(ang) * scale).double()


def _paper_inv_freq(method: str, name: str, head_dim: int) -> tuple[torch.Tensor, float]:
    """The papers' frequencies for member `name`, written out here (float64): theta_j = b^(-2j/d)."""
    b = 10000.0
    proportional = name == "p-rope"
    d = head_dim if name in ("rope", "rope-llama", "hybrid", "p-rope") else head_dim // 4  # partial: a quarter
    n_bands = head_dim // 2 if proportional else d // 2
    used = head_dim // 8 if proportional else n_bands  # p-RoPE rotates a quarter of the head: the fastest bands
    j = torch.arange(n_bands, dtype=torch.float64)
    temperature = 1.0
    if method == "ntk":
        b = b * S ** (d / (d - 2))  # bloc97
    if method == "abf":
        b = b * 50 ** (math.log(S) / math.log(8))  # Xiong et al.'s x50 per 8x, kept per doubling
    theta = b ** (-2 * j / d)
    if method in ("pi", "custom"):
        theta = theta / (S if method == "pi" else 2.0)  # Chen et al.; the custom dict below is linear x2
    if method == "yarn":
        # Peng et al. with HF's ramp by band index: gamma = 1 above beta = 32 turns within L, 0 below alpha = 1.
        def band(turns: float) -> float:
            return d * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(b))

        low, high = max(math.floor(band(32)), 0), min(math.ceil(band(1)), d - 1)
        high = high + 0.001 if low == high else high
        gamma = 1 - torch.clamp((j - low) / (high - low), 0, 1)
        theta = ((1 - gamma) / S + gamma) * theta
        temperature = 0.1 * math.log(S) + 1
    theta[used:] = 0.0  # p-RoPE's removed bands never turn
    return theta, temperature


CASES = [(name, method) for name in ROTARY for method in ("direct", "pi", "ntk", "yarn", "abf", "custom")
         if not (name == "p-rope" and method in ("yarn", "custom"))]


@pytest.fixture(scope="module")
def extended(tiny_zoo, ids_and_tokenizer, tmp_path_factory):
    """Every rotary member x method extended for one step through the zoo's loop (no scoring): the saved folders."""
    ids, tok = ids_and_tokenizer
    out = tmp_path_factory.mktemp("ext")
    folders = {}
    for custom in (False, True):
        cfg = ExtendConfig(members=ROTARY if not custom else ROTARY[:4], methods=("direct", "pi", "ntk", "abf")
                           if not custom else ("yarn",), steps=1, checkpoints=(), progress=False,
                           rope_parameters={"rope_type": "linear", "factor": 2.0} if custom else None)
        jobs, left = plan_extension(tiny_zoo, cfg)
        assert not left
        for job in jobs:
            folder = out / job.folder_name
            extend_member(job, cfg, ids, tok, folder, (lambda: None, lambda s: None))
            folders[(job.member, job.method)] = (folder, job)
    return folders


@pytest.mark.parametrize("name,method", CASES)
def test_each_method_carries_the_papers_table(extended, name, method):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder, job = extended[(name, method)]
    cos, sin, config = _cos_sin(folder, 2 * TARGET)
    params = config.rope_parameters
    assert all(params.get(k) == v for k, v in job.rope_parameters.items()) and config.max_position_embeddings == TARGET
    # 1) HF's own rope init for the rope_parameters the folder carries.
    kind = params["rope_type"]
    if kind == "default":
        d = int(config.hidden_size // config.num_attention_heads * params.get("partial_rotary_factor", 1.0))
        inv, factor = 1.0 / params["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d), 1.0
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    hf_cos, hf_sin = _table(inv, factor, 2 * TARGET)
    assert (cos.double() - hf_cos).abs().max() <= 1e-6 and (sin.double() - hf_sin).abs().max() <= 1e-6
    # 2) The paper's formula written out above.
    theta, temperature = _paper_inv_freq(method, name, config.hidden_size // config.num_attention_heads)
    p_cos, p_sin = _table(theta, temperature, 2 * TARGET)
    assert cos.shape == p_cos.shape
    assert (cos.double() - p_cos).abs().max() <= 1e-6, (name, method, (cos.double() - p_cos).abs().max())
    assert (sin.double() - p_sin).abs().max() <= 1e-6
    record = json.loads((folder / "zoo.json").read_text())
    assert record["extension"]["method"] == method and record["extension"]["from_length"] == L
    assert record["widths"]["length"] == TARGET and record["member"] == name


def test_yarn_gamma_reported_is_hfs_ramp(extended):
    from posprobe.analyses.context_extension import yarn_bands

    folder, job = extended[("rope", "yarn")]
    got = yarn_bands(job)
    cfg_ = json.loads((folder / "config.json").read_text())
    assert cfg_["rope_parameters"]["original_max_position_embeddings"] == L
    d, b = 16, 10000.0
    theta = b ** (-2 * torch.arange(d // 2, dtype=torch.float64) / d)
    ratio = torch.tensor(got["freq_factor"].to_numpy())
    want, _ = _paper_inv_freq("yarn", "rope", 16)
    assert torch.allclose(ratio * theta, want, rtol=0, atol=1e-12)
    # At this L only the fastest band turns more than once within L: YaRN is PI with a temperature on the rest.
    assert got["gamma"].tolist()[0] == 1.0 and set(got["gamma"].tolist()[1:]) == {0.0}


def test_step_zero_is_the_unextended_member(tiny_zoo, ids_and_tokenizer, tmp_path):
    from safetensors.torch import load_file

    ids, tok = ids_and_tokenizer
    cfg = ExtendConfig(members=("rope-llama",), methods=("pi",), steps=2, checkpoints=(0,), progress=False)
    (job,), _ = plan_extension(tiny_zoo, cfg)
    seen = {}

    def look(step, model):
        seen[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return step

    rec = extend_member(job, cfg, ids, tok, tmp_path / "x", (lambda: None, lambda s: None), on_checkpoint=look)
    saved = load_file(job.source / "model.safetensors")
    assert sorted(seen) == [0, 2] and [s for s, _ in rec["checkpoints"]] == [0, 2]
    assert all(torch.equal(seen[0][k], saved[k]) for k in saved)
    assert any(not torch.equal(seen[2][k], saved[k]) for k in saved)  # the fine-tuning moved something


def test_killed_extension_resumes_to_the_uninterrupted_weights(tiny_zoo, ids_and_tokenizer, tmp_path):
    from safetensors.torch import load_file

    from posprobe.report.checkpoint import Checkpoint

    ids, tok = ids_and_tokenizer
    cfg = ExtendConfig(members=("partial",), methods=("yarn",), steps=6, checkpoints=(0, 3), checkpoint_every=2,
                       progress=False)
    (job,), _ = plan_extension(tiny_zoo, cfg)
    calls = []

    def look(step, model):
        calls.append(step)
        return float(sum(p.double().sum() for p in model.parameters()))

    whole = extend_member(job, cfg, ids, tok, tmp_path / "whole", (lambda: None, lambda s: None), on_checkpoint=look)
    assert calls == [0, 3, 6]
    calls.clear()
    io, saved = dying_state_io(Checkpoint(tmp_path / "work", {"k": 1}), after=3)
    with pytest.raises(Died):
        extend_member(job, cfg, ids, tok, tmp_path / "resumed", io, on_checkpoint=look)
    assert saved == [0, 2, 3] and calls == [0, 3]
    resumed = extend_member(job, cfg, ids, tok, tmp_path / "resumed", io, on_checkpoint=look)
    assert calls == [0, 3, 6] and resumed["steps_run"] == 3  # 0 and 3 not looked at again
    assert resumed["checkpoints"] == whole["checkpoints"] and resumed["log"] == whole["log"]
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_curves_equal_a_plain_hugging_face_forward_after_a_resume(tiny_zoo, tmp_path, monkeypatch):
    """A run killed right after its step-0 scores were saved, then repeated, scores nothing twice and gives the
    numbers of a plain HF forward."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import posprobe.analyses.context_extension as zx

    cfg = ExtendConfig(members=("rope",), methods=("pi",), steps=2, checkpoints=(0,), eval_tokens=256,
                       sliding="never", progress=False)
    real_extend, real_rows, scored = zx.extend_member, zx._Scorer.folder_rows, []

    class Died(Exception):
        pass

    def dying(job, config, ids, tok, folder, io, **kw):
        def save_then_die(state):
            io[1](state)
            raise Died
        return real_extend(job, config, ids, tok, folder, (io[0], save_then_die), **kw)

    def counted(self, folder, label, protocols):
        scored.append(label)
        return real_rows(self, folder, label, protocols)

    monkeypatch.setattr(zx._Scorer, "folder_rows", counted)
    monkeypatch.setattr(zx, "extend_member", dying)
    with pytest.raises(Died):
        zx.extend_zoo(tiny_zoo, cfg, tmp_path / "out")
    assert scored == ["rope-s0", "rope-s0-pi"] and not (tmp_path / "out").exists()
    monkeypatch.setattr(zx, "extend_member", real_extend)
    result = zx.extend_zoo(tiny_zoo, cfg, tmp_path / "out")
    assert scored == ["rope-s0", "rope-s0-pi", "rope-s0-pi"]  # only step 2 scored by the rerun
    assert (tmp_path / "out" / "rope-s0-pi" / "zoo.json").is_file() and (tmp_path / "out" / "extend").is_dir()
    assert not (tmp_path / "out.work").exists()
    curves = result.tables["curves"]
    tok = AutoTokenizer.from_pretrained(tiny_zoo / "rope-s0")
    ids = torch.tensor(tok((tiny_zoo / "eval.txt").read_text(), add_special_tokens=False)["input_ids"])

    def ppl(model, n):  # Press et al.'s chunks: non-overlapping sequences of n, every token but the first scored
        rows = ids[: max(n, 256 // n * n)].view(-1, n)
        with torch.no_grad():
            logits = model(rows).logits[:, :-1]
        return math.exp(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                          rows[:, 1:].reshape(-1)).item())

    plain = AutoModelForCausalLM.from_pretrained(tiny_zoo / "rope-s0").eval()
    pi_cfg = AutoConfig.from_pretrained(tiny_zoo / "rope-s0", rope_parameters={
        "rope_type": "linear", "factor": S, "rope_theta": 10000.0, "partial_rotary_factor": 1.0})
    pi = AutoModelForCausalLM.from_pretrained(tiny_zoo / "rope-s0", config=pi_cfg).eval()
    for method, model, step in (("unextended", plain, 0), ("pi", pi, 0)):
        for n in (L, TARGET, 2 * TARGET):
            got = curves[(curves.method == method) & (curves.step == step) & (curves.length == n)]["ppl"].item()
            assert got == pytest.approx(ppl(model, n), rel=1e-5), (method, n)
    s = result.tables["summary"].iloc[0]
    pi_curve = curves[(curves.method == "pi") & (curves.length == TARGET)]
    ref = curves[(curves.method == "unextended") & (curves.length == L)]["ppl"].item()
    by_hand = next((int(r.step) for r in pi_curve.sort_values("step").itertuples() if r.ppl <= ref), None)
    assert s["steps_to_threshold"] == by_hand or (by_hand is None and math.isnan(s["steps_to_threshold"]))
    last = curves[(curves.method == "pi") & (curves.step == 2) & (curves.length == L)]["ppl"].item()
    assert s["in_window_cost"] == pytest.approx(last / ref, rel=1e-12)
    cfg_json = json.loads((tmp_path / "out" / "rope-s0-pi" / "config.json").read_text())
    assert cfg_json["rope_parameters"]["rope_type"] == "linear" and cfg_json["rope_parameters"]["factor"] == S


def test_steps_to_threshold_by_hand():
    curve = [(100, 18.9), (0, 30.0), (25, 21.0), (50, 19.5)]
    assert steps_to_threshold(curve, 20.0) == 50
    assert steps_to_threshold(curve, 19.5) == 50  # <= counts
    assert steps_to_threshold(curve, 31.0) == 0
    assert steps_to_threshold(curve, 18.0) is None


def test_summary_table_by_hand():
    import pandas as pd

    from posprobe.analyses.context_extension import summary_table

    rows = [("unextended", 0, 16, 20.0), ("unextended", 0, 64, 40.0), ("unextended", 0, 128, 80.0)]
    rows += [("pi", 0, 16, 25.0), ("pi", 0, 64, 30.0), ("pi", 0, 128, 60.0),
             ("pi", 5, 16, 22.0), ("pi", 5, 64, 21.0), ("pi", 5, 128, 50.0),
             ("pi", 9, 16, 21.0), ("pi", 9, 64, 19.0), ("pi", 9, 128, 45.0)]
    curves = pd.DataFrame([{"member": "rope", "seed": 0, "method": m, "step": s, "protocol": "chunks", "length": n,
                            "ppl": p, "status": "ok"} for m, s, n, p in rows])
    r = summary_table(curves, 16, 64).iloc[0]
    assert (r.ppl_L_unextended, r.ppl_Lp_unextended, r.ppl_Lp_step0, r.ppl_Lp, r.ppl_2Lp) == (20, 40, 30, 19, 45)
    assert r.in_window_cost == pytest.approx(21 / 20) and r.steps_to_threshold == 9 and r.n_checkpoints == 3


def test_bad_input_is_refused_before_training(tiny_zoo, tmp_path, capsys):
    from posprobe.cli import main

    out = str(tmp_path / "o")
    bad = {
        ("--member", "alibi", "--method", "pi"): "alibi has no rotary positions",
        ("--member", "p-rope", "--method", "yarn"): "proportional rope type",
        ("--member", "learned", "--method", "direct"): "learned table has L = 16 rows",
        ("--length", "16",): "must be longer than the members' training length L = 16",
        ("--member", "rope", "--rope-parameters", '{"rope_type": "dynamic", "factor": 2}'): "not a fixed extension",
        ("--member", "rope", "--rope-parameters", '{"rope_type": "linear"}'): "cannot carry",
        ("--member", "rope", "--rope-parameters", "[1]"): "JSON object",
        ("--member", "rope", "--checkpoints", "0,300"): "checkpoints must lie in 0..steps",
        ("--member", "fire"): "unknown zoo member 'fire'",
    }
    for flags, why in bad.items():
        assert main(["zoo", "extend", str(tiny_zoo), *flags, "--out", out]) == 2, flags
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, (flags, err)
    assert main(["zoo", "extend", str(tmp_path), "--out", out]) == 2
    assert "is not a zoo folder" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["zoo", "extend", str(tiny_zoo), "--member", "rope", "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.work").exists()


def test_whole_zoo_plan_leaves_out_what_hf_cannot_carry_and_runs_the_controls(tiny_zoo):
    jobs, left = plan_extension(tiny_zoo, ExtendConfig())
    got = {(j.member, j.method) for j in jobs}
    assert ("alibi", "direct") in got and not any(j.member == "alibi" and j.method != "direct" for j in jobs)
    assert {(r["member"], r["method"]) for r in left} == {("learned", "direct"), ("p-rope", "yarn")}
    assert len(jobs) == 5 * 5 - 1 + 1
    j = next(j for j in jobs if j.member == "rope")
    # Same tokens per step as pre-training (8 x 16 = 2 x 64); a tenth of the pre-training lr; 10% warmup here.
    assert (j.batch_size, j.lr, j.warmup) == (2, pytest.approx(2e-4), 20)


def test_ppl_at_L_is_zoo_evals_number_by_default():
    """'ppl at L' of the unextended member is printed by `zoo eval` and `zoo extend`: the same tokens by default."""
    from posprobe.analyses.configs import ExtrapolationConfig

    assert ExtendConfig().eval_tokens == ExtrapolationConfig().max_tokens


def test_zoo_eval_keeps_extended_methods_apart():
    """An extended zoo read by `zoo eval` / `zoo atlas`: each method is its own member, not a seed of the member."""
    from posprobe.zoo.folder import member_info

    rec = {"member": "rope", "family": "rotary", "block": "gpt", "seed": 1}
    assert member_info("rope-s1", rec)["member"] == "rope"
    assert member_info("rope-s1-pi", {**rec, "method": "pi"})["member"] == "rope+pi"
