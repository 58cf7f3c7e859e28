"""`posprobe probe`: linear probes for absolute position at every layer's residual stream."""

from __future__ import annotations

import argparse

HELP = "Probe absolute position from the residual stream per layer (ridge MAE, bucket accuracy, shuffled control)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import ProbeConfig
    from posprobe.cli.args import add_analysis_arguments, add_resume_arguments

    add_analysis_arguments(p, ProbeConfig)
    add_resume_arguments(p)


def run(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import ProbeConfig
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 2, "window")
    checks.check_at_least(args, 1, "max_windows")
    checks.check_at_least(args, 0, "skip_first")
    checks.check_out(args.out)
    config = config_from_args(ProbeConfig, args, progress=not args.no_progress)
    early = checks.peek_model(args)
    checks.check_layers(early, config.layers, "--layers")
    checks.check_window(early, args, config.window)
    text = checks.read_text_early(args.text, config.window)  # None: the built-in text

    from posprobe.analyses.probes import run_probes
    from posprobe.backend.loading import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    from posprobe.report.checkpoint import discard_work_folder, work_folder_for

    # Each (point, layer)'s fold scores are kept in <out>.work as they complete: a rerun resumes from there.
    work = work_folder_for(args.out)
    result = run_probes(model, text, config, source=args.text, work=work, fresh=args.fresh)
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    discard_work_folder(work)
    print(f"wrote {paths['report']}")
    return 0
