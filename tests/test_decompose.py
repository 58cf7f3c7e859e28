"""Word/position score decomposition: exact identities against the model's own scores and against a
plain-torch recomputation from the weights."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from posprobe.analyses.decompose import (
    DATA_TERMS, decompose_layer, decompose_layer0, head_summary, positional_mean, relative_fraction, summary_table,
)
from posprobe.backend.facts import WrongModelKind

ROOT = Path(__file__).resolve().parents[1]


def _tokens(n: int = 24, batch: int = 2, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _assert_biases_nonzero(model) -> None:
    a, ln = model.blocks[0].attn, model.blocks[0].ln1
    assert a.b_Q.abs().min() > 0 and a.b_K.abs().min() > 0
    if hasattr(ln, "w"):
        assert (ln.w - 1).abs().min() > 0 and ln.b.abs().min() > 0


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
    ln, a = model.blocks[0].ln1, model.blocks[0].attn
    n = toks.shape[1]
    for head in (0, model.cfg.n_heads - 1):
        full, ww, pp = _plain_terms(_d(model.W_E)[toks], _d(model.W_pos)[:n], _d(ln.w), _d(ln.b), model.cfg.eps,
                                    _d(a.W_Q), _d(a.b_Q), _d(a.W_K), _d(a.b_K), head)
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        assert (dec.reconstructed()[:, head][:, causal] - full[:, causal]).abs().max() <= tol
        assert (terms["ww"][:, head] - ww).abs().max() <= tol
        assert (terms["pp"][:, head] - pp).abs().max() <= tol


def test_layer0_processed_weights_same_terms(tiny_ape64):
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


@pytest.mark.parametrize("fixture,tol", [("tiny_ape64", 1e-10), ("tiny_rope64", 1e-10), ("tiny_rope", 1e-5)])
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
    assert dec.allowed.all()  # bidirectional, no padding
    assert dec.max_error() <= 5e-5 * max(1.0, float(dec.scores.abs().max()))
    emb, a = minilm.embed, minilm.blocks[0].attn
    n = toks.shape[1]
    word = _d(emb.embed.W_E)[toks] + _d(emb.token_type_embed.W_token_type)[0]
    full, ww, pp = _plain_terms(word, _d(emb.pos_embed.W_pos)[:n], _d(emb.ln.w), _d(emb.ln.b), minilm.cfg.eps,
                                _d(a.W_Q), _d(a.b_Q), _d(a.W_K), _d(a.b_K), head=3)
    terms = dec.terms()
    assert (dec.reconstructed()[:, 3] - full).abs().max() < 1e-4
    assert (terms["ww"][:, 3] - ww).abs().max() < 1e-4 and (terms["pp"][:, 3] - pp).abs().max() < 1e-4
    # the any-layer split on real weights, at a middle layer
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
    from posprobe.analyses.decompose_report import heatmap_figure, profile_figure

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
