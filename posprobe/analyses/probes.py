"""Linear position probes: how much absolute position each layer's residual stream carries.

Per (residual point, layer): ridge regression to the absolute position (MAE in positions) and a
linear classifier (ridge one-vs-rest or logistic) over equal-width position buckets (accuracy). Folds are grouped by
token row (sentence/window), so no row ever has tokens on both sides of a split. A control probe
is trained on positions shuffled *within each row* (same label distribution per row, no link
between a vector and its position); a chance baseline predicts the training mean / majority bucket.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from posprobe.analyses.configs import ProbeConfig
from posprobe.analyses.sections import AtlasRun, AtlasSection, CompareRun, ModelEntry, register
from posprobe.backend.model import encode_text, first_token
from posprobe.core.capture import Reducer, batches, stream, to_cpu_once
from posprobe.data import framed_windows
from posprobe.report import probes as probes_report
from posprobe.report.checkpoint import Checkpoint, rows_sha256, run_key
from posprobe.report.probes import fold_summary  # noqa: F401 - part of this module's API
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256


def text_rows(model: Any, text: str, window: int = 64, max_windows: int | None = None) -> list[list[int]]:
    """Token rows of exactly `window` ids: the text's tokens cut into windows, each row starting with the
    model's BOS/CLS token when its tokenizer has one (so position 0 is what the model usually sees)."""
    first = first_token(model)
    return framed_windows(encode_text(model, text), window, pre=[first] if first is not None else [],
                          max_windows=max_windows)


def run_probes(model: Any, text: str | None = None, config: ProbeConfig | None = None, *,
               source: str | None = None, work: str | Path | None = None, fresh: bool = False) -> Result:
    """Position probes over `config.max_windows` windows of `config.window` tokens of `text`; the result's meta
    records the data in the common schema.

    Args:
        model: a TransformerLens model.
        text: the text cut into windows (default: the built-in text).
        config: the analysis's options (None: its Config's defaults).
        source: what meta.json's data record names as the text (default: "built-in text" or "text").
        work: the checkpoint folder, as in `position_probes` (None: no checkpoint).
        fresh: discard what `work` holds first, as in `position_probes`.

    Returns:
        `position_probes`'s Result: one `probes` table (model, point, layer, condition, fold, metric, value,
            alpha).

    Examples:
        >>> import posprobe as pp
        >>> cfg = pp.ProbeConfig(window=32, max_windows=8, max_tokens=200, n_splits=2, inner_splits=2, progress=False)
        >>> probes = pp.run_probes(pp.load_model("tiny-rope"), None, cfg).tables["probes"]
        >>> sorted(probes.condition.unique()), sorted(probes.metric.unique())
        (['chance', 'control', 'probe'], ['accuracy', 'mae'])
    """
    from posprobe.backend.facts import model_facts
    from posprobe.data import BUILTIN_TEXT

    cfg = config or ProbeConfig()
    model_facts(model)  # refuses, before tokenising, a model no hook value of which can be trusted
    body = BUILTIN_TEXT if text is None else text
    rows = text_rows(model, body, cfg.window, cfg.max_windows)
    result = position_probes(model, rows, cfg, work=work, fresh=fresh)
    result.meta["data"] = data_meta(source or ("built-in text" if text is None else "text"), n_items=len(rows),
                                    unit="windows", sha256=text_sha256(body))
    return result


def position_buckets(positions: np.ndarray, n_pos: int, n_buckets: int) -> np.ndarray:
    """Equal-width bucket index (0..n_buckets-1) of each position in 0..n_pos-1."""
    if not 1 < n_buckets <= n_pos:
        raise ValueError(f"n_buckets must be in 2..{n_pos} (sequence length), got {n_buckets}")
    return (np.asarray(positions) * n_buckets) // n_pos


def group_folds(groups: np.ndarray, n_splits: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train_idx, test_idx) pairs from GroupKFold: every group (token row) is wholly on one side."""
    from sklearn.model_selection import GroupKFold

    n_groups = len(np.unique(groups))
    if n_groups < n_splits or n_splits < 2:
        raise ValueError(f"Need at least n_splits={n_splits} >= 2 token rows for grouped folds, got {n_groups}")
    dummy = np.zeros((len(groups), 1))
    return list(GroupKFold(n_splits=n_splits).split(dummy, groups=groups))


def shuffle_within_groups(labels: np.ndarray, groups: np.ndarray, seed: int) -> np.ndarray:
    """Labels permuted at random inside each group (seeded): per-row label distribution is kept."""
    rng = np.random.default_rng(seed)
    out = labels.copy()
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        out[idx] = labels[rng.permutation(idx)]
    return out


def sample_tokens(n_rows: int, n_pos: int, max_tokens: int, seed: int, skip_first: int = 0) -> np.ndarray:
    """Sorted flat indices (row * n_pos + pos) of at most `max_tokens` tokens, drawn without replacement."""
    if not 0 <= skip_first < n_pos:
        raise ValueError(f"skip_first must be in 0..{n_pos - 1}, got {skip_first}")
    flat = (np.arange(n_rows)[:, None] * n_pos + np.arange(skip_first, n_pos)[None]).ravel()
    if len(flat) > max_tokens:
        flat = np.random.default_rng(seed).choice(flat, size=max_tokens, replace=False)
    return np.sort(flat)


def _layer_chunks(keys: list[tuple[str, int]], n_tok: int, d_model: int, memory_mb: float) -> Iterator[list]:
    per_key = n_tok * d_model * 4 / 2**20
    size = max(1, int(memory_mb // max(per_key, 1e-9)))
    for i in range(0, len(keys), size):
        yield keys[i : i + size]


def collect_residuals(
    model: Any, rows: Int[torch.Tensor, "batch pos"], keys: Sequence[tuple[str, int]], flat_idx: np.ndarray,
    *, batch_size: int, progress: bool,
) -> dict[tuple[str, int], np.ndarray]:
    """{(point, layer): float32 [n_tokens, d_model]} at the sampled flat token indices, one streamed pass.

    Only the sampled tokens of each batch are kept, so memory is len(keys) x n_tokens x d_model."""
    n_pos = rows.shape[1]
    out: dict[tuple[str, int], list[torch.Tensor]] = {k: [] for k in keys}
    offset = {"row": 0}
    layer_points: dict[int, list[str]] = {}
    for p, l in keys:
        layer_points.setdefault(l, []).append(p)

    def fn(point: str, layer: int, x: torch.Tensor, state: dict) -> None:
        if (point, layer) not in out:
            return
        r0 = offset["row"]
        lo, hi = r0 * n_pos, (r0 + x.shape[0]) * n_pos
        sel = flat_idx[(flat_idx >= lo) & (flat_idx < hi)] - lo
        # The sampled rows stay on the model's device; all of them cross to the CPU once, after the pass.
        idx = torch.as_tensor(sel).to(x.device, non_blocking=True)
        out[(point, layer)].append(x.reshape(-1, x.shape[-1]).index_select(0, idx).float())

    reducers = [Reducer(sorted(set(layer_points[l])), [l], fn) for l in layer_points]

    def counted() -> Iterator[torch.Tensor]:
        for b in batches(rows, batch_size):
            yield b
            offset["row"] += b.shape[0]

    stream(model, counted(), reducers, total=-(-rows.shape[0] // batch_size), progress=progress, desc="capture")
    done = to_cpu_once({k: torch.cat(v) for k, v in out.items()})
    return {k: v.numpy() for k, v in done.items()}


def _checkpoint(work: str | Path | None, fresh: bool, model: Any, rows: torch.Tensor, cfg: ProbeConfig) -> Checkpoint:
    if work is None:
        return Checkpoint(None, {})
    from posprobe.backend.facts import model_facts
    from posprobe.backend.model import weights_fingerprint

    key = run_key("probes", model={"facts": model_facts(model).summary(), "weights": weights_fingerprint(model)},
                  data={"rows": rows_sha256(rows)}, config=cfg)
    return Checkpoint(work, key, fresh=fresh)


def ridge_path(xtr: np.ndarray, Ytr: np.ndarray, xte: np.ndarray, alphas: Sequence[float]) -> np.ndarray:
    """Ridge predictions (with intercept) for every penalty at once: [n_alpha, n_test, n_targets].

    One eigendecomposition of the smaller Gram matrix of the centred training data serves all
    penalties (primal X^T X when n >= d, dual X X^T otherwise)."""
    mx, my = xtr.mean(0), Ytr.mean(0)
    X, Y, T = xtr - mx, Ytr - my, xte - mx
    if X.shape[0] >= X.shape[1]:
        lam, V = np.linalg.eigh(X.T @ X)
        left, right = T @ V, V.T @ (X.T @ Y)
    else:
        lam, U = np.linalg.eigh(X @ X.T)
        left, right = (T @ X.T) @ U, U.T @ Y
    lam = np.clip(lam, 0, None)
    return np.stack([left @ (right / (lam + a)[:, None]) + my for a in alphas])


def _scores(pred: np.ndarray, y: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Per penalty: MAE of the position column, accuracy of the argmax over the bucket columns.
    return np.abs(pred[..., 0] - y).mean(-1), (pred[..., 1:].argmax(-1) == b).mean(-1)


def _fit_fold(X: np.ndarray, y: np.ndarray, b: np.ndarray, groups: np.ndarray, tr: np.ndarray, te: np.ndarray,
              cfg: ProbeConfig) -> dict[str, float]:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    # Targets: the position and the +-1 bucket indicators (what RidgeClassifier fits), one solve.
    Y = np.column_stack([y, 2.0 * (b[:, None] == np.arange(cfg.n_buckets)[None]) - 1.0])
    # Penalty chosen on training rows only, by an inner split that is grouped by row as well.
    inner_mae, inner_acc = np.zeros(len(cfg.alphas)), np.zeros(len(cfg.alphas))
    for itr, ite in group_folds(groups[tr], min(cfg.inner_splits, len(np.unique(groups[tr])))):
        itr, ite = tr[itr], tr[ite]
        sc = StandardScaler().fit(X[itr])
        m, a = _scores(ridge_path(sc.transform(X[itr]), Y[itr], sc.transform(X[ite]), cfg.alphas), y[ite], b[ite])
        inner_mae, inner_acc = inner_mae + m, inner_acc + a
    a_mae, a_acc = cfg.alphas[int(inner_mae.argmin())], cfg.alphas[int(inner_acc.argmax())]
    sc = StandardScaler().fit(X[tr])
    xtr, xte = sc.transform(X[tr]), sc.transform(X[te])
    mae, acc = _scores(ridge_path(xtr, Y[tr], xte, [a_mae, a_acc]), y[te], b[te])
    out = {"mae": float(mae[0]), "accuracy": float(acc[1]), "alpha_mae": a_mae, "alpha_accuracy": a_acc}
    if cfg.classifier == "logistic":
        clf = LogisticRegression(C=cfg.C, max_iter=300, random_state=cfg.seed).fit(xtr, b[tr])
        out.update(accuracy=float((clf.predict(xte) == b[te]).mean()), alpha_accuracy=float("nan"))
    return out


def _chance(y: np.ndarray, b: np.ndarray, tr: np.ndarray, te: np.ndarray) -> dict[str, float]:
    # Predict-the-training-mean MAE and majority-bucket accuracy: what a probe with no signal scores.
    counts = np.bincount(b[tr])
    return {"mae": float(np.abs(y[te] - y[tr].mean()).mean()), "accuracy": float((b[te] == counts.argmax()).mean())}


def probe_scores(X: np.ndarray, positions: np.ndarray, groups: np.ndarray, n_pos: int,
                 cfg: ProbeConfig) -> pd.DataFrame:
    """Per-fold scores of the real probe, the within-row shuffled control and the chance baseline.

    Columns: condition ("probe" | "control" | "chance"), fold, metric ("mae" in positions | "accuracy"), value,
    alpha (the ridge penalty picked for that metric by the inner grouped split; NaN for chance)."""
    buckets = position_buckets(positions, n_pos, cfg.n_buckets)
    order = shuffle_within_groups(np.arange(len(positions)), groups, cfg.seed + 1)
    rows = []
    for fold, (tr, te) in enumerate(group_folds(groups, cfg.n_splits)):
        real = _fit_fold(X, positions, buckets, groups, tr, te, cfg)
        # Control: the training labels are shuffled within each row; the test labels stay true.
        ys, bs = positions.copy(), buckets.copy()
        ys[tr], bs[tr] = positions[order][tr], buckets[order][tr]
        ctrl = _fit_fold(X, ys, bs, groups, tr, te, cfg)
        for condition, res in (("probe", real), ("control", ctrl), ("chance", _chance(positions, buckets, tr, te))):
            rows += [
                dict(condition=condition, fold=fold, metric=m, value=res[m], alpha=res.get(f"alpha_{m}", float("nan")))
                for m in ("mae", "accuracy")
            ]
    return pd.DataFrame(rows)


def position_probes(model: Any, token_rows: Sequence[Sequence[int]] | torch.Tensor,
                    config: ProbeConfig | None = None, *, work: str | Path | None = None,
                    fresh: bool = False) -> Result:
    """Probe absolute position from the residual stream at every (point, layer).

    Args:
        model: a TransformerLens model.
        token_rows: the windows, `[batch, pos]` token ids of equal length (at most the model's context); enough
            rows that each training fold has >= 2.
        config: the probe's options: points, layers, buckets, folds, token sample (None: its Config's defaults).
        work: a folder where each (point, layer)'s fold scores are kept as they complete; the same call resumes
            from there (capturing only the residuals still needed) to the same table; another model, rows or
            config there is refused (None: no checkpoint).
        fresh: discard what `work` holds first.

    Returns:
        A Result whose df (table `probes`) has one row per model, point, layer, condition
            (probe/control/chance), fold, metric (mae: mean absolute error in positions; accuracy: fraction of
            held-out tokens in the right bucket), value, and alpha (the ridge penalty picked; NaN for chance).
            Folds group by token row; `report.probes.fold_summary(result.df)` gives mean and std over folds.
    """
    from posprobe.backend.facts import model_facts

    cfg = config or ProbeConfig()
    facts = model_facts(model)
    rows = torch.as_tensor(token_rows) if not isinstance(token_rows, torch.Tensor) else token_rows
    if rows.dim() != 2:
        raise ValueError("token_rows must be equal-length rows of token ids")
    n_rows, n_pos = rows.shape
    if n_pos > facts.n_ctx:
        raise ValueError(f"Rows of {n_pos} tokens exceed the model's context of {facts.n_ctx}")
    layers = list(range(facts.n_layers)) if cfg.layers is None else list(cfg.layers)
    if not layers or any(not 0 <= l < facts.n_layers for l in layers):
        raise ValueError(f"layers must be a non-empty subset of 0..{facts.n_layers - 1}, got {cfg.layers}")
    position_buckets(np.arange(n_pos), n_pos - cfg.skip_first, cfg.n_buckets)  # validates n_buckets
    if n_rows - -(-n_rows // cfg.n_splits) < 2:
        # Every outer training set needs two rows for the grouped inner split that picks the penalty.
        raise ValueError(
            f"Too few token rows ({n_rows}) for n_splits={cfg.n_splits}: each training fold needs >= 2 rows"
        )
    flat = sample_tokens(n_rows, n_pos, cfg.max_tokens, cfg.seed, cfg.skip_first)
    positions, groups = flat % n_pos, flat // n_pos
    keys = [(p, l) for l in layers for p in cfg.points]
    from threadpoolctl import threadpool_limits

    ckpt = _checkpoint(work, fresh, model, rows, cfg)
    unit = lambda key: f"probe|{key[0]}|{key[1]}"  # noqa: E731
    done = ckpt.announce([unit(k) for k in keys], "probes")
    frames = {}
    for key in keys:
        if ckpt.has(unit(key)):
            frames[key] = pd.DataFrame(ckpt.get(unit(key)))
    todo = [k for k in keys if k not in frames]
    bar = tqdm(total=len(keys), initial=done, desc="probes" + (f" (resumed {done})" if done else ""), unit="probe",
               disable=not cfg.progress)
    for chunk in _layer_chunks(todo, len(flat), facts.d_model, cfg.memory_mb):
        acts = collect_residuals(model, rows, chunk, flat, batch_size=cfg.batch_size, progress=cfg.progress)
        for key in chunk:
            # Positions are shifted so skipped leading tokens do not distort the buckets.
            # Single-threaded BLAS: these matrices are small, and threaded OpenBLAS on a busy machine
            # was measured 100x slower (spin-waiting threads).
            with threadpool_limits(1):
                df = probe_scores(acts.pop(key), positions - cfg.skip_first, groups, n_pos - cfg.skip_first, cfg)
            df.insert(0, "layer", key[1])
            df.insert(0, "point", key[0])
            frames[key] = pd.DataFrame(ckpt.put(unit(key), df.to_dict("list")))
            bar.update(1)
    bar.close()
    frames = [frames[k] for k in keys]
    df = pd.concat(frames, ignore_index=True)
    df.insert(0, "model", facts.name)
    data = data_meta("token rows", n_items=n_rows, unit="windows")
    meta = make_meta("probes", model=facts.summary(), data=data, config=cfg, n_rows=n_rows, n_pos=n_pos,
                     n_tokens=len(flat), control="training positions shuffled within each token row (test labels true)",
                     folds="GroupKFold by token row")
    return Result({"probes": df}, meta)


def _atlas_run(model: Any, r: AtlasRun) -> Result:
    c = r.config
    return run_probes(model, r.text, ProbeConfig(points=("resid_post",), n_splits=3, window=r.window,
                                                 max_windows=max(r.max_windows, 6), max_tokens=c.probe_tokens_used(),
                                                 seed=c.seed, progress=c.progress), source=r.source)


def _atlas_headlines(part: Result) -> list[tuple[str, float]]:
    p = part.tables["probes"]
    mae = p[p.metric == "mae"].groupby(["layer", "condition"]).value.mean().unstack()
    return [("mae_first_layer", float(mae["probe"].iloc[0])), ("mae_last_layer", float(mae["probe"].iloc[-1])),
            ("mae_control", float(mae["control"].mean())), ("mae_chance", float(mae["chance"].mean()))]


def _compare(m: ModelEntry, run: CompareRun) -> Any:
    text, cfg = run.text, run.config
    window = min(cfg.window, m.facts.n_ctx)
    # Enough windows to hold the sampled tokens (a probe of 128 dims on 512 tokens sat at chance on every relative
    # member of the CPU zoo; on 2,048 the NoPE member's error falls layer by layer).
    windows = max(cfg.max_windows, -(-cfg.probe_tokens // window))
    got = run_probes(m.model, text, ProbeConfig(points=("resid_pre", "resid_post"), n_splits=3, window=window,
                                                max_windows=windows, max_tokens=cfg.probe_tokens, seed=cfg.seed,
                                                progress=False))
    p = got.tables["probes"]
    # The residual stream before layer 0 is the embedding (layer -1); after layer l, resid_post of l.
    p = pd.concat([p[(p.point == "resid_pre") & (p.layer == 0)].assign(layer=-1), p[p.point == "resid_post"]])
    per_layer = p.groupby(["layer", "condition", "metric"], as_index=False).value.mean()
    return {"probes": per_layer}, None


ATLAS_SECTION = register(AtlasSection("probes", "Position probes", _atlas_run, _atlas_headlines,
                                      probes_report.atlas_paragraph,
    compare=_compare, compare_page=probes_report.compare_section))
