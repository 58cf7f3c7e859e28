"""`posprobe geometry`: geometry of W_pos (learned APE) and of the positional part of the residual stream."""

from __future__ import annotations

import argparse

HELP = "PCA / cosine / sinusoid-fit geometry of W_pos and of per-position residual means."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli.args import add_model_arguments, add_text_arguments

    add_model_arguments(p)
    add_text_arguments(p)
    p.add_argument("--layers", default=None, help="comma-separated layers for the residual view (default: first, middle, last)")
    p.add_argument("--point", default="resid_post", choices=["resid_pre", "resid_mid", "resid_post"])
    p.add_argument("--skip-first", type=int, default=1, help="leave out the first N positions of the residual view "
                                                             "(BOS/CLS outliers; default 1)")
    p.add_argument("--components", type=int, default=6, help="principal components to report (default 6)")
    p.add_argument("--max-pos", type=int, default=None, help="W_pos rows to analyse (default: all)")
    p.add_argument("--out", required=True, help="output folder (report.html, geometry.parquet/.csv, meta.json)")


def run(args: argparse.Namespace) -> int:
    from posprobe.cli import checks
    from posprobe.cli.args import int_list

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 2, "window")
    checks.check_at_least(args, 1, "max_windows", "components", "max_pos")
    checks.check_at_least(args, 0, "skip_first")
    checks.check_out(args.out)
    early = checks.peek_model(args)
    checks.check_layers(early, int_list(args.layers), "--layers")
    checks.check_window(early, args, args.window)
    if args.max_pos is not None and early is not None and early.known_kind:
        # Only the W_pos view reads --max-pos, and only learned-position models have W_pos.
        if early.positional_kind not in ("learned_absolute", "shortformer"):
            raise checks.WrongModelKind(f"--max-pos selects W_pos rows, but {early.name} uses "
                                        f"{early.positional_kind} positions (no W_pos); drop --max-pos")
        checks.check_window(early, args, args.max_pos, "--max-pos")
    text = checks.read_text_early(args.text)  # None: the built-in text

    from posprobe.analyses.geometry import GeometryConfig, run_geometry
    from posprobe.backend.loading import load_model

    config = GeometryConfig(layers=int_list(args.layers), point=args.point, skip_first=args.skip_first,
                            components=args.components, max_pos=args.max_pos, window=args.window,
                            max_windows=args.max_windows)
    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    result = run_geometry(model, text, config, source=args.text)
    paths = result.save(args.out)
    print(f"wrote {paths['report']}")
    return 0
