"""Attaching forward hooks to a TransformerLens model's HookPoints, and counting what is attached.

Below the adapters and the façades: `bridge_ops` measures with it, `hooks.py` re-exports it for everyone above.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

# Context levels of posprobe's hooks, far above TL's own (which count up from 0 per nested `hooks()`).
_LEVELS = itertools.count(1_000_000)


def live_hook_count(model: Any) -> int:
    """Number of forward/backward hooks currently attached to the model's HookPoints."""
    # A bridge lists one HookPoint under several alias names: count each HookPoint once.
    # Permanent hooks are the model's own wiring (TL 4's BERT bridge routes hook_mlp_in that way), not ours.
    points = {id(hp): hp for hp in model.hook_dict.values()}.values()
    return sum(not getattr(h, "is_permanent", False) for hp in points for h in (*hp.fwd_hooks, *hp.bwd_hooks))


@contextmanager
def hooked(model: Any, fwd_hooks: Sequence[tuple[str, Callable]]) -> Iterator[Any]:
    """Attach `fwd_hooks` (TL-style `fn(tensor, hook=...)`) for the duration of the block; they are
    removed on exit, also on error. Unknown hook names raise before anything is attached."""
    known = model.hook_dict  # a bridge rebuilds this dict (~40 ms) on every access: read it once
    for name, _ in fwd_hooks:
        if name not in known:
            raise ValueError(f"{model.cfg.model_name} has no hook {name!r}")
    # Attach straight to the HookPoints under a level of our own (TL's `model.hooks()` re-reads the hook
    # dict per hook, ~5 s per forward on a bridge), and remove exactly that level on exit.
    level = next(_LEVELS)
    points = {}
    try:
        for name, fn in fwd_hooks:
            hp = known[name]
            points[id(hp)] = hp
            hp.add_hook(fn, dir="fwd", level=level)
        yield model
    finally:
        for hp in points.values():
            hp.remove_hooks("fwd", level=level)
