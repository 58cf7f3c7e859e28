"""`posprobe heads`: which heads are positional, and how (signatures and classes per head)."""

from __future__ import annotations

import argparse

HELP = ("Head signatures: attention to self, i-1 and the first token, attention sinks, offset profiles, "
        "entropy, induction and relative-position fit per head, with classes by written-out rules.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import HeadsConfig
    from posprobe.cli.args import add_analysis_arguments, add_resume_arguments

    add_analysis_arguments(p, HeadsConfig)
    add_resume_arguments(p)


def run(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import HeadsConfig
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_out(args.out)
    config = config_from_args(HeadsConfig, args, progress=not args.no_progress)
    early = checks.peek_model(args)
    checks.check_window(early, args, config.window)
    checks.check_window(early, args, 1 + 2 * config.induction_len, "--induction-len (1 + 2 x)")
    text = checks.read_text_early(args.text, config.window)  # None: the built-in text

    from posprobe.analyses.heads import run_heads
    from posprobe.backend.loading import load_model
    from posprobe.core import distributed

    model = load_model(args.model, device=distributed.local_device(args.device), dtype=args.dtype, n_ctx=args.n_ctx)
    from posprobe.report.checkpoint import discard_work_folder, work_folder_for

    # The corpus pass keeps its sums in <out>.work as it goes: a rerun of the same command resumes from there.
    work = work_folder_for(args.out)
    result = run_heads(model, text, config, source=args.text, work=work, fresh=args.fresh)
    if not distributed.is_writer():  # under torchrun every rank holds the merged result; rank 0 writes it
        return 0
    from posprobe.report.heads import summary_text

    print(summary_text(result))  # the sentence the atlas prints for this section, from the same numbers
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    discard_work_folder(work)
    print(f"wrote {paths['report']}")
    return 0
