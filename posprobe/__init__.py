"""posprobe: mechanistic analysis of positional behaviour in trained transformers.

Public API (imports are lazy so `posprobe --help` and `import posprobe` stay fast).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "posprobe.models",
    "load_hf_model": "posprobe.models",
    "ModelLoadError": "posprobe.sources",
    "model_facts": "posprobe.facts",
    "ModelFacts": "posprobe.facts",
    "WrongModelKind": "posprobe.facts",
    "capture": "posprobe.capture",
    "stream": "posprobe.capture",
    "Reducer": "posprobe.capture",
    "RunningMean": "posprobe.capture",
    "mean_by_position": "posprobe.capture",
    "learned_positions": "posprobe.positions",
    "rope_positions": "posprobe.positions",
    "PositionPlan": "posprobe.positions",
    "KeyView": "posprobe.positions",
    "PositionError": "posprobe.positions",
    "RotarySpec": "posprobe.rope",
    "Result": "posprobe.results",
    "load_blimp": "posprobe.data",
    "run_shift_test": "posprobe.shift_run",
    "ShiftConfig": "posprobe.shift",
    "decompose_layer0": "posprobe.decompose",
    "decompose_layer": "posprobe.decompose",
    "positional_mean": "posprobe.decompose",
    "head_summary": "posprobe.decompose",
    "Decomposition": "posprobe.decompose",
    "position_probes": "posprobe.probes",
    "ProbeConfig": "posprobe.probes",
    "wpos_geometry": "posprobe.geometry",
    "residual_geometry": "posprobe.geometry",
    "generate": "posprobe.generate",
    "apply_plan": "posprobe.surgery",
    "key_squish": "posprobe.surgery",
    "preset_plan": "posprobe.surgery",
    "squish_run": "posprobe.squish",
    "frequency_usage": "posprobe.frequency",
    "FrequencyUsage": "posprobe.frequency",
    "band_ablation": "posprobe.frequency_ablation",
    "BandAblation": "posprobe.frequency_ablation",
    "p_sweep": "posprobe.frequency_ablation",
    "head_ablations": "posprobe.frequency_ablation",
    "builtin_pairs": "posprobe.data",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'posprobe' has no attribute {name!r}")
