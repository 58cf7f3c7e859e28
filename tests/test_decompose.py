"""Word/position score decomposition: exact identities against the model's own scores and against a
plain-torch recomputation from the weights."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import need_hooked
from hf_util import W_E, W_pos, gpt2_layer0

from posprobe.analyses.decompose import (
    DATA_TERMS,
    EXACT_TERMS,
    decompose_layer,
    decompose_layer0,
    head_summary,
    positional_mean,
    relative_fraction,
    summary_table,
)
from posprobe.backend.facts import WrongModelKind
from posprobe.backend.loading import load_model

ROOT = Path(__file__).resolve().parents[1]


def _tokens(n: int = 24, batch: int = 2, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _assert_biases_nonzero(model) -> None:
    w = gpt2_layer0(model)
    assert w["b_Q"].abs().min() > 0 and w["b_K"].abs().min() > 0
    assert (w["ln_w"] - 1).abs().min() > 0 and w["ln_b"].abs().min() > 0


def _plain_ln(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x - x.mean(-1, keepdim=True)
    x = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return x * w + b if w is not None else x


def _plain_terms(x_word, x_pos, w, b, eps, W_Q, b_Q, W_K, b_K, head):
    """One head's full score and ww/pp terms from weights alone (float64, no TL code)."""
    x = x_word + x_pos
    xc = x - x.mean(-1, keepdim=True)
    s = (xc.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    full = _plain_ln(x, w, b, eps)
    q, k = full @ W_Q[head] + b_Q[head], full @ W_K[head] + b_K[head]
    scale = math.sqrt(W_Q.shape[-1])
    wgt = w if w is not None else 1.0
    wn = (x_word - x_word.mean(-1, keepdim=True)) / s * wgt
    pn = (x_pos - x_pos.mean(-1, keepdim=True)) / s * wgt
    ww = (wn @ W_Q[head]) @ (wn @ W_K[head]).transpose(-1, -2) / scale
    pp = (pn @ W_Q[head]) @ (pn @ W_K[head]).transpose(-1, -2) / scale
    return q @ k.transpose(-1, -2) / scale, ww, pp


def _d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64)


def _check_causal(dec, tol: float) -> None:
    n = dec.scores.shape[-1]
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    assert torch.equal(dec.allowed, causal.expand_as(dec.allowed)), "model masks something other than j > i"
    rec = dec.reconstructed()
    assert torch.isneginf(rec[..., ~causal]).all() and torch.isneginf(dec.scores[..., ~causal]).all()
    assert dec.max_error() <= tol


@pytest.mark.parametrize("fixture,tol", [("tiny_ape64", 1e-10), ("tiny_ape", 1e-5)])
def test_layer0_identity_against_model_and_plain_torch(request, fixture, tol):
    model = request.getfixturevalue(fixture)
    _assert_biases_nonzero(model)
    toks = _tokens()
    dec = decompose_layer0(model, toks)
    assert dec.parts == ("w", "p", "n", "b")
    _check_causal(dec, tol)
    terms = dec.terms()
    assert all(terms[t].abs().max() > 1e-3 for t in ("ww", "wp", "pw", "pp", "bias"))
    w = gpt2_layer0(model)  # HF GPT-2 weights, split per head by hand
    n = toks.shape[1]
    for head in (0, w["W_Q"].shape[0] - 1):
        full, ww, pp = _plain_terms(_d(W_E(model))[toks], _d(W_pos(model))[:n], w["ln_w"], w["ln_b"], w["eps"],
                                    w["W_Q"], w["b_Q"], w["W_K"], w["b_K"], head)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        assert (dec.reconstructed()[:, head][:, causal] - full[:, causal]).abs().max() <= tol
        assert (terms["ww"][:, head] - ww).abs().max() <= tol
        assert (terms["pp"][:, head] - pp).abs().max() <= tol


def test_layer0_processed_weights_same_terms():
    need_hooked()  # TL 3's weight processing exists only on the legacy HookedTransformer
    tiny_ape64 = load_model("tiny-ape", dtype="float64", backend="hooked")
    processed = copy.deepcopy(tiny_ape64)
    processed.load_and_process_state_dict(copy.deepcopy(tiny_ape64.state_dict()), fold_ln=True,
                                          center_writing_weights=True, center_unembed=True)
    assert type(processed.blocks[0].ln1).__name__ == "LayerNormPre"
    assert processed.blocks[0].attn.b_Q.abs().min() > 0
    # centred by TL, so not the same weights as before
    assert processed.W_E.mean(-1).abs().max() < 1e-6 < tiny_ape64.W_E.mean(-1).abs().max()
    toks = _tokens(seed=1)
    dec_p, dec_u = decompose_layer0(processed, toks), decompose_layer0(tiny_ape64, toks)
    assert dec_p.parts == ("w", "p", "b")  # the LN bias moved into b_Q
    _check_causal(dec_p, 1e-10)
    # TL's weight processing itself drifts ~3e-7 on a float64 model, so compare the two at 1e-5.
    ok = dec_u.allowed
    assert (dec_p.scores[ok] - dec_u.scores[ok]).abs().max() < 1e-5
    for name, t in dec_p.terms().items():
        assert (t[ok] - dec_u.terms()[name][ok]).abs().max() < 1e-5, name


def test_rope_model_exact_split_is_refused(tiny_rope):
    with pytest.raises(WrongModelKind, match="decompose_layer"):
        decompose_layer0(tiny_rope, _tokens(8))


# tiny_rope64 at 1e-6, not 1e-10: HF's Llama RMSNorm normalises in float32 whatever the weights' dtype, so the
# model's own scores carry float32 rounding that no float64 split can reproduce (measured 3.4e-7).
@pytest.mark.parametrize("fixture,tol", [("tiny_ape64", 1e-10), ("tiny_rope64", 1e-6), ("tiny_rope", 1e-5)])
def test_data_driven_split_sums_exactly(request, fixture, tol):
    model = request.getfixturevalue(fixture)
    rows = _tokens(20, batch=6, seed=2)
    means = positional_mean(model, rows, [0, 1], batch_size=4, progress=False)
    from posprobe.core.capture import capture

    for layer in (0, 1):
        plain = capture(model, rows, ["resid_pre"], layers=[layer])[("resid_pre", layer)].to(torch.float64).mean(0)
        assert (means[layer] - plain).abs().max() < 1e-5
        dec = decompose_layer(model, _tokens(16, seed=3), layer, means[layer])
        assert dec.parts[:4] == ("m", "p", "c", "r")
        assert tuple(dec.terms()) == DATA_TERMS
        _check_causal(dec, tol)
        assert dec.terms()["pp"].abs().max() > 1e-4 and dec.terms()["rr"].abs().max() > 1e-4


def test_data_driven_split_rejects_short_mean(tiny_ape):
    mean = positional_mean(tiny_ape, _tokens(8, batch=2), [1], progress=False)[1]
    with pytest.raises(ValueError, match="covers 8 positions"):
        decompose_layer(tiny_ape, _tokens(12), 1, mean)


def test_minilm_layer0_real_weights(minilm):
    tok = minilm.tokenizer
    toks = tok("The keeper of the lighthouse kept a careful log of passing ships.", return_tensors="pt")["input_ids"]
    dec = decompose_layer0(minilm, toks)
    assert dec.parts == ("w", "p", "t", "n", "b")
    assert dec.meta["token_type_term"] == "bias"
    assert dec.allowed.all()  # bidirectional, no padding
    assert dec.max_error() <= 5e-5 * max(1.0, float(dec.scores.abs().max()))
    # the any-layer split on real weights, at a middle layer
    n = toks.shape[1]
    mean = positional_mean(minilm, torch.randint(1000, 8000, (4, n), generator=torch.Generator().manual_seed(0)),
                           [3], progress=False)[3]
    dec3 = decompose_layer(minilm, toks, 3, mean)
    assert dec3.max_error() <= 5e-5 * max(1.0, float(dec3.scores.abs().max()))


def test_relative_fraction_against_pandas():
    n = 7
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    ok = (j <= i)[None]
    toeplitz = torch.sin(0.7 * (i - j).double())[None]
    assert relative_fraction(toeplitz, ok)[0] == pytest.approx(1.0, abs=1e-12)
    x = torch.randn(2, n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    okb = ok.expand(2, n, n)
    frac, means = relative_fraction(x, okb)
    import pandas as pd

    df = pd.DataFrame({"rel": (i - j).expand(2, n, n)[okb].numpy(), "v": x[okb].numpy()})
    within = ((df.v - df.groupby("rel").v.transform("mean")) ** 2).sum()
    assert frac == pytest.approx(1 - within / ((df.v - df.v.mean()) ** 2).sum(), abs=1e-12)
    assert 0 < frac < 1
    assert means[n - 1] == pytest.approx(df[df.rel == 0].v.mean())


def test_head_summary_shares_sum_to_one(tiny_ape):
    dec = decompose_layer0(tiny_ape, _tokens(16))
    s = head_summary(dec)
    assert set(s.columns) == {"model", "layer", "head", "term", "metric", "value"}
    shares = s[(s.metric == "var_share") & (s.term != "positional")].groupby("head").value.sum()
    assert (shares - 1).abs().max() < 1e-9
    table = summary_table(s)
    assert sorted(table["rank"]) == [1, 2, 3, 4] and table["share_positional"].is_monotonic_decreasing
    rel = s[s.metric == "rel_pos_fraction"].value
    assert ((rel >= 0) & (rel <= 1)).all()
    from posprobe.report.decompose import heatmap_figure, profile_figure

    fig = heatmap_figure(dec.frame(heads=[1]), 1, ("ww", "wp", "pw", "pp"))
    assert [tr.z.shape for tr in fig.data] == [(16, 16)] * 4
    assert len(profile_figure(dec.frame(heads=[1]), 1).data[0].x) == 16


def test_cli_writes_report_and_refuses_bad_input(tmp_path, capsys):
    from posprobe.cli import main

    out = tmp_path / "r"
    assert main(["decompose", "tiny-ape", "--out", str(out), "--head", "2"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["method"] == "exact-layer0" and meta["head"] == 2 and meta["max_abs_error"] < 1e-5
    html = (out / "report.html").read_text()
    assert html.count('id="posprobe-fig-') == 3 and "share_pp" in html
    import pandas as pd

    df = pd.read_parquet(out / "decompose.parquet")
    maps = df[df.metric == "score"]
    assert set(maps.term) == {"ww", "wp", "pw", "pp", "bias"} and set(maps["head"]) == {2}
    bad = tmp_path / "bad"
    assert main(["decompose", "tiny-ape", "--out", str(bad), "--head", "9"]) == 2
    assert main(["decompose", "tiny-rope", "--method", "exact", "--out", str(bad)]) == 2
    assert not bad.exists()
    assert "data-driven" in capsys.readouterr().err
    out2 = tmp_path / "rope"
    assert main(["decompose", "tiny-rope", "--layer", "1", "--sentence", "A short one.", "--out", str(out2)]) == 0
    assert json.loads((out2 / "meta.json").read_text())["method"] == "data-driven"


def test_notebook_executes(tmp_path):
    from conftest import run_notebook

    text, _ = run_notebook("score_decomposition", tmp_path, timeout=300)
    assert "max |terms - scores|" in text


# --- Independent term-by-term references: plain torch on the raw weights (Hugging Face modules for
# MiniLM), never posprobe code. Each reference splits the attention input into raw additive parts,
# freezes the LayerNorm's per-token scale at the value of the *full* sum, and projects every part.
# The references are then mutated the way a plausible bug would (a part given the wrong label, the
# scale taken from the wrong sum) to show the comparison would catch it.

_SENTENCES = ("The keeper of the lighthouse kept a careful log of passing ships.",
              "Who should Derek hug after shocking Richard?")


def _frozen_ln_parts(raw: dict, gamma: torch.Tensor, beta: torch.Tensor, eps: float, scale_from: tuple | None = None):
    """Each raw part centred, divided by the per-token LN scale of the sum of `scale_from` parts (default:
    all of them, which is what the model normalises), times gamma; the LN bias beta as part "n"."""
    total = sum(raw[k] for k in (scale_from or raw))
    scale = (total - total.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True).add(eps).sqrt()
    out = {k: (x - x.mean(-1, keepdim=True)) / scale * gamma for k, x in raw.items()}
    out["n"] = beta.expand_as(out["w"])
    return out


def _reference_terms(normed: dict, q_of, k_of, b_Q: torch.Tensor, b_K: torch.Tensor, d_head: int, constant: str):
    """{pair: [batch head query_pos key_pos]} for every pair of parts in `normed` plus "b" (b_Q / b_K), and the
    grouped terms ww, wp, pw, pp and "bias" (every pair touching a part in `constant` or b), the last built
    from one constant query / key vector rather than by summing pairs."""
    q = {k: q_of(x) for k, x in normed.items()}
    k = {n: k_of(x) for n, x in normed.items()}
    batch, pos, heads, _ = q["w"].shape
    q["b"], k["b"] = b_Q.expand(batch, pos, heads, d_head), b_K.expand(batch, pos, heads, d_head)

    def dot(a, c):
        return torch.einsum("bqhe,bkhe->bhqk", a, c) / math.sqrt(d_head)

    pairs = {a + c: dot(q[a], k[c]) for a in q for c in k}
    q_const = sum(q[c] for c in constant + "b")
    k_const = sum(k[c] for c in constant + "b")
    grouped = {t: pairs[t] for t in ("ww", "wp", "pw", "pp")}
    grouped["bias"] = (dot(q["w"] + q["p"], k_const) + dot(q_const, k["w"] + k["p"]) + dot(q_const, k_const))
    grouped["full"] = dot(sum(q.values()), sum(k.values()))
    return pairs, grouped


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.fixture(scope="module")
def minilm64(minilm):
    """The same MiniLM weights as a float64 TL model (depends on `minilm` for the CI-mandatory package check)."""
    from posprobe.backend.loading import load_model

    return load_model("minilm", dtype="float64")


@pytest.fixture(scope="module")
def bert_hf(minilm):
    """all-MiniLM-L6-v2 as a plain Hugging Face BertModel in float64 (weights exactly the fp32 ones, widened)."""
    from transformers import BertModel

    from posprobe.backend.sources import resolve

    return BertModel.from_pretrained(resolve("minilm").path, dtype=torch.float64).eval()


# fp64 TL model vs fp64 HF reference: only summation order differs. fp32 TL model: the captured LN
# scale and the scores are fp32, so terms agree to ~1e-6 relative; 2e-5 of the largest score leaves room.
@pytest.mark.parametrize("fixture,rel_tol", [("minilm64", 1e-10), ("minilm", 2e-5)])
def test_minilm_layer0_terms_match_hf_weights(request, bert_hf, fixture, rel_tol):
    model = request.getfixturevalue(fixture)
    enc = model.tokenizer(list(_SENTENCES), return_tensors="pt", padding=True)
    # equal-length rows only: the split runs without a padding mask
    rows = [enc["input_ids"][i][enc["attention_mask"][i].bool()] for i in range(len(_SENTENCES))]
    emb, att = bert_hf.embeddings, bert_hf.encoder.layer[0].attention.self
    H, d_model = bert_hf.config.num_attention_heads, bert_hf.config.hidden_size
    dh = d_model // H
    for toks in rows:
        toks = toks[None]
        n = toks.shape[1]
        dec = decompose_layer0(model, toks)
        tol = rel_tol * max(1.0, float(dec.scores.abs().max()))
        raw = {
            "w": emb.word_embeddings.weight[toks],
            "p": emb.position_embeddings.weight[:n][None].expand(1, n, d_model),
            "t": emb.token_type_embeddings.weight[0].expand(1, n, d_model),
        }  # one segment: token_type_ids = 0
        ln = emb.LayerNorm
        normed = _frozen_ln_parts(raw, ln.weight, ln.bias, ln.eps)
        # the frozen parts rebuild HF's own embedding output (so the raw parts and the scale are right)
        hf_embed = emb(input_ids=toks, token_type_ids=torch.zeros_like(toks))
        assert _max_diff(sum(normed.values()), hf_embed) < 1e-12

        def q_of(x):
            return torch.nn.functional.linear(x, att.query.weight).view(*x.shape[:2], H, dh)

        def k_of(x):
            return torch.nn.functional.linear(x, att.key.weight).view(*x.shape[:2], H, dh)

        pairs, grouped = _reference_terms(normed, q_of, k_of, att.query.bias.view(H, dh), att.key.bias.view(H, dh),
                                          dh, constant="tn")
        assert _max_diff(grouped["full"], dec.scores.double()) <= tol  # HF weights vs the TL model's own scores
        got, got_pairs = dec.terms(), dec.terms(detail=True)
        for name in EXACT_TERMS:
            assert _max_diff(got[name], grouped[name]) <= tol, name
        assert set(got_pairs) == set(pairs)
        for name, ref in pairs.items():
            assert _max_diff(got_pairs[name], ref) <= tol, name
        # every grouped term carries weight here, so a mix-up cannot hide in a zero
        assert all(float(grouped[t].abs().max()) > 100 * tol for t in EXACT_TERMS)

        # Bug 1: the segment embedding labelled as word (the old split) moves ww and bias by far more than tol.
        folded_ww = got_pairs["ww"] + got_pairs["wt"] + got_pairs["tw"] + got_pairs["tt"]
        assert _max_diff(folded_ww, grouped["ww"]) > 100 * tol
        # Bug 2: a scale frozen from the wrong sum (segment embedding left out) breaks every term.
        wrong = _frozen_ln_parts(raw, ln.weight, ln.bias, ln.eps, scale_from=("w", "p"))
        _, wrong_grouped = _reference_terms(wrong, q_of, k_of, att.query.bias.view(H, dh), att.key.bias.view(H, dh),
                                            dh, constant="tn")
        assert _max_diff(got["ww"], wrong_grouped["ww"]) > 10 * tol
        assert _max_diff(got["pp"], wrong_grouped["pp"]) > 10 * tol


def test_relative_views_match_hf_weights_and_a_least_squares_fit(bert_hf, minilm64):
    # The atlas's two views of relative position (analyses/relative_views.py) for MiniLM's layer 0: the pp term and
    # the position terms rebuilt from HF's BertModel weights (as above); the offset's share of the pp term's variance
    # as the R² of a least-squares fit on one indicator per offset i - j (numpy), the position terms' share of the
    # row-centred score variance written out; the pattern view taken as given from a heads table.
    import numpy as np
    import pandas as pd

    from posprobe.analyses.relative_views import relative_views

    model = minilm64
    toks = model.tokenizer(list(_SENTENCES)[:1], return_tensors="pt")["input_ids"]
    n = toks.shape[1]
    emb, att = bert_hf.embeddings, bert_hf.encoder.layer[0].attention.self
    H, d_model = bert_hf.config.num_attention_heads, bert_hf.config.hidden_size
    dh = d_model // H
    raw = {"w": emb.word_embeddings.weight[toks], "p": emb.position_embeddings.weight[:n][None].expand(1, n, d_model),
           "t": emb.token_type_embeddings.weight[0].expand(1, n, d_model)}
    normed = _frozen_ln_parts(raw, emb.LayerNorm.weight, emb.LayerNorm.bias, emb.LayerNorm.eps)

    def proj(w):
        return lambda x: torch.nn.functional.linear(x, w).view(*x.shape[:2], H, dh)

    _, grouped = _reference_terms(normed, proj(att.query.weight), proj(att.key.weight), att.query.bias.view(H, dh),
                                  att.key.bias.view(H, dh), dh, constant="tn")
    given = pd.DataFrame({"layer": 0, "head": range(H), "metric": "relative_r2", "value": np.linspace(0, 1, H)})
    got = relative_views(model, toks, pd.concat([given, given.assign(layer=1)]))
    w = got.pivot_table(index="head", columns=["term", "metric"], values="value")
    assert np.allclose(w[("pattern", "relative_r2")], given.value, atol=0)
    offsets = (np.arange(n)[:, None] - np.arange(n)[None, :]).ravel()
    X = (offsets[:, None] == np.arange(-(n - 1), n)[None, :]).astype(float)
    for h in range(H):
        y = grouped["pp"][0, h].numpy().ravel()
        fit = X @ np.linalg.lstsq(X, y, rcond=None)[0]
        r2 = 1 - ((y - fit) ** 2).sum() / ((y - y.mean()) ** 2).sum()
        assert abs(w[("pp", "rel_pos_fraction")][h] - r2) <= 1e-9, h
        rc = lambda x: x - x.mean(-1, keepdim=True)  # noqa: E731  (softmax ignores a per-query constant)
        s, pos = rc(grouped["full"][0, h]), rc(sum(grouped[t][0, h] for t in ("wp", "pw", "pp")))
        assert abs(w[("positional", "var_share")][h] - float((pos * s).sum() / (s * s).sum())) <= 1e-9, h
    # Not vacuous: the heads differ in both views.
    assert w[("pp", "rel_pos_fraction")].std() > 0.1 and w[("positional", "var_share")].std() > 0.1


def test_relative_view_classes_on_a_hand_made_table():
    import pandas as pd

    from posprobe.analyses.relative_views import disagreements

    rows = []
    for h, (pp, share, pattern) in enumerate([(0.9, 0.6, 0.95), (0.8, 0.5, 0.2), (0.8, 0.1, 0.1), (0.2, 0.9, 0.9),
                                              (0.5, 0.3, 0.8)]):
        rows += [(0, h, "pp", "rel_pos_fraction", pp), (0, h, "positional", "var_share", share),
                 (0, h, "pattern", "relative_r2", pattern)]
    t = pd.DataFrame(rows, columns=["layer", "head", "term", "metric", "value"])
    d = disagreements(t, 0.8)
    # Head 4 sits on both thresholds: the term's are inclusive (>=), the pattern's exclusive (>), as in `heads`.
    assert [x[:2] for x in d["term"]] == [(0, 0), (0, 1), (0, 4)]
    assert [x[:2] for x in d["pattern"]] == [(0, 0), (0, 3)]
    assert [x[:2] for x in d["both"]] == [(0, 0)]
    assert [x[:2] for x in d["term_only"]] == [(0, 1), (0, 4)] and [x[:2] for x in d["pattern_only"]] == [(0, 3)]
    assert d["term_only"][0] == (0, 1, 0.8, 0.2)


@pytest.mark.parametrize("fixture,rel_tol", [("tiny_ape64", 1e-10), ("tiny_ape", 2e-5)])
def test_tiny_ape_layer0_terms_from_state_dict(request, fixture, rel_tol):
    model = request.getfixturevalue(fixture)
    w = gpt2_layer0(model)  # from HF's c_attn / ln_1, not from posprobe or TL
    W_Q, W_K = w["W_Q"], w["W_K"]  # [head_index, d_model, d_head]
    dh = W_Q.shape[-1]
    eps = w["eps"]
    toks = _tokens(20, batch=3, seed=5)
    n = toks.shape[1]
    dec = decompose_layer0(model, toks)
    tol = rel_tol * max(1.0, float(dec.scores[dec.allowed].abs().max()))
    raw = {"w": _d(W_E(model))[toks], "p": _d(W_pos(model))[:n].expand(toks.shape[0], n, -1)}
    gamma, beta = w["ln_w"], w["ln_b"]
    normed = _frozen_ln_parts(raw, gamma, beta, eps)
    assert _max_diff(sum(normed.values()), torch.nn.functional.layer_norm(raw["w"] + raw["p"], (raw["w"].shape[-1],),
                                                                          gamma, beta, eps)) < 1e-12

    def proj(W):
        return lambda x: torch.einsum("bpd,hde->bphe", x, W)

    pairs, grouped = _reference_terms(normed, proj(W_Q), proj(W_K), w["b_Q"], w["b_K"],
                                      dh, constant="n")
    ok = dec.allowed
    assert _max_diff(grouped["full"][ok], dec.scores.double()[ok]) <= tol
    got, got_pairs = dec.terms(), dec.terms(detail=True)
    for name in EXACT_TERMS:
        assert _max_diff(got[name][ok], grouped[name][ok]) <= tol, name
    assert set(got_pairs) == set(pairs)
    for name, ref in pairs.items():
        assert _max_diff(got_pairs[name][ok], ref[ok]) <= tol, name
    assert all(float(grouped[t][ok].abs().max()) > 100 * tol for t in EXACT_TERMS)
    # Mutations the comparison must catch: the LN bias labelled as word; the scale frozen from the word alone.
    assert (
        _max_diff((got_pairs["ww"] + got_pairs["wn"] + got_pairs["nw"] + got_pairs["nn"])[ok], grouped["ww"][ok])
        > 100 * tol
    )
    wrong = _frozen_ln_parts(raw, gamma, beta, eps, scale_from=("w",))
    _, wrong_grouped = _reference_terms(wrong, proj(W_Q), proj(W_K), w["b_Q"], w["b_K"],
                                        dh, constant="n")
    assert _max_diff(got["pp"][ok], wrong_grouped["pp"][ok]) > 10 * tol


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_alibi_models_split_into_content_terms_and_hfs_distance_bias(name, monkeypatch):
    # ALiBi adds -slope * distance to the scores; the data-driven split carries it as the term "alibi". Independent
    # references: HF's own bias tensor (BLOOM's build_alibi_tensor: slope * j; MPT's build_mpt_alibi_tensor), which the
    # term must equal up to one constant per query row, and HF's eager attention weights, which the softmax of the
    # summed terms must equal. With the slopes read wrong (doubled) the run-time identity check refuses the result.
    from families import tiny_family

    bridge, hf = tiny_family(name)
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    mean = positional_mean(bridge, ids, [1], progress=False)[1]
    dec = decompose_layer(bridge, ids, 1, mean)
    assert "alibi" in dec.term_names() and dec.max_error() <= 1e-5
    term = dec.terms()["alibi"][0]  # head query key, float64
    n_heads = term.shape[0]
    base = hf.base_model
    if hasattr(base, "build_mpt_alibi_tensor"):
        want = base.build_mpt_alibi_tensor(n_heads, 12)[:, 0].double()  # [head, 1, key] -> [head, key]
    else:
        import transformers.models.bloom.modeling_bloom as B

        want = B.build_alibi_tensor(torch.ones(1, 12, dtype=torch.long), n_heads, torch.float64).view(n_heads, 12)
    gap = term - want[:, None, :]  # [head, query, key]
    rows = [gap[:, i, : i + 1] for i in range(12)]
    assert max(float((r - r[:, :1]).abs().max()) for r in rows) <= 1e-5  # a constant per query row
    # HF's eager weights from an independent copy of the weights (tiny_family's reference: never the model the bridge
    # wraps, whose forward is the bridge's). float32 on CPU: measured max |diff| BLOOM 1.9e-7, MPT 1.8e-7; tol 1e-6.
    assert hf is not bridge.original_model and hf.config._attn_implementation == "eager"
    with torch.no_grad():
        att = hf(ids, output_attentions=True).attentions[1].double()
    err = (torch.softmax(dec.reconstructed(), -1) - att).abs().max()
    assert err <= 1e-6, f"softmax of the summed terms vs HF's eager weights: max |diff| {err:.3g}"
    summary = head_summary(dec)
    share = summary[(summary.metric == "var_share") & (summary.term != "positional")].groupby("head").value.sum()
    assert (share - 1).abs().max() <= 1e-9
    # The family computes its term from what the backend reads (`hooks.score_bias`): read the slopes doubled there.
    from posprobe.backend.dispatch import ops
    from posprobe.backend.hooks import alibi_slopes

    doubled = [tuple(2 * s for s in layer) for layer in alibi_slopes(bridge)]
    monkeypatch.setattr(ops(bridge), "alibi_slopes", lambda model: doubled)
    with pytest.raises(RuntimeError, match="terms differ from the model's layer-1 scores"):
        decompose_layer(bridge, ids, 1, mean)


def test_a_new_biased_family_needs_no_edit_of_the_decomposition(monkeypatch):
    # A family that biases scores brings its own term (`Family.score_bias`): here a made-up one ("posprobe-dummy",
    # ALiBi's maths under another name) on a tiny BLOOM reaches the split, its name and the sum check untouched.
    import dataclasses

    from families import tiny_family

    from posprobe.backend.families import FAMILIES, alibi

    bridge, _ = tiny_family("bloom")
    calls = []

    def term(read, model, layer, scores, qk):
        calls.append(layer)
        return alibi.score_bias(read.alibi_slopes(model)[layer], scores, qk)

    # The registry's ALiBi entry swapped for the made-up family: the model's facts name it from here on.
    monkeypatch.setitem(FAMILIES, alibi.FAMILY.kind,
                        dataclasses.replace(alibi.FAMILY, score_term="posprobe-dummy", score_bias=term))
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    mean = positional_mean(bridge, ids, [1], progress=False)[1]
    dec = decompose_layer(bridge, ids, 1, mean)
    assert calls == [1] and dec.term_names()[-1] == "posprobe-dummy" and dec.max_error() <= 1e-5
