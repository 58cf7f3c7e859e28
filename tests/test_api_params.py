"""Every parameter of every public `run_*` analysis is described in its docstring, named in backticks (issue #64: a
review found `source` undescribed in 12 of 13 and 150 of 256 public parameters named). Planted: deleting the
sentence naming run_frequency's `source` fails this test."""

from __future__ import annotations

import inspect

import posprobe


def test_every_run_parameter_is_named_in_its_docstring():
    missing = []
    for name in (n for n in posprobe.__all__ if n.startswith("run_")):
        fn = getattr(posprobe, name)
        doc = inspect.getdoc(fn) or ""
        for p in inspect.signature(fn).parameters:
            if f"`{p}`" not in doc and f"`{p}=" not in doc and p not in ("model", "text"):
                missing.append(f"{name}({p})")
    assert not missing, "parameters no docstring names (write `name`: what it is): " + ", ".join(missing)
