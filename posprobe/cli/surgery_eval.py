"""`posprobe surgery-eval`: loss vs position on long text under several position presets."""

from __future__ import annotations

import argparse

HELP = "Loss (nats/token) vs position on a text under each position/frequency preset, in one tidy table."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli import add_model_arguments
    from posprobe.core.presets_help import PRESET_HELP

    add_model_arguments(p)
    p.add_argument("--preset", action="append", required=True, help=f"repeatable; {PRESET_HELP}")
    p.add_argument("--text", required=True, help="a text file (WikiText is detokenised automatically)")
    p.add_argument("--window", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--max-windows", type=int, default=4)
    p.add_argument("--out", default=None, help="directory for surgery_eval.parquet/.csv, meta.json, report.html")


def run(args: argparse.Namespace) -> int:
    from posprobe.cli import checks

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 2, "window")
    checks.check_at_least(args, 1, "max_windows")
    checks.check_presets(args.preset)
    checks.check_out(args.out)
    early = checks.peek_model(args)
    checks.require_rotary(early, "surgery-eval")
    checks.check_window(early, args, args.window)
    text = checks.read_text_early(args.text)

    from posprobe.analyses.squish import run_surgery_eval
    from posprobe.backend.loading import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    result = run_surgery_eval(model, text, args.preset, window=args.window, max_windows=args.max_windows,
                              source=args.text)
    for spec, v in result.df.groupby("preset", sort=False).value.mean().items():
        print(f"{spec:<40} mean loss {v:.4f} nats/token")
    if args.out:
        paths = result.save(args.out)
        print(f"wrote {paths['report']}")
    return 0
