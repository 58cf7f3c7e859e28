"""The one dispatch point between the two backends: `ops(model)` is the adapter module that implements the
model operations for this object — `bridge_ops` for a TransformerBridge, `legacy_ops` for a TL 3
HookedTransformer / HookedEncoder. The façades (`model.py`, `hooks.py`, `facts.py`) call it; nothing else
branches on the backend."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from posprobe.backend import bridge_ops, legacy_ops
from posprobe.backend.kind import is_bridge


def ops(model: Any) -> ModuleType:
    """The adapter module for `model` (both define the same functions with the same meaning)."""
    return bridge_ops if is_bridge(model) else legacy_ops
