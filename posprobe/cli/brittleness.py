"""`posprobe brittleness`: loss vs Gaussian noise on the key positions of near or far (query, key) pairs."""

from __future__ import annotations

import argparse

HELP = ("Loss (nats/token) vs Gaussian noise (sigma, tokens) on the key positions of only the pairs in a distance "
        "bucket (near:K = the K nearest earlier keys, far:D = keys more than D back), one curve per bucket, on the "
        "plain Hugging Face RoPE model.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import BrittlenessConfig
    from posprobe.cli.args import add_config_arguments, add_model_arguments, add_output_arguments, add_text_argument

    add_model_arguments(p)
    add_text_argument(p)
    add_config_arguments(p, BrittlenessConfig)
    add_output_arguments(p, required=True)


def run(args: argparse.Namespace) -> int:
    import sys

    from posprobe.analyses.configs import BrittlenessConfig, check_length
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    # Validation before torch is imported: bad input fails in about a second.
    if args.n_ctx is not None:
        raise ValueError("--n-ctx does not apply to brittleness (the model runs at full length); a --window past the "
                         "model's trained context is refused")
    config = config_from_args(BrittlenessConfig, args, progress=not args.no_progress)
    check_length(config.window, config.buckets, what="--window")
    checks.check_out(args.out)
    early = checks.peek_model(args)
    checks.require_rotary(early, "brittleness")
    checks.check_window(early, args, config.window)
    text = checks.read_text_early(args.text, config.window)

    from posprobe.analyses.brittleness import run_brittleness
    from posprobe.backend.loading import load_hf_model

    print(f"loading {args.model} ...", file=sys.stderr)
    model, tokenizer = load_hf_model(args.model, dtype=args.dtype, device=args.device)
    result = run_brittleness(model, text, config, tokenizer=tokenizer, source=args.text)
    s = result.tables["brittleness_summary"]
    grid = s.pivot_table(index="bucket", columns="sigma", values="delta_nll", sort=False)
    grid.columns = [f"sigma={c:g}" for c in grid.columns]
    base = float(s[s.sigma == 0].nll.mean())
    n, lengths = result.meta["data"]["n_items"], result.meta["window_lengths"]
    print(f"{n} window(s) of {', '.join(map(str, lengths))} tokens; loss at sigma 0: {base:.4f} nats/token")
    print("loss increase over sigma 0 (nats/token), rows bucket, columns noise sigma (tokens):")
    print(grid.to_string(float_format=lambda v: f"{v:.4f}"))
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    print(f"wrote {paths['report']}")
    return 0
