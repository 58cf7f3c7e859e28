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
Step 2 (PoSE, DroPE, scaled YaRN):
- PoSE's position skip drawn from U{0..L'-L-1} (off by one), or added to the first chunk too, or drawn as the max of
  two uniforms (skewed): test_pose_ids_follow_the_released_rule fails (the last by its chi2: 6331 against ~107).
- The loop not passing the batch's position ids to the forward: test_pose_trains_at_L_with_its_ids... fails.
- DroPE leaving layer 0 rotary (`no_rope_layers` [1, 0]): test_drope_scores_are_plain_dot_products... fails for
  rope-llama and hybrid.
- The scaled ramp's band share off by 10%: test_scaled_yarn_ramp_keeps_bands_at_small_L and
  test_scaled_yarn_folder_carries_the_ramp fail.
The learned control (copy):
- The new rows all copies of the last row (`rows.clamp(max=L - 1)`), or left at their random init: the copy test
  fails (row t != row t mod L).
Attention entropy and the page:
- The entropy averaged over the queries after the first only: test_attention_entropy_is_the_definition... fails.
- The summary's or the curves' mean over seeds replaced by the first seed's value: test_summary_frame_by_hand and
  test_the_extend_curves_are_means_over_seeds_with_their_range fail.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from zoo_util import Died, dying_state_io

from posprobe.zoo.config import ZooConfig
from posprobe.zoo.extend import ExtendConfig, plan_extension, steps_to_threshold
from posprobe.zoo.train import train_member

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


CASES = [(name, method) for name in ROTARY for method in ("direct", "pi", "ntk", "yarn", "abf", "pose", "custom")
         if not (name == "p-rope" and method in ("yarn", "custom"))]


@pytest.fixture(scope="module")
def extended(tiny_zoo, ids_and_tokenizer, tmp_path_factory):
    """Every rotary member x method extended for one step through the zoo's loop (no scoring): the saved folders."""
    ids, tok = ids_and_tokenizer
    out = tmp_path_factory.mktemp("ext")
    folders = {}
    for custom in (False, True):
        cfg = ExtendConfig(members=ROTARY if not custom else ROTARY[:4],
                           methods=("direct", "pi", "ntk", "abf", "pose", "drope") if not custom else ("yarn",),
                           steps=1, checkpoints=(), progress=False,
                           rope_parameters={"rope_type": "linear", "factor": 2.0} if custom else None)
        jobs, left = plan_extension(tiny_zoo, cfg)
        assert not left
        for job in jobs:
            folder = out / job.folder_name
            train_member(job.job(cfg, ids, tok), folder, (lambda: None, lambda s: None))
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
    from posprobe.zoo.methods import yarn_bands

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

    rec = train_member(job.job(cfg, ids, tok), tmp_path / "x", (lambda: None, lambda s: None), on_checkpoint=look)
    saved = load_file(job.source / "model.safetensors")
    assert sorted(seen) == [0, 2] and [s for s, _ in rec["checkpoints"]] == [0, 2]
    assert all(torch.equal(seen[0][k], saved[k]) for k in saved)
    assert any(not torch.equal(seen[2][k], saved[k]) for k in saved)  # the fine-tuning moved something
    # The folder says what was done to it (read by zoo eval, the atlas and the page): every field as asked above.
    saved_rec = json.loads((tmp_path / "x" / "zoo.json").read_text(encoding="utf-8"))
    ext = saved_rec["extension"]
    assert saved_rec["method"] == "pi"  # zoo eval and the atlas name the model rope-llama+pi by it
    assert ext == {"method": "pi", "from_length": L, "length": TARGET, "scale": S, "source": "rope-llama-s0",
                   "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": S},
                   "notes": {"scale": S}, "config_fields": {}, "train_length": TARGET, "steps": 2,
                   "batch_size": 8 * L // TARGET, "lr": job.lr, "warmup": 0}


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

    whole = train_member(job.job(cfg, ids, tok), tmp_path / "whole", (lambda: None, lambda s: None), on_checkpoint=look)
    assert calls == [0, 3, 6]
    calls.clear()
    io, saved = dying_state_io(Checkpoint(tmp_path / "work", {"k": 1}), after=3)
    with pytest.raises(Died):
        train_member(job.job(cfg, ids, tok), tmp_path / "resumed", io, on_checkpoint=look)
    assert saved == [0, 2, 3] and calls == [0, 3]
    resumed = train_member(job.job(cfg, ids, tok), tmp_path / "resumed", io, on_checkpoint=look)
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
    import posprobe.zoo.train as zoo_train

    real_train, real_rows, scored = zoo_train.train_member, zx._Scorer.folder_rows, []

    class Died(Exception):
        pass

    def dying(job, folder, io, **kw):
        def save_then_die(state):
            io[1](state)
            raise Died
        return real_train(job, folder, (io[0], save_then_die), **kw)

    def counted(self, folder, label, protocols):
        scored.append(label)
        return real_rows(self, folder, label, protocols)

    monkeypatch.setattr(zx._Scorer, "folder_rows", counted)
    monkeypatch.setattr(zoo_train, "train_member", dying)
    with pytest.raises(Died):
        zx.extend_zoo(tiny_zoo, cfg, tmp_path / "out")
    assert scored == ["rope-s0", "rope-s0-pi"] and not (tmp_path / "out").exists()
    monkeypatch.setattr(zoo_train, "train_member", real_train)
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
        ("--member", "alibi", "--method", "pose"): "pose included: it reaches a model through HF's position_ids",
        ("--member", "alibi", "--method", "drope"): "alibi has no rotary positions (alibi family), so drope",
        ("--member", "learned", "--method", "direct"): "extended with --method copy only (its learned table of L = 16",
        ("--member", "rope", "--method", "copy"): "rope with copy: copy grows a learned position table",
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
    assert {(r["member"], r["method"]) for r in left} == {("p-rope", "yarn")}
    assert ("learned", "copy") in got and not any(j.member == "learned" and j.method != "copy" for j in jobs)
    assert len(jobs) == 5 * 5 - 1 + 2
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


# --- PoSE -------------------------------------------------------------------------------------------------------

def _pose_rows(n_steps: int, batch: int, n_ids: int = 2000, seed: int = 3):
    """PoSE batches over ids 0..n_ids-1 (a token's id is its place in the text, so the content skip can be read off
    the tokens): per row (start, l0, v, u) read back from the ids alone, as the rule below names them."""
    from posprobe.zoo.extend import pose_batch

    ids = torch.arange(n_ids)
    out = []
    for step in range(n_steps):
        x, pos = pose_batch(ids, step, seed, batch, L, TARGET)
        assert x.shape == pos.shape == (batch, L)
        for row, p in zip(x.tolist(), pos.tolist()):
            out.append((row, p))
    return out


def test_pose_ids_follow_the_released_rule():
    """Zhu et al.'s rule as their code draws it (dwzhu-pku/PoSE, src/train_pose.py, train_preprocess_function_pose,
    N = 2): chunk 1 = positions 0..l0-1 with l0 ~ U{1..(L+1)//2}; chunk 2 = positions l0+u..L-1+u with
    u ~ U{0..L'-L}; its text l0+v..L-1+v of a window of W = min(5L, text) tokens, v ~ U{0..W-L}. Everything is read
    back from the ids, and each draw's histogram is checked against the uniform law on exactly that range."""
    from posprobe.zoo.extend import pose_batch

    W = 5 * L
    rows = _pose_rows(400, 48)
    us, l0s, vs = [], [], []
    for x, p in rows:
        assert p[0] == 0 and all(0 <= q < TARGET for q in p)
        jumps = [i for i in range(1, L) if p[i] != p[i - 1] + 1]
        assert len(jumps) <= 1 and all(p[i] > p[i - 1] for i in range(1, L))  # two contiguous chunks, increasing
        u = p[-1] - (L - 1)
        us.append(u)
        if jumps:
            (l0,) = jumps
            assert p[l0] - p[l0 - 1] - 1 == u
            l0s.append(l0)  # l0 is seen only where u > 0; u is drawn apart from l0, so this is still U{1..8}
            # the text: chunk 1 contiguous from the window's start, chunk 2 contiguous, skipped by v
            assert x[:l0] == list(range(x[0], x[0] + l0)) and x[l0:] == list(range(x[l0], x[l0] + L - l0))
            v = x[l0] - x[l0 - 1] - 1
            assert 0 <= x[0] <= 2000 - W
            vs.append(v)

    def chi2_uniform(values, low, high):
        k = high - low + 1
        counts = torch.bincount(torch.tensor(values) - low, minlength=k)
        assert counts.numel() == k, (low, high, counts.numel())  # nothing outside the range
        assert (counts > 0).all(), "every value of the range is drawn"
        e = len(values) / k
        stat = float(((counts - e) ** 2 / e).sum())
        return stat, k - 1

    for values, low, high in ((us, 0, TARGET - L), (l0s, 1, (L + 1) // 2), (vs, 0, W - L)):
        assert min(values) == low and max(values) == high
        stat, dof = chi2_uniform(values, low, high)
        assert stat < dof + 6 * math.sqrt(2 * dof), (low, high, stat, dof)  # ~4 sigma above the chi2 mean
    # Seeded: the same (seed, step) gives the same batch; another step or seed another one.
    ids = torch.arange(2000)
    a = pose_batch(ids, 5, 1, 8, L, TARGET)
    assert all(torch.equal(s, t) for s, t in zip(a, pose_batch(ids, 5, 1, 8, L, TARGET)))
    assert not torch.equal(a[1], pose_batch(ids, 6, 1, 8, L, TARGET)[1])
    assert not torch.equal(a[1], pose_batch(ids, 5, 2, 8, L, TARGET)[1])


def _rotary_position_reads():
    from torch.nn.modules.module import register_module_forward_pre_hook

    reads = []

    def hook(module, args):
        if type(module).__name__.endswith("RotaryEmbedding") and module.training and len(args) >= 2:
            reads.append(args[1].detach().clone())
    return reads, register_module_forward_pre_hook(hook)


def test_pose_trains_at_L_with_its_ids_and_resumes_bit_for_bit(tiny_zoo, ids_and_tokenizer, tmp_path):
    """The ids the model's own rotary module receives during the fine-tuning are pose_batch's of each step (seen
    from outside the loop); the saved member carries L' and its own rope; a killed run resumes to the same weights."""
    from safetensors.torch import load_file

    from posprobe.report.checkpoint import Checkpoint
    from posprobe.zoo.extend import pose_batch

    ids, tok = ids_and_tokenizer
    cfg = ExtendConfig(members=("rope-llama",), methods=("pose",), steps=4, checkpoints=(), checkpoint_every=1,
                       progress=False)
    (job,), _ = plan_extension(tiny_zoo, cfg)
    assert (job.train_length, job.batch_size) == (L, 8)  # the pre-training batch at L: same tokens per step
    reads, handle = _rotary_position_reads()
    try:
        whole = train_member(job.job(cfg, ids, tok), tmp_path / "whole", (lambda: None, lambda s: None))
    finally:
        handle.remove()
    assert len(reads) == 4
    for step, got in enumerate(reads):
        assert torch.equal(got, pose_batch(ids, step, job.seed, 8, L, TARGET)[1])
    seen = torch.cat(reads)
    assert seen.max() >= L and seen.max() < TARGET  # past L, never at or past L'
    folder = tmp_path / "whole"
    c = json.loads((folder / "config.json").read_text())
    own = json.loads((job.source / "config.json").read_text())
    assert c["max_position_embeddings"] == TARGET and c["rope_parameters"] == own["rope_parameters"]
    rec = json.loads((folder / "zoo.json").read_text())["extension"]
    assert rec["method"] == "pose" and rec["train_length"] == L and rec["notes"]["positions"] == "unscaled"
    io, saved = dying_state_io(Checkpoint(tmp_path / "work", {"k": 2}), after=2)
    with pytest.raises(Died):
        train_member(job.job(cfg, ids, tok), tmp_path / "resumed", io)
    assert saved == [1, 2]
    resumed = train_member(job.job(cfg, ids, tok), tmp_path / "resumed", io)
    assert resumed["steps_run"] == 2 and resumed["log"] == whole["log"]
    a, b = load_file(folder / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- DroPE ------------------------------------------------------------------------------------------------------

def _attention_probs_by_hand(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(each layer's attention probabilities from the model's own eager forward, the same computed here in plain
    torch from each attention module's input: q.k / sqrt(d_head) with no rotation, causal mask, softmax)."""
    inputs = []
    attn_modules = [m for name, m in model.named_modules() if name.endswith(("self_attn", "attention"))
                    and hasattr(m, "forward") and not name.endswith("attention.attention")]
    hooks = [m.register_forward_pre_hook(lambda mod, a, kw: inputs.append(kw.get("hidden_states", a[0] if a else None)),
                                         with_kwargs=True) for m in attn_modules]
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    cfg = model.config
    H = cfg.num_attention_heads
    d = cfg.hidden_size // H
    mine = []
    for mod, hs in zip(attn_modules, inputs):
        b, t, _ = hs.shape
        if hasattr(mod, "query_key_value"):  # GPT-NeoX: one projection, per head [q | k | v]
            qkv = torch.nn.functional.linear(hs, mod.query_key_value.weight, mod.query_key_value.bias)
            qkv = qkv.view(b, t, H, 3, d)
            q, k = qkv[..., 0, :], qkv[..., 1, :]
        else:  # Llama / SmolLM3: separate projections, no bias
            q = (hs @ mod.q_proj.weight.T).view(b, t, H, d)
            k = (hs @ mod.k_proj.weight.T).view(b, t, H, d)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        mine.append(scores.softmax(-1))
    return [a.double() for a in out.attentions], mine


@pytest.mark.parametrize("name", ROTARY)
def test_drope_scores_are_plain_dot_products_in_every_layer(extended, name):
    from transformers import AutoModelForCausalLM

    folder, job = extended[(name, "drope")]
    c = json.loads((folder / "config.json").read_text())
    if name in ("rope-llama", "hybrid"):
        assert c["no_rope_layers"] == [0, 0] and job.notes["removed"] == "no_rope_layers"
    else:
        assert c["rope_parameters"]["rope_type"] == "proportional"
        assert c["rope_parameters"]["partial_rotary_factor"] == 0.0
    assert c["max_position_embeddings"] == TARGET
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    for source, rotates in ((folder, False), (job.source, True)):
        model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval()
        hf, mine = _attention_probs_by_hand(model, ids)
        assert len(hf) == len(mine) == 2
        worst = max(float((a - b).abs().max()) for a, b in zip(hf, mine))
        if rotates:  # the unextended member rotates in some layer: the by-hand scores are not its scores
            assert worst > 1e-3, (name, worst)
        else:
            assert worst <= 1e-6, (name, worst)


def test_drope_refused_for_a_class_that_cannot_carry_it(tmp_path):
    """GPT-J's rotary table is its own (`rotary_dim`), not built from rope_parameters, and GPTJConfig has no
    no_rope_layers: refused with one sentence. A Llama with the default rope type is carried (the proportional type
    with partial_rotary_factor 0, which Llama's rotary module reads)."""
    from transformers import GPTJConfig, GPTJForCausalLM, LlamaConfig, LlamaForCausalLM

    from posprobe.zoo.extend import drope_config

    GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=2, rotary_dim=8, n_positions=64,
                               bos_token_id=1, eos_token_id=1)).save_pretrained(tmp_path / "gptj")
    with pytest.raises(ValueError) as e:
        drope_config(tmp_path / "gptj", 64)
    assert str(e.value) == ("HF's gptj config cannot carry a model without rotation: it has no no_rope_layers, and "
                            "its rotary positions are not read from rope_parameters")
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    rope, fields, _ = drope_config(tmp_path / "llama", 64)
    assert rope["rope_type"] == "proportional" and rope["partial_rotary_factor"] == 0.0 and not fields


# --- YaRN's ramp at small L --------------------------------------------------------------------------------------

def test_scaled_yarn_ramp_keeps_bands_at_small_L():
    """At L = 128 (d = 32, base 1e4, s = 4) the paper's beta = 32 keeps no band by the paper's formula; the scaled
    ramp (beta x L/4096, alpha x L/4096 at base 1e4) keeps the fastest bands. gamma is checked against Peng et
    al.'s formula (ramp by turns) and HF's (ramp by band index), both written out here."""
    from posprobe.zoo.extend import ExtendJob, method_rope_parameters, scaled_yarn_betas
    from posprobe.zoo.methods import yarn_bands

    Lb, T, d, b = 128, 512, 32, 10000.0
    assert scaled_yarn_betas(Lb, b) == pytest.approx((32 * Lb / 4096, Lb / 4096), rel=1e-12)
    assert scaled_yarn_betas(4096, b) == pytest.approx((32.0, 1.0), rel=1e-12)  # the reference is left as it is
    j = torch.arange(d // 2, dtype=torch.float64)
    turns = Lb / (2 * math.pi * b ** (2 * j / d))

    def paper(alpha, beta):  # Peng et al. Eq. 18-19: gamma(r) = 0 below alpha, 1 above beta, linear between
        return torch.clamp((turns - alpha) / (beta - alpha), 0, 1)

    def hf(alpha, beta):  # the reference code's and HF's: linear in the band index between the outward-rounded ends
        def band(r):
            return d * math.log(Lb / (r * 2 * math.pi)) / (2 * math.log(b))
        low, high = max(math.floor(band(beta)), 0), min(math.ceil(band(alpha)), d - 1)
        return 1 - torch.clamp((j - low) / (high - low), 0, 1)

    got = {}
    for ramp in ("paper", "scaled"):
        rope, notes = method_rope_parameters("yarn", {"rope_type": "default", "rope_theta": b}, d, Lb, T,
                                             yarn_ramp=ramp)
        job = ExtendJob("rope-llama", 0, "yarn", Path("x"), {}, Lb, T, rope, 1, 1e-4, 0, notes)
        got[ramp] = yarn_bands(job)
    alpha, beta = 1 / 32, 1.0
    g = got["scaled"]
    assert torch.allclose(torch.tensor(g["gamma_paper"].to_numpy()), paper(alpha, beta), atol=1e-12)
    assert torch.allclose(torch.tensor(g["gamma"].to_numpy()), hf(alpha, beta), atol=1e-12)
    assert torch.allclose(torch.tensor(got["paper"]["gamma_paper"].to_numpy()), paper(1.0, 32.0), atol=1e-12)
    assert (got["paper"]["gamma_paper"] < 1).all()  # the paper's ramp keeps no band at L = 128
    kept = int((g["gamma_paper"] == 1).sum())
    assert kept == 6 and int((g["gamma"] == 1).sum()) == 6  # bands 0-5 turn more than once within 128 tokens
    # the share kept is Llama 2's at 4,096 tokens (bands turning > 32 times: 21 of 64) to within a band
    llama_kept = int((4096 / (2 * math.pi * b ** (2 * torch.arange(64.0) / 128)) > 32).sum())
    assert abs(kept / 16 - llama_kept / 64) <= 1 / 16
    freq = torch.tensor(g["freq_factor"].to_numpy())
    assert torch.allclose(freq, (1 - hf(alpha, beta)) / 4 + hf(alpha, beta), atol=1e-12)


def test_scaled_yarn_folder_carries_the_ramp(tiny_zoo, ids_and_tokenizer, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ids, tok = ids_and_tokenizer
    cfg = ExtendConfig(members=("rope-llama",), methods=("yarn",), yarn_ramp="scaled", steps=1, checkpoints=(),
                       progress=False)
    (job,), _ = plan_extension(tiny_zoo, cfg)
    train_member(job.job(cfg, ids, tok), tmp_path / "y", (lambda: None, lambda s: None))
    cos, sin, config = _cos_sin(tmp_path / "y", 2 * TARGET)
    p = config.rope_parameters
    assert p["beta_fast"] == pytest.approx(32 * L / 4096) and p["beta_slow"] == pytest.approx(L / 4096)
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    hf_cos, _ = _table(inv, factor, 2 * TARGET)
    assert (cos.double() - hf_cos).abs().max() <= 1e-6
    d, b = 16, 10000.0
    j = torch.arange(d // 2, dtype=torch.float64)

    def band(r):
        return d * math.log(L / (r * 2 * math.pi)) / (2 * math.log(b))

    low, high = max(math.floor(band(p["beta_fast"])), 0), min(math.ceil(band(p["beta_slow"])), d - 1)
    gamma = 1 - torch.clamp((j - low) / (high - low), 0, 1)
    theta = ((1 - gamma) / S + gamma) * b ** (-2 * j / d)
    p_cos, _ = _table(theta, 0.1 * math.log(S) + 1, 2 * TARGET)
    assert (cos.double() - p_cos).abs().max() <= 1e-6


def test_pose_and_drope_end_to_end(tiny_zoo, tmp_path):
    """`extend_zoo` with pose and drope on a GPT-NeoX and a SmolLM3 member: the curves are scored through the same
    analysis as the other methods, at step 0 DroPE's ppl equals a plain HF forward of the member without rotation,
    and the runs count the tokens of their L-long sequences."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from posprobe.analyses.context_extension import extend_zoo

    cfg = ExtendConfig(members=("rope", "rope-llama"), methods=("pose", "drope"), steps=2, checkpoints=(0,),
                       eval_tokens=256, sliding="never", progress=False)
    result = extend_zoo(tiny_zoo, cfg, tmp_path / "out")
    curves, runs = result.tables["curves"], result.tables["runs"]
    assert set(curves["method"]) == {"unextended", "pose", "drope"} and (curves["status"] == "ok").all()
    assert set(runs["tokens_per_step"]) == {8 * L}
    for name in ("rope", "rope-llama"):
        c = json.loads((tmp_path / "out" / f"{name}-s0-drope" / "config.json").read_text())
        assert c.get("no_rope_layers") == [0, 0] or c["rope_parameters"] == {
            "rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 0.0}
    # DroPE at step 0 = the unextended weights without rotation, by a plain HF forward (chunks of L').
    tok = AutoTokenizer.from_pretrained(tiny_zoo / "rope-s0")
    ids = torch.tensor(tok((tiny_zoo / "eval.txt").read_text(), add_special_tokens=False)["input_ids"])
    src = tiny_zoo / "rope-s0"
    # GPT-NeoX with zero rotated dims: another way to say "no rotation" than the folder's (proportional, p = 0)
    no_rope = AutoConfig.from_pretrained(src, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.0})
    model = AutoModelForCausalLM.from_pretrained(src, config=no_rope).eval()
    rows = ids[:256].view(-1, TARGET)
    with torch.no_grad():
        logits = model(rows).logits[:, :-1]
    want = math.exp(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                      rows[:, 1:].reshape(-1)).item())
    got = curves[(curves.member == "rope") & (curves.method == "drope") & (curves.step == 0)
                 & (curves.length == TARGET)]["ppl"].item()
    assert got == pytest.approx(want, rel=1e-5)


def test_the_mechanism_reads_each_models_own_rotation_at_its_own_lengths(tiny_zoo, tmp_path):
    """The mechanism tables (per head a(s) and Chen's bounds, per band usage) are measured on the unextended member
    at L -> L' and on each extended member at L' -> 2L', each on its own rotation: the band frequencies listed equal
    the papers' theta_j (PI: theta_j / s; NTK: the bloc97 base), written out in this file; DroPE on GPT-NeoX (HF's
    proportional type with no rotated share) has every band at frequency 0, so a(s) is flat and never leaves its
    range; the previous-token attention of PI's folder and of the member's equals HF's own attention at offset 1 on
    windows of L. Catches: the source folder measured in place of the extended one, or the lengths swapped."""
    from posprobe.analyses.context_extension import extend_zoo

    cfg = ExtendConfig(members=("rope",), methods=("pi", "ntk", "drope"), steps=1, checkpoints=(), eval_tokens=256,
                       sliding="never", progress=False)
    result = extend_zoo(tiny_zoo, cfg, tmp_path / "out")
    mech, usage, refused = (result.tables[k] for k in ("mechanism", "band_usage", "mechanism_refused"))
    lengths = mech.groupby("method")[["theory_context", "theory_target"]].first()
    assert lengths.loc["unextended"].tolist() == [L, TARGET]
    assert lengths.loc["pi"].tolist() == lengths.loc["ntk"].tolist() == [TARGET, 2 * TARGET]
    assert set(mech["method"]) == {"unextended", "pi", "ntk", "drope"} and len(mech[mech.method == "pi"]) == 2 * 2
    head_dim = 32 // 2
    for method in ("unextended", "pi", "ntk"):
        want, _ = _paper_inv_freq("direct" if method == "unextended" else method, "rope", head_dim)
        got = usage[(usage.method == method) & (usage.layer == 0)].sort_values("band")["frequency"].to_numpy()
        assert got == pytest.approx(want.numpy(), rel=1e-6), method
    assert (usage[usage.method == "drope"]["frequency"] == 0).all() and not len(refused)
    drope = mech[mech.method == "drope"]
    assert (drope["excess"] == 0).all() and not drope["extrapolation_leaves_range"].any()
    assert mech[mech.method == "unextended"]["excess"].gt(0).any()  # the rotary member's a(s) does leave it
    share = usage[usage.method == "pi"].groupby("layer")["value"].sum()
    assert share.to_numpy() == pytest.approx(1.0, abs=1e-6)  # per layer the bands' shares of |q.k| sum to 1
    prev = result.tables["previous_token"]  # every model on windows of L, whatever length it was trained at
    assert set(prev["method"]) == {"unextended", "pi", "ntk", "drope"} and set(prev["length"]) == {L}
    assert prev.groupby("method").size().to_dict() == {m: 2 * 2 for m in ("unextended", "pi", "ntk", "drope")}
    assert prev["prev_attention"].between(0, 1).all()
    for method, folder in (("pi", tmp_path / "out" / "rope-s0-pi"), ("unextended", tiny_zoo / "rope-s0")):
        mine = prev[prev.method == method].sort_values(["layer", "head"])
        want = _prev_by_hand(folder, (tiny_zoo / "eval.txt").read_text(), L, int(mine["windows"].iloc[0]))
        assert mine["prev_attention"].to_numpy() == pytest.approx(want.flatten().numpy(), abs=1e-5), method


def _prev_by_hand(folder: Path, text: str, n: int, windows: int) -> torch.Tensor:
    """[layer, head] mean of HF's own eager attention from i to i - 1 over queries 1..n-1 of `windows` windows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"][:windows * n]
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        att = model(torch.tensor(ids).view(windows, n), output_attentions=True).attentions
    i = torch.arange(1, n)
    return torch.stack([a[:, :, i, i - 1].double().mean((0, 2)) for a in att])


def test_previous_token_attention_is_hf_attention_at_offset_one(tiny_zoo, tmp_path):
    """`previous_token_frame` per head = the mean of HF's own eager attention on key i - 1 over queries 1..n-1 and the
    windows, computed here from `output_attentions`, on the unextended member and on its PI extension (HF applies the
    linear scaling); with every query weight zeroed attention is uniform over the i + 1 visible keys, so each head
    gives mean_i 1 / (i + 1), written out. Catches: offset 2 read for offset 1, query 0 counted (its only key is
    itself)."""
    from transformers import AutoModelForCausalLM

    from posprobe.analyses.context_extension import extend_zoo
    from posprobe.analyses.extension_mechanism import previous_token_frame
    from posprobe.backend.loading import load_model

    text = (tiny_zoo / "eval.txt").read_text()
    cfg = ExtendConfig(members=("rope-llama",), methods=("pi",), steps=2, checkpoints=(), eval_tokens=256,
                       sliding="never", mechanism=False, progress=False)
    extend_zoo(tiny_zoo, cfg, tmp_path / "out")
    for folder in (tiny_zoo / "rope-llama-s0", tmp_path / "out" / "rope-llama-s0-pi"):
        got = previous_token_frame(load_model(str(folder)), folder, text, L, max_windows=3)
        assert set(got["windows"]) == {3} and set(got["length"]) == {L}
        want = _prev_by_hand(folder, text, L, 3)
        for _, r in got.iterrows():
            assert r["prev_attention"] == pytest.approx(want[int(r["layer"]), int(r["head"])].item(), abs=1e-5)
    flat = AutoModelForCausalLM.from_pretrained(tiny_zoo / "rope-llama-s0")
    for layer in flat.model.layers:
        torch.nn.init.zeros_(layer.self_attn.q_proj.weight)
    flat.save_pretrained(tmp_path / "flat")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_zoo / "rope-llama-s0" / f).is_file():
            (tmp_path / "flat" / f).write_bytes((tiny_zoo / "rope-llama-s0" / f).read_bytes())
    got = previous_token_frame(load_model(str(tmp_path / "flat")), tmp_path / "flat", text, L, max_windows=2)
    uniform = sum(1 / (i + 1) for i in range(1, L)) / (L - 1)
    assert got["prev_attention"].to_numpy() == pytest.approx([uniform] * len(got), rel=1e-6)


def test_mechanism_summary_by_hand():
    """Per (member, method), unextended first: heads counted, the share leaving the range, median and largest
    excess, largest interpolation bound; numbers worked out by hand."""
    import pandas as pd

    from posprobe.report.zoo_extend import mechanism_summary

    rows = [("rope", "pi", 64, 128, 0.5, True, 0.2), ("rope", "pi", 64, 128, 0.1, False, 0.4),
            ("rope", "pi", 64, 128, 0.3, True, 0.1), ("rope", "unextended", 16, 64, 2.0, True, 0.05)]
    m = pd.DataFrame(rows, columns=["member", "method", "theory_context", "theory_target", "excess",
                                    "extrapolation_leaves_range", "interpolation_bound"]).assign(head=0)
    got = mechanism_summary(m)
    assert got["method"].tolist() == ["unextended", "pi"]
    pi = got.iloc[1]
    assert (pi.context, pi.target, pi.heads) == (64, 128, 3)
    assert pi.leaving_share == pytest.approx(2 / 3) and pi.excess_median == pytest.approx(0.3)
    assert pi.excess_max == pytest.approx(0.5) and pi.interpolation_bound_max == pytest.approx(0.4)


def test_copy_grows_the_learned_table_as_longformer_then_scores_to_Lp_only(tiny_zoo, ids_and_tokenizer, tmp_path):
    """The learned control: at step 0 its table has L' rows, row t = the member's row t mod L (read from the source's
    safetensors, Beltagy et al.'s copy), so within L its logits equal the unextended member's (plain HF); the saved
    folder loads in plain HF with L' rows; `extend_zoo` scores it at L and L' and says "cannot run" at 2L'."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from posprobe.analyses.context_extension import extend_zoo

    cfg = ExtendConfig(members=("learned",), methods=("copy",), steps=1, checkpoints=(0,), eval_tokens=256,
                       sliding="never", progress=False)
    (job,), _ = plan_extension(tiny_zoo, cfg)
    assert job.method == "copy" and job.batch_size == 2 and job.notes["to_rows"] == TARGET
    seen = {}

    def look(step, model):
        seen[step] = model.transformer.wpe.weight.detach().clone()
        if step == 0:
            x = torch.arange(3, 3 + L)[None]
            unext = AutoModelForCausalLM.from_pretrained(job.source).eval()
            with torch.no_grad():
                seen["logits"] = (model(x).logits, unext(x).logits)
            model(torch.arange(TARGET)[None])  # runs at L'
        return step

    ids, tok = ids_and_tokenizer
    train_member(job.job(cfg, ids, tok), tmp_path / "x", (lambda: None, lambda s: None), on_checkpoint=look)
    old = load_file(job.source / "model.safetensors")["transformer.wpe.weight"]
    assert old.shape[0] == L and seen[0].shape[0] == TARGET
    for t in range(TARGET):
        assert torch.equal(seen[0][t], old[t % L]), t
    got, want = seen["logits"]
    assert torch.allclose(got, want, atol=1e-6)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "x")
    assert saved.config.n_positions == TARGET and saved.transformer.wpe.weight.shape[0] == TARGET

    result = extend_zoo(tiny_zoo, cfg, tmp_path / "out")
    c = result.tables["curves"]
    ok = c[(c.method == "copy") & (c.status == "ok")]
    assert sorted(set(ok["length"])) == [L, TARGET]
    assert set(c[(c.method == "copy") & (c.length == 2 * TARGET)]["status"]) == {"cannot run"}
    assert set(c[(c.method == "unextended") & (c.status == "ok")]["length"]) == {L}
    ent = result.tables["attention_entropy"]
    copy = ent[ent.method == "copy"]
    assert set(copy[copy.status == "ok"]["length"]) == {L, TARGET}
    assert set(copy[copy.length == 2 * TARGET]["status"]) == {"cannot run"}


def test_attention_entropy_is_the_definition_on_hf_attention(tiny_zoo):
    """`attention_entropy` per layer = -sum p ln p of HF's attention, mean over rows, heads and queries: with every
    query weight zeroed the scores are equal, so attention is uniform over the i + 1 visible keys and the entropy is
    mean_i ln(i + 1), written out here; on the trained member it equals the head-signature pass's `entropy` (the
    TransformerLens bridge's captured pattern, another code path), mean over heads. Catches: the mean taken over the
    queries after the first only (the uniform case then differs), or the log of the wrong tensor."""
    from transformers import AutoTokenizer

    from posprobe.analyses.configs import HeadsConfig
    from posprobe.analyses.extension_mechanism import attention_entropy, uniform_entropy
    from posprobe.analyses.heads import head_signatures
    from posprobe.backend.loading import load_causal_lm, load_model

    folder = tiny_zoo / "rope-llama-s0"
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tok((tiny_zoo / "eval.txt").read_text(), add_special_tokens=False)["input_ids"][:3 * L])
    rows = ids.view(3, L)
    model = load_causal_lm(folder)
    got = attention_entropy(model, rows)
    heads = head_signatures(load_model(str(folder)), rows, HeadsConfig(induction_len=0, progress=False))
    h = heads.tables["heads"]
    want = h[h.metric == "entropy"].groupby("layer")["value"].mean().to_numpy()
    assert got.numpy() == pytest.approx(want, rel=1e-5)
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.self_attn.q_proj.weight)
    uniform = sum(math.log(i + 1) for i in range(L)) / L
    assert uniform_entropy(L) == pytest.approx(uniform, rel=1e-12)
    assert attention_entropy(model, rows).numpy() == pytest.approx([uniform] * len(model.model.layers), rel=1e-6)
    assert got.max() < uniform  # the trained member does not attend evenly


def test_entropy_summary_by_hand():
    """Per member and method, the mean relative entropy over seeds and layers per length; rows not ok are ignored."""
    import pandas as pd

    from posprobe.report.zoo_extend import entropy_summary

    rows = [("rope", 0, "pi", 16, 0, 0.5, "ok"), ("rope", 1, "pi", 16, 1, 0.7, "ok"),
            ("rope", 0, "pi", 64, 0, 0.9, "ok"), ("rope", 0, "unextended", 16, 0, 0.2, "ok"),
            ("rope", 0, "unextended", 64, 0, 9.0, "cannot run")]
    e = pd.DataFrame(rows, columns=["member", "seed", "method", "length", "layer", "relative", "status"])
    got = entropy_summary(e)
    assert got["method"].tolist() == ["unextended", "pi"]
    assert got.iloc[1]["relative_at_16"] == pytest.approx(0.6) and got.iloc[1]["relative_at_64"] == pytest.approx(0.9)
    assert got.iloc[0]["relative_at_16"] == pytest.approx(0.2) and math.isnan(got.iloc[0]["relative_at_64"])


def test_summary_frame_by_hand():
    """What `zoo extend` prints and its page shows: per member, method and protocol, mean [lowest-highest] over seeds,
    steps-to-threshold and the effective window per seed; numbers worked out by hand. Catches the first seed's value
    shown for the mean, or the seeds' order lost."""
    import pandas as pd

    from posprobe.report.result import Result
    from posprobe.report.zoo_extend import summary_frame

    cols = ["member", "seed", "method", "protocol", "ppl_L_unextended", "ppl_Lp_step0", "ppl_Lp", "ppl_2Lp",
            "in_window_cost", "steps_to_threshold", "ew_unextended", "ew_step0", "ew"]
    rows = [("rope", 0, "pi", "chunks", 10.0, 40.0, 12.0, 20.0, 1.10, None, 64, 0, 0),
            ("rope", 1, "pi", "chunks", 12.0, 44.0, 13.0, float("nan"), 1.20, 100, 64, 0, 32),
            ("rope", 0, "yarn", "chunks", 10.0, 15.0, 11.0, 14.0, 1.0, 25, 64, float("nan"), 64)]
    got = summary_frame(Result({"summary": pd.DataFrame(rows, columns=cols)}, {"analysis": "zoo-extend"}))
    pi, yarn = got.iloc[0], got.iloc[1]
    assert (pi["ppl L unext"], pi["ppl L' step 0"], pi["ppl L'"]) == ("11.00 [10.00–12.00]", "42.00 [40.00–44.00]",
                                                                      "12.50 [12.00–13.00]")
    assert pi["ppl 2L'"] == "20.00" and pi["cost at L"] == "1.15 [1.10–1.20]"
    assert pi["steps to threshold"] == "never,100" and pi["eff. window unext/0/last"] == "64/0/0,64/0/32"
    assert yarn["ppl L'"] == "11.00" and yarn["eff. window unext/0/last"] == "64/-/64"


def test_the_extend_curves_are_means_over_seeds_with_their_range():
    """The page's curve for a method at each step: the mean of the seeds' ppl at L' (chunks), bars to the lowest and
    highest seed, and the threshold the seeds' mean unextended ppl at L; by hand on two seeds. Catches the first seed
    drawn for the mean."""
    import pandas as pd

    from posprobe.report.result import Result
    from posprobe.report.zoo_extend import figures

    rows = [("rope", s, m, st, "chunks", n, p, "ok") for s, m, st, n, p in (
        (0, "unextended", 0, 16, 10.0), (1, "unextended", 0, 16, 14.0), (0, "pi", 0, 64, 40.0), (1, "pi", 0, 64, 50.0),
        (0, "pi", 5, 64, 20.0), (1, "pi", 5, 64, 16.0), (0, "pi", 5, 16, 99.0))]
    c = pd.DataFrame(rows, columns=["member", "seed", "method", "step", "protocol", "length", "ppl", "status"])
    (fig,) = figures(Result({"curves": c}, {"analysis": "zoo-extend", "train_length": 16, "target_length": 64}))
    (trace,) = fig.data
    assert list(trace.x) == [0, 5] and list(trace.y) == [45.0, 18.0]
    assert list(trace.error_y.array) == [5.0, 2.0] and list(trace.error_y.arrayminus) == [5.0, 2.0]
    assert fig.layout.shapes[0].y0 == 12.0


def test_the_passkey_figure_draws_each_methods_last_checkpoint_as_the_seeds_mean():
    """The page's passkey figure: per member and method, success by distance at the method's last checkpoint (the
    unextended member at its only one), the mean of the seeds with bars to the lowest and highest; by hand on two
    seeds. Catches the first seed drawn for the mean and step 0 drawn for a fine-tuned method."""
    import pandas as pd

    from posprobe.report.result import Result
    from posprobe.report.zoo_extend import _passkey_figure, figures

    rows = [("rope", s, m, st, d, r, 20, "ok") for s, m, st, d, r in (
        (0, "unextended", 0, 8, 1.0), (1, "unextended", 0, 8, 0.5), (0, "unextended", 0, 24, 0.0),
        (1, "unextended", 0, 24, 0.1), (0, "ntk", 0, 8, 0.9), (1, "ntk", 0, 8, 0.9), (0, "ntk", 0, 24, 0.0),
        (1, "ntk", 0, 24, 0.0), (0, "ntk", 5, 8, 0.2), (1, "ntk", 5, 8, 0.0), (0, "ntk", 5, 24, 0.6),
        (1, "ntk", 5, 24, 1.0))]
    pk = pd.DataFrame(rows, columns=["member", "seed", "method", "step", "distance", "success_rate", "trials",
                                     "status"])
    meta = {"analysis": "zoo-extend", "train_length": 16, "target_length": 64}
    fig = _passkey_figure(Result({"passkey": pk}, meta))
    got = {t.name: t for t in fig.data}
    assert list(got["unextended"].x) == [8, 24] and list(got["unextended"].y) == pytest.approx([0.75, 0.05])
    assert list(got["ntk"].y) == pytest.approx([0.1, 0.8])  # step 5, not step 0's 0.9 / 0.0
    assert list(got["ntk"].error_y.array) == pytest.approx([0.1, 0.2])
    assert list(got["ntk"].error_y.arrayminus) == pytest.approx([0.1, 0.2])
    assert sorted((s.type, s.x0 if s.type == "line" and s.x0 == s.x1 else s.y0) for s in fig.layout.shapes) == [
        ("line", 0.2), ("line", 16)]
    c = pd.DataFrame([("rope", 0, "unextended", 0, "chunks", 16, 10.0, "ok")],
                     columns=["member", "seed", "method", "step", "protocol", "length", "ppl", "status"])
    assert len(figures(Result({"curves": c}, meta))) == 1  # no passkey table: no passkey figure


def test_the_extend_page_draws_the_curves_from_the_tables(tiny_zoo, tmp_path):
    """`zoo extend`'s report page: its own page (not the generic preview) with the summary, one curve per method whose
    points are the mean ppl at L' over seeds at each step (recomputed here from the curves table), the threshold
    line at the unextended member's ppl at L, and attention entropy against length."""
    from posprobe.analyses.context_extension import extend_zoo
    from posprobe.report.pages import page_for
    from posprobe.report.zoo_extend import figures, sections

    cfg = ExtendConfig(members=("rope-llama",), methods=("direct", "yarn"), steps=2, checkpoints=(0, 1),
                       eval_tokens=256, sliding="never", progress=False)
    result = extend_zoo(tiny_zoo, cfg, tmp_path / "out")
    assert page_for(result).__name__ == "posprobe.report.zoo_extend"
    curves, entropy = figures(result)
    c = result.tables["curves"]
    for trace in curves.data:
        want = c[(c.method == trace.name) & (c.length == TARGET) & (c.protocol == "chunks")].groupby("step")["ppl"]
        assert list(trace.x) == [0, 1, 2] and list(trace.y) == pytest.approx(list(want.mean()), rel=1e-12)
    threshold = c[(c.method == "unextended") & (c.length == L) & (c.protocol == "chunks")]["ppl"].mean()
    assert [s.y0 for s in curves.layout.shapes] == pytest.approx([threshold])
    assert {t.name for t in entropy.data} == {"unextended", "direct", "yarn"}
    heads = [s.heading for s in sections(result)]
    assert heads[:3] == ["Summary", "Perplexity at L' against steps", "Attention entropy against length"]
    page = (tmp_path / "out" / "extend" / "report.html").read_text()
    assert "Perplexity at L&#x27; against steps" in page or "Perplexity at L' against steps" in page
