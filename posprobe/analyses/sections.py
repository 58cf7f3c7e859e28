"""What an atlas section is: each section-bearing analysis declares one `AtlasSection` in its own module (how the
atlas runs it with bounded settings on one model, its slim tables on each of many models, when it cannot run and
why, its headline numbers, its paragraph, the report function that draws the models side by side), and registers it
here; `run_atlas` (one model) and `run_zoo_atlas` (many) are loops over them. A section's name, module, --help line
and atlases are its entry in `configs.SECTIONS` (read without importing any analysis)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from posprobe.analyses.configs import SECTIONS, AtlasConfig, ExtrapolationConfig, ZooAtlasConfig


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


@dataclass
class ModelEntry:
    """One model of an atlas over many: its label (a zoo member's folder name, or the spec), the spec it was loaded
    from, its zoo record (None outside a zoo), the loaded model and its ModelFacts, or why it could not be loaded."""

    label: str
    spec: str
    record: dict | None
    model: Any = None
    facts: Any = None
    why: str | None = None


@dataclass(frozen=True)
class CompareRun:
    """What every section of one atlas over many models shares: its config, the text every model reads, and the
    paths the user named (zoo folders carry their training record)."""

    config: ZooAtlasConfig
    text: str
    paths: tuple[str, ...] = ()
    #: The name the text is recorded under.
    source: str | None = None
    #: `zoo eval`'s own extrapolation settings (every ExtrapolationConfig knob); None: the atlas's bounded ones.
    extrapolation: ExtrapolationConfig | None = None


#: `n(metric)`: the number the atlas table holds for (this section, metric), or None.
Lookup = Callable[[str], "float | None"]


@dataclass(frozen=True)
class AtlasSection:
    """One atlas section, declared beside its analysis."""

    name: str
    title: str
    #: One model: runs the analysis with the run's bounded settings: (model, AtlasRun) -> its Result (None for a
    #: section only the atlas over many models has).
    run: Callable[[Any, AtlasRun], Any] | None
    #: Its headline numbers from its Result: [(metric, value)], the atlas table's rows for this section.
    headlines: Callable[[Any], list[tuple[str, float]]] | None
    #: The section's findings in words: (the atlas result, n) -> one paragraph.
    paragraph: Callable[[Any, Lookup], str] | None
    #: Why it cannot run on a model beyond its family's reasons: (facts, whether the long-context engine runs the
    #: model) -> reasons, None where a check passes; the first reason given is reported.
    blocked: Callable[[Any, bool], tuple[str | None, ...]] = field(default=lambda facts, engine_runs: ())
    #: How many of its own report's figures the atlas page shows.
    key_figures: int = 1
    #: Extra atlas meta from its Result (e.g. the layers the frequency section measured), {} by default.
    meta: Callable[[Any], dict] = field(default=lambda part: {})
    #: Many models, one at a time: (ModelEntry, CompareRun) -> (tables, headline dict or None), the slim tables the
    #: atlas over many models concatenates (tagged with the model and its member, family, block, seed); or a string:
    #: why the section does not apply to that model, in posprobe's own words.
    compare: Callable[[ModelEntry, CompareRun], Any] | None = None
    #: Many models at once (a cross-model section: similarity, training): (the entries, CompareRun) -> (tables,
    #: {model label: why it was left out}). A section has `compare` or `across`, not both.
    across: Callable[[list[ModelEntry], CompareRun], tuple[dict[str, Any], dict[str, str]]] | None = None
    #: Whether `across` reads the loaded models (head similarity does; the training curves are read from the zoo
    #: folder): only then are the models kept in memory until the cross-model sections run.
    across_reads_models: bool = True
    #: The report function that draws this section's models side by side: (the result) -> a page Section or None.
    #: It reads the result's tables and meta only; the result names it in meta "pages" as "module:function", so a
    #: saved result renders again without the analyses.
    compare_page: Callable[[Any], Any] | None = None


_REGISTRY: dict[str, AtlasSection] = {}


def register(section: AtlasSection) -> AtlasSection:
    """Declare `section` (called by its analysis module at import); returns it."""
    _REGISTRY[section.name] = section
    return section


def section(name: str) -> AtlasSection:
    """The declared section `name`, importing the module its SECTIONS entry names where not yet declared; KeyError
    for a name that is neither."""
    if name not in _REGISTRY and name in SECTIONS:
        importlib.import_module(SECTIONS[name].module)
    if name not in _REGISTRY:
        raise KeyError(f"No atlas section {name!r} (known: {', '.join(SECTIONS)})")
    return _REGISTRY[name]


def why_not(name: str, facts: Any, engine_runs: bool = False) -> str | None:
    """Why section `name` does not run on a model with these ModelFacts (its positional family's reason first, then
    the section's own `blocked` reasons), or None when it runs."""
    from posprobe.backend.families import not_applicable

    reasons = (not_applicable(facts.positional_kind, name), *section(name).blocked(facts, engine_runs))
    return next((r for r in reasons if r is not None), None)
