"""Geometry of position representations: learned W_pos, or the positional part of the residual stream.

For a [pos, d_model] matrix P (rows = positions): PCA (explained variance, component scores by
position), the cosine-similarity matrix between positions, the norm by position, and a sinusoid fit
of each leading component's score (period from an FFT peak refined by least squares, with R^2).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int

from posprobe.analyses.configs import GeometryConfig
from posprobe.analyses.sections import AtlasRun, AtlasSection, CompareRun, ModelEntry, register, why_not
from posprobe.backend.facts import WrongModelKind, model_facts, require_learned
from posprobe.backend.model import context_length, n_layers, position_table, token_table
from posprobe.report import geometry as geometry_report
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256


def pca(P: np.ndarray, n_components: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(explained variance ratio [k], component scores [pos, k], directions [k, d_model]) of centred P.

    Signs are fixed so that each direction's largest-magnitude loading is positive (reproducible)."""
    X = np.asarray(P, dtype=np.float64)
    X = X - X.mean(0)
    U, S, Vt = np.linalg.svd(X, full_matrices=False)
    k = min(n_components, len(S))
    flip = np.sign(Vt[np.arange(k), np.abs(Vt[:k]).argmax(1)])
    total = (S**2).sum()
    ratio = (S[:k] ** 2) / total if total > 0 else np.zeros(k)
    return ratio, U[:, :k] * S[:k] * flip, Vt[:k] * flip[:, None]


def cosine_matrix(P: np.ndarray, center: bool = False) -> np.ndarray:
    """[pos, pos] cosine similarity between rows of P (optionally after removing the mean row)."""
    X = np.asarray(P, dtype=np.float64)
    if center:
        X = X - X.mean(0)
    n = np.linalg.norm(X, axis=1, keepdims=True)
    X = X / np.where(n == 0, 1, n)
    return X @ X.T


def fit_sinusoid(y: np.ndarray, t: np.ndarray | None = None, *, max_period: float | None = None) -> dict[str, float]:
    """Least-squares fit y ~ a cos(2 pi t / T) + b sin(2 pi t / T) + c.

    The period T (in positions) starts at the peak of the zero-padded FFT of the centred signal and
    is refined by a bounded 1-D search (a, b, c are linear given T). Periods up to `max_period`
    (default 4 x the span, so a monotonic half-wave is still a sinusoid) are searched. Returns
    period, amplitude, phase (radians), offset, r2."""
    from scipy.optimize import minimize_scalar

    y = np.asarray(y, dtype=np.float64)
    t = np.arange(len(y), dtype=np.float64) if t is None else np.asarray(t, dtype=np.float64)
    if len(y) < 4 or len(t) != len(y):
        raise ValueError("fit_sinusoid needs at least 4 points and one t per y")
    span = t.max() - t.min() + 1
    max_period = 4 * span if max_period is None else max_period
    ss_tot = float(((y - y.mean()) ** 2).sum())

    def solve(freq: float) -> tuple[float, np.ndarray]:
        A = np.stack([np.cos(2 * np.pi * freq * t), np.sin(2 * np.pi * freq * t), np.ones_like(t)], 1)
        coef, *_ = np.linalg.lstsq(A, y, rcond=None)
        return float(((A @ coef - y) ** 2).sum()), coef

    # Assumes roughly even spacing for the FFT start; the least-squares refinement does not.
    n_fft = 8 * int(2 ** np.ceil(np.log2(len(y))))
    step = float(np.median(np.diff(np.sort(t)))) if len(t) > 1 else 1.0
    spec = np.abs(np.fft.rfft(y - y.mean(), n=n_fft))
    freqs = np.fft.rfftfreq(n_fft, d=step)
    f_lo, f_hi = 1.0 / max_period, 0.5 / step
    ok = (freqs >= f_lo) & (freqs <= f_hi)
    f0 = float(freqs[ok][spec[ok].argmax()]) if ok.any() else f_lo
    df = 1.0 / (n_fft * step)
    # Refine near the FFT peak, then keep the best of that and a coarse log-grid (FFT peaks of short
    # windows are biased toward low frequencies for slow components).
    cands = [f0] + list(np.geomspace(f_lo, f_hi, 64))
    best = min(cands, key=lambda f: solve(f)[0])
    lo, hi = max(f_lo, best - 2 * df), min(f_hi, best + 2 * df)
    if hi > lo:
        r = minimize_scalar(lambda f: solve(f)[0], bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
        if r.fun <= solve(best)[0]:
            best = float(r.x)
    sse, (a, b, c) = solve(best)
    return dict(period=1.0 / best, amplitude=float(np.hypot(a, b)), phase=float(np.arctan2(-b, a)),
                offset=float(c), r2=1.0 - sse / ss_tot if ss_tot > 0 else float("nan"))


def matrix_geometry(P: Float[torch.Tensor, "pos d_model"] | np.ndarray, *, n_components: int = 6,
                    max_cos_pos: int = 256, positions: np.ndarray | None = None) -> pd.DataFrame:
    """Tidy geometry of a position matrix: metric, k, pos, pos2, value.

    metric: explained_variance (k; fraction), pc_score (k, pos; units of P), norm (pos), cosine
    (pos, pos2; first `max_cos_pos` positions, uncentred), sin_period (k; positions), sin_r2 (k),
    sin_amplitude (k), sin_phase (k; radians), mean_norm (-; norm of the mean row)."""
    X = P.detach().double().cpu().numpy() if isinstance(P, torch.Tensor) else np.asarray(P, dtype=np.float64)
    pos = np.arange(len(X)) if positions is None else np.asarray(positions)
    ratio, scores, _ = pca(X, n_components)
    parts = [pd.DataFrame(dict(metric="explained_variance", k=np.arange(len(ratio)), value=ratio))]
    k_idx, p_idx = np.meshgrid(np.arange(scores.shape[1]), pos, indexing="ij")
    parts.append(pd.DataFrame(dict(metric="pc_score", k=k_idx.ravel(), pos=p_idx.ravel(), value=scores.T.ravel())))
    parts.append(pd.DataFrame(dict(metric="norm", pos=pos, value=np.linalg.norm(X, axis=1))))
    parts.append(pd.DataFrame(dict(metric="mean_norm", value=[float(np.linalg.norm(X.mean(0)))])))
    m = min(max_cos_pos, len(X))
    a, b = np.meshgrid(pos[:m], pos[:m], indexing="ij")
    parts.append(pd.DataFrame(dict(metric="cosine", pos=a.ravel(), pos2=b.ravel(), value=cosine_matrix(X[:m]).ravel())))
    for k in range(scores.shape[1]):
        fit = fit_sinusoid(scores[:, k], pos)
        parts += [
            pd.DataFrame(dict(metric=f"sin_{q}", k=[k], value=[fit[q]])) for q in ("period", "r2", "amplitude", "phase")
        ]
    df = pd.concat(parts, ignore_index=True)
    for c in ("k", "pos", "pos2"):
        df[c] = df[c].astype("Int64")
    return df[["metric", "k", "pos", "pos2", "value"]]


def _top_directions(X: np.ndarray, k: int) -> np.ndarray:
    """[k, d] orthonormal top-k principal directions of the rows of centred X."""
    return np.linalg.svd(X - X.mean(0), full_matrices=False)[2][:k]


def position_token_overlap(W_pos: torch.Tensor | np.ndarray, W_E: torch.Tensor | np.ndarray,
                           ks: Sequence[int] | None = None) -> pd.DataFrame:
    """Add or concatenate? Whether a model that sums a learned position table into its token embeddings keeps the
    two in separate directions (a concatenation learned on its own) or mixes them. Per k (default 1, 2, 4, ... up to
    d_model / 2): `angle_min` / `angle_mean`, the principal angles (degrees) between the top-k principal subspaces of
    the centred position table and of the centred token embeddings; `pos_share_in_token`, the fraction of the
    position table's variance inside the token embeddings' top-k subspace, and `token_share_in_pos` the converse;
    `random_share` = k / d_model, what a uniformly random k-dimensional subspace holds in expectation (the
    baseline: above it the two share directions, below it they avoid each other); `pos_own_share` /
    `token_own_share`, each table's variance in its own top-k subspace. Columns: k, metric, value."""
    P = W_pos.detach().double().cpu().numpy() if isinstance(W_pos, torch.Tensor) else np.asarray(W_pos, np.float64)
    E = W_E.detach().double().cpu().numpy() if isinstance(W_E, torch.Tensor) else np.asarray(W_E, np.float64)
    if P.ndim != 2 or E.ndim != 2 or P.shape[1] != E.shape[1]:
        raise ValueError(f"W_pos and W_E must be [rows, d_model] with the same d_model, got {P.shape} and {E.shape}")
    d = P.shape[1]
    limit = min(d, P.shape[0] - 1, E.shape[0] - 1)
    ks = [k for k in (ks or [2 ** i for i in range(int(np.log2(max(d // 2, 1))) + 1)]) if 1 <= k <= limit]
    if not ks:
        raise ValueError(f"no k in 1..{limit} (d_model {d}, {P.shape[0]} positions, {E.shape[0]} tokens)")
    Pc, Ec = P - P.mean(0), E - E.mean(0)
    p_total, e_total = float((Pc ** 2).sum()), float((Ec ** 2).sum())
    if p_total == 0 or e_total == 0:  # a constant table (e.g. untrained zeros) has no principal directions
        names = ("angle_min", "angle_mean", "pos_share_in_token", "token_share_in_pos", "pos_own_share",
                 "token_own_share")
        return pd.DataFrame([dict(k=k, metric=m, value=k / d if m == "random_share" else float("nan"))
                             for k in ks for m in (*names, "random_share")])
    Vp_all, Ve_all = _top_directions(P, max(ks)), _top_directions(E, max(ks))
    rows = []
    for k in ks:
        Vp, Ve = Vp_all[:k], Ve_all[:k]
        cos = np.clip(np.linalg.svd(Vp @ Ve.T, compute_uv=False), 0.0, 1.0)
        angles = np.degrees(np.arccos(cos))
        values = {"angle_min": float(angles.min()), "angle_mean": float(angles.mean()),
                  "pos_share_in_token": float(((Pc @ Ve.T) ** 2).sum()) / p_total,
                  "token_share_in_pos": float(((Ec @ Vp.T) ** 2).sum()) / e_total,
                  "random_share": k / d,
                  "pos_own_share": float(((Pc @ Vp.T) ** 2).sum()) / p_total,
                  "token_own_share": float(((Ec @ Ve.T) ** 2).sum()) / e_total}
        rows += [dict(k=k, metric=m, value=v) for m, v in values.items()]
    return pd.DataFrame(rows)


def wpos_geometry(model: Any, *, n_components: int = 6, max_pos: int | None = None, max_cos_pos: int = 256) -> Result:
    """Geometry of the learned position embedding W_pos (first `max_pos` rows; all by default).

    Raises WrongModelKind for models without W_pos (RoPE, NoPE, ...): use `residual_geometry` there.

    Args:
        model: a TransformerLens model with a learned position table.
        n_components: the number of principal components analysed.
        max_pos: analyse the first `max_pos` rows of W_pos (None: the model's context, all rows).
        max_cos_pos: the cosine matrix covers the first `max_cos_pos` positions.

    Returns:
        A Result with one `geometry` table; df columns: model, source ("W_pos"), layer (NA), metric, k, pos,
            pos2, value (metrics as in `matrix_geometry`).
    """
    facts = model_facts(model)
    try:
        require_learned(facts, "W_pos geometry")
    except WrongModelKind as e:
        raise WrongModelKind(f"{e}. Use the residual-stream view instead: residual_geometry(model, token_rows, "
                             "layer) or `posprobe geometry MODEL --text PATH`") from None
    W = position_table(model)[: max_pos or facts.n_ctx]
    df = matrix_geometry(W, n_components=n_components, max_cos_pos=max_cos_pos)
    df.insert(0, "layer", pd.array([pd.NA] * len(df), dtype="Int64"))
    df.insert(0, "source", "W_pos")
    df.insert(0, "model", facts.name)
    meta = make_meta("geometry", model=facts.summary(), data=data_meta(None, n_items=int(W.shape[0]), unit="positions"),
                     config=dict(n_components=n_components, max_pos=max_pos, max_cos_pos=max_cos_pos),
                     views=["W_pos"], n_pos=int(W.shape[0]))
    return Result({"geometry": df}, meta)


@torch.no_grad()
def position_means(model: Any, token_rows: Sequence[Sequence[int]] | torch.Tensor, layers: Sequence[int],
                   point: str = "resid_pre", *, batch_size: int = 8, progress: bool = True) -> dict[int, torch.Tensor]:
    """{layer: float64 [pos, d_model]} mean of `point` at each position over the token rows (streamed)."""
    from posprobe.core.capture import batches, mean_by_position, stream

    rows = torch.as_tensor(token_rows) if not isinstance(token_rows, torch.Tensor) else token_rows
    if rows.dim() != 2:
        raise ValueError("token_rows must be equal-length rows of token ids")
    n = n_layers(model)
    if not layers or any(not 0 <= l < n for l in layers):
        raise ValueError(f"layers must be a non-empty subset of 0..{n - 1}, got {list(layers)}")
    if rows.shape[1] > context_length(model):
        raise ValueError(f"Rows of {rows.shape[1]} tokens exceed the model's context of {context_length(model)}")
    (state,) = stream(model, batches(rows, batch_size), [mean_by_position(point, layers)],
                      total=-(-rows.shape[0] // batch_size), progress=progress, desc="position means")
    return {l: state[l].mean for l in layers}


def residual_geometry(model: Any, token_rows: Sequence[Sequence[int]] | Int[torch.Tensor, "batch pos"],
                      layer: int | Sequence[int], *, point: str = "resid_pre", n_components: int = 6,
                      skip_first: int = 0, max_cos_pos: int = 256, batch_size: int = 8,
                      progress: bool = True) -> Result:
    """Geometry of the positional part of the residual stream: the mean of `point` at each position
    over the token rows (content averages out; what is left depends on position only), for each layer.

    Args:
        model: a TransformerLens model.
        token_rows: the windows, `[batch, pos]` token ids of equal length.
        layer: one layer or several.
        point: the capture point averaged (e.g. "resid_pre", "resid_post").
        n_components: the number of principal components analysed.
        skip_first: drops leading positions (e.g. BOS / attention-sink rows whose huge norm dominates PCA); at
            least 4 positions must be left.
        max_cos_pos: the cosine matrix covers the first `max_cos_pos` positions kept.
        batch_size: rows per forward pass.
        progress: show a tqdm bar.

    Returns:
        A Result with one `geometry` table; df columns: model, source (`"<point> mean"`), layer, metric, k, pos,
            pos2, value (metrics as in `matrix_geometry`: explained_variance, pc_score, norm, mean_norm, cosine,
            sin_period, sin_r2, sin_amplitude, sin_phase).
    """
    facts = model_facts(model)
    layers = [layer] if isinstance(layer, int) else list(layer)
    means = position_means(model, token_rows, layers, point, batch_size=batch_size, progress=progress)
    n_pos = next(iter(means.values())).shape[0]
    if not 0 <= skip_first <= n_pos - 4:
        raise ValueError(f"skip_first must leave at least 4 positions of {n_pos}, got {skip_first}")
    frames = []
    for l in layers:
        df = matrix_geometry(means[l][skip_first:], n_components=n_components, max_cos_pos=max_cos_pos,
                             positions=np.arange(skip_first, n_pos))
        df.insert(0, "layer", l)
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    df["layer"] = df["layer"].astype("Int64")
    df.insert(0, "source", f"{point} mean")
    df.insert(0, "model", facts.name)
    config = dict(point=point, layers=layers, skip_first=skip_first, n_components=n_components,
                  max_cos_pos=max_cos_pos, batch_size=batch_size)
    meta = make_meta(
        "geometry",
        model=facts.summary(),
        data=data_meta("token rows", n_items=len(token_rows), unit="windows"),
        config=config,
        views=[f"{point} mean"],
        n_rows=len(token_rows),
        n_pos=n_pos,
    )
    return Result({"geometry": df}, meta)


def run_geometry(model: Any, text: str | None = None, config: GeometryConfig | None = None, *,
                 source: str | None = None) -> Result:
    """W_pos geometry (learned-position models) and the residual-stream view over windows of `text`,
    as one `geometry` table (column `source` tells the views apart).

    Args:
        model: a TransformerLens model.
        text: the text cut into windows (default: the built-in text).
        config: the analysis's options (None: its Config's defaults; layers default to the first, middle and
            last).
        source: what meta.json's data record names as the text (default: "built-in text" or "text").

    Returns:
        A Result with the `geometry` table (`wpos_geometry`'s and `residual_geometry`'s rows) and, on a model
            with W_pos, `pos_token_subspace` (the overlap of the position and token embedding subspaces).

    Examples:
        >>> import posprobe as pp
        >>> cfg = pp.GeometryConfig(window=32, max_windows=4, progress=False)
        >>> result = pp.run_geometry(pp.load_model("tiny-ape"), None, cfg)  # learned positions: W_pos and the residual
        >>> sorted(result.tables["geometry"].source.unique())
        ['W_pos', 'resid_post mean']
    """
    from posprobe.analyses.probes import text_rows
    from posprobe.data import BUILTIN_TEXT

    cfg = config or GeometryConfig()
    facts = model_facts(model)
    layers = cfg.layers if cfg.layers is not None else tuple(sorted({0, facts.n_layers // 2, facts.n_layers - 1}))
    body = BUILTIN_TEXT if text is None else text
    rows = text_rows(model, body, cfg.window, cfg.max_windows)
    parts = []
    if facts.has_w_pos:
        parts.append(wpos_geometry(model, n_components=cfg.components, max_pos=cfg.max_pos))
    parts.append(residual_geometry(model, rows, list(layers), point=cfg.point, n_components=cfg.components,
                                   skip_first=cfg.skip_first, progress=cfg.progress))
    df = pd.concat([r.df for r in parts], ignore_index=True)
    tables = {"geometry": df}
    if facts.has_w_pos:
        overlap = position_token_overlap(position_table(model)[: cfg.max_pos or facts.n_ctx], token_table(model))
        overlap.insert(0, "model", facts.name)
        tables["pos_token_subspace"] = overlap
    data = data_meta(source or ("built-in text" if text is None else "text"), n_items=len(rows), unit="windows",
                     sha256=text_sha256(body))
    meta = make_meta("geometry", model=facts.summary(), data=data, config=cfg,
                     views=[v for r in parts for v in r.meta["views"]], n_rows=len(rows), n_pos=len(rows[0]))
    return Result(tables, meta)


def _atlas_run(model: Any, r: AtlasRun) -> Result:
    return run_geometry(model, r.text, GeometryConfig(window=r.window, max_windows=r.max_windows,
                                                      progress=r.config.progress), source=r.source)


def _atlas_headlines(part: Result) -> list[tuple[str, float]]:
    g = part.tables["geometry"]
    ev = g[(g.source == "W_pos") & (g.metric == "explained_variance")].sort_values("k")
    return [("wpos_pc1_explained", float(ev.value.iloc[0]))] if len(ev) else []


def _compare(m: ModelEntry, run: CompareRun) -> Any:
    text, cfg = run.text, run.config
    if (why := why_not("geometry", m.facts)) is not None:
        return why
    got = run_geometry(m.model, text, GeometryConfig(window=min(cfg.window, m.facts.n_ctx),
                                                     max_windows=cfg.max_windows, progress=False))
    g = got.tables["geometry"]
    ev = g[(g.source == "W_pos") & (g.metric == "explained_variance")]
    return {"pos_token_subspace": got.tables.get("pos_token_subspace"), "wpos_variance": ev}, None


ATLAS_SECTION = register(AtlasSection(
    "geometry", "Learned-position geometry", _atlas_run, _atlas_headlines, geometry_report.atlas_paragraph,
    blocked=lambda facts, engine_runs: (facts.unsupported,
                                        None if facts.has_w_pos else "the model exposes no position table"),
    compare=_compare, compare_page=geometry_report.compare_section))
