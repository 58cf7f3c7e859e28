from __future__ import annotations

import argparse
from pathlib import Path

HELP = "Split one layer's attention scores into word/position cross terms (TUPE-style) and report per head."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import DecomposeConfig
    from posprobe.cli.args import add_config_arguments, add_model_arguments, add_output_arguments, add_text_argument

    add_model_arguments(p)
    add_text_argument(p)
    add_config_arguments(p, DecomposeConfig)
    p.add_argument(
        "--process-weights",
        action="store_true",
        help="load as TL 3's HookedTransformer with LN folding / weight centring (needs transformer-lens<4)",
    )
    add_output_arguments(p)


def run(args: argparse.Namespace) -> int:
    from posprobe.cli import checks

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 1, "max_windows")
    checks.check_at_least(args, 0, "head")
    checks.check_out(args.out)
    out = Path(args.out)
    early = checks.peek_model(args)
    checks.check_layers(early, [args.layer], "--layer")
    if args.head is not None and early is not None and early.n_heads is not None and args.head >= early.n_heads:
        raise ValueError(f"--head {args.head} out of range for {early.n_heads} heads")
    if args.method == "exact":
        if args.layer != 0:
            raise ValueError("The exact split exists at layer 0 only; use --method data for later layers")
        if early is not None and early.known_kind and "exact-layer0" not in getattr(early.family, "decompositions", ()):
            raise checks.WrongModelKind(
                f"--method exact needs position embeddings added to the token embeddings, but {early.name} uses "
                f"{early.positional_kind} positions; use --method data (the data-driven split)")
    text = checks.read_text_early(args.text)

    from posprobe.analyses.configs import DecomposeConfig
    from posprobe.cli.args import config_from_args

    config = config_from_args(DecomposeConfig, args, text=text, progress=not args.no_progress)

    from posprobe.analyses.decompose import run_decompose
    from posprobe.backend.loading import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx,
                       process_weights=args.process_weights, backend="hooked" if args.process_weights else "bridge")
    result = run_decompose(model, config, source=args.text)
    paths = result.save(out, figure_formats=args.figures)
    print(f"Wrote {paths['report']} (max |terms - scores| = {result.meta['max_abs_error']:.2e})")
    return 0
