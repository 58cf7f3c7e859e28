"""Which page module renders which analysis. A page module has `title(result) -> str`,
`sections(result) -> list[Section]` and `figures(result) -> list`, built from tables + meta only."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from posprobe.report.html import Section

#: Rows of a table shown on a page or printed to the console (the saved table has them all).
PREVIEW_ROWS = 50

PAGES = {
    "shift-test": "posprobe.report.shift",
    "frequency": "posprobe.report.frequency",
    "decompose": "posprobe.report.decompose",
    "probes": "posprobe.report.probes",
    "geometry": "posprobe.report.geometry",
    "squish": "posprobe.report.squish",
    "surgery-eval": "posprobe.report.squish",
    "squish-study": "posprobe.report.squish_study",
    "brittleness": "posprobe.report.brittleness",
    "long-context": "posprobe.report.long_context",
    "heads": "posprobe.report.heads",
    "sinks": "posprobe.report.sinks",
    "retrieval": "posprobe.report.retrieval",
    "atlas": "posprobe.report.atlas",
    "extrapolation": "posprobe.report.extrapolation",
    "zoo-eval": "posprobe.report.extrapolation",
    "zoo-train": "posprobe.report.zoo_training",
    "zoo-atlas": "posprobe.report.zoo_atlas",
    "zoo-tasks": "posprobe.report.zoo_tasks",
    "zoo-extend": "posprobe.report.zoo_extend",
    "zoo-emergence": "posprobe.report.emergence",
    "zoo-extend-study": "posprobe.report.extend_study",
    "conform": "posprobe.report.conform",
}


class _Generic:
    """Page for results of unknown analyses (user-built): a preview of each table."""

    @staticmethod
    def title(result: Any) -> str:
        return str(result.meta.get("title") or result.analysis)

    @staticmethod
    def figures(result: Any) -> list:
        return []

    @staticmethod
    def sections(result: Any) -> list[Section]:
        out = []
        for name, df in result.tables.items():
            head = (
                f"{name} ({len(df)} rows)"
                if len(df) <= PREVIEW_ROWS
                else f"{name} (first {PREVIEW_ROWS} of {len(df)} rows)"
            )
            out.append(Section(head, table=df.head(PREVIEW_ROWS)))
        return out


def page_for(result: Any) -> ModuleType | type[_Generic]:
    """The page module registered for `result.analysis` (a generic preview page otherwise)."""
    name = PAGES.get(result.analysis)
    return importlib.import_module(name) if name else _Generic
