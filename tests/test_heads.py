"""Head signatures: chunked = full, every statistic against plain torch on Hugging Face's own attention
patterns, the detection scores against TransformerLens's head_detector, the sink score against Gu et
al.'s formula, and real-weight sanity on SmolLM2 (previous-token and sink heads exist) and MiniLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posprobe.analyses.configs import HeadsConfig
from posprobe.analyses.heads import detection_scores, head_signatures, run_heads
from posprobe.core.capture import capture

SMALL = dict(window=24, max_windows=4, induction_len=8, induction_batch=3, progress=False)


def _wide(result):
    return result.tables["heads"].pivot_table(index=["layer", "head"], columns="metric", values="value", dropna=False)


def test_chunked_equals_full_and_memory_does_not_grow(tiny_rope):
    one = run_heads(tiny_rope, None, HeadsConfig(batch_size=1, **SMALL))
    full = run_heads(tiny_rope, None, HeadsConfig(batch_size=4, **SMALL))
    a, b = _wide(one), _wide(full)
    assert np.allclose(a.values, b.values, atol=1e-6, rtol=0, equal_nan=True)
    assert np.allclose(one.tables["offsets"].value, full.tables["offsets"].value, atol=1e-6)
    # The accumulators are [head, 2 * window - 1] per layer whatever the number of windows.
    assert len(one.tables["offsets"]) == len(full.tables["offsets"])


def _reference(patterns: list[torch.Tensor], first_k: int) -> dict[str, np.ndarray]:
    """Every signature from full causal patterns [batch, head, n, n], in plain torch, layer by layer."""
    out = {}
    for l, p in enumerate(patterns):
        p = p.double()
        B, H, n, _ = p.shape
        i = torch.arange(n)
        prev = p[:, :, i[1:], i[1:] - 1].mean((0, 2))
        # Queries 1..n-1 for self/first masses: a decoder's query 0 sees only itself (forced 1).
        self_ = p[:, :, i[1:], i[1:]].mean((0, 2))
        # Gu et al. 2025: alpha_k = 1 / (T - k + 1) * sum_{i >= k} A[i, k], k = the first token (all T queries see it).
        sink = p[:, :, :, 0].sum(2).mean(0) / n
        ent = -(torch.special.xlogy(p, p)).sum(-1)  # [B, H, n]
        rel_ent = (ent[:, :, 1:] / torch.log(torch.arange(2, n + 1, dtype=torch.float64))).mean((0, 2))
        dist = (p * (i[:, None] - i[None, :]).abs()).sum(-1).mean((0, 2))
        # Toeplitz fit: each causal entry predicted by its diagonal's mean over all windows.
        r2 = []
        for h in range(H):
            vals, preds = [], []
            for d in range(n):
                diag = torch.diagonal(p[:, h], offset=-d, dim1=1, dim2=2).reshape(-1)
                vals.append(diag)
                preds.append(torch.full_like(diag, diag.mean()))
            v, f = torch.cat(vals), torch.cat(preds)
            r2.append(1 - ((v - f) ** 2).sum() / ((v - v.mean()) ** 2).sum())
        out[l] = dict(prev_mass=prev, self_mass=self_, sink_score=sink, first_mass=p[:, :, 1:, 0].mean((0, 2)),
                      first_k_mass=p[:, :, 1:, :first_k].sum(-1).mean((0, 2)), entropy=ent.mean((0, 2)),
                      relative_entropy=rel_ent, mean_distance=dist, relative_r2=torch.stack(r2))
    return out


@pytest.mark.real
def test_signatures_equal_plain_torch_on_hf_attention_smollm2(smollm2):
    from posprobe.backend.loading import load_hf_model

    hf, tok = load_hf_model("smollm2")
    hf.set_attn_implementation("eager")  # the only implementation that returns patterns
    ids = tok("The harbour town woke slowly on winter mornings, and the boats came back before sunrise. " * 3,
              add_special_tokens=False).input_ids
    rows = torch.tensor([[tok.bos_token_id] + ids[:15], [tok.bos_token_id] + ids[15:30]])
    cfg = HeadsConfig(window=16, induction_len=0, progress=False)
    got = _wide(head_signatures(smollm2, rows, cfg))
    with torch.no_grad():
        patterns = hf(rows, output_attentions=True).attentions
    ref = _reference(list(patterns), cfg.first_k)
    for l in (0, 5, 29):
        for metric, want in ref[l].items():
            have = got.loc[l][metric].to_numpy()
            assert np.allclose(have, want.numpy(), atol=2e-5, rtol=0), (l, metric, np.abs(have - want.numpy()).max())


def test_detection_scores_equal_transformer_lens_head_detector(tiny_ape):
    from conftest import need_package

    need_package("transformer_lens.head_detector", "a TransformerLens with head_detector (3.9 and 4.3 both ship it)")
    import transformer_lens.head_detector as head_detector
    rng = np.random.default_rng(0)
    half = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 20))
    text = half + half
    toks = tiny_ape.to_tokens(text)  # [BOS] + bytes, exactly what head_detector feeds the model
    pattern = capture(tiny_ape, toks, ["pattern"])
    for name, key in (("induction_head", "induction_score"), ("duplicate_token_head", "duplicate_score")):
        tl = head_detector.detect_head(tiny_ape, text, name)
        ours = torch.stack([detection_scores(pattern["pattern", l], toks)[key] for l in range(2)])
        assert torch.allclose(ours, tl.double(), atol=1e-6), name
    tl_prev = head_detector.detect_head(tiny_ape, text, "previous_token_head")
    ours = _wide(head_signatures(tiny_ape, toks, HeadsConfig(window=toks.shape[1], induction_len=0, progress=False)))
    assert np.allclose(ours["prev_token_score"].to_numpy().reshape(2, -1), tl_prev.numpy(), atol=1e-6)


def test_detection_scores_by_hand():
    # One sequence a b a b: duplicates (2,0), (3,1); induction (2,1), (3,2). A pattern that puts all of
    # query 2's mass on key 1 and query 3's on key 2 scores (1 + 1) / 4 rows.
    toks = torch.tensor([[5, 6, 5, 6]])
    p = torch.zeros(1, 1, 4, 4)
    p[0, 0, 0, 0] = p[0, 0, 1, 0] = 1
    p[0, 0, 2, 1] = p[0, 0, 3, 2] = 1
    s = detection_scores(p, toks)
    assert s["induction_score"].item() == pytest.approx(0.5) and s["duplicate_score"].item() == 0


@pytest.mark.real
def test_smollm2_has_previous_token_and_sink_heads(smollm2):
    r = run_heads(smollm2, None, HeadsConfig(window=48, max_windows=2, induction_len=12, induction_batch=2,
                                             progress=False))
    w = _wide(r)
    assert w.prev_mass.max() > 0.5 and w.sink_score.max() > 0.5
    assert 0 < r.meta["sink_fraction"] < 1
    kinds = set(r.tables["head_classes"].kind)
    assert {"sink", "previous-token"} <= kinds
    assert "sink heads" in r.to_html()


@pytest.mark.real
def test_minilm_encoder_signatures(minilm):
    r = run_heads(minilm, None, HeadsConfig(window=24, max_windows=2, progress=False))
    w = _wide(r)
    assert w.induction_score.isna().all() and "encoder" in r.meta["induction"]
    assert (w.relative_entropy <= 1 + 1e-9).all() and (w.prev_mass >= 0).all()
    offs = r.tables["offsets"]
    assert (offs.rel_pos < 0).any()  # bidirectional: attention to later tokens is profiled too


def test_cli_writes_report(tmp_path, capsys):
    from posprobe.cli import main

    out = tmp_path / "h"
    assert main(["heads", "tiny-ape", "--window", "32", "--max-windows", "3", "--induction-len", "6",
                 "--sink-threshold", "0.05", "--out", str(out), "--no-progress"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"heads.parquet", "head_classes.csv", "offsets.parquet", "meta.json", "report.html"} <= names
    printed = capsys.readouterr().out
    # The atlas's sentence, not a bare value_counts; the low threshold makes every head a sink head.
    assert printed.startswith("Of 8 heads: 8 sink") and "100% of heads are sink heads (threshold 0.05)" in printed
    assert main(["heads", "tiny-ape", "--window", "999", "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()
