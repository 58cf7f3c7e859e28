"""`posprobe probe`: linear probes for absolute position at every layer's residual stream."""

from __future__ import annotations

import argparse

HELP = "Probe absolute position from the residual stream per layer (ridge MAE, bucket accuracy, shuffled control)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli.args import add_model_arguments, add_text_arguments

    add_model_arguments(p)
    add_text_arguments(p)
    p.add_argument("--points", default="resid_pre,resid_mid,resid_post", help="comma-separated residual points")
    p.add_argument("--layers", default=None, help="comma-separated layers (default: all)")
    p.add_argument("--n-buckets", type=int, default=8, help="position buckets for the classifier (default 8)")
    p.add_argument("--folds", type=int, default=4, help="GroupKFold splits over rows (default 4)")
    p.add_argument("--max-tokens", type=int, default=2000, help="tokens sampled (seeded) for the probes (default 2000)")
    p.add_argument("--skip-first", type=int, default=0, help="leave out the first N positions (e.g. 1 for BOS)")
    p.add_argument("--classifier", default="ridge", choices=["ridge", "logistic"], help="bucket classifier (default ridge)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output folder (report.html, probes.parquet/.csv, meta.json)")


def run(args: argparse.Namespace) -> int:
    from posprobe.cli import checks
    from posprobe.cli.args import int_list

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 2, "window")
    checks.check_at_least(args, 1, "max_windows")
    checks.check_at_least(args, 0, "skip_first")
    checks.check_out(args.out)
    early = checks.peek_model(args)
    checks.check_layers(early, int_list(args.layers), "--layers")
    checks.check_window(early, args, args.window)
    text = checks.read_text_early(args.text)  # None: the built-in text

    from posprobe.backend.loading import load_model
    from posprobe.analyses.probes import ProbeConfig, run_probes

    cfg = ProbeConfig(points=tuple(p.strip() for p in args.points.split(",") if p.strip()), layers=int_list(args.layers),
                      n_buckets=args.n_buckets, n_splits=args.folds, max_tokens=args.max_tokens,
                      skip_first=args.skip_first, classifier=args.classifier, seed=args.seed)
    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    result = run_probes(model, text, cfg, window=args.window, max_windows=args.max_windows, source=args.text)
    paths = result.save(args.out)
    print(f"wrote {paths['report']}")
    return 0
