"""Targeted capture (only the hooks an analysis needs) and streaming reducers over a token stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from posprobe.backend.hooks import hook_name, hooked
from posprobe.backend.model import context_length, device_of, forward, model_name, n_layers


def _heads(x: torch.Tensor, point: str, heads: Sequence[int] | None) -> torch.Tensor:
    if heads is None:
        return x
    idx = torch.as_tensor(list(heads), device=x.device)
    if point in ("scores", "pattern"):
        return x.index_select(1, idx)  # [batch, head_index, query_pos, key_pos]
    if point in ("q", "k", "v", "rot_q", "rot_k", "z"):
        return x.index_select(2, idx)  # [batch, pos, head_index, d_head]
    return x


def _run_through(model: Any, tokens: torch.Tensor, layers: Sequence[int]) -> None:
    # Later layers cannot affect earlier activations, so a decoder need not run them (nor the unembedding).
    # The batch's one host->device copy; everything the hooks compute from it then stays on the device.
    # Fused attention (SDPA) unless a hook sits inside attention: then the bridge computes it step by step.
    forward(model, tokens.to(device_of(model)), stop_at_layer=max(layers) + 1, fused_attention=True)


@torch.no_grad()
def capture(
    model: Any,
    tokens: Int[torch.Tensor, "batch pos"],
    points: Sequence[str],
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
) -> dict[tuple[str, int], torch.Tensor]:
    """Run one forward pass with hooks only at `points` x `layers`; return {(point, layer): tensor}.

    Layers after the last requested one are not run (decoders). Hooks are removed on exit, also on error.

    Args:
        model: a TransformerLens model (as `load_model` returns).
        tokens: the token ids, `[batch, pos]`, moved to the model's device.
        points: the capture points to hook ("q", "rot_k", "scores", "pattern", "resid_pre", ...; see
            `posprobe.backend.vocab.POINTS`); an unknown name is a ValueError.
        layers: the layers to hook (None: every layer); one out of range is a ValueError.
        heads: keep only these heads where the point has a head axis (None: all heads).

    Returns:
        {(point, layer): tensor}, detached, in TL's layouts (`batch pos head_index d_head`,
            `batch head_index query_pos key_pos`, `batch pos d_model`), restricted to `heads` where the point
            has a head axis.
    """
    layers = list(range(n_layers(model))) if layers is None else list(layers)
    if not layers or not points:
        raise ValueError("Nothing to capture: give at least one point and one layer")
    bad = [l for l in layers if not 0 <= l < n_layers(model)]
    if bad:
        raise ValueError(f"Layers {bad} out of range for a {n_layers(model)}-layer model")
    out: dict[tuple[str, int], torch.Tensor] = {}

    def make(point: str, layer: int) -> Callable:
        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            out[(point, layer)] = _heads(x.detach(), point, heads)
            return x

        return hook

    hooks = [(hook_name(p, l), make(p, l)) for p in points for l in layers]
    with hooked(model, hooks):
        _run_through(model, tokens, layers)
    require_fired(model, [(p, l) for p in points for l in layers], set(out))
    return out


def require_fired(model: Any, wanted: Sequence[tuple[str, int]], fired: set[tuple[str, int]]) -> None:
    """Raise where a hook posprobe attached never fired during the forward: the model computes that quantity
    somewhere posprobe cannot see (e.g. a bridge adapter that rotates q/k inside HF code), and a measurement
    from it would be silently empty or wrong."""
    missing = [f"{p} (layer {l})" for p, l in wanted if (p, l) not in fired]
    if missing:
        raise RuntimeError(f"{model_name(model)}: the hook for {', '.join(missing[:3])}"
                           f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} never fired, so posprobe "
                           "cannot measure it on this model (its attention does not expose that point)")


def float64_device(device: torch.device | str) -> torch.device:
    """Where float64 accumulators for activations on `device` live: the device itself, except mps, which
    has no float64 (there: the CPU, at the price of one copy per update)."""
    device = torch.device(device)
    return torch.device("cpu") if device.type == "mps" else device


@dataclass
class RunningMean:
    """Streaming mean and variance (Chan et al. parallel update) of a tensor over a leading axis.

    `update(x)` takes `[n, *shape]` samples; `mean`, `var` and `count` have `shape`. float64 inside,
    so long corpora do not lose precision.
    """

    count: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    m2: torch.Tensor | None = None

    def update(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        x = x.detach().to(float64_device(x.device), torch.float64)
        w = torch.ones(x.shape[:1] + (1,) * (x.dim() - 1), dtype=torch.float64, device=x.device) if weight is None \
            else weight.to(x.device, torch.float64).reshape(x.shape[:1] + (1,) * (x.dim() - 1))
        if weight is None and x.shape[0] == 0:
            return
        n_b = w.sum(0)
        # No host read of n_b (a device sync per update on a GPU): an all-zero-weight batch leaves the
        # state unchanged anyway (n_b = 0 gives delta terms of 0; mean_b = 0 is only used where n_b > 0).
        mean_b = (w * x).sum(0) / n_b.clamp_min(1e-300)
        m2_b = (w * (x - mean_b) ** 2).sum(0)
        self._fold(n_b.expand_as(mean_b).clone(), mean_b, m2_b)

    def _fold(self, n_b: torch.Tensor, mean_b: torch.Tensor, m2_b: torch.Tensor) -> None:
        # Chan et al.'s pairwise update: one batch's (count, mean, M2) into the running ones.
        if self.count is None:
            self.count, self.mean, self.m2 = n_b, mean_b, m2_b
            return
        n = self.count + n_b
        delta = mean_b - self.mean
        safe = n.clamp_min(1e-300)
        self.mean = self.mean + delta * n_b / safe
        self.m2 = self.m2 + m2_b + delta**2 * self.count * n_b / safe
        self.count = n

    @property
    def var(self) -> torch.Tensor:
        assert self.count is not None and self.m2 is not None, "no data seen"
        return self.m2 / self.count.clamp_min(1)

    def merge(self, other: RunningMean) -> RunningMean:
        """Fold another RunningMean's samples into this one (Chan et al. pairwise update; exact up to
        float64 rounding), e.g. the states of several data-parallel ranks. Returns self."""
        if other.count is None:
            return self
        device = other.mean.device if self.mean is None else self.mean.device
        self._fold(*(t.to(device).clone() for t in (other.count, other.mean, other.m2)))
        return self


@dataclass
class Reducer:
    """A streaming statistic: which (point, layer) hooks it reads and what it does with each batch.

    `fn(point, layer, tensor, state)` folds one batch's activation into `state` (a dict it owns).
    """

    points: Sequence[str]
    layers: Sequence[int]
    fn: Callable[[str, int, torch.Tensor, dict], None]
    state: dict = field(default_factory=dict)


def batches(token_rows: Sequence[Sequence[int]] | torch.Tensor, batch_size: int) -> Iterator[torch.Tensor]:
    """Equal-length token rows as `[batch, pos]` tensors of at most `batch_size` rows."""
    rows = torch.as_tensor(token_rows) if not isinstance(token_rows, torch.Tensor) else token_rows
    if rows.dim() != 2 or rows.shape[0] == 0:
        raise ValueError("Need a non-empty 2-D set of equal-length token rows")
    for i in range(0, rows.shape[0], batch_size):
        yield rows[i : i + batch_size]


def check_rows(model: Any, token_rows: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
    """`token_rows` as a `[batch, pos]` tensor, checked before any forward: non-empty, pos >= 2 (a query needs
    a key before it), and no longer than the model's context."""
    rows = torch.as_tensor(token_rows) if not isinstance(token_rows, torch.Tensor) else token_rows
    if rows.dim() != 2 or rows.shape[0] == 0 or rows.shape[1] < 2:
        raise ValueError("token_rows must be a non-empty [batch, pos] set of equal-length rows with pos >= 2")
    if rows.shape[1] > context_length(model):
        raise ValueError(f"windows of {rows.shape[1]} tokens exceed the model's n_ctx={context_length(model)}")
    return rows


@torch.no_grad()
def stream(
    model: Any,
    token_batches: Iterable[torch.Tensor],
    reducers: Sequence[Reducer],
    *,
    total: int | None = None,
    progress: bool = True,
    desc: str = "batches",
    context: Callable[[], Any] | None = None,
    resume: Any = None,
) -> list[dict]:
    """Feed every batch through the model once, letting each reducer fold its hooks' activations.

    Memory stays bounded by one batch's activations plus the reducers' states.

    Args:
        model: a TransformerLens model (as `load_model` returns); layers after the last one a reducer reads are
            not run.
        token_batches: the batches of token ids, each `[batch, pos]`; none at all is a ValueError.
        reducers: the statistics to fold; each reads its (point, layer) hooks and updates its own `state`.
        total: the number of batches, for the progress bar only (None: unknown).
        progress: show a tqdm bar.
        desc: the progress bar's label.
        context: if given, a zero-argument callable whose context manager is entered around each forward
            (e.g. a position plan).
        resume: a `posprobe.report.checkpoint.StreamResume`: restore the states after the batches an earlier
            run finished, skip those batches, and save the states as the pass goes (None: no checkpoint).

    Returns:
        Each reducer's state, in the order of `reducers` (the same dicts the reducers hold).
    """
    needed = sorted({(p, l) for r in reducers for p in r.points for l in r.layers}, key=lambda x: (x[1], x[0]))
    if not needed:
        raise ValueError("No reducer asks for any activation")
    layers = [l for _, l in needed]

    fired: set[tuple[str, int]] = set()

    def make(point: str, layer: int) -> Callable:
        readers = [r for r in reducers if point in r.points and layer in r.layers]

        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            fired.add((point, layer))
            for r in readers:
                r.fn(point, layer, x.detach(), r.state)
            return x

        return hook

    hooks = [(hook_name(p, l), make(p, l)) for p, l in needed]
    seen = skip = 0
    got = resume.load() if resume is not None else None
    if got is not None:
        skip, states = got
        for r, st in zip(reducers, states):
            r.state.clear()
            r.state.update(st)
    with hooked(model, hooks), tqdm(total=total, desc=desc + (f" (resumed {skip})" if skip else ""), unit="batch",
                                    disable=not progress, initial=skip) as bar:
        for toks in token_batches:
            if seen < skip:  # folded into the restored states by the earlier run
                seen += 1
                continue
            if context is not None:
                with context():
                    _run_through(model, toks, layers)
            else:
                _run_through(model, toks, layers)
            seen += 1
            bar.update(1)
            if seen == skip + 1:
                require_fired(model, needed, fired)  # after the first batch: no pass over a corpus to find out
            if resume is not None and resume.due():
                resume.save(seen, [r.state for r in reducers])
    if seen == 0:
        raise ValueError("Empty input: no token batches to stream")
    if resume is not None:
        resume.save(seen, [r.state for r in reducers])
    return [r.state for r in reducers]


def mean_by_position(point: str, layers: Sequence[int]) -> Reducer:
    """Reducer: running mean/var of `point` at each position, per layer (`state[layer]` RunningMean).

    Args:
        point: the capture point to average (e.g. "resid_pre"); the mean is over the batch axis, so it keeps
            each position apart.
        layers: the layers to read it at.

    Returns:
        A `Reducer` for `stream`, whose state maps each layer to a `RunningMean` (float64 mean, var and count,
            of shape `[pos, ...]` of the point).
    """

    def fn(p: str, layer: int, x: torch.Tensor, state: dict) -> None:
        state.setdefault(layer, RunningMean()).update(x)

    return Reducer([point], list(layers), fn)


def to_cpu_once(tree: Any) -> Any:
    """`tree` (nested dicts / lists / tuples / objects with tensor attributes, e.g. reducer states) with
    every tensor moved to the CPU in one device->host copy per dtype instead of one per tensor (each
    copy is a device sync on a GPU). Non-tensor leaves are kept; CPU tensors are returned as they are."""
    found: list[torch.Tensor] = []

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)
        elif hasattr(x, "__dict__") and not isinstance(x, type):
            for v in vars(x).values():
                collect(v)

    collect(tree)
    moved: dict[int, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in found:
        if id(t) not in moved:
            moved[id(t)] = t
            by_dtype.setdefault(t.dtype, []).append(t)
    done: dict[int, torch.Tensor] = {}
    for dtype, ts in by_dtype.items():
        flat = torch.cat([t.detach().reshape(-1) for t in ts]).cpu()
        for t, piece in zip(ts, flat.split([t.numel() for t in ts])):
            done[id(t)] = piece.view(t.shape)

    def rebuild(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return done.get(id(x), x)
        if isinstance(x, dict):
            return {k: rebuild(v) for k, v in x.items()}
        if isinstance(x, list):
            return [rebuild(v) for v in x]
        if isinstance(x, tuple):
            return type(x)(*[rebuild(v) for v in x]) if hasattr(x, "_fields") else tuple(rebuild(v) for v in x)
        if hasattr(x, "__dict__") and not isinstance(x, type):
            for k, v in vars(x).items():
                setattr(x, k, rebuild(v))
            return x
        return x

    return rebuild(tree)
