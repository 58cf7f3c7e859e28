from __future__ import annotations

import argparse

HELP = "Per-frequency RoPE usage per head (band norms, score shares, rel-pos profiles, ablations) as an HTML report."

def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--text", default=None, help="UTF-8 text file (WikiText auto-detokenised); default: a built-in text")
    p.add_argument("--out", required=True, help="output directory (report.html, *.parquet, *.csv, meta.json)")
    p.add_argument("--window", type=int, default=128, help="tokens per window incl. BOS (default 128)")
    p.add_argument("--max-windows", type=int, default=8, help="number of windows (default 8)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--queries", type=int, default=64,
                   help="score statistics from the last N query positions of each window (0: all; default 64)")
    p.add_argument("--ablate", action=argparse.BooleanOptionalAction, default=True,
                   help="run band ablations (model-wide p sweep + per-head) and report loss changes")
    p.add_argument("--ablate-windows", type=int, default=4, help="windows used for ablations (default 4)")
    p.add_argument("--top-heads", type=int, default=6, help="heads given their own report section")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from posprobe.cli import checks

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 0, "queries")
    checks.check_at_least(args, 1, "window", "max_windows", "batch_size", "ablate_windows", "top_heads")
    checks.check_out(args.out)
    early = checks.peek_model(args)
    checks.require_rotary(early, "freq-report")
    checks.check_window(early, args, args.window)
    text = checks.read_text_early(args.text)  # None: the built-in text

    from posprobe.analyses.frequency import FrequencyConfig, run_frequency
    from posprobe.backend.loading import load_model

    config = FrequencyConfig(window=args.window, max_windows=args.max_windows, batch_size=args.batch_size,
                             queries=args.queries or None, ablate=args.ablate, ablate_windows=args.ablate_windows,
                             top_heads=args.top_heads, progress=not args.no_progress)
    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    result = run_frequency(model, text, config, source=args.text)
    paths = result.save(args.out)
    print(f"wrote {len(paths)} files to {args.out} (report: {paths['report']})")
    return 0
