"""`posprobe geometry`: geometry of W_pos (learned APE) and of the positional part of the residual stream."""

from __future__ import annotations

import argparse

HELP = "PCA / cosine / sinusoid-fit geometry of W_pos and of per-position residual means."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import GeometryConfig
    from posprobe.cli.args import add_analysis_arguments

    add_analysis_arguments(p, GeometryConfig)


def run(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import GeometryConfig
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 2, "window")
    checks.check_at_least(args, 1, "max_windows", "components", "max_pos")
    checks.check_at_least(args, 0, "skip_first")
    checks.check_out(args.out)
    config = config_from_args(GeometryConfig, args, progress=not args.no_progress)
    early = checks.peek_model(args)
    checks.check_layers(early, config.layers, "--layers")
    checks.check_window(early, args, args.window)
    if args.max_pos is not None and early is not None and early.known_kind:
        # Only the W_pos view reads --max-pos, and only learned-position models have W_pos.
        if early.positional_kind not in ("learned_absolute", "shortformer"):
            raise checks.WrongModelKind(f"--max-pos selects W_pos rows, but {early.name} uses "
                                        f"{early.positional_kind} positions (no W_pos); drop --max-pos")
        checks.check_window(early, args, args.max_pos, "--max-pos")
    text = checks.read_text_early(args.text, args.window)  # None: the built-in text

    from posprobe.analyses.geometry import run_geometry
    from posprobe.backend.loading import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    result = run_geometry(model, text, config, source=args.text)
    from posprobe.report.geometry import overlap_text

    sentence = overlap_text(result)
    if sentence:
        print(sentence)
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    print(f"wrote {paths['report']}")
    return 0
