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
    from posprobe.data import read_text, token_windows
    from posprobe.backend.loading import load_model
    from posprobe.analyses.squish import loss_by_position, surgery_eval_report
    from posprobe.core.surgery import preset_plan

    if args.window < 2:
        raise ValueError(f"--window must be >= 2; got {args.window}")
    text = read_text(args.text)
    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    if args.window > model.cfg.n_ctx:
        raise ValueError(f"--window {args.window} exceeds the model's context n_ctx={model.cfg.n_ctx} (raise --n-ctx)")
    for spec in args.preset:  # every preset is checked before any forward pass
        preset_plan(spec, model, 2)
    ids = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = token_windows(ids, args.window, max_windows=args.max_windows)
    df = loss_by_position(model, windows, args.preset)
    summary = df.groupby("preset", sort=False).value.mean()
    for spec, v in summary.items():
        print(f"{spec:<40} mean loss {v:.4f} nats/token")
    if args.out:
        paths = surgery_eval_report(df, {"text": str(args.text), "window": args.window, "presets": args.preset,
                                         "n_windows": len(windows)}, model, args.out)
        print(f"wrote {paths['report']}")
    return 0
