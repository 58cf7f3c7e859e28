"""`posprobe surgery-eval`: loss vs position on long text under several position presets."""

from __future__ import annotations

import argparse

HELP = "Loss (nats/token) vs position on a text under each position/frequency preset, in one tidy table."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import SurgeryEvalConfig
    from posprobe.cli.args import add_config_arguments, add_model_arguments, add_output_arguments, add_text_argument

    add_model_arguments(p)
    add_text_argument(p, required=True)
    add_config_arguments(p, SurgeryEvalConfig)
    add_output_arguments(p, required=False)


def run(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import SurgeryEvalConfig
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 2, "window")
    checks.check_at_least(args, 1, "max_windows")
    config = config_from_args(SurgeryEvalConfig, args)
    checks.check_out(args.out)
    early = checks.peek_model(args)
    checks.require_rotary(early, "surgery-eval")
    checks.check_window(early, args, config.window)
    text = checks.read_text_early(args.text, config.window)

    from posprobe.analyses.squish import run_surgery_eval
    from posprobe.backend.loading import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    result = run_surgery_eval(model, text, config, source=args.text)
    for spec, v in result.df.groupby("preset", sort=False).value.mean().items():
        print(f"{spec:<40} mean loss {v:.4f} nats/token")
    if args.out:
        paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
        print(f"wrote {paths['report']}")
    return 0
