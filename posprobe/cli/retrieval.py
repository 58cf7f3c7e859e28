"""`posprobe retrieval`: which heads copy the needle while the model answers (Wu et al. 2025), per preset, and what
masking them does to the answers."""

from __future__ import annotations

import argparse
from typing import Any

HELP = ("Retrieval heads: Wu et al.'s retrieval score per head while the model answers needle prompts, its attention "
        "on the needle and the first token, under each surgery preset; needle accuracy with the top-k heads masked "
        "vs k random heads.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import RetrievalConfig
    from posprobe.cli.args import (
        add_config_arguments,
        add_model_arguments,
        add_output_arguments,
        add_resume_arguments,
        add_text_argument,
    )

    add_model_arguments(p)
    add_text_argument(p, required=False)
    add_config_arguments(p, RetrievalConfig)
    add_output_arguments(p, required=True)
    add_resume_arguments(p)


def run(args: argparse.Namespace) -> int:
    import sys

    from posprobe.analyses.configs import RetrievalConfig
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    # Validation before torch is imported: bad input fails in about a second.
    if args.n_ctx is not None:
        raise ValueError("--n-ctx does not apply to retrieval (the model runs at full length)")
    config = config_from_args(RetrievalConfig, args, progress=not args.no_progress)
    checks.check_out(args.out)
    early = checks.peek_model(args)
    checks.require_rotary(early, "retrieval")
    if early is not None and early.n_layers and early.n_heads:
        config.check_heads(early.n_layers, early.n_heads)
    _refuse_unused(args, config)
    text = checks.read_text_early(args.text)
    if text is None:
        from posprobe.data import BUILTIN_TEXT

        text = BUILTIN_TEXT

    from posprobe.analyses.retrieval import run_retrieval
    from posprobe.backend.loading import load_hf_model
    from posprobe.report.checkpoint import discard_work_folder, work_folder_for
    from posprobe.report.retrieval import summary_text

    # Every finished answer is kept in <out>.work: a rerun of the same command resumes from there.
    work = work_folder_for(args.out)
    print(f"loading {args.model} ...", file=sys.stderr)
    model, tokenizer = load_hf_model(args.model, dtype=args.dtype, device=args.device)
    result = run_retrieval(model, text, config, tokenizer=tokenizer,
                           source=args.text or "built-in text", work=work, fresh=args.fresh)
    print(summary_text(result))
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    discard_work_folder(work)
    print(f"wrote {paths['report']}")
    return 0


def _refuse_unused(args: argparse.Namespace, config: Any) -> None:
    # An option that cannot change the result is refused rather than silently ignored.
    from posprobe.analyses.configs import RetrievalConfig
    from posprobe.cli.checks import given_flags
    from posprobe.data.needles import TASKS

    if not any(config.mask_k) and given_flags(args, RetrievalConfig, "random_draws"):
        raise ValueError("--random-draws applies only to masking: give --mask-k K > 0 or drop it")
    if config.binary_scores and given_flags(args, RetrievalConfig, "bootstrap"):
        raise ValueError(f"--bootstrap applies only to fractional scores (multi-value tasks); "
                         f"{', '.join(config.tasks)} score 0 or 1 and get Wilson intervals")
    if args.text and not any(TASKS[t].haystack == "text" for t in config.tasks):
        users = [t for t, task in TASKS.items() if task.haystack == "text"]
        raise ValueError(f"--text is read only by text-haystack tasks ({', '.join(users)}); "
                         f"{', '.join(config.tasks)} build their own haystacks")
