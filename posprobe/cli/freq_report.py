from __future__ import annotations

import argparse

HELP = "Per-frequency RoPE usage per head (band norms, score shares, rel-pos profiles, ablations) as an HTML report."

# Used when --text is not given, so the command runs offline with no data files.
BUILTIN_TEXT = """\
The harbour town woke slowly on winter mornings. Fishing boats came back before sunrise, and the \
market opened an hour later, when the first carts rolled down from the hills with bread, cheese and \
apples. Children walked to school along the sea wall, counting the gulls that sat on every post.

In the old library above the post office, a retired teacher kept a record of the weather. Every day \
for forty years she wrote down the temperature, the direction of the wind and the height of the tide. \
Her notebooks filled three shelves. Scientists from the university later used them to show how the \
storms had grown stronger and the winters shorter over the decades.

The town council argued for a long time about a new bridge across the river. Some people wanted it \
built of stone, like the church and the harbour wall; others said steel would be cheaper and would \
last just as long. In the end they chose a wooden footbridge, painted green, which the children \
decorated with lanterns every December.

When summer came, visitors arrived by train. They rented small rooms above the shops, swam in the cold \
water, and ate fried fish on the beach. By September they were gone again, the cafes closed their \
shutters, and the town returned to its quiet routine of boats, markets and weather notes.
"""


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


def token_rows(model, text: str, window: int, max_windows: int | None):
    """Windows of `window` tokens, each starting with the tokenizer's BOS when it has one."""
    from posprobe.data import token_windows

    if window > model.cfg.n_ctx:
        raise ValueError(f"--window {window} exceeds the model's n_ctx={model.cfg.n_ctx}")
    bos = getattr(model.tokenizer, "bos_token_id", None) if model.tokenizer is not None else None
    ids = model.to_tokens(text, prepend_bos=False, truncate=False)[0].tolist()
    rows = token_windows(ids, window - (bos is not None), max_windows=max_windows)
    return [[bos] + r for r in rows] if bos is not None else rows


def run(args: argparse.Namespace) -> int:
    from posprobe.data import read_text
    from posprobe.backend.facts import model_facts, require_rotary
    from posprobe.analyses.frequency import frequency_usage, top_heads
    from posprobe.analyses.frequency_ablation import band_ablation, head_ablations, p_sweep
    from posprobe.report.frequency import build_report, save_report
    from posprobe.backend.loading import load_model

    if args.queries < 0:
        raise ValueError("--queries must be >= 0")
    for name in ("window", "max_windows", "batch_size", "ablate_windows", "top_heads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    text = read_text(args.text) if args.text else BUILTIN_TEXT
    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    facts = model_facts(model)
    require_rotary(facts, "freq-report")
    rows = token_rows(model, text, args.window, args.max_windows)
    progress = not args.no_progress
    usage = frequency_usage(model, rows, batch_size=args.batch_size, queries=args.queries or None, progress=progress)
    top = top_heads(usage.heads, args.top_heads)
    ablation = None
    if args.ablate:
        conds = p_sweep(facts) + head_ablations(facts, top)
        ablation = band_ablation(model, rows[: args.ablate_windows], conds, batch_size=args.batch_size,
                                 progress=progress)
    meta = {**usage.meta, "command": "freq-report", "text": args.text or "<built-in>", "top_heads": top,
            "ablate_windows": min(args.ablate_windows, len(rows)) if args.ablate else 0}
    html = build_report(usage, ablation, top, f"Per-frequency RoPE usage: {facts.name}")
    paths = save_report(args.out, usage, ablation, html, meta)
    print(f"wrote {len(paths)} files to {args.out} (report: {paths['report.html']})")
    return 0
