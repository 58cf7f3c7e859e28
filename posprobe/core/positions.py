"""Position control: arbitrary position ids for learned embeddings, separate q/k positions for RoPE.

Both are context managers that attach hooks for the block and always remove them.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from jaxtyping import Int

from posprobe.backend.facts import WrongModelKind, model_facts, require_learned, require_rotary, require_supported
from posprobe.backend.families import family
from posprobe.backend.families.base import BUCKET_BIAS, POSITION_IDS, QK_ROTATION, SCORE_BIAS
from posprobe.backend.hooks import (
    alibi_slopes,
    attention_scores,
    bucket_bias,
    embedding_positions,
    hook_name,
    hooked,
    kept_scores,
    layer_rotary_spec,
    pos_embed_hook,
    pre_rotation,
    rotate_at,
    table_length,
)
from posprobe.backend.model import context_length, device_of, model_name, n_layers, position_table
from posprobe.rope import RotarySpec


class PositionError(ValueError):
    """Positions that cannot be applied (past the context, wrong length, negative)."""


def _as_tensor(x: Any, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=dtype)


def _position_dtype(x: Any) -> torch.dtype:
    # float64 positions, except on mps, which has no float64 (float32 is exact for positions < 2**24).
    return torch.float32 if isinstance(x, torch.Tensor) and x.device.type == "mps" else torch.float64


def check_learned_positions(model: Any, position_ids: torch.Tensor) -> None:
    """Raise PositionError unless every id indexes a row of W_pos (0 <= id < n_ctx)."""
    n_ctx = context_length(model)
    if position_ids.numel() == 0:
        raise PositionError("No positions given (empty input)")
    lo, hi = int(position_ids.min()), int(position_ids.max())
    if lo < 0:
        raise PositionError(f"Position ids must be >= 0; got {lo}")
    if hi >= n_ctx:
        raise PositionError(
            f"Position id {hi} is past the model's context: {model_name(model)} has n_ctx={n_ctx} "
            f"learned positions (ids 0..{n_ctx - 1})"
        )


@contextmanager
def learned_positions(
    model: Any, position_ids: Int[torch.Tensor, " pos"] | Int[torch.Tensor, "batch pos"]
) -> Iterator[Any]:
    """Within the block, token t of every forward gets the learned embedding W_pos[position_ids[t]] (or, on a
    fixed-sinusoidal model such as XGLM, the sinusoid of position_ids[t], set in HF's own position module).

    Args:
        model: a TransformerLens model with a learned position table (W_pos) or a fixed-sinusoidal one; any other
            positional kind is refused.
        position_ids: the position of each token, `[pos]` (the same for every row) or `[batch, pos]`; its length
            must equal the sequence length of each forward (else PositionError). Checked against n_ctx before
            any forward pass. A shift by k is `arange(L) + k`.

    Yields:
        The model, with the positions in force within the `with` block.
    """
    facts = model_facts(model)
    if facts.family is not None and facts.family.fixed_table:
        require_supported(facts, "Setting position ids")
        ids = _as_tensor(position_ids, torch.long)
        check_learned_positions(model, ids)
        with embedding_positions(model, ids.to(device_of(model))):
            yield model
        return
    require_learned(facts, "Setting learned position ids")
    ids = _as_tensor(position_ids, torch.long)
    check_learned_positions(model, ids)
    W_pos = position_table(model)
    on_device = ids.to(W_pos.device)  # once, not per forward

    def hook(pos_embed: torch.Tensor, hook: Any) -> torch.Tensor:
        n = pos_embed.shape[1]
        if ids.shape[-1] != n:
            raise PositionError(f"{ids.shape[-1]} position ids given for a sequence of {n} tokens")
        out = W_pos[on_device]
        return out.expand(pos_embed.shape[0], -1, -1) if out.dim() == 2 else out

    with hooked(model, [(pos_embed_hook(model), hook)]):
        yield model


@dataclass(frozen=True)
class KeyView:
    """Queries where `queries` is True see every key at `k_pos` instead of the plan's k_pos."""

    queries: torch.Tensor
    k_pos: torch.Tensor
    name: str = "local"


@dataclass(frozen=True)
class PositionPlan:
    """Per token: the position its query is rotated to and the position its key is rotated to.

    Floats allowed; shapes `[pos]` or `[batch, pos]`. `views` let a key's position depend on which
    query looks at it (e.g. a span seen normally by itself, squished by later tokens). `layers`
    limits the plan to some layers (None: all). `rotary` overrides a layer's rotation (new base,
    per-band scale, removed bands). `label` names the plan in outputs.

    Examples:
        >>> import torch, posprobe as pp
        >>> model = pp.load_model("tiny-rope")
        >>> toks = model.to_tokens("Answer in French. What is the capital of Italy?")
        >>> n = toks.shape[1]
        >>> keys = torch.arange(n, dtype=torch.float64)
        >>> keys[1:18] = 1.0  # the instruction's 17 byte tokens squished onto one position
        >>> plan = pp.PositionPlan(q_pos=torch.arange(n, dtype=torch.float64), k_pos=keys, label="squished")
        >>> with pp.rope_positions(model, plan):
        ...     squished = model(toks)
        >>> bool((squished - model(toks)).abs().max() > 0)
        True
    """

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    views: tuple[KeyView, ...] = ()
    layers: frozenset[int] | None = None
    rotary: Mapping[int, RotarySpec] | None = None
    label: str = "custom"
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        q, k = _as_tensor(self.q_pos, _position_dtype(self.q_pos)), _as_tensor(self.k_pos, _position_dtype(self.k_pos))
        if q.shape != k.shape:
            raise PositionError(f"q_pos has shape {tuple(q.shape)} but k_pos has {tuple(k.shape)}")
        object.__setattr__(self, "q_pos", q)
        object.__setattr__(self, "k_pos", k)
        for v in self.views:
            if v.queries.shape[-1] != len(self) or v.k_pos.shape[-1] != len(self):
                raise PositionError(f"view {v.name!r} covers {v.k_pos.shape[-1]} tokens, plan has {len(self)}")

    def __len__(self) -> int:
        return int(self.q_pos.shape[-1])

    @classmethod
    def default(cls, n: int, label: str = "default") -> PositionPlan:
        """Every token's query and key at its own index: the model's unmodified positions."""
        p = torch.arange(n, dtype=torch.float64)
        return cls(p, p.clone(), label=label)

    def extended(self, n: int) -> PositionPlan:
        """The plan for `n` tokens: new tokens continue after the last query position, q = k, step 1."""
        extra = n - len(self)
        if extra <= 0:
            return self
        start = self.q_pos[..., -1:] + 1
        steps = torch.arange(extra, dtype=torch.float64)
        new = start + steps
        views = tuple(
            KeyView(torch.cat([v.queries, torch.zeros(v.queries.shape[:-1] + (extra,), dtype=torch.bool)], -1),
                    torch.cat([v.k_pos, new.expand(v.k_pos.shape[:-1] + (extra,))], -1), v.name)
            for v in self.views
        )
        return replace(
            self, q_pos=torch.cat([self.q_pos, new], -1), k_pos=torch.cat([self.k_pos, new], -1), views=views
        )


class _RopeControl:
    """Hook state: pre-rotation q/k per layer, so a KV cache (keys stored unrotated) works too."""

    def __init__(self, model: Any, plan: PositionPlan, rotary_layers: tuple[int, ...]):
        self.model, self.plan = model, plan
        self.q_new: dict[int, torch.Tensor] = {}
        self.k_new: dict[int, torch.Tensor] = {}
        self.k_all: dict[int, torch.Tensor] = {}
        self.q_buf: dict[int, torch.Tensor] = {}
        # NoPE layers rotate nothing: nothing to control there. A layer's own rotation is looked up per forward
        # (`_spec`): dynamic / longrope RoPE use the table of the input's length.
        self.override = {l: s for l, s in (plan.rotary or {}).items() if l in rotary_layers}
        self.specs = {l: self.override.get(l) or layer_rotary_spec(model, l) for l in rotary_layers}
        # The plan's tensors (CPU, float64) copied once per device and reused by every layer and batch:
        # a copy per rotation was one host->device transfer per layer on a GPU.
        self._on: dict[tuple[str, int, torch.device], torch.Tensor] = {}
        # Per view and query window: the selected query rows, worked out on the plan's CPU tensors so
        # the scores hook never reads a device tensor back (see _view_rows).
        self._rows: dict[tuple[int, int, int, torch.device], tuple[torch.Tensor | None, torch.Tensor | None]] = {}

    def _device(self, name: str, i: int, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        key = (name, i, device)
        got = self._on.get(key)
        if got is None:
            # mps has no float64; the rotation computes its angles in float32 there anyway (hp of a
            # non-float64 model), so casting first loses nothing.
            if torch.device(device).type == "mps" and t.dtype == torch.float64:
                t = t.to(torch.float32)
            got = self._on[key] = t.to(device)
        return got

    def _positions(self, which: str, start: int, stop: int, device: torch.device) -> torch.Tensor:
        if stop > len(self.plan):
            raise PositionError(
                f"The position plan covers {len(self.plan)} tokens but the sequence has {stop}; "
                "build the plan for the full length (PositionPlan.extended)"
            )
        pos = self.plan.q_pos if which == "q" else self.plan.k_pos
        return self._device(which, 0, pos, device)[..., start:stop]

    def _view_rows(
        self, i: int, off: int, total: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # (row indices on the device, None) for a 1-D selection, (None, device mask) for a per-batch one,
        # (None, None) when the view selects no query in this window.
        key = (i, off, total, device)
        if key not in self._rows:
            rows = self.plan.views[i].queries[..., off:total]
            if not bool(rows.any()):  # a CPU tensor: no device sync
                self._rows[key] = (None, None)
            elif rows.dim() == 1:
                self._rows[key] = (rows.nonzero()[:, 0].to(device), None)
            else:
                self._rows[key] = (None, rows.to(device))
        return self._rows[key]

    def stash(self, layer: int, which: str):
        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            (self.q_new if which == "q" else self.k_new)[layer] = pre_rotation(self.model, layer, x, which)
            return x

        return hook

    def _spec(self, layer: int, total: int) -> RotarySpec:
        # The plan's rotation for the layer, else the layer's own for an input of `total` tokens (HF's rule for a
        # forward at positions 0..total-1; a plan that moves positions keeps that table, so it measures positions
        # alone).
        if layer in self.override or table_length(self.model, layer, total) is None:
            return self.specs[layer]
        return layer_rotary_spec(self.model, layer, total)

    def rot_q(self, layer: int):
        # TL rotates q before k, but q's offset is only known once k shows how long the cache is:
        # hand TL a buffer now and fill it in the rot_k hook, before the scores are computed.
        def hook(q_rot: torch.Tensor, hook: Any) -> torch.Tensor:
            buf = torch.empty_like(q_rot)
            self.q_buf[layer] = buf
            return buf

        return hook

    def rot_k(self, layer: int):
        def hook(k_rot: torch.Tensor, hook: Any) -> torch.Tensor:
            new = self.k_new.pop(layer)
            total = k_rot.shape[1]
            if total == new.shape[1]:
                k_all = new
            else:
                k_all = torch.cat([self.k_all[layer], new], dim=1)
                if k_all.shape[1] != total:
                    raise RuntimeError("KV-cache length out of step with posprobe's key record; restart the cache")
            self.k_all[layer] = k_all
            q = self.q_new.pop(layer)
            off = total - q.shape[1]
            spec = self._spec(layer, total)
            dev = k_rot.device
            self.q_buf[layer].copy_(rotate_at(self.model, layer, q, self._positions("q", off, total, dev), spec,
                                              total))
            return rotate_at(self.model, layer, k_all, self._positions("k", 0, total, dev), spec, total)

        return hook

    def rotated(self, layer: int):
        # The net under the support gate: q/k stashed for this layer but never re-rotated means the architecture's
        # attention skipped its rotation hooks, and the scores about to be used carry the model's own positions.
        def hook(scores: torch.Tensor, hook: Any) -> torch.Tensor:
            if layer in self.k_new or layer in self.q_new:
                raise RuntimeError(f"Position control on {model_name(self.model)}: layer {layer}'s rotation hooks "
                                   "never fired, so the plan's positions were not applied (this attention rotates "
                                   "elsewhere); nothing was computed with them")
            return scores

        return hook

    def views(self, layer: int):
        def hook(scores: torch.Tensor, hook: Any) -> torch.Tensor:
            q_rot = self.q_buf.pop(layer)
            k_all = self.k_all[layer]
            total, n_q = k_all.shape[1], q_rot.shape[1]
            off = total - n_q
            out = scores
            for i, v in enumerate(self.plan.views):
                idx, rows = self._view_rows(i, off, total, scores.device)
                if idx is None and rows is None:
                    continue
                k_pos = self._device("view", i, v.k_pos, scores.device)[..., :total]
                k_rot = rotate_at(self.model, layer, k_all, k_pos, self._spec(layer, total), total)
                if idx is not None:
                    # Only the selected query rows: one view per query stays O(n^2) per view, not O(n^3).
                    alt = attention_scores(self.model, layer, q_rot[:, idx], k_rot).to(scores.dtype)
                    part = out[:, :, idx]
                    out = out.clone() if out is scores else out
                    # Masked entries keep the model's own fill value (-inf, or the bridge's finfo.min), whatever
                    # the view says.
                    out[:, :, idx] = torch.where(kept_scores(self.model, scores[:, :, idx]), alt, part)
                    continue
                alt = attention_scores(self.model, layer, q_rot, k_rot)
                sel = rows.reshape(-1, 1, n_q, 1)
                out = torch.where(sel & kept_scores(self.model, scores), alt.to(scores.dtype), out)
            return out

        return hook

    def hooks(self) -> list[tuple[str, Any]]:
        layers = self.plan.layers if self.plan.layers is not None else range(n_layers(self.model))
        hs: list[tuple[str, Any]] = []
        for l in (l for l in layers if l in self.specs):
            hs += [(hook_name("q", l), self.stash(l, "q")), (hook_name("k", l), self.stash(l, "k")),
                   (hook_name("rot_k", l), self.rot_k(l)), (hook_name("rot_q", l), self.rot_q(l)),
                   (hook_name("scores", l), self.rotated(l))]
            if self.plan.views:
                hs.append((hook_name("scores", l), self.views(l)))
        return hs


class _PreRotationControl:
    """Position control where the model rotates q and k where no rotation hook fires (GPT-J inside HF's own
    attention): the q and k projections are turned ahead of the model's rotation, by the plan's position minus the
    one the model will rotate to (its own index: every forward starts at position 0; posprobe decodes by
    recomputing the prefix), so the model's rotation lands each vector at the plan's position. With the layer's own
    rotation this is one turn by the difference (the identity plan turns by 0: bit-equal); a rotary override turns
    back from the model's position with its own rotation, then on with the override. Key views need the rotated
    q/k: refused."""

    def __init__(self, model: Any, plan: PositionPlan, rotary_layers: tuple[int, ...]):
        self.model, self.plan = model, plan
        own = {l: layer_rotary_spec(model, l) for l in rotary_layers}
        self.specs = {l: (plan.rotary or {}).get(l) or own[l] for l in rotary_layers}
        self.own = own
        self._on: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _turn(self, which: str, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if n > len(self.plan):
            raise PositionError(f"The position plan covers {len(self.plan)} tokens but the sequence has {n}; build the "
                                "plan for the full length (PositionPlan.extended)")
        key = (which, device)
        if key not in self._on:
            pos = self.plan.q_pos if which == "q" else self.plan.k_pos
            dt = torch.float32 if torch.device(device).type == "mps" else torch.float64
            self._on[key] = pos.to(dt).to(device)
        pos = self._on[key][..., :n]
        return pos, torch.arange(n, dtype=pos.dtype, device=device)

    def hook(self, layer: int, which: str):
        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            pos, own_pos = self._turn(which, x.shape[1], x.device)
            spec, own = self.specs[layer], self.own[layer]
            if spec == own:
                return rotate_at(self.model, layer, x, pos - own_pos, own)
            back = rotate_at(self.model, layer, x, -own_pos.expand_as(pos), own)
            return rotate_at(self.model, layer, back, pos, spec)

        return hook

    def hooks(self) -> list[tuple[str, Any]]:
        layers = self.plan.layers if self.plan.layers is not None else range(n_layers(self.model))
        return [(hook_name(w, l), self.hook(l, w)) for l in layers if l in self.specs for w in ("q", "k")]


@contextmanager
def rope_positions(model: Any, plan: PositionPlan | None = None, *, q_pos: Sequence[float] | torch.Tensor | None = None,
                   k_pos: Sequence[float] | torch.Tensor | None = None) -> Iterator[PositionPlan]:
    """Within the block, rotate queries and keys of a RoPE model to the plan's positions.

    Works with TL's KV cache (generation): the plan must cover the full length (see `PositionPlan.extended`).

    Args:
        model: a TransformerLens model with rotary layers (as `load_model` returns).
        plan: the query and key positions (and key views, layers) to apply. Give a PositionPlan, or `q_pos` and
            `k_pos` directly; a plan naming layers the model lacks is a PositionError.
        q_pos: the query position of each token (float), used only when `plan` is None.
        k_pos: the key position of each token (float), used only when `plan` is None.

    Yields:
        The plan in force (the one given, or the one built from `q_pos` and `k_pos`), within the `with` block.

    Examples:
        >>> import torch, posprobe as pp
        >>> model = pp.load_model("tiny-rope")
        >>> toks = model.to_tokens("The capital of France is")
        >>> n = toks.shape[1]
        >>> with pp.rope_positions(model, pp.PositionPlan(q_pos=torch.arange(n) + 100, k_pos=torch.arange(n) + 100)):
        ...     shifted = model(toks)
        >>> bool((shifted - model(toks)).abs().max() < 1e-4)  # a common shift leaves relative positions unchanged
        True
    """
    facts = model_facts(model)
    require_rotary(facts, "Query/key position control")
    if plan is None:
        if q_pos is None or k_pos is None:
            raise PositionError("Give a PositionPlan or both q_pos and k_pos")
        plan = PositionPlan(_as_tensor(q_pos, torch.float64), _as_tensor(k_pos, torch.float64))
    if plan.layers is not None and not all(0 <= l < n_layers(model) for l in plan.layers):
        raise PositionError(f"Plan names layers {sorted(plan.layers)}; the model has {n_layers(model)}")
    if facts.rotation_unhooked is not None:
        if plan.views:
            raise NotImplementedError(f"Key views are not available for {facts.name}: they need the rotated q and k, "
                                      f"but {facts.rotation_unhooked}")
        pre = _PreRotationControl(model, plan, facts.rotary_layers)
        with hooked(model, pre.hooks()):
            yield plan
        return
    control = _RopeControl(model, plan, facts.rotary_layers)
    with hooked(model, control.hooks()):
        yield plan


def _check_bias_plan(model: Any, plan: PositionPlan, control: str, what: str, needs: str) -> None:
    # The score-bias controls (ALiBi's distances, T5's buckets) move where queries and keys sit, nothing else.
    facts = model_facts(model)
    if facts.family is None or facts.family.control != control:
        raise WrongModelKind(f"{what} needs {needs} model, but {facts.name} uses {facts.positional_kind} positions")
    require_supported(facts, what)
    if plan.views or plan.rotary:
        raise PositionError(f"{what} takes query and key positions only (no key views or rotary overrides)")


@contextmanager
def alibi_positions(model: Any, plan: PositionPlan) -> Iterator[PositionPlan]:
    """Within the block, an ALiBi model (BLOOM, MPT) scores query i against key j at relative distance
    q_pos[i] - k_pos[j]: each head's score gets slope * ((k_pos[j] - j) - (q_pos[i] - i)) added to the bias the
    model already applied (slopes measured from the model itself), so the identity plan changes nothing, bit for
    bit. Key views and rotary overrides do not apply to ALiBi (PositionError)."""
    _check_bias_plan(model, plan, SCORE_BIAS, "ALiBi position control", "an ALiBi")
    slopes = alibi_slopes(model)
    layers = plan.layers if plan.layers is not None else range(n_layers(model))
    # Plan offsets and slopes copied once per device, not per layer and forward (a host->device copy each).
    on: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def hook_for(layer: int) -> Any:
        def hook(scores: torch.Tensor, hook: Any) -> torch.Tensor:
            n_q, total = scores.shape[-2], scores.shape[-1]
            if total > len(plan):
                raise PositionError(f"The position plan covers {len(plan)} tokens but the sequence has {total}")
            dev = scores.device
            if dev not in on:
                idx = torch.arange(len(plan), dtype=torch.float64)
                on[dev] = ((plan.q_pos - idx).to(dev), (plan.k_pos - idx).to(dev),
                           torch.tensor(slopes, dtype=torch.float64).to(dev))
            dq, dk, all_slopes = on[dev]
            s = all_slopes[layer][:, None, None]
            diff = dk[..., None, :total] - dq[..., total - n_q:total, None]  # [(batch,) query, key]
            delta = s * diff.unsqueeze(-3)  # [(batch,) head, query, key]
            delta = delta if delta.dim() == 4 else delta[None]
            return torch.where(kept_scores(model, scores), scores + delta.to(scores.dtype), scores)

        return hook

    with hooked(model, [(hook_name("scores", l), hook_for(l)) for l in layers]):
        yield plan


@contextmanager
def bucket_positions(model: Any, plan: PositionPlan) -> Iterator[PositionPlan]:
    """Within the block, a T5-bias model scores query i against key j with the bias of offset k_pos[j] - q_pos[i]:
    each layer's scores get the bias table's value at that offset's bucket minus its value at the real offset
    j - i (the table read from the model, the buckets by its own function), so the identity plan changes nothing,
    bit for bit. Positions must be whole tokens (buckets take integer offsets); key views and rotary overrides do
    not apply (PositionError)."""
    _check_bias_plan(model, plan, BUCKET_BIAS, "T5 bucket position control", "a T5-bias")
    for name, p in (("q_pos", plan.q_pos), ("k_pos", plan.k_pos)):
        if not torch.equal(p, p.round()):
            raise PositionError(f"T5 buckets take whole-token offsets; {name} holds fractional positions")
    layers = plan.layers if plan.layers is not None else range(n_layers(model))
    on: dict[tuple[torch.device, int, int], torch.Tensor] = {}  # the delta per device and shape, not per layer

    def delta(n_q: int, total: int, dev: torch.device) -> torch.Tensor:
        key = (dev, n_q, total)
        if key not in on:
            q = plan.q_pos[..., total - n_q:total, None].to(torch.long)
            k = plan.k_pos[..., None, :total].to(torch.long)
            idx = torch.arange(total)
            real = idx[None, :] - idx[total - n_q:, None]
            d = bucket_bias(model, k - q) - bucket_bias(model, real)  # [(batch,) head, query, key]
            on[key] = (d if d.dim() == 4 else d[None]).to(dev)
        return on[key]

    def hook(scores: torch.Tensor, hook: Any) -> torch.Tensor:
        n_q, total = scores.shape[-2], scores.shape[-1]
        if total > len(plan):
            raise PositionError(f"The position plan covers {len(plan)} tokens but the sequence has {total}")
        d = delta(n_q, total, scores.device)
        return torch.where(kept_scores(model, scores), scores + d.to(scores.dtype), scores)

    with hooked(model, [(hook_name("scores", l), hook) for l in layers]):
        yield plan


def shifted_plan(n: int, k: float, *, q_only: bool = False) -> PositionPlan:
    """Positions k..k+n-1 for queries and keys (or queries only): the shift test's RoPE plan."""
    base = torch.arange(n, dtype=torch.float64)
    return PositionPlan(base + k, base if q_only else base + k, label=f"shift{'-q' if q_only else ''}:{k:g}")


def _by_rotation(model: Any, pos: torch.Tensor, label: str) -> Any:
    # One host->device copy for q and k (the plan keeps them on the device); mps has no float64, and float32 holds
    # every integer position below 2**24 exactly.
    device = device_of(model)
    p = pos.to(device, torch.float32 if device.type == "mps" else torch.float64)
    return rope_positions(model, PositionPlan(p, p.clone(), label=label))


#: How each family's control (`Family.control`) places token t at pos[..., t]: the one dispatch from a family to
#: the code that moves its positions.
_CONTROLLERS: dict[str, Callable[[Any, torch.Tensor, str], Any]] = {
    POSITION_IDS: lambda model, pos, label: learned_positions(model, pos),
    SCORE_BIAS: lambda model, pos, label: alibi_positions(
        model, PositionPlan(pos.double(), pos.double().clone(), label=label)),
    QK_ROTATION: _by_rotation,
    BUCKET_BIAS: lambda model, pos, label: bucket_positions(
        model, PositionPlan(pos.double(), pos.double().clone(), label=label)),
}


def token_positions(model: Any, pos: torch.Tensor, label: str = "positions") -> Any:
    """A context in which token t's query and key sit at `pos[..., t]` (`[pos]` or `[batch, pos]`, CPU), whatever
    the model's positional kind: learned or sinusoidal ids, ALiBi distances or RoPE rotations (WrongModelKind for
    others).

    Examples:
        >>> import torch, posprobe as pp
        >>> from posprobe.core.positions import token_positions
        >>> model = pp.load_model("tiny-ape")  # learned absolute positions (GPT-2 layout)
        >>> toks = model.to_tokens("The capital of France is")
        >>> with token_positions(model, torch.arange(toks.shape[1]) + 100):  # token t at position 100 + t
        ...     moved = model(toks)
        >>> bool((moved - model(toks)).abs().max() > 0)  # absolute positions matter here
        True
    """
    kind = model_facts(model).positional_kind
    try:
        fam = family(kind)
    except KeyError:
        raise WrongModelKind(f"Positions can be set on learned, sinusoidal, rotary, ALiBi or T5-bias models; "
                             f"{model_name(model)} uses {kind}") from None
    controller = _CONTROLLERS.get(fam.control) if fam.control is not None else None
    if controller is not None:
        return controller(model, pos, label)
    raise WrongModelKind(f"Positions can be set on learned, sinusoidal, rotary, ALiBi or T5-bias models; "
                         f"{model_name(model)} uses {kind} positions ({fam.why_no_control})")
