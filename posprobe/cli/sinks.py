"""`posprobe sinks`: how many heads sink on the first token (Gu et al. 2025), and what sets that token apart."""

from __future__ import annotations

import argparse

HELP = ("Attention sinks: the share of heads whose attention sinks on the first token (Gu et al. 2025 Sink_1^eps, "
        "random tokens and text), with the first token's key/value norms and query cosines per head.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import SinksConfig
    from posprobe.cli.args import add_analysis_arguments

    add_analysis_arguments(p, SinksConfig)


def run(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import SinksConfig
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_out(args.out)
    config = config_from_args(SinksConfig, args, progress=not args.no_progress)
    early = checks.peek_model(args)
    checks.check_window(early, args, config.length, "--length")
    text = checks.read_text_early(args.text, config.length) if config.max_windows else None

    from posprobe.analyses.sinks import run_sinks
    from posprobe.backend.loading import load_model
    from posprobe.report.sinks import summary_text

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    result = run_sinks(model, text, config, source=args.text)
    print(summary_text(result))
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    print(f"wrote {paths['report']}")
    return 0
