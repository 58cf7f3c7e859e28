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
    from posprobe.data import read_text
    from posprobe.analyses.decompose_report import DecomposeConfig, decompose_report
    from posprobe.backend.loading import load_model

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if args.max_windows < 1:
        raise ValueError("--max-windows must be >= 1")
    text = read_text(args.text) if args.text else None
    config = DecomposeConfig(layer=args.layer, method=args.method, text=text, sentence=args.sentence,
                             head=args.head, max_windows=args.max_windows)
    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx,
                       process_weights=args.process_weights)
    result, figures, summary_html = decompose_report(model, config)
    result.meta["corpus_path"] = args.text
    paths = result.save(out, name="decompose", figures=figures, summary_html=summary_html,
                        title=f"Score decomposition: {result.meta['model']['name']} layer {args.layer}")
    print(f"Wrote {paths['report']} (max |terms - scores| = {result.meta['max_abs_error']:.2e})")
    return 0
