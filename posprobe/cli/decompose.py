from __future__ import annotations

import argparse
from pathlib import Path

HELP = "Split one layer's attention scores into word/position cross terms (TUPE-style) and report per head."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--layer", type=int, default=0, help="layer to decompose (default 0)")
    p.add_argument("--method", default="auto", choices=["auto", "exact", "data"],
                   help="exact layer-0 split (learned positions) or data-driven split; auto picks exact when it applies")
    p.add_argument("--text", default=None, help="corpus text file for positional means (default: built-in English text)")
    p.add_argument("--sentence", default=None, help="sentence to decompose (default: the corpus's first sentence)")
    p.add_argument("--head", type=int, default=None, help="head for the heatmaps (default: most positional head)")
    p.add_argument("--max-windows", type=int, default=32, help="corpus windows for the positional mean (default 32)")
    p.add_argument("--process-weights", action="store_true", help="load with TL's LN folding / weight centring")
    p.add_argument("--out", required=True, help="output folder (report.html, decompose.parquet/.csv, meta.json)")


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
        if early is not None and early.known_kind and early.positional_kind != "learned_absolute":
            raise checks.WrongModelKind(
                f"--method exact needs position embeddings added to the token embeddings, but {early.name} uses "
                f"{early.positional_kind} positions; use --method data (the data-driven split)")
    text = checks.read_text_early(args.text)

    from posprobe.analyses.decompose import DecomposeConfig, run_decompose
    from posprobe.backend.loading import load_model

    config = DecomposeConfig(layer=args.layer, method=args.method, text=text, sentence=args.sentence,
                             head=args.head, max_windows=args.max_windows)
    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx,
                       process_weights=args.process_weights)
    result = run_decompose(model, config, source=args.text)
    paths = result.save(out)
    print(f"Wrote {paths['report']} (max |terms - scores| = {result.meta['max_abs_error']:.2e})")
    return 0
