"""One skeleton for the analysis commands: flags from the analysis's Config, every check before torch loads (the
output folder, the config, the model's spec, the text), then load, run, print the summary, save. A command module
declares an `AnalysisCommand` with what differs and exposes its `add_arguments` / `run`.

argparse and dataclasses only at import: `posprobe --help` stays instant."""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass, fields
from typing import Any, Callable, Literal


@dataclass(frozen=True)
class AnalysisCommand:
    """What one analysis command is made of."""

    #: The analysis's Config class name in `posprobe.analyses.configs` (its fields become the flags).
    config: str
    #: "module:function" of the analysis, called as function(model, text, config, source=..., **extras).
    analysis: str
    #: "tl": a TransformerLens model (`load_model`); "hf": the plain Hugging Face model and its tokenizer.
    loader: Literal["tl", "hf"] = "tl"
    #: Whether --text is "required" or "optional" (None: the analysis's built-in text).
    text: Literal["optional", "required"] = "optional"
    #: Whether the analysis must have a text (the built-in one where --text is not given).
    needs_text: bool = False
    out_required: bool = True
    #: Whether the run keeps its work in <out>.work (resume on rerun, --fresh to start over).
    resume: bool = False
    #: Whether the run may be launched under torchrun (each rank its local device; rank 0 writes).
    distributed: bool = False
    #: Flag minimums checked before anything else: ((minimum, (config field, ...)), ...).
    at_least: tuple[tuple[int, tuple[str, ...]], ...] = ()
    #: Why --n-ctx does not apply (refused where given), None where it does.
    no_n_ctx: str | None = None
    #: Checks of the command's own, after the config and the peek: (args, config, early facts) -> the window the
    #: text must fill (tokens), or None.
    checks: Callable[[argparse.Namespace, Any, Any], int | None] | None = None
    #: Prints the result's headline to stdout: (args, result).
    summary: Callable[[argparse.Namespace, Any], None] | None = None

    def config_class(self) -> type:
        """The Config dataclass."""
        return getattr(importlib.import_module("posprobe.analyses.configs"), self.config)

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """MODEL, --text, the Config's flags, --out / figures / csv, and resume flags where the run keeps work."""
        from posprobe.cli.args import (
            add_config_arguments,
            add_model_arguments,
            add_output_arguments,
            add_resume_arguments,
            add_text_argument,
        )

        add_model_arguments(p)
        add_text_argument(p, required=self.text == "required")
        add_config_arguments(p, self.config_class())
        add_output_arguments(p, required=self.out_required)
        if self.resume:
            add_resume_arguments(p)

    def run(self, args: argparse.Namespace) -> int:
        """Validate everything before torch is imported (bad input fails in about a second), then load the model,
        run the analysis, print its summary and save its outputs; returns the exit code."""
        from posprobe.cli import checks
        from posprobe.cli.args import config_from_args

        for minimum, names in self.at_least:
            checks.check_at_least(args, minimum, *names)
        if self.no_n_ctx is not None and args.n_ctx is not None:
            raise ValueError(self.no_n_ctx)
        checks.check_out(args.out)
        cls = self.config_class()
        shown = {"progress": not args.no_progress} if "progress" in {f.name for f in fields(cls)} else {}
        config = config_from_args(cls, args, **shown)
        early = checks.peek_model(args)
        window = self.checks(args, config, early) if self.checks is not None else None
        text = checks.read_text_early(args.text, window)
        if text is None and self.needs_text:
            from posprobe.data import BUILTIN_TEXT

            text = BUILTIN_TEXT

        module, function = self.analysis.split(":")
        run_analysis = getattr(importlib.import_module(module), function)
        extras: dict[str, Any] = {}
        model = self._load(args, extras)
        work = None
        if self.resume:
            from posprobe.report.checkpoint import work_folder_for

            work = work_folder_for(args.out)  # every finished unit is kept there: a rerun resumes
            extras.update(work=work, fresh=args.fresh)
        source = args.text if args.text or not self.needs_text else "built-in text"
        result = run_analysis(model, text, config, source=source, **extras)
        if self.distributed:
            from posprobe.core import distributed

            if not distributed.is_writer():  # under torchrun every rank holds the merged result; rank 0 writes it
                return 0
        if self.summary is not None:
            self.summary(args, result)
        if args.out:
            paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
            if work is not None:
                from posprobe.report.checkpoint import discard_work_folder

                discard_work_folder(work)
            print(f"wrote {paths['report']}")
        return 0

    def _load(self, args: argparse.Namespace, extras: dict[str, Any]) -> Any:
        from posprobe.cli.threads import warn_if_busy

        warn_if_busy()  # inputs are checked: the heavy work starts here
        if self.loader == "hf":
            from posprobe.backend.loading import load_hf_model

            print(f"loading {args.model} ...", file=sys.stderr)
            model, extras["tokenizer"] = load_hf_model(args.model, dtype=args.dtype, device=args.device)
            return model
        from posprobe.backend.loading import load_model

        device = args.device
        if self.distributed:
            from posprobe.core import distributed

            device = distributed.local_device(device)
        return load_model(args.model, device=device, dtype=args.dtype, n_ctx=args.n_ctx)
