"""Tests written to kill the mutants benchmarks/mutation.py found alive in posprobe/analyses/geometry.py (issue #53).

Each checks posprobe against an independent computation written here (numpy's eigendecomposition for PCA, a
brute-force least-squares grid for the sinusoid fit, scipy's subspace angles, a plain Hugging Face twin of the tiny
model for the residual means), never against posprobe itself. Tiny inputs; the whole file runs in a few seconds.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd
import pytest
import torch
from hf_util import W_E, W_pos

from posprobe.analyses.configs import GeometryConfig
from posprobe.analyses.geometry import (
    _atlas_headlines,
    cosine_matrix,
    fit_sinusoid,
    matrix_geometry,
    pca,
    position_means,
    position_token_overlap,
    residual_geometry,
    run_geometry,
    wpos_geometry,
)
from posprobe.analyses.probes import text_rows
from posprobe.data import BUILTIN_TEXT
from posprobe.report.result import Result

# ----------------------------------------------------------------------------------------------- references


def _ref_pca(X: np.ndarray, k: int):
    """PCA by numpy's eigendecomposition of the scatter matrix (not an SVD): variance ratios, scores, directions,
    each direction signed so its largest-magnitude loading is positive."""
    Xc = X - X.mean(0)
    w, v = np.linalg.eigh(Xc.T @ Xc)
    order = np.argsort(w)[::-1]
    w, v = np.clip(w[order], 0, None), v[:, order]
    k = min(k, min(X.shape))
    dirs = []
    for i in range(k):
        d = v[:, i]
        dirs.append(d if d[np.argmax(np.abs(d))] > 0 else -d)
    dirs = np.array(dirs)
    return w[:k] / w.sum(), Xc @ dirs.T, dirs


def _ref_lstsq(y, t, period):
    """a, b, c of y ~ a cos(2 pi t / T) + b sin(2 pi t / T) + c and the residual sum of squares."""
    A = np.stack([np.cos(2 * np.pi * t / period), np.sin(2 * np.pi * t / period), np.ones_like(t)], 1)
    coef = np.linalg.lstsq(A, y, rcond=None)[0]
    return coef, float(((A @ coef - y) ** 2).sum())


def _check_fit_at_its_period(fit, y, t):
    """Amplitude, phase, offset and R^2 are what the least-squares fit at the reported period gives (numpy)."""
    (a, b, c), sse = _ref_lstsq(y, t, fit["period"])
    ss_tot = ((y - y.mean()) ** 2).sum()
    assert fit["amplitude"] == pytest.approx(np.hypot(a, b), rel=1e-9, abs=1e-12)
    # y = A cos(2 pi t / T + phi) + c: a = A cos(phi), b = -A sin(phi)
    assert fit["phase"] == pytest.approx(np.arctan2(-b, a), abs=1e-9)
    assert fit["offset"] == pytest.approx(c, rel=1e-9, abs=1e-12)
    assert fit["r2"] == pytest.approx(1 - sse / ss_tot, rel=1e-9, abs=1e-12)


def _best_grid_r2(y, t, periods):
    ss_tot = ((y - y.mean()) ** 2).sum()
    return max(1 - _ref_lstsq(y, t, T)[1] / ss_tot for T in periods)


# ----------------------------------------------------------------------------------------------- pca, cosine


def test_pca_equals_the_eigendecomposition_with_the_documented_signs():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(30, 7)) * np.linspace(4, 0.5, 7) + 5.0  # an offset the centring must remove
    ratio, scores, dirs = pca(X, 4)
    r_ratio, r_scores, r_dirs = _ref_pca(X, 4)
    assert ratio.shape == (4,) and scores.shape == (30, 4) and dirs.shape == (4, 7)
    assert np.allclose(ratio, r_ratio, atol=1e-12)
    assert np.allclose(dirs, r_dirs, atol=1e-9)
    assert np.allclose(scores, r_scores, atol=1e-9)
    # more components asked than the rank allows: one per singular value
    ratio, scores, dirs = pca(X[:3], 6)
    assert ratio.shape == (3,) and scores.shape == (3, 3) and dirs.shape == (3, 7)
    assert ratio.sum() == pytest.approx(1.0)
    # a constant matrix has no variance: ratios are zeros, not NaN
    ratio, scores, _ = pca(np.ones((6, 3)), 2)
    assert np.array_equal(ratio, np.zeros(2)) and np.allclose(scores, 0)


def test_cosine_matrix_by_loops_plain_and_centred():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(6, 5)) + 1.0
    X[2] = 0.0  # a zero row: cosine 0 with everything, not NaN

    def ref(M):
        out = np.zeros((len(M), len(M)))
        for i in range(len(M)):
            for j in range(len(M)):
                ni, nj = np.sqrt(M[i] @ M[i]), np.sqrt(M[j] @ M[j])
                out[i, j] = 0.0 if ni == 0 or nj == 0 else M[i] @ M[j] / (ni * nj)
        return out

    assert np.allclose(cosine_matrix(X), ref(X), atol=1e-12)
    assert np.allclose(cosine_matrix(X, center=True), ref(X - X.mean(0)), atol=1e-12)
    assert not np.allclose(cosine_matrix(X), cosine_matrix(X, center=True))


# ----------------------------------------------------------------------------------------------- fit_sinusoid


@pytest.mark.parametrize("period, phase", [(7.3, 0.4), (23.0, -2.0), (61.0, 2.9)])
def test_fit_sinusoid_exact_signal_against_the_definition(period, phase):
    t = np.arange(3.0, 83.0)  # does not start at 0
    y = 2.5 * np.cos(2 * np.pi * t / period + phase) + 0.7
    fit = fit_sinusoid(y, t)
    assert fit["period"] == pytest.approx(period, rel=1e-6)
    assert fit["amplitude"] == pytest.approx(2.5, rel=1e-6)
    assert np.cos(fit["phase"] - phase) == pytest.approx(1.0, abs=1e-9)
    assert fit["offset"] == pytest.approx(0.7, abs=1e-6)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-9)
    _check_fit_at_its_period(fit, y, t)


def test_fit_sinusoid_is_at_least_as_good_as_a_fine_grid_on_noisy_and_uneven_data():
    rng = np.random.default_rng(5)
    t = np.sort(rng.choice(np.arange(200.0), size=60, replace=False))  # uneven spacing
    y = np.cos(2 * np.pi * t / 37.0 + 1.0) + 0.4 * rng.normal(size=t.size)
    fit = fit_sinusoid(y, t)
    _check_fit_at_its_period(fit, y, t)
    span = t.max() - t.min() + 1
    step = np.median(np.diff(t))
    grid = 1 / np.linspace(1 / (4 * span), 0.5 / step, 4000)
    assert fit["r2"] >= _best_grid_r2(y, t, grid) - 1e-9
    assert fit["period"] == pytest.approx(37.0, rel=0.02)


def test_fit_sinusoid_period_range_default_four_spans_and_max_period():
    t = np.arange(20.0)
    y = 0.5 * t - 3.0  # a ramp: the longer the period, the better the fit; the search stops at its bound
    span = 20.0
    fit = fit_sinusoid(y)
    assert fit["period"] == pytest.approx(4 * span, rel=1e-4)
    _check_fit_at_its_period(fit, y, t)
    fit = fit_sinusoid(y, max_period=30.0)
    assert fit["period"] == pytest.approx(30.0, rel=1e-4)
    _check_fit_at_its_period(fit, y, t)
    # the shortest period searched is two steps (Nyquist): an alternating signal is fitted at exactly 2
    alt = np.where(np.arange(16) % 2 == 0, 1.0, -1.0)
    fit = fit_sinusoid(alt)
    assert fit["period"] == pytest.approx(2.0, rel=1e-6) and fit["r2"] == pytest.approx(1.0, abs=1e-9)
    # positions two apart: Nyquist is then a period of 4 positions
    fit = fit_sinusoid(alt, np.arange(0.0, 32.0, 2.0))
    assert fit["period"] == pytest.approx(4.0, rel=1e-6)


def test_fit_sinusoid_small_and_degenerate_inputs():
    t = np.arange(4.0)
    y = np.cos(2 * np.pi * t / 3.0)
    fit = fit_sinusoid(y)  # four points are enough
    assert fit["r2"] > 0.99
    with pytest.raises(ValueError, match="at least 4"):
        fit_sinusoid(y[:3])
    with pytest.raises(ValueError, match="one t per y"):
        fit_sinusoid(y, np.arange(5.0))
    assert np.isnan(fit_sinusoid(np.full(8, 2.0))["r2"])  # no variance to explain


# ----------------------------------------------------------------------------------------------- matrix_geometry


def _sinusoid_matrix(n=48, d=10, seed=0):
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    p = np.arange(n)
    cols = [3 * np.cos(2 * np.pi * p / 24), 3 * np.sin(2 * np.pi * p / 24), np.cos(2 * np.pi * p / 8),
            0.5 * np.sin(2 * np.pi * p / 12 + 0.3)]
    return np.stack(cols, 1) @ Q[:, :4].T + rng.normal(size=d)  # plus a constant row offset


def test_matrix_geometry_every_row_against_numpy():
    X = _sinusoid_matrix()
    positions = np.arange(5, 5 + len(X))
    df = matrix_geometry(torch.tensor(X, dtype=torch.float32), n_components=3, max_cos_pos=7, positions=positions)
    Xf = torch.tensor(X, dtype=torch.float32).double().numpy()  # the float32 input, read in float64
    assert list(df.columns) == ["metric", "k", "pos", "pos2", "value"]
    for c in ("k", "pos", "pos2"):
        assert str(df[c].dtype) == "Int64"
    ratio, scores, _ = _ref_pca(Xf, 3)
    m = lambda name: df[df.metric == name]  # noqa: E731
    ev = m("explained_variance")
    assert list(ev.k) == [0, 1, 2] and ev.pos.isna().all() and ev.pos2.isna().all()
    assert np.allclose(ev.value, ratio, atol=1e-12)
    sc = m("pc_score")
    assert len(sc) == 3 * len(X) and sc.pos2.isna().all()
    for k in range(3):
        part = sc[sc.k == k]
        assert list(part.pos) == list(positions)
        assert np.allclose(part.value, scores[:, k], atol=1e-9)
    nm = m("norm")
    assert list(nm.pos) == list(positions) and nm.k.isna().all()
    assert np.allclose(nm.value, np.sqrt((Xf ** 2).sum(1)), atol=1e-12)
    mn = m("mean_norm")
    assert len(mn) == 1 and mn.k.isna().all() and mn.pos.isna().all()
    assert mn.value.item() == pytest.approx(np.sqrt((Xf.mean(0) ** 2).sum()), rel=1e-12)
    cs = m("cosine")
    assert len(cs) == 49 and cs.k.isna().all()
    for _, row in cs.iterrows():
        i, j = int(row.pos) - 5, int(row.pos2) - 5
        assert 0 <= i < 7 and 0 <= j < 7
        assert row.value == pytest.approx(Xf[i] @ Xf[j] / np.sqrt((Xf[i] @ Xf[i]) * (Xf[j] @ Xf[j])), abs=1e-12)
    for k in range(3):
        t = positions.astype(float)
        got = {q: m(f"sin_{q}").set_index("k").value[k] for q in ("period", "r2", "amplitude", "phase")}
        assert m("sin_period").pos.isna().all()
        (a, b, c), sse = _ref_lstsq(scores[:, k], t, got["period"])
        ss_tot = ((scores[:, k] - scores[:, k].mean()) ** 2).sum()
        assert got["amplitude"] == pytest.approx(np.hypot(a, b), rel=1e-6)
        assert got["phase"] == pytest.approx(np.arctan2(-b, a), abs=1e-6)
        assert got["r2"] == pytest.approx(1 - sse / ss_tot, abs=1e-9)
    # the two strongest components are the period-24 pair (variance 4.5 each), fitted exactly
    assert m("sin_period").set_index("k").value[0] == pytest.approx(24.0, rel=1e-5)
    assert len(df) == 3 + 3 * len(X) + len(X) + 1 + 49 + 4 * 3
    # default positions 0..n-1 and the cosine block capped at the matrix size
    df0 = matrix_geometry(X, n_components=2, max_cos_pos=1000)
    assert list(df0[df0.metric == "norm"].pos) == list(range(len(X)))
    assert (df0.metric == "cosine").sum() == len(X) ** 2
    assert (df0.metric == "explained_variance").sum() == 2


# ----------------------------------------------------------------------------------------------- model views


@pytest.fixture(scope="module")
def ape64():
    from posprobe.backend.loading import load_model

    return load_model("tiny-ape", dtype="float64")


def test_wpos_geometry_table_and_meta_against_the_hf_table(ape64):
    W = W_pos(ape64).double().numpy()
    res = wpos_geometry(ape64, n_components=2, max_pos=40, max_cos_pos=5)
    df = res.df
    assert list(df.columns) == ["model", "source", "layer", "metric", "k", "pos", "pos2", "value"]
    assert (df.model == "tiny-ape").all() and (df.source == "W_pos").all()
    assert df.layer.isna().all() and str(df.layer.dtype) == "Int64"
    nm = df[df.metric == "norm"]
    assert list(nm.pos) == list(range(40))
    assert np.allclose(nm.value, np.linalg.norm(W[:40], axis=1), atol=1e-12)
    ratio, _, _ = _ref_pca(W[:40], 2)
    assert np.allclose(df[df.metric == "explained_variance"].value, ratio, atol=1e-12)
    assert (df.metric == "cosine").sum() == 25
    assert res.meta["n_pos"] == 40 and res.meta["views"] == ["W_pos"]
    assert res.meta["config"] == dict(n_components=2, max_pos=40, max_cos_pos=5)
    assert res.meta["data"]["n_items"] == 40 and res.meta["data"]["unit"] == "positions"
    full = wpos_geometry(ape64, n_components=1, max_cos_pos=2)  # every row by default
    assert full.meta["n_pos"] == 256 and (full.df.metric == "norm").sum() == 256


def test_position_means_refuse_bad_rows_and_layers(ape64):
    rows = torch.tensor(text_rows(ape64, BUILTIN_TEXT, 12, 3))
    last = position_means(ape64, rows, [1], "resid_pre", progress=False)  # the last layer is allowed
    assert set(last) == {1}
    for bad in ([], [2], [-1], [0, 2]):
        with pytest.raises(ValueError, match="layers"):
            position_means(ape64, rows, bad, progress=False)
    with pytest.raises(ValueError, match="equal-length"):
        position_means(ape64, rows[0], [0], progress=False)
    long_rows = torch.zeros(1, 257, dtype=torch.long)
    with pytest.raises(ValueError, match="exceed"):
        position_means(ape64, long_rows, [0], progress=False)
    full = torch.zeros(1, 256, dtype=torch.long)  # exactly the context is fine
    assert position_means(ape64, full, [0], progress=False)[0].shape == (256, 64)


def test_residual_geometry_against_a_plain_hf_twin(ape64):
    from posprobe.backend.tiny import tiny_hf_model

    rows = text_rows(ape64, BUILTIN_TEXT, 16, 5)
    ids = torch.tensor(rows)
    twin = tiny_hf_model("tiny-ape", seed=0, dtype=torch.float64)
    with torch.no_grad():
        hs = twin(ids, output_hidden_states=True).hidden_states
    # resid_pre of layer 0 = embeddings; resid_pre of layer 1 = block 0's output (GPT-2's hidden_states[1])
    want = {0: hs[0].mean(0).numpy(), 1: hs[1].mean(0).numpy()}
    assert np.allclose(want[0], (W_E(ape64)[ids].mean(0) + W_pos(ape64)[:16]).numpy(), atol=1e-12)
    res = residual_geometry(ape64, rows, [0, 1], point="resid_pre", n_components=2, skip_first=3, max_cos_pos=4,
                            batch_size=2, progress=False)
    df = res.df
    assert list(df.columns) == ["model", "source", "layer", "metric", "k", "pos", "pos2", "value"]
    assert (df.source == "resid_pre mean").all() and (df.model == "tiny-ape").all()
    assert str(df.layer.dtype) == "Int64" and list(df.layer.unique()) == [0, 1]
    for layer in (0, 1):
        part = df[df.layer == layer]
        M = want[layer][3:]
        nm = part[part.metric == "norm"]
        assert list(nm.pos) == list(range(3, 16))
        assert np.allclose(nm.value, np.linalg.norm(M, axis=1), atol=1e-9)
        ratio, scores, _ = _ref_pca(M, 2)
        assert np.allclose(part[part.metric == "explained_variance"].value, ratio, atol=1e-9)
        sc = part[(part.metric == "pc_score") & (part.k == 1)]
        assert np.allclose(sc.value, scores[:, 1], atol=1e-8)
        cs = part[part.metric == "cosine"]
        assert len(cs) == 16 and set(cs.pos) == {3, 4, 5, 6}
    assert res.meta["n_rows"] == 5 and res.meta["n_pos"] == 16 and res.meta["views"] == ["resid_pre mean"]
    assert res.meta["data"]["n_items"] == 5 and res.meta["data"]["unit"] == "windows"
    assert res.meta["config"] == dict(point="resid_pre", layers=[0, 1], skip_first=3, n_components=2,
                                      max_cos_pos=4, batch_size=2)
    # one layer given as an int; skip_first may leave exactly four positions, not three
    one = residual_geometry(ape64, rows, 1, point="resid_pre", n_components=1, skip_first=12, progress=False)
    assert list(one.df.layer.unique()) == [1] and one.meta["config"]["layers"] == [1]
    assert list(one.df[one.df.metric == "norm"].pos) == [12, 13, 14, 15]
    for bad in (13, -1):
        with pytest.raises(ValueError, match="skip_first"):
            residual_geometry(ape64, rows, 0, skip_first=bad, progress=False)


def _ref_overlap(P, E, ks):
    from scipy.linalg import subspace_angles

    out = {}
    for k in ks:
        bases = []
        for X in (P, E):
            Xc = X - X.mean(0)
            w, v = np.linalg.eigh(Xc.T @ Xc)
            bases.append(v[:, np.argsort(w)[::-1][:k]])
        Bp, Be = bases
        ang = np.degrees(subspace_angles(Bp, Be))
        Pc, Ec = P - P.mean(0), E - E.mean(0)
        out[k] = dict(angle_min=ang.min(), angle_mean=ang.mean(), random_share=k / P.shape[1],
                      pos_share_in_token=((Pc @ Be) ** 2).sum() / (Pc ** 2).sum(),
                      token_share_in_pos=((Ec @ Bp) ** 2).sum() / (Ec ** 2).sum(),
                      pos_own_share=((Pc @ Bp) ** 2).sum() / (Pc ** 2).sum(),
                      token_own_share=((Ec @ Be) ** 2).sum() / (Ec ** 2).sum())
    return out


def test_run_geometry_on_a_learned_position_model(ape64):
    cfg = GeometryConfig(window=12, max_windows=3, components=2, max_pos=30, skip_first=2, point="resid_pre",
                         progress=False)
    text = BUILTIN_TEXT[:2000]
    res = run_geometry(ape64, text, cfg)
    g = res.tables["geometry"]
    assert list(g.source.unique()) == ["W_pos", "resid_pre mean"]
    wp = g[g.source == "W_pos"]
    assert (wp.metric == "norm").sum() == 30
    assert (wp.metric == "explained_variance").sum() == 2
    resid = g[g.source == "resid_pre mean"]
    assert sorted(resid.layer.unique()) == [0, 1]  # default layers: first, middle (2 // 2 = 1), last
    assert list(resid[(resid.layer == 0) & (resid.metric == "norm")].pos) == list(range(2, 12))
    # the residual view's layer 0 mean against the embedding sum over the same windows
    ids = torch.tensor(text_rows(ape64, text, 12, 3))
    M = (W_E(ape64)[ids].mean(0) + W_pos(ape64)[:12]).numpy()[2:]
    nm = resid[(resid.layer == 0) & (resid.metric == "norm")]
    assert np.allclose(nm.value, np.linalg.norm(M, axis=1), atol=1e-9)
    # add or concatenate: the first 30 rows of the HF position table against the HF token table
    ov = res.tables["pos_token_subspace"]
    assert (ov.model == "tiny-ape").all()
    P, E = W_pos(ape64).double().numpy()[:30], W_E(ape64).double().numpy()
    ref = _ref_overlap(P, E, [1, 2, 4, 8, 16])
    assert sorted(set(ov.k)) == [1, 2, 4, 8, 16]  # up to d_model / 2 = 32, but at most 30 rows - 1
    for _, row in ov.iterrows():
        assert row.value == pytest.approx(ref[row.k][row.metric], abs=1e-6), (row.k, row.metric)
    assert res.meta["n_rows"] == 3 and res.meta["n_pos"] == 12
    assert res.meta["views"] == ["W_pos", "resid_pre mean"]
    assert res.meta["data"]["source"] == "text"
    assert res.meta["data"]["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert res.meta["data"]["n_items"] == 3 and res.meta["config"]["max_pos"] == 30
    named = run_geometry(ape64, text, cfg, source="my notes")
    assert named.meta["data"]["source"] == "my notes"
    # the built-in text by default
    builtin = run_geometry(ape64, None, GeometryConfig(window=8, max_windows=2, components=1, max_pos=8,
                                                       skip_first=0, layers=(1,), progress=False))
    assert builtin.meta["data"]["source"] == "built-in text"
    assert builtin.meta["data"]["sha256"] == hashlib.sha256(BUILTIN_TEXT.encode()).hexdigest()
    assert list(builtin.tables["geometry"].layer.dropna().unique()) == [1]


def test_run_geometry_on_a_rope_model_has_no_w_pos_view(tiny_rope):
    res = run_geometry(tiny_rope, BUILTIN_TEXT[:800],
                       GeometryConfig(window=10, max_windows=2, components=1, layers=(0,), progress=False))
    assert set(res.tables) == {"geometry"} and list(res.tables["geometry"].source.unique()) == ["resid_post mean"]
    assert res.meta["views"] == ["resid_post mean"]


def test_overlap_default_ks_respect_both_row_counts():
    rng = np.random.default_rng(9)
    P = rng.normal(size=(40, 16)) * np.linspace(3, 0.3, 16)
    E = rng.normal(size=(5, 16)) * np.linspace(0.3, 2, 16)  # only 5 tokens: k at most 4
    got = position_token_overlap(P, E)
    assert sorted(set(got.k)) == [1, 2, 4]
    ref = _ref_overlap(P, E, [1, 2, 4])
    for _, row in got.iterrows():
        assert row.value == pytest.approx(ref[row.k][row.metric], abs=1e-6)
    got = position_token_overlap(P, rng.normal(size=(50, 16)), ks=(16, 3, 0, 40))  # out-of-range k dropped
    assert list(got.k.unique()) == [16, 3]
    assert position_token_overlap(rng.normal(size=(9, 2)), rng.normal(size=(9, 2))).k.unique().tolist() == [1]
    with pytest.raises(ValueError, match="no k"):
        position_token_overlap(P, E, ks=(5, 8))
    # a constant table: every metric but the random baseline is NaN, for each k and each of the seven metrics
    const = position_token_overlap(P, np.ones((20, 16)), ks=(1, 4))
    assert len(const) == 14 and set(const.metric) == set(ref[1])
    assert const[const.metric != "random_share"].value.isna().all()
    assert list(const[const.metric == "random_share"].value) == [1 / 16, 4 / 16]


def test_atlas_headline_is_the_first_w_pos_component():
    g = pd.DataFrame(dict(source=["W_pos", "W_pos", "resid_post mean", "W_pos"],
                          metric=["explained_variance", "explained_variance", "explained_variance", "norm"],
                          k=[1, 0, 0, pd.NA], value=[0.2, 0.7, 0.9, 3.0]))
    assert _atlas_headlines(Result({"geometry": g}, {})) == [("wpos_pc1_explained", 0.7)]
    assert _atlas_headlines(Result({"geometry": g[g.source != "W_pos"]}, {})) == []


def test_atlas_run_passes_the_atlas_window_text_and_source(ape64):
    import types

    from posprobe.analyses.geometry import _atlas_run

    text = BUILTIN_TEXT[:1500]
    r = types.SimpleNamespace(text=text, source="atlas text", window=10, max_windows=2,
                              config=types.SimpleNamespace(progress=False))
    res = _atlas_run(ape64, r)
    cfg = res.meta["config"]
    assert (cfg["window"], cfg["max_windows"], cfg["progress"]) == (10, 2, False)
    assert res.meta["data"]["source"] == "atlas text" and res.meta["n_rows"] == 2 and res.meta["n_pos"] == 10
    assert res.meta["data"]["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert set(res.tables) == {"geometry", "pos_token_subspace"}


def test_float32_input_is_read_in_float64():
    """A float32 table is analysed in float64 (the SVD of a float32 copy would be off by ~1e-7)."""
    rng = np.random.default_rng(11)
    X = (rng.normal(size=(40, 12)) * np.linspace(3, 0.5, 12)).astype(np.float32)
    X64 = X.astype(np.float64)
    ratio, scores, _ = pca(X, 3)
    r_ratio, r_scores, _ = _ref_pca(X64, 3)
    assert np.abs(ratio - r_ratio).max() < 1e-12 and np.abs(scores - r_scores).max() < 1e-10
    assert np.abs(cosine_matrix(X) - cosine_matrix(X64)).max() < 1e-14
    assert cosine_matrix(X).dtype == np.float64
    df = matrix_geometry(X, n_components=2)
    assert np.abs(df[df.metric == "explained_variance"].value.to_numpy() - r_ratio[:2]).max() < 1e-12
    E = (rng.normal(size=(60, 12)) * np.linspace(0.5, 2, 12)).astype(np.float32)
    got = position_token_overlap(X, E, ks=(2, 4))
    ref = _ref_overlap(X64, E.astype(np.float64), [2, 4])
    for _, row in got.iterrows():
        assert abs(row.value - ref[row.k][row.metric]) < 1e-9, (row.k, row.metric)
    t = np.arange(40.0)
    y = np.cos(2 * np.pi * t / 9.0).astype(np.float32)
    fit = fit_sinusoid(y, t.astype(np.float32))
    _check_fit_at_its_period(fit, y.astype(np.float64), t)


def test_pca_of_a_table_with_less_than_unit_variance():
    rng = np.random.default_rng(12)
    X = 0.01 * rng.normal(size=(20, 5)) * np.linspace(2, 0.5, 5)  # total variance far below 1
    ratio, _, _ = pca(X, 2)
    assert np.allclose(ratio, _ref_pca(X, 2)[0], atol=1e-12) and ratio[0] > 0.2


def test_documented_defaults_and_tidy_index(ape64, capfd):
    rng = np.random.default_rng(13)
    X = rng.normal(size=(300, 4))
    df = matrix_geometry(X)
    assert (df.metric == "cosine").sum() == 256 ** 2  # the first 256 positions by default
    assert (df.metric == "explained_variance").sum() == 4  # 6 components asked, 4 dims
    assert list(df.index) == list(range(len(df)))
    full = wpos_geometry(ape64)
    assert full.meta["config"] == dict(n_components=6, max_pos=None, max_cos_pos=256)
    assert (full.tables["geometry"].metric == "explained_variance").sum() == 6
    rows = text_rows(ape64, BUILTIN_TEXT, 12, 2)
    capfd.readouterr()
    res = residual_geometry(ape64, rows, 0, progress=False)
    assert res.meta["config"] == dict(point="resid_pre", layers=[0], skip_first=0, n_components=6, max_cos_pos=256,
                                      batch_size=8)
    assert res.meta["analysis"] == "geometry" and res.meta["data"]["source"] == "token rows"
    assert list(res.tables["geometry"].index) == list(range(len(res.tables["geometry"])))
    assert (res.tables["geometry"].metric == "explained_variance").sum() == 6
    assert capfd.readouterr().err == ""  # progress=False: no progress bar
    assert full.meta["analysis"] == "geometry" and list(full.tables) == ["geometry"]
    assert full.meta["data"] == {"source": None, "sha256": None, "n_items": 256, "unit": "positions"}


def test_residual_view_at_resid_post_against_the_twin(ape64):
    from posprobe.backend.tiny import tiny_hf_model

    rows = text_rows(ape64, BUILTIN_TEXT, 10, 3)
    twin = tiny_hf_model("tiny-ape", seed=0, dtype=torch.float64)
    with torch.no_grad():
        hs = twin(torch.tensor(rows), output_hidden_states=True).hidden_states
    res = residual_geometry(ape64, rows, [0], point="resid_post", n_components=2, progress=False)
    nm = res.tables["geometry"][res.tables["geometry"].metric == "norm"]
    assert np.allclose(nm.value, np.linalg.norm(hs[1].mean(0).numpy(), axis=1), atol=1e-9)
    assert (res.tables["geometry"].source == "resid_post mean").all()


def test_refusal_names_the_analysis_and_the_residual_view(tiny_rope):
    from posprobe.backend.facts import WrongModelKind

    with pytest.raises(WrongModelKind) as e:
        wpos_geometry(tiny_rope)
    msg = str(e.value)
    assert msg.startswith("W_pos geometry needs learned absolute position embeddings")
    assert msg.endswith("Use the residual-stream view instead: residual_geometry(model, token_rows, layer) or "
                        "`posprobe geometry MODEL --text PATH`")


def test_overlap_row_limits_and_shape_checks():
    rng = np.random.default_rng(14)
    P, E = rng.normal(size=(5, 16)), rng.normal(size=(50, 16))
    assert list(position_token_overlap(P, E, ks=(4,)).k.unique()) == [4]  # at most rows - 1 = 4
    with pytest.raises(ValueError, match="no k"):
        position_token_overlap(P, E, ks=(5,))
    with pytest.raises(ValueError, match="no k"):
        position_token_overlap(rng.normal(size=(40, 16)), E, ks=(17,))  # at most d_model
    with pytest.raises(ValueError, match="must be"):
        position_token_overlap(rng.normal(size=(5, 16, 16)), E)


def test_run_geometry_default_layers_components_and_tables(capfd):
    """Default layers: first, middle and last of a six-layer model (0, 3, 5)."""
    import transformers as T
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend.tiny import byte_tokenizer, tiny_hf_config

    cfg = tiny_hf_config("tiny-ape")
    cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_inner, cfg.n_positions = 6, 16, 2, 32, 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = T.GPT2LMHeadModel(cfg).eval()
    six = TransformerBridge.boot_transformers("six", hf_model=hf, tokenizer=byte_tokenizer())
    six.cfg.model_name = "six"
    capfd.readouterr()
    res = run_geometry(six, BUILTIN_TEXT[:600], GeometryConfig(window=8, max_windows=2, components=2, progress=False))
    assert capfd.readouterr().err == ""
    g = res.tables["geometry"]
    resid = g[g.source == "resid_post mean"]
    assert sorted(resid.layer.unique()) == [0, 3, 5]
    assert (resid.metric == "explained_variance").sum() == 3 * 2
    assert list(g.index) == list(range(len(g)))
    assert list(res.tables["pos_token_subspace"].columns) == ["model", "k", "metric", "value"]
    assert res.meta["analysis"] == "geometry" and res.meta["data"]["unit"] == "windows"


def test_fit_sinusoid_small_signals_and_offset_positions():
    t = np.arange(16.0)
    y = 0.01 * np.cos(2 * np.pi * t / 5.0)  # total variance far below 1: R^2 is still defined
    fit = fit_sinusoid(y)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-9) and fit["period"] == pytest.approx(5.0, rel=1e-6)
    # the default longest period is 4 x the span of the positions given (20 positions from 10: span 20)
    t = np.arange(10.0, 30.0)
    fit = fit_sinusoid(0.5 * t, t)
    assert fit["period"] == pytest.approx(4 * 20, rel=1e-4)
