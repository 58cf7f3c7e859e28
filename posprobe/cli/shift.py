from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from posprobe.backend.peek import PeekedFacts

HELP = ("Start every sentence at position k (no prior context) and measure how minimal-pair accuracy "
        "(BLiMP or built-in pairs) and perplexity change with k (Sinha et al. 2022).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--k", type=int, nargs="+", default=[100], help="start positions to test (0 is always added)")
    p.add_argument("--blimp", metavar="DIR", help="folder of official BLiMP .jsonl files, or 'hub' to download "
                                                  "(default: posprobe's built-in template pairs, no download)")
    p.add_argument("--paradigm", nargs="+", help="BLiMP paradigms (file names / UIDs) to use")
    p.add_argument("--field", nargs="+", help="BLiMP fields to use (morphology, syntax, semantics, ...)")
    p.add_argument("--max-pairs", type=int, default=None, help="pairs per paradigm (seeded sample; built-in default 50)")
    p.add_argument("--no-pairs", action="store_true", help="score only --text")
    p.add_argument("--text", metavar="PATH", help="text file for perplexity (WikiText is detokenised automatically)")
    p.add_argument("--window", type=int, default=64, help="tokens per text window (default 64)")
    p.add_argument("--max-windows", type=int, default=32, help="text windows to score (default 32)")
    p.add_argument("--prefix", choices=["auto", "bos", "eot", "none"], default="auto",
                   help="token before each sentence; auto = <|endoftext|> if the vocabulary has it, else BOS")
    p.add_argument("--prefix-position", choices=["with-sentence", "zero"], default="with-sentence",
                   help="under a shift, the prefix moves to k with the sentence, or stays at position 0")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for CIs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["auto", "hf", "tl"], default="auto",
                   help="hf: native position_ids (fast; needs weights on disk); tl: TransformerLens hooks")
    p.add_argument("--allow-beyond-context", action="store_true",
                   help="RoPE only: allow positions past the trained context (extrapolation)")
    p.add_argument("--out", metavar="DIR", help="write tables (parquet/CSV), meta.json and report.html here")
    p.add_argument("--no-progress", action="store_true")


def _pairs(args: argparse.Namespace):
    from posprobe.data import BUILTIN_SOURCE, builtin_pairs, load_blimp

    if args.no_pairs:
        return None, None
    if args.blimp is None:
        if args.paradigm or args.field:
            raise ValueError("--paradigm/--field select BLiMP data; give --blimp DIR")
        return builtin_pairs(max_pairs=args.max_pairs or 50, seed=args.seed), BUILTIN_SOURCE
    if args.blimp == "hub":
        from posprobe.data.blimp_hub import download_blimp

        folder = download_blimp()
    else:
        folder = args.blimp
    pairs = load_blimp(folder, paradigms=args.paradigm, fields=args.field, max_pairs=args.max_pairs, seed=args.seed)
    return pairs, f"blimp:{folder}"


def _check_model(facts: PeekedFacts | None, args: argparse.Namespace) -> None:
    """What the spec alone can rule out: the wrong kind of positions, or a k past the context.

    Only a lower bound on each item's length is known here (one token; a text window's --window), so
    the exact check (k + the longest tokenised sentence) still runs after loading.
    """
    from posprobe.backend.peek import WrongModelKind

    if facts is None or not facts.known_kind:
        return
    if facts.positional_kind not in ("learned_absolute", "rotary"):
        raise WrongModelKind(f"shift-test needs learned or rotary positions, but {facts.name} uses "
                             f"{facts.positional_kind} positions")
    if args.backend == "hf" and facts.is_tiny:
        raise ValueError(f"{facts.name} has no Hugging Face weights on disk; use --backend tl or auto")
    ctx = facts.context_length
    if ctx is None or (facts.is_rotary and args.allow_beyond_context):
        return
    kmax = max(args.k)
    if args.text:
        shortest, rest = args.window, (f"{ctx - args.window} (the context minus --window {args.window}; one less "
                                       "with a prefix token)")
    else:
        shortest, rest = 1, f"{ctx} minus the longest sentence's length in tokens (at most {ctx - 1})"
    if kmax + shortest > ctx:
        hint = "; --allow-beyond-context lets a RoPE model extrapolate" if facts.is_rotary else ""
        raise ValueError(f"k={kmax} does not fit in the context of {facts.name} ({ctx} positions, "
                         f"{facts.positional_kind}): the largest allowed k is {rest}{hint}")


def run(args: argparse.Namespace) -> int:
    from posprobe.cli.checks import check_at_least, check_out, peek_model, read_text_early

    # Validation before torch is imported (analyses.shift imports it): bad input fails in about a second.
    bad_k = [k for k in args.k if k < 0]
    if bad_k:
        raise ValueError(f"k must be a whole number >= 0; got {bad_k}")
    check_at_least(args, 1, "batch_size", "max_windows", "max_pairs")
    check_at_least(args, 2, "window")
    check_at_least(args, 0, "bootstrap")
    check_out(args.out)
    _check_model(peek_model(args), args)
    pairs, source = _pairs(args)
    text = read_text_early(args.text)
    if pairs is None and text is None:
        raise ValueError("Nothing to score: --no-pairs needs --text")

    from posprobe.analyses.shift import ShiftConfig
    from posprobe.report.shift import console_table
    from posprobe.analyses.shift import run_shift_test

    cfg = ShiftConfig(ks=tuple(args.k), prefix=args.prefix, prefix_position=args.prefix_position,
                      batch_size=args.batch_size, n_bootstrap=args.bootstrap, seed=args.seed, window=args.window,
                      max_windows=args.max_windows, allow_beyond_context=args.allow_beyond_context,
                      progress=not args.no_progress)
    cfg.all_ks()
    result = run_shift_test(args.model, pairs, text=text, config=cfg, data_source=source, backend=args.backend,
                            device=args.device, dtype=args.dtype)
    model = result.meta["model"]
    print(f"shift test: {model['name']} ({model['positional_kind']}), data: {source or args.text}")
    print(console_table(result))
    if args.out:
        paths = result.save(args.out)
        print(f"wrote {paths['report']} and {len(paths) - 1} other files")
    return 0
