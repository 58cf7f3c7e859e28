"""What an atlas section is: each section-bearing analysis declares one `AtlasSection` in its own module (how the
atlas runs it with bounded settings, when it cannot run and why, its headline numbers, its paragraph), and
registers it here; `run_atlas` is a loop over them. A section's name, module and --help line are its entry in
`configs.ATLAS_SECTIONS` (read without importing any analysis)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from posprobe.analyses.configs import ATLAS_SECTIONS, AtlasConfig


@dataclass(frozen=True)
class AtlasRun:
    """The bounded settings every section of one atlas run shares, derived once from the model and the config."""

    #: The model's ModelFacts.
    facts: Any
    config: AtlasConfig
    #: The text the sections read, and the name recorded as its source.
    text: str
    source: str
    #: Tokens per window and windows per section.
    window: int
    max_windows: int
    #: Shift distances that keep the built-in sentences inside the context.
    ks: tuple[int, ...]
    #: The sections this run will run (a section may size itself by another's presence: sinks zeroes heads only
    #: where retrieval runs too).
    sections: tuple[str, ...] = ()


#: `n(metric)`: the number the atlas table holds for (this section, metric), or None.
Lookup = Callable[[str], "float | None"]


@dataclass(frozen=True)
class AtlasSection:
    """One atlas section, declared beside its analysis."""

    name: str
    title: str
    #: Runs the analysis with the run's bounded settings: (model, AtlasRun) -> its Result.
    run: Callable[[Any, AtlasRun], Any]
    #: Its headline numbers from its Result: [(metric, value)], the atlas table's rows for this section.
    headlines: Callable[[Any], list[tuple[str, float]]]
    #: The section's findings in words: (the atlas result, n) -> one paragraph.
    paragraph: Callable[[Any, Lookup], str]
    #: Why it cannot run on a model beyond its family's reasons: (facts, whether the long-context engine runs the
    #: model) -> reasons, None where a check passes; the first reason given is reported.
    blocked: Callable[[Any, bool], tuple[str | None, ...]] = field(default=lambda facts, engine_runs: ())
    #: How many of its own report's figures the atlas page shows.
    key_figures: int = 1
    #: Extra atlas meta from its Result (e.g. the layers the frequency section measured), {} by default.
    meta: Callable[[Any], dict] = field(default=lambda part: {})


_REGISTRY: dict[str, AtlasSection] = {}


def register(section: AtlasSection) -> AtlasSection:
    """Declare `section` (called by its analysis module at import); returns it."""
    _REGISTRY[section.name] = section
    return section


def section(name: str) -> AtlasSection:
    """The declared section `name`, importing the module its ATLAS_SECTIONS entry names where not yet declared;
    KeyError for a name that is neither."""
    if name not in _REGISTRY and name in ATLAS_SECTIONS:
        importlib.import_module(ATLAS_SECTIONS[name][0])
    if name not in _REGISTRY:
        raise KeyError(f"No atlas section {name!r} (known: {', '.join(ATLAS_SECTIONS)})")
    return _REGISTRY[name]
