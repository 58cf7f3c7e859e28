"""The positional zoo, a model factory: small causal LMs that differ only in their positions, trained by posprobe as
ordinary Hugging Face folders (`train_zoo`; on synthetic tasks `train_task_zoo`; continued to a longer context by
`zoo.extend`). It stands below the analyses and imports none of them (tests/test_layers.py): comparing the models is
the analyses' work (`posprobe.analyses.atlas_many`: `evaluate_zoo`, `run_zoo_atlas`). Imports are lazy:
`import posprobe.zoo` loads no torch.

Where a change lands (counted on the code):
- a member: one `Member(...)` row in `members.py` (its HF config builder on the row), plus its expected layer
  phrases in `tests/test_zoo.py`'s EXPECTED_LAYERS, whose test trains every member and checks the family posprobe
  detects from the saved folder;
- an architecture fact a member relies on (labels not shifted, weights a decoder-only forward leaves unused): the
  architecture's row in `backend/architectures.py`, not the member;
- the zoo folder format (zoo.json, eval.txt, training/, tasks/, member folder names): `folder.py` alone.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZooConfig": "posprobe.zoo.config",
    "ExtendConfig": "posprobe.zoo.extend",
    "TaskConfig": "posprobe.zoo.config",
    "train_task_zoo": "posprobe.zoo.task_zoo",
    "TIERS": "posprobe.zoo.config",
    "load_config_file": "posprobe.zoo.config",
    "MEMBERS": "posprobe.zoo.members",
    "Member": "posprobe.zoo.members",
    "train_zoo": "posprobe.zoo.run",
    "train_tokenizer": "posprobe.zoo.tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'posprobe.zoo' has no attribute {name!r}")
