"""Every public function of `posprobe.__all__` has a Google-style docstring the API reference renders as tables: an
`Args:` entry for every parameter of its signature, none for a parameter it lacks, and one `Returns:` entry (`Yields:`
for a generator, the context managers among them), parsed by griffe as mkdocstrings parses them (issue #64: no API
entry had Args/Returns sections, and 112 of 260 public parameters were described nowhere). Planted: deleting the
`source:` line of run_frequency's Args fails this test naming `run_frequency(source)`; so does un-indenting the
second line of a Returns entry (griffe then reads two returned values)."""

from __future__ import annotations

import inspect
import logging

import griffe
import pytest

import posprobe


def public_functions() -> list[str]:
    """The names in `posprobe.__all__` that are functions (not classes: configs, results, exceptions)."""
    return [n for n in posprobe.__all__ if callable(getattr(posprobe, n)) and not inspect.isclass(getattr(posprobe, n))]


def sections(fn) -> dict[str, list]:
    """{section kind ("parameters", "returns", "yields", ...): its items} of `fn`'s docstring, parsed as google."""
    doc = griffe.Docstring(inspect.getdoc(fn) or "", parser="google")
    logging.disable(logging.WARNING)  # no parent object here: griffe would warn of missing types, not of our docs
    try:
        parsed = doc.parse()
    finally:
        logging.disable(logging.NOTSET)
    out: dict[str, list] = {}
    for s in parsed:
        out.setdefault(s.kind.value, []).extend(s.value if isinstance(s.value, list) else [s.value])
    return out


def test_the_public_functions_are_found():
    assert len(public_functions()) >= 50, public_functions()


def test_every_public_function_documents_its_args_and_returns():
    missing, stale, no_returns = [], [], []
    for name in public_functions():
        fn = getattr(posprobe, name)
        got = sections(fn)
        documented = [p.name.lstrip("*") for p in got.get("parameters", [])]
        params = list(inspect.signature(fn).parameters)
        missing += [f"{name}({p})" for p in params if p not in documented]
        stale += [f"{name}({p})" for p in documented if p not in params]
        kind = "yields" if inspect.isgeneratorfunction(inspect.unwrap(fn)) else "returns"
        if len(got.get(kind, [])) != 1:
            no_returns.append(f"{name}: {len(got.get(kind, []))} {kind.capitalize()} entries")
    problems = []
    if missing:
        problems.append("parameters without an Args entry (write `name: what it is`): " + ", ".join(missing))
    if stale:
        problems.append("Args entries naming no parameter of the signature: " + ", ".join(stale))
    if no_returns:
        problems.append("want exactly one Returns entry (Yields: for a generator or context manager; indent the "
                        "entry's further lines): " + ", ".join(no_returns))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, kinds", [
    ("Sum.\n\nArgs:\n    x: the x.\n\nReturns:\n    The sum,\n        in units.\n", {"parameters": 1, "returns": 1}),
    ("Sum.\n\nReturns:\n    The sum,\n    in units.\n", {"returns": 2}),  # what the check above refuses
])
def test_griffe_reads_sections_as_the_check_assumes(text, kinds):
    def f(x: int) -> int:
        return x

    f.__doc__ = text
    got = sections(f)
    assert {k: len(v) for k, v in got.items() if k != "text"} == kinds
