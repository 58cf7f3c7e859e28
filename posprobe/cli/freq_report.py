from __future__ import annotations

import argparse

HELP = "Per-frequency RoPE usage per head (band norms, score shares, rel-pos profiles, ablations) as an HTML report."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import FrequencyConfig
    from posprobe.cli.args import add_analysis_arguments, add_resume_arguments

    add_analysis_arguments(p, FrequencyConfig)
    add_resume_arguments(p)


def run(args: argparse.Namespace) -> int:
    from posprobe.cli import checks

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 0, "queries")
    checks.check_at_least(args, 1, "window", "max_windows", "batch_size", "ablate_windows", "top_heads")
    checks.check_out(args.out)
    early = checks.peek_model(args)
    checks.require_rotary(early, "freq-report")
    checks.check_window(early, args, args.window)
    text = checks.read_text_early(args.text, args.window)  # None: the built-in text

    from posprobe.analyses.configs import FrequencyConfig
    from posprobe.cli.args import config_from_args

    config = config_from_args(FrequencyConfig, args, progress=not args.no_progress)
    checks.check_layers(early, config.layers, "--layers")

    from posprobe.analyses.frequency import run_frequency
    from posprobe.backend.loading import load_model
    from posprobe.core import distributed

    model = load_model(args.model, device=distributed.local_device(args.device), dtype=args.dtype, n_ctx=args.n_ctx)
    from posprobe.report.checkpoint import discard_work_folder, work_folder_for

    # The corpus pass keeps its sums in <out>.work as it goes: a rerun of the same command resumes from there.
    work = work_folder_for(args.out)
    result = run_frequency(model, text, config, source=args.text, work=work, fresh=args.fresh)
    if not distributed.is_writer():  # under torchrun every rank holds the merged result; rank 0 writes it
        return 0
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    discard_work_folder(work)
    print(f"wrote {len(paths)} files to {args.out} (report: {paths['report']})")
    return 0
