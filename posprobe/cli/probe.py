"""`posprobe probe`: linear probes for absolute position at every layer's residual stream."""

from __future__ import annotations

import argparse
import html

HELP = "Probe absolute position from the residual stream per layer (ridge MAE, bucket accuracy, shuffled control)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli import add_model_arguments

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


def add_text_arguments(p: argparse.ArgumentParser) -> None:
    """--text/--window/--max-windows: where the token rows come from (shared with `geometry`)."""
    p.add_argument("--text", default=None, help="UTF-8 text file (WikiText auto-detokenised); default: a short built-in text")
    p.add_argument("--window", type=int, default=64, help="tokens per row, incl. BOS/CLS if the tokenizer has one (default 64)")
    p.add_argument("--max-windows", type=int, default=32, help="at most this many rows (default 32)")


def int_list(text: str | None) -> tuple[int, ...] | None:
    """'0,3,5' -> (0, 3, 5); None stays None. Raises ValueError with the offending text."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def load_rows(model, text_path: str | None, window: int, max_windows: int | None) -> list[list[int]]:
    """Token rows from --text (or the built-in text) for `model`."""
    from posprobe.data import read_text
    from posprobe.analyses.probes import BUILTIN_TEXT, text_rows

    text = read_text(text_path) if text_path else BUILTIN_TEXT
    return text_rows(model, text, window, max_windows)


def run(args: argparse.Namespace) -> int:
    from posprobe.backend.loading import load_model
    from posprobe.analyses.probes import ProbeConfig, position_probes, probe_figures, summarize

    # Validate cheap arguments before the (slow) model load.
    cfg = ProbeConfig(points=tuple(p.strip() for p in args.points.split(",") if p.strip()), layers=int_list(args.layers),
                      n_buckets=args.n_buckets, n_splits=args.folds, max_tokens=args.max_tokens,
                      skip_first=args.skip_first, classifier=args.classifier, seed=args.seed)
    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    rows = load_rows(model, args.text, args.window, args.max_windows)
    result = position_probes(model, rows, cfg)
    result.meta["text"] = args.text or "built-in"
    s = summarize(result.df)
    table = s.pivot_table(index=["point", "layer"], columns=["metric", "term"], values=["mean", "std"]).round(3)
    summary = (f"<p>{len(rows)} rows of {len(rows[0])} tokens from {html.escape(args.text or 'the built-in text')}; "
               f"{result.meta['n_tokens']} sampled tokens; {cfg.n_splits}-fold GroupKFold by row. Control: training "
               "positions shuffled within each row. Chance: predict the training mean / majority bucket.</p>"
               + table.to_html(classes="pp-table", border=0))
    paths = result.save(args.out, name="probes", figures=probe_figures(result.df),
                        title=f"Position probes: {result.meta['model']['name']}", summary_html=summary)
    print(f"wrote {paths['report']}")
    return 0
