"""posprobe: mechanistic analysis of positional behaviour in trained transformers.

Public API (imports are lazy so `posprobe --help` and `import posprobe` stay fast).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # models (backend)
    "load_model": "posprobe.backend.loading",
    "load_hf_model": "posprobe.backend.loading",
    "ModelLoadError": "posprobe.backend.sources",
    "model_facts": "posprobe.backend.facts",
    "ModelFacts": "posprobe.backend.facts",
    "WrongModelKind": "posprobe.backend.facts",
    "hf_facts": "posprobe.backend.facts",
    # capture and position control (core)
    "capture": "posprobe.core.capture",
    "stream": "posprobe.core.capture",
    "Reducer": "posprobe.core.capture",
    "RunningMean": "posprobe.core.capture",
    "mean_by_position": "posprobe.core.capture",
    "learned_positions": "posprobe.core.positions",
    "rope_positions": "posprobe.core.positions",
    "PositionPlan": "posprobe.core.positions",
    "KeyView": "posprobe.core.positions",
    "PositionError": "posprobe.core.positions",
    "RotarySpec": "posprobe.rope",
    "generate": "posprobe.core.generation",
    "apply_plan": "posprobe.core.surgery",
    "key_squish": "posprobe.core.surgery",
    "preset_plan": "posprobe.core.presets",
    "preset_pairs": "posprobe.core.presets",
    "long_attention": "posprobe.core.long_engine",
    # data
    "load_blimp": "posprobe.data",
    "builtin_pairs": "posprobe.data",
    "BUILTIN_TEXT": "posprobe.data",
    # analyses: Config -> run -> Result
    "ShiftConfig": "posprobe.analyses.configs",
    "FrequencyConfig": "posprobe.analyses.configs",
    "DecomposeConfig": "posprobe.analyses.configs",
    "ProbeConfig": "posprobe.analyses.configs",
    "GeometryConfig": "posprobe.analyses.configs",
    "SquishConfig": "posprobe.analyses.configs",
    "SurgeryEvalConfig": "posprobe.analyses.configs",
    "HeadsConfig": "posprobe.analyses.configs",
    "run_heads": "posprobe.analyses.heads",
    "AtlasConfig": "posprobe.analyses.configs",
    "run_atlas": "posprobe.analyses.atlas",
    "run_shift_test": "posprobe.analyses.shift",
    "run_frequency": "posprobe.analyses.frequency",
    "run_decompose": "posprobe.analyses.decompose",
    "run_probes": "posprobe.analyses.probes",
    "run_geometry": "posprobe.analyses.geometry",
    "run_squish": "posprobe.analyses.squish",
    "run_surgery_eval": "posprobe.analyses.squish",
    "SinksConfig": "posprobe.analyses.configs",
    "run_sinks": "posprobe.analyses.sinks",
    "RetrievalConfig": "posprobe.analyses.configs",
    "run_retrieval": "posprobe.analyses.retrieval",
    "ConformConfig": "posprobe.analyses.configs",
    "run_conform": "posprobe.analyses.conform",
    "EngineAdapter": "posprobe.backend.engines.adapter",
    "EngineRope": "posprobe.backend.engines.rope",
    "head_similarity": "posprobe.analyses.head_similarity",
    "SquishStudyConfig": "posprobe.analyses.configs",
    "run_squish_study": "posprobe.analyses.squish_study",
    "BrittlenessConfig": "posprobe.analyses.configs",
    "run_brittleness": "posprobe.analyses.brittleness",
    "LongContextConfig": "posprobe.analyses.configs",
    "run_long_context": "posprobe.analyses.long_context",
    "ExtrapolationConfig": "posprobe.analyses.configs",
    "run_extrapolation": "posprobe.analyses.extrapolation",
    "rope_theory_table": "posprobe.analyses.rope_tables",
    # the positional zoo: matched models per positional family
    "ZooConfig": "posprobe.zoo.config",
    "train_zoo": "posprobe.zoo.run",
    "evaluate_zoo": "posprobe.analyses.atlas_many",
    "run_zoo_atlas": "posprobe.analyses.atlas_many",
    "ZooAtlasConfig": "posprobe.analyses.configs",
    "train_task_zoo": "posprobe.zoo.task_zoo",
    "TaskConfig": "posprobe.zoo.config",
    "ExtendConfig": "posprobe.zoo.extend",
    "extend_zoo": "posprobe.analyses.context_extension",
    "extend_study": "posprobe.analyses.extend_study",
    "BackcopyConfig": "posprobe.zoo.backcopy",
    "run_sink_control": "posprobe.analyses.sink_control",
    "extend_study_table": "posprobe.analyses.extend_study",
    "EmergenceConfig": "posprobe.analyses.configs",
    "run_emergence": "posprobe.analyses.emergence",
    # analysis building blocks
    "frequency_usage": "posprobe.analyses.frequency",
    "FrequencyUsage": "posprobe.analyses.frequency",
    "band_ablation": "posprobe.analyses.frequency_ablation",
    "BandAblation": "posprobe.analyses.frequency_ablation",
    "p_sweep": "posprobe.analyses.frequency_ablation",
    "head_ablations": "posprobe.analyses.frequency_ablation",
    "decompose_layer0": "posprobe.analyses.decompose",
    "decompose_layer": "posprobe.analyses.decompose",
    "positional_mean": "posprobe.analyses.decompose",
    "head_summary": "posprobe.analyses.decompose",
    "Decomposition": "posprobe.analyses.decompose",
    "position_probes": "posprobe.analyses.probes",
    "wpos_geometry": "posprobe.analyses.geometry",
    "residual_geometry": "posprobe.analyses.geometry",
    "squish_generate": "posprobe.analyses.squish",
    # results
    "Result": "posprobe.report.result",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'posprobe' has no attribute {name!r}")
