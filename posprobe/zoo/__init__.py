"""The positional zoo: small causal LMs that differ only in their positions, trained by posprobe as ordinary
Hugging Face folders (`train_zoo`; on synthetic tasks `train_task_zoo`), and analyses run across them side by side
(`evaluate_zoo`, `run_zoo_atlas`). Sits above the
analyses (it runs them) and below the CLI. Imports are lazy: `import posprobe.zoo` loads no torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZooConfig": "posprobe.zoo.config",
    "ExtendConfig": "posprobe.zoo.extend",
    "ZooAtlasConfig": "posprobe.zoo.config",
    "TaskConfig": "posprobe.zoo.config",
    "run_zoo_atlas": "posprobe.zoo.atlas",
    "train_task_zoo": "posprobe.zoo.task_zoo",
    "TIERS": "posprobe.zoo.config",
    "load_config_file": "posprobe.zoo.config",
    "MEMBERS": "posprobe.zoo.members",
    "Member": "posprobe.zoo.members",
    "train_zoo": "posprobe.zoo.run",
    "evaluate_zoo": "posprobe.zoo.evaluate",
    "train_tokenizer": "posprobe.zoo.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'posprobe.zoo' has no attribute {name!r}")
