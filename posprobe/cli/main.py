"""Command-line entry point. Subcommands live in posprobe/cli/<name>.py and import heavy
libraries (torch, TransformerLens) only inside `run`, so `posprobe --help` is instant."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

# Subcommand name -> module under posprobe.cli (each has HELP, add_arguments(p), run(args) -> int).
SUBCOMMANDS = {
    "info": "info",
    "shift-test": "shift",
    "freq-report": "freq_report",
    "squish": "squish",
    "squish-study": "squish_study",
    "brittleness": "brittleness",
    "surgery-eval": "surgery_eval",
    "long-context": "long_context",
    "decompose": "decompose",
    "probe": "probe",
    "geometry": "geometry",
    "heads": "heads",
    "sinks": "sinks",
    "retrieval": "retrieval",
    "atlas": "atlas",
    "zoo": "zoo",
    "conform": "conform",
}

#: Subcommand name -> its page in the source tree's docs/ (the site: `mkdocs serve`); every `--help` ends with it.
DOCS_PAGES = {
    "info": "docs/models.md (with --theory: docs/rope-theory.md)",
    "shift-test": "docs/shift-test.md",
    "freq-report": "docs/frequency.md",
    "squish": "docs/surgery-squishing.md",
    "squish-study": "docs/surgery-squishing.md",
    "brittleness": "docs/surgery-squishing.md",
    "surgery-eval": "docs/surgery-squishing.md",
    "long-context": "docs/sinks-retrieval-long-context.md",
    "decompose": "docs/decomposition.md",
    "probe": "docs/probes-geometry.md",
    "geometry": "docs/probes-geometry.md",
    "heads": "docs/heads.md",
    "sinks": "docs/sinks-retrieval-long-context.md",
    "retrieval": "docs/sinks-retrieval-long-context.md",
    "atlas": "docs/atlas.md",
    "zoo": "docs/zoo.md",
    "conform": "docs/conform.md",
}
DOCS_SITE = "the site, with search and the API reference: `mkdocs serve` in a clone (bash .ci/setup --docs)"


def docs_epilog(page: str) -> str:
    """The line every --help ends with: where the command's documentation is."""
    return f"Docs: {page} in posprobe's source tree; {DOCS_SITE}."


def build_parser() -> argparse.ArgumentParser:
    """The full argparse tree (cheap: command modules defer their heavy imports)."""
    parser = argparse.ArgumentParser(
        prog="posprobe",
        description="Mechanistic analysis of positional behaviour in trained transformers.",
        epilog=docs_epilog("docs/index.md"),
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(f"posprobe.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"posprobe.cli.{module}":
                raise
            continue  # a subcommand not built in this checkout
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, epilog=docs_epilog(DOCS_PAGES[name]))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
        for leaf in _leaf_parsers(p):  # `zoo train` etc.: their own --help ends the same way
            leaf.epilog = leaf.epilog or docs_epilog(DOCS_PAGES[name])
    for leaf in _leaf_parsers(parser):
        leaf.add_argument("--threads", type=int, default=None, metavar="N",
                          help="torch compute threads (default: torch's, one per core); on a machine other jobs "
                               "keep busy, 1 runs several times faster (docs/getting-started.md, 'Threads')")
    return parser


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    # The parsers that take a command's own flags (`zoo train`, not `zoo`), so --threads goes where the flags go.
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for a in subs for child in dict.fromkeys(a.choices.values()) for leaf in _leaf_parsers(child)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code (2 for user errors, with one clear message)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    try:
        if getattr(args, "no_progress", False):  # also transformers' "Loading weights" bar (read at its import)
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
            if "transformers" in sys.modules:
                sys.modules["transformers"].utils.logging.disable_progress_bar()
        from posprobe.cli.threads import set_threads

        set_threads(getattr(args, "threads", None))
        if getattr(args, "device", None) is not None:  # before any weights load: a device torch lacks, or a typo
            from posprobe.cli.args import resolve_device

            args.device = resolve_device(args.device)
        if getattr(args, "figures", None):  # a bad format fails before any work
            from posprobe.report.export import parse_formats

            args.figures = parse_formats(args.figures)
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(interrupt_message(args), file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, NotImplementedError, OSError) as e:
        if args.debug or os.environ.get("POSPROBE_DEBUG"):
            raise
        print(f"posprobe {args.command}: error: {e}", file=sys.stderr)
        return 2


def interrupt_message(args: argparse.Namespace) -> str:
    """The line printed on Ctrl-C: on a line of its own (a progress bar may hold the cursor mid-line), saying
    whether and how a rerun resumes."""
    out = getattr(args, "out", None)
    if hasattr(args, "fresh") and out:
        from posprobe.report.checkpoint import work_folder_for

        how = (f"the work done so far is kept in {work_folder_for(out)}: rerun the same command to resume "
               "(--fresh starts over)")
    else:
        how = "nothing was written; rerun the command to start again"
    return f"\nposprobe {args.command}: interrupted; {how}"


if __name__ == "__main__":
    raise SystemExit(main())
