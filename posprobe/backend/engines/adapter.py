"""Any engine in `posprobe conform`, plugged in by its user: an `EngineAdapter` is the engine's next-token scoring
(token ids -> log-probabilities of the next token at every position), optionally its cached scoring and its own
phase arithmetic, and the rotation it declares per layer type (`EngineRope`: base, rotated dims, scale, YaRN's
settings, attention factor). `run_conform(model, config, engine=adapter)` checks it against the HF reference of
`model` (a GGUF file, a packaged GGUF model or a local HF folder) exactly as it checks llama.cpp: declared, behaviour,
cache (where `cached` is given) and precision. The engine runs wherever its user runs it (vLLM, sglang, MLX on their
machine); posprobe only reads the arrays it returns. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from posprobe.backend.engines.rope import EngineRope

__all__ = ["EngineAdapter"]


def _float32_product(rope: EngineRope) -> Callable[[np.ndarray], np.ndarray]:
    # The usual arithmetic (HF's since transformers PR #29285): float32 frequencies times float32 positions.
    from posprobe.backend.engines.rope import engine_table

    inv = engine_table(rope)[0].astype(np.float32)
    return lambda positions: (np.asarray(positions, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float64)


@dataclass(frozen=True)
class EngineAdapter:
    """An engine as `posprobe conform` reads it.

    `name`: how reports call it. `ropes`: {layer type: EngineRope} it declares ("all" for one table, else HF's layer
    types, e.g. "full_attention" and "sliding_attention"). `logprobs(ids)`: the next-token log-probabilities at every
    position of the token ids, `[len(ids), vocab]` (natural log; one uncached pass). `cached(ids, start, chunk)`
    (optional): the same at positions `start .. len(ids) - 1`, `[len(ids) - start, vocab]`, after a prefill of
    `ids[:start]` and steps of `chunk` tokens through the engine's cache. `phases(rope)` (optional): positions ->
    the phases `[position, band]` (rad) the engine computes (default: float32 frequencies times float32 positions).
    The scaling in force is the engine's own: `ropes` declare it and `config.rope_scaling` lays it over HF's side.

    Examples:
        >>> from posprobe import ConformConfig, EngineAdapter, EngineRope, run_conform
        >>> mine = EngineAdapter("my-engine", {"all": EngineRope("all", n_rot=64, base=1e5)}, logprobs=print)
        >>> run_conform("smollm2", ConformConfig(checks=("declared",)), engine=mine).meta["verdict"]
        'conforms'
        >>> off = EngineAdapter("my-engine", {"all": EngineRope("all", n_rot=64, base=1e5, attn_factor=1.2)}, print)
        >>> got = run_conform("smollm2", ConformConfig(checks=("declared",)), engine=off)
        >>> got.tables["declared"].loc[0, "bug_class"]
        'attention factor off'
    """

    name: str
    ropes: dict[str, EngineRope]
    logprobs: Callable[[list[int]], Any]
    cached: Callable[[list[int], int, int], Any] | None = None
    phases_of: Callable[[EngineRope], Callable[[np.ndarray], np.ndarray]] | None = None

    def __post_init__(self) -> None:
        if not self.ropes or not all(isinstance(r, EngineRope) for r in self.ropes.values()):
            raise ValueError("EngineAdapter.ropes: give {layer type: EngineRope} for every layer type the engine has")
        if not callable(self.logprobs):
            raise ValueError("EngineAdapter.logprobs: give a function from token ids to [len(ids), vocab] log-probs")

    # The engine-module protocol `run_conform` reads (posprobe.backend.engines.ENGINES' modules have the same).
    def check_proven(self, path: Any, meta: dict[str, Any]) -> None:
        """Nothing to refuse: the adapter's rotation is what its user declares."""

    def parse_options(self, pairs: Any) -> dict[str, float]:
        """{} ; ValueError for any option: an adapter's settings are in its own engine, declared by `ropes`."""
        if pairs:
            raise ValueError(f"--engine-option {list(pairs)}: an adapter takes no options (set them in the engine and "
                             "declare them in its ropes)")
        return {}

    def options_for_scaling(self, rope: dict | None) -> dict[str, float]:
        """{}: the scaling in force is the engine's own (declared in `ropes`)."""
        return {}

    def declared(self, meta: dict[str, Any], options: dict | None = None, *, path: Any = None
                 ) -> dict[str, EngineRope]:
        """The rotation the adapter declares per layer type."""
        return dict(self.ropes)

    def missing_package(self) -> None:
        """None: the engine is already running in its user's process."""
        return None

    def next_token_logprobs(self, path: Any, ids: list[int], options: dict | None = None, *,
                            threads: int | None = None) -> np.ndarray:
        """The adapter's `logprobs(ids)` as float32 `[len(ids), vocab]`; ValueError for another shape."""
        return _rows(self.name, self.logprobs(list(ids)), len(ids))

    def cache_pair(self, path: Any, ids: list[int], start: int, options: dict | None = None, *, chunk: int = 1,
                   threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(uncached, cached) next-token log-probabilities at positions `start ..`; NotImplementedError where the
        adapter gives no cached scoring."""
        if self.cached is None:
            raise NotImplementedError(f"{self.name} gives no cached scoring (EngineAdapter.cached)")
        uncached = self.next_token_logprobs(path, ids)[start:]
        return uncached, _rows(self.name, self.cached(list(ids), start, chunk), len(ids) - start)

    def phases(self, rope: EngineRope) -> Callable[[np.ndarray], np.ndarray]:
        """positions -> the engine's phases `[position, band]` (rad) for `rope`."""
        return self.phases_of(rope) if self.phases_of is not None else _float32_product(rope)


def _rows(name: str, got: Any, n: int) -> np.ndarray:
    arr = np.asarray(got.detach().cpu().float() if hasattr(got, "detach") else got, dtype=np.float32)
    if arr.ndim != 2 or arr.shape[0] != n:
        raise ValueError(f"{name} returned log-probabilities of shape {arr.shape}; expected [{n}, vocab]")
    return arr
