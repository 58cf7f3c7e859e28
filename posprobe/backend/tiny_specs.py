"""Configurations of the built-in tiny random models, as plain data.

Kept apart from `tiny.py` (which needs torch) so the CLI can read a tiny model's positional facts
before anything heavy is imported.
"""

from __future__ import annotations

from typing import Any

from posprobe.backend.families import LEARNED, ROTARY, tl_name

SPECS: dict[str, dict[str, Any]] = {
    "tiny-ape": dict(
        n_layers=2, d_model=64, n_heads=4, d_head=16, d_mlp=128, n_ctx=256, act_fn="gelu",
        normalization_type="LN", positional_embedding_type=tl_name(LEARNED),
    ),
    "tiny-rope": dict(
        n_layers=2, d_model=64, n_heads=4, d_head=16, d_mlp=128, n_ctx=256, act_fn="silu",
        normalization_type="RMS", positional_embedding_type=tl_name(ROTARY), rotary_dim=16, rotary_base=10000,
        n_key_value_heads=2, gated_mlp=True,
    ),
}
