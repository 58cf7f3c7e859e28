"""posprobe/analyses/decompose.py against hand computations and Hugging Face (issue #36's mutation testing).

Synthetic decompositions (random float64 pair terms under a causal mask) check the grouping of pair terms, the per-head
summary (numpy: row-centred covariance shares, variance ratios, mean |term|, the diagonal-mean fraction, the rank),
the tidy frame and the identity check's tolerance, each written out here. On models: the scores a BERT layer's
split is checked against are HF's own q.k / sqrt(d) (TL's hook there carries the pattern), refusals and the meta
`run_decompose` writes.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from posprobe.analyses import decompose as D
from posprobe.analyses.configs import DecomposeConfig

F64 = torch.float64


def _synthetic(parts=("p", "c", "r", "m", "b"), method="data-driven", batch=2, heads=3, n=6, seed=0,
               dtype=F64, model="synthetic", layer=2):
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randn(len(parts), len(parts), batch, heads, n, n, generator=g, dtype=F64)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = pairs.sum((0, 1)).masked_fill(~causal, -math.inf).to(dtype)
    return D.Decomposition(model, layer, method, tuple(parts), pairs, scores, torch.zeros(batch, n, dtype=torch.long))


def _pair(dec, a, b):
    return dec.pairs[dec.parts.index(a), dec.parts.index(b)]


# ---- grouping ---------------------------------------------------------------------------------------------------

def test_data_driven_terms_group_the_pairs_as_documented():
    dec = _synthetic()
    terms = dec.terms()
    assert tuple(terms) == ("pp", "pc", "pr", "cp", "cc", "cr", "rp", "rc", "rr", "mean", "bias")
    for name in ("pp", "pc", "pr", "cp", "cc", "cr", "rp", "rc", "rr"):
        assert torch.equal(terms[name], _pair(dec, name[0], name[1]))
    mean = sum(_pair(dec, a, b) for a, b in ("mp", "mc", "mr", "mm", "pm", "cm", "rm"))
    bias = sum(_pair(dec, a, b) for a in "pcrmb" for b in "pcrmb" if "b" in a + b)
    assert torch.allclose(terms["mean"], mean, rtol=0, atol=1e-12)
    assert torch.allclose(terms["bias"], bias, rtol=0, atol=1e-12)
    detail = dec.terms(detail=True)
    assert len(detail) == 25 and all(torch.equal(detail[a + b], _pair(dec, a, b)) for a in "pcrmb" for b in "pcrmb")
    assert dec.term_names(detail=True) == tuple(a + b for a in "pcrmb" for b in "pcrmb")


def test_exact_terms_group_t_n_b_as_bias():
    dec = _synthetic(parts=("w", "p", "t", "n", "b"), method="exact-layer0")
    terms = dec.terms()
    assert tuple(terms) == ("ww", "wp", "pw", "pp", "bias")
    bias = sum(_pair(dec, a, b) for a in "wptnb" for b in "wptnb" if set(a + b) & set("tnb"))
    assert torch.allclose(terms["bias"], bias, rtol=0, atol=1e-12)
    assert torch.equal(terms["wp"], _pair(dec, "w", "p"))


def test_the_alibi_pseudo_part_pairs_only_with_itself():
    dec = _synthetic(parts=("p", "c", "r", "m", "b", "a"))
    assert dec.term_names() == D.DATA_TERMS + ("alibi",)
    names = dec.term_names(detail=True)
    assert "aa" in names and not {"pa", "ap", "ab", "ba", "ma"} & set(names) and len(names) == 26
    terms = dec.terms()
    assert torch.equal(terms["alibi"], _pair(dec, "a", "a"))
    bias = sum(_pair(dec, a, b) for a in "pcrmb" for b in "pcrmb" if "b" in a + b)
    assert torch.allclose(terms["bias"], bias, rtol=0, atol=1e-12)  # no (x, a) pair leaks into another term


def test_reconstructed_and_max_error_by_hand():
    dec = _synthetic(dtype=torch.float32)
    ok = torch.ones(6, 6, dtype=torch.bool).tril()
    rec = dec.reconstructed()
    assert rec.dtype == F64 and torch.isinf(rec[..., ~ok]).all()
    want = float((dec.pairs.sum((0, 1))[..., ok] - dec.scores.double()[..., ok]).abs().max())
    assert dec.max_error() == want and 0 < want < 1e-5  # float32 scores vs float64 terms


# ---- the identity check's tolerance ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(F64, 1e-6), (torch.float32, 1e-4), (torch.float16, 1e-2),
                                       (torch.bfloat16, 5e-2)])
def test_checked_tolerance_per_dtype_scaled_by_the_largest_score(dtype, tol):
    # The scores' dtype picks the tolerance, times max(1, largest |score|); the rounding of the scores to that dtype
    # stays below 3% of it, so an error planted at half the tolerance passes and one at twice fails.
    dec = _synthetic()
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    big = float(dec.scores[torch.isfinite(dec.scores)].abs().max())
    assert big > 1.0 and D.IDENTITY_TOLERANCE[dtype] == tol
    for frac, passes in ((0.5, True), (2.0, False)):
        scores = dec.pairs.sum((0, 1)).clone()
        scores[0, 0, 3, 1] += frac * tol * big
        probe = D.Decomposition("m", 1, "data-driven", dec.parts, dec.pairs,
                                scores.masked_fill(~causal, -math.inf).to(dtype), dec.tokens)
        if passes:
            assert D._checked(probe) is probe
        else:
            with pytest.raises(RuntimeError, match=r"differ from the model's layer-1 scores"):
                D._checked(probe)


def test_checked_scale_is_at_least_one():
    small = _synthetic()
    pairs = small.pairs * 1e-3  # every score below 1 in size: the tolerance is 1e-6 itself, not 1e-6 * max|score|
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    for delta, passes in ((0.6e-6, True), (1.4e-6, False)):
        scores = pairs.sum((0, 1)).clone()
        scores[1, 2, 5, 0] += delta
        dec = D.Decomposition("m", 0, "data-driven", small.parts, pairs, scores.masked_fill(~causal, -math.inf),
                              small.tokens)
        if passes:
            assert D._checked(dec) is dec
        else:
            with pytest.raises(RuntimeError, match=r"by 1.4e-06 \(tolerance 1e-06\)"):
                D._checked(dec)


# ---- per-head summary against numpy --------------------------------------------------------------------------------

def _np_summary(dec, row_centred):
    terms = {k: v.numpy() for k, v in dec.terms().items()}
    ok_all = np.isfinite(dec.scores.numpy())
    total = sum(terms.values())
    out = {}
    pos_share = {}
    for h in range(dec.scores.shape[1]):
        ok = ok_all[:, h]

        def centre(x):
            x = np.where(ok, x, 0.0)
            if row_centred:
                mean = x.sum(-1, keepdims=True) / np.maximum(ok.sum(-1, keepdims=True), 1)
            else:
                mean = x[ok].mean()
            return np.where(ok, x - mean, 0.0)

        s = centre(total[:, h])
        ss = (s ** 2).sum()
        pos = 0.0
        for name, t in terms.items():
            tc = centre(t[:, h])
            share = (tc * s).sum() / ss
            out[(h, name, "var_share")] = share
            out[(h, name, "var_ratio")] = (tc ** 2).sum() / ss
            out[(h, name, "mean_abs")] = np.abs(t[:, h][ok]).mean()
            if "p" in name or name == "alibi":
                pos += share
        out[(h, "positional", "var_share")] = pos
        pos_share[h] = pos
        out[(h, "pp", "rel_pos_fraction")] = _np_relative_fraction(terms["pp"][:, h], ok)[0]
    for rank, h in enumerate(sorted(pos_share, key=lambda h: -pos_share[h]), start=1):
        out[(h, "positional", "rank")] = rank
    return out


@pytest.mark.parametrize("row_centred", [True, False])
@pytest.mark.parametrize("parts", [("p", "c", "r", "m", "b"), ("p", "c", "r", "m", "b", "a")])
def test_head_summary_equals_numpy(row_centred, parts):
    dec = _synthetic(parts=parts, seed=3)
    df = D.head_summary(dec, row_centred=row_centred)
    assert list(df.columns) == ["model", "layer", "head", "term", "metric", "value"]
    assert (df.model == "synthetic").all() and (df.layer == 2).all() and df["value"].dtype == np.float64
    want = _np_summary(dec, row_centred)
    got = {(int(r.head), r.term, r.metric): r.value for r in df.itertuples()}
    assert set(got) == set(want)
    for key, v in want.items():
        assert got[key] == pytest.approx(v, rel=1e-10, abs=1e-12), key
    shares = df[(df.metric == "var_share") & (df.term != "positional")].groupby("head").value.sum()
    assert np.allclose(shares.values, 1.0)  # the terms sum to the scores, so their shares to one


def test_head_summary_of_a_head_with_constant_scores_is_nan_not_an_error():
    dec = _synthetic(heads=1)
    flat = torch.zeros_like(dec.pairs)
    flat[0, 0] = 2.0  # every entry of every row the same: nothing varies within a row
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    dec = D.Decomposition("m", 0, "data-driven", dec.parts, flat, flat.sum((0, 1)).masked_fill(~causal, -math.inf),
                          dec.tokens)
    df = D.head_summary(dec)
    shares = df[df.metric.isin(["var_share", "var_ratio"]) & (df.term != "positional")]
    assert shares.value.isna().all()
    assert df[(df.term == "pp") & (df.metric == "mean_abs")].value.item() == 2.0


def _np_relative_fraction(term, ok):
    n = term.shape[-1]
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    rel = np.broadcast_to(i - j + n - 1, term.shape)[ok]
    v = term[ok]
    means = np.full(2 * n - 1, np.nan)
    for r in range(2 * n - 1):
        if (rel == r).any():
            means[r] = v[rel == r].mean()
    total = ((v - v.mean()) ** 2).sum()
    within = ((v - means[rel]) ** 2).sum()
    return (1 - within / total if total > 0 else np.nan), means


def test_relative_fraction_equals_numpy_with_a_ragged_mask():
    g = torch.Generator().manual_seed(5)
    term = torch.randn(3, 7, 7, generator=g, dtype=F64)
    ok = torch.ones(3, 7, 7, dtype=torch.bool).tril()
    ok[1, :, :2] = False  # some diagonals lose entries in one sequence
    ok[2, 6] = False
    frac, means = D.relative_fraction(term, ok)
    want_frac, want_means = _np_relative_fraction(term.numpy(), ok.numpy())
    assert frac == pytest.approx(want_frac, rel=1e-12)
    assert means.shape == (13,) and means.dtype == F64
    assert np.allclose(means.numpy(), want_means, equal_nan=True, rtol=1e-12, atol=1e-14)
    assert torch.isnan(means[:6]).all() and not torch.isnan(means[6:]).any()  # keys after the query: no entries
    f32 = D.relative_fraction(term.float(), ok)[0]
    assert f32 == pytest.approx(want_frac, rel=1e-6)
    const = D.relative_fraction(torch.ones(1, 4, 4, dtype=F64), torch.ones(1, 4, 4, dtype=torch.bool).tril())
    assert math.isnan(const[0]) and const[1][3:].tolist() == [1.0] * 4  # no variance: no fraction


def test_frame_rows_by_hand():
    dec = _synthetic(heads=2, n=4)
    df = dec.frame(batch=1)
    n_ok = 10  # causal entries of a 4-token sequence
    assert len(df) == len(D.DATA_TERMS) * 2 * n_ok and list(df.index) == list(range(len(df)))
    assert list(df.columns) == ["model", "layer", "head", "query_pos", "key_pos", "rel_pos", "term", "value"]
    assert (df.model == "synthetic").all() and (df.layer == 2).all() and set(df["head"]) == {0, 1}
    terms = dec.terms()
    for r in df.sample(25, random_state=0).itertuples():
        assert r.rel_pos == r.query_pos - r.key_pos and r.key_pos <= r.query_pos
        assert r.value == terms[r.term][1, r.head, r.query_pos, r.key_pos].item()
    one = dec.frame(heads=[1], detail=True)
    assert set(one["head"]) == {1} and len(one) == 25 * n_ok


# ---- small helpers by hand -----------------------------------------------------------------------------------------

def test_tokens_and_first_sentence_by_hand():
    assert D._as_tokens([5, 6]).tolist() == [[5, 6]]
    assert D._as_tokens([[7]]).tolist() == [[7]]  # one token is a sequence
    for bad in ([], [[]], torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match="Expected tokens \\[batch, pos\\]"):
            D._as_tokens(bad)
    assert D._first_sentence("  One two. Three four. ") == "One two."
    assert D._first_sentence("No stop here") == "No stop here."
    assert D._first_sentence("Ends here.") == "Ends here."
    assert D._first_sentence("A.B. and more") == "A.B."  # ". " ends a sentence


def test_corpus_rows_are_half_overlapping_framed_windows(tiny_ape):
    tok = tiny_ape.tokenizer
    text = "the quick brown fox jumps over the lazy dog " * 6
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pre = [tok.bos_token_id] if tiny_ape.cfg.default_prepend_bos and tok.bos_token_id is not None else []
    rows = D.corpus_rows(tiny_ape, text, 9, max_windows=3)
    body = 9 - len(pre)
    assert rows.shape == (3, 9)
    for w in range(3):
        start = w * (body // 2)
        assert rows[w].tolist() == pre + ids[start:start + body]
    assert D.corpus_rows(tiny_ape, text, 9, max_windows=100).shape[0] == (len(ids) - body) // (body // 2) + 1


# ---- on models -----------------------------------------------------------------------------------------------------

def test_bert_split_checks_against_hfs_own_scores():
    # TL's hook_attn_scores carries the pattern on BERT: the split's scores are rebuilt from q and k. They must be
    # HF's own q.k / sqrt(d) of the layer (the embedding output through HF's query/key projections).
    from families import tiny_family

    bridge, ref = tiny_family("bert")
    ids = torch.randint(5, 250, (1, 7), generator=torch.Generator().manual_seed(0))
    dec = D.decompose_layer0(bridge, ids)
    with torch.no_grad():
        h = ref.bert.embeddings(input_ids=ids, token_type_ids=torch.zeros_like(ids))
        att = ref.bert.encoder.layer[0].attention.self
        H, d = att.num_attention_heads, att.attention_head_size
        q = att.query(h).view(1, 7, H, d).transpose(1, 2)
        k = att.key(h).view(1, 7, H, d).transpose(1, 2)
        want = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    assert torch.isfinite(dec.scores).all()  # an encoder masks nothing
    assert (dec.scores.double() - want.double()).abs().max() <= 1e-5
    assert dec.max_error() <= 1e-4


def test_decompose_heads_refusals_and_choices(tiny_ape):
    n_layers, n_heads = tiny_ape.cfg.n_layers, tiny_ape.cfg.n_heads
    with pytest.raises(ValueError, match=f"--layer {n_layers} out of range for a {n_layers}-layer model"):
        D.decompose_heads(tiny_ape, DecomposeConfig(layer=n_layers, progress=False))
    with pytest.raises(ValueError, match=f"--head {n_heads} out of range for {n_heads} heads"):
        D.decompose_heads(tiny_ape, DecomposeConfig(head=n_heads, progress=False))
    with pytest.raises(ValueError, match="method must be"):
        D.decompose_heads(tiny_ape, DecomposeConfig(method="fast", progress=False))
    with pytest.raises(ValueError, match="The exact split exists at layer 0 only"):
        D.decompose_heads(tiny_ape, DecomposeConfig(method="exact", layer=1, progress=False))
    assert D.decompose_heads(tiny_ape, DecomposeConfig(method="exact", progress=False))[0].method == "exact-layer0"
    dec, _ = D.decompose_heads(tiny_ape, DecomposeConfig(method="data", head=0, max_windows=3, progress=False))
    assert dec.method == "data-driven" and dec.meta["corpus_windows"] == 3
    with pytest.raises(ValueError, match=f"Layer {n_layers} out of range for a {n_layers}-layer model"):
        D._check_linear(tiny_ape, n_layers)


@pytest.mark.parametrize("text,source,want_source", [(None, None, "built-in text"), ("Cats sit. Dogs run.", None,
                                                     "text"), ("Cats sit. Dogs run.", "my.txt", "my.txt")])
def test_run_decompose_meta_and_table_by_hand(tiny_ape, text, source, want_source):
    from posprobe.data import BUILTIN_TEXT

    cfg = DecomposeConfig(text=text, head=None, progress=False)
    res = D.run_decompose(tiny_ape, cfg, source=source)
    meta, df = res.meta, res.tables["decompose"]
    used = text if text is not None else BUILTIN_TEXT
    assert meta["data"] == {"source": want_source, "sha256": hashlib.sha256(used.encode()).hexdigest(),
                            "n_items": meta["n_tokens"], "unit": "tokens"}
    assert "text" not in meta["config"] and meta["config"]["layer"] == 0
    assert meta["layer"] == 0 and meta["method"] == "exact-layer0" and meta["parts"][:2] == ["w", "p"]
    assert meta["n_tokens"] == len(meta["sentence_tokens"]) > 1
    assert meta["heatmap_terms"] == ["ww", "wp", "pw", "pp"]
    summary = df[df.metric != "score"]
    top = summary[(summary.term == "positional") & (summary.metric == "rank") & (summary.value == 1)]["head"].item()
    assert meta["head"] == top and set(df[df.metric == "score"]["head"]) == {top}
    assert list(df.index) == list(range(len(df)))
    assert list(df.columns) == ["model", "layer", "head", "term", "metric", "query_pos", "key_pos", "rel_pos", "value"]
    chosen = D.run_decompose(tiny_ape, DecomposeConfig(text=text, head=1, progress=False))
    assert chosen.meta["head"] == 1 and set(chosen.tables["decompose"].query("metric == 'score'")["head"]) == {1}
