from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from posprobe.analyses.configs import ShiftConfig
    from posprobe.backend.peek import PeekedFacts

HELP = ("Start every sentence at position k (no prior context) and measure how minimal-pair accuracy "
        "(BLiMP or built-in pairs) and perplexity change with k (Sinha et al. 2022).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import ShiftConfig
    from posprobe.cli.args import add_config_arguments, add_model_arguments, add_output_arguments, add_resume_arguments

    add_model_arguments(p)
    p.add_argument("--blimp", metavar="DIR", help="folder of official BLiMP .jsonl files, or 'hub' to download "
                                                  "(default: posprobe's built-in template pairs, no download)")
    p.add_argument("--paradigm", nargs="+", help="BLiMP paradigms (file names / UIDs) to use")
    p.add_argument("--field", nargs="+", help="BLiMP fields to use (morphology, syntax, semantics, ...)")
    p.add_argument(
        "--max-pairs", type=int, default=None, help="pairs per paradigm (seeded sample; built-in default 50)"
    )
    p.add_argument("--no-pairs", action="store_true", help="score only --text")
    p.add_argument("--text", metavar="PATH", help="text file for perplexity (WikiText is detokenised automatically)")
    p.add_argument("--backend", choices=["auto", "hf", "tl"], default="auto",
                   help="hf: native position_ids (fast; needs weights on disk); tl: TransformerLens hooks")
    add_config_arguments(p, ShiftConfig)
    add_output_arguments(p, required=False)
    add_resume_arguments(p)


def _pairs(args: argparse.Namespace, seed: int):
    from posprobe.data import BUILTIN_SOURCE, builtin_pairs, load_blimp

    if args.no_pairs:
        return None, None
    if args.blimp is None:
        if args.paradigm or args.field:
            raise ValueError("--paradigm/--field select BLiMP data; give --blimp DIR")
        return builtin_pairs(max_pairs=args.max_pairs or 50, seed=seed), BUILTIN_SOURCE
    if args.blimp == "hub":
        from posprobe.data.blimp_hub import download_blimp

        folder = download_blimp()
    else:
        folder = args.blimp
    pairs = load_blimp(folder, paradigms=args.paradigm, fields=args.field, max_pairs=args.max_pairs, seed=seed)
    return pairs, f"blimp:{folder}"


def _check_model(facts: PeekedFacts | None, args: argparse.Namespace, cfg: ShiftConfig) -> None:
    """What the spec alone can rule out: the wrong kind of positions, or a k past the context.

    Only a lower bound on each item's length is known here (one token; a text window's --window), so
    the exact check (k + the longest tokenised sentence) still runs after loading.
    """
    from posprobe.backend.families import control
    from posprobe.backend.peek import WrongModelKind

    if facts is None or not facts.known_kind:
        return
    if control(facts.positional_kind) is None:
        raise WrongModelKind(f"shift-test needs learned, sinusoidal, rotary or ALiBi positions, but {facts.name} uses "
                             f"{facts.positional_kind} positions")
    if args.backend == "hf" and facts.is_tiny:
        raise ValueError(f"{facts.name} has no Hugging Face weights on disk; use --backend tl or auto")
    ctx = facts.context_length
    if ctx is None or (control(facts.positional_kind) != "position ids" and cfg.allow_beyond_context):
        return
    kmax = max(cfg.ks)
    if args.text:
        shortest, rest = cfg.window, (f"{ctx - cfg.window} (the context minus --window {cfg.window}; one less "
                                       "with a prefix token)")
    else:
        shortest, rest = 1, f"{ctx} minus the longest sentence's length in tokens (at most {ctx - 1})"
    if kmax + shortest > ctx:
        hint = "; --allow-beyond-context lets a RoPE model extrapolate" if facts.is_rotary else ""
        raise ValueError(f"k={kmax} does not fit in the context of {facts.name} ({ctx} positions, "
                         f"{facts.positional_kind}): the largest allowed k is {rest}{hint}")


#: Offline, no learned-position weights install from a registry (no GPT-2 anywhere): the zoo makes one.
OFFLINE_LEARNED_HINT = ("A learned-position model to shift offline: train the zoo's learned member (a few minutes on "
                        "2 cores) with `posprobe zoo train --member learned --out zoo`, then "
                        "`posprobe shift-test zoo/learned-s0 --k 64`.")


def run(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import ShiftConfig
    from posprobe.cli.args import config_from_args
    from posprobe.cli.checks import check_at_least, check_out, peek_model, read_text_early

    # Validation before torch is imported (analyses.shift imports it): bad input fails in about a second.
    bad_k = [k for k in (args.ks or []) if k < 0]
    if bad_k:
        raise ValueError(f"k must be a whole number >= 0; got {bad_k}")
    check_at_least(args, 1, "batch_size", "max_windows", "max_pairs")
    check_at_least(args, 2, "window")
    check_out(args.out)
    cfg = config_from_args(ShiftConfig, args, progress=not args.no_progress)
    cfg.all_ks()
    _check_model(peek_model(args), args, cfg)
    pairs, source = _pairs(args, cfg.seed)
    text = read_text_early(args.text)
    if pairs is None and text is None:
        raise ValueError("Nothing to score: --no-pairs needs --text")

    from posprobe.analyses.shift import run_shift_test
    from posprobe.backend.sources import HubUnreachableError
    from posprobe.core import distributed
    from posprobe.report.checkpoint import discard_work_folder, work_folder_for
    from posprobe.report.shift import console_table

    # With --out, blocks of scored pairs and text windows are kept in <out>.work: a rerun resumes from there.
    work = work_folder_for(args.out) if args.out else None
    try:
        result = run_shift_test(args.model, pairs, text=text, config=cfg, data_source=source, backend=args.backend,
                                device=distributed.local_device(args.device), dtype=args.dtype, work=work,
                                fresh=args.fresh)
    except HubUnreachableError as e:
        raise HubUnreachableError(f"{e} {OFFLINE_LEARNED_HINT}") from None
    if not distributed.is_writer():  # under torchrun every rank holds the merged result; rank 0 writes it
        return 0
    model = result.meta["model"]
    print(f"shift test: {model['name']} ({model['positional_kind']}), data: {source or args.text}")
    print(console_table(result))
    if args.out:
        paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
        discard_work_folder(work)
        print(f"wrote {paths['report']} and {len(paths) - 1} other files")
    return 0
