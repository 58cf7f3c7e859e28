"""`posprobe retrieval`: which heads copy the needle while the model answers (Wu et al. 2025), per preset, and what
masking them does to the answers."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.cli.command import AnalysisCommand

HELP = ("Retrieval heads: Wu et al.'s retrieval score per head while the model answers needle prompts, its attention "
        "on the needle and the first token, under each surgery preset; needle accuracy with the top-k heads masked "
        "vs k random heads.")


def _checks(args: argparse.Namespace, config: Any, early: Any) -> None:
    from posprobe.cli import checks

    checks.require_rotary(early, "retrieval")
    if early is not None and early.n_layers and early.n_heads:
        config.check_heads(early.n_layers, early.n_heads)
    _refuse_unused(args, config)


def _summary(args: argparse.Namespace, result: Any) -> None:
    from posprobe.report.retrieval import summary_text

    print(summary_text(result))


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


COMMAND = AnalysisCommand("RetrievalConfig", "posprobe.analyses.retrieval:run_retrieval", loader="hf",
                          needs_text=True, resume=True, checks=_checks, summary=_summary,
                          no_n_ctx="--n-ctx does not apply to retrieval (the model runs at full length)")
add_arguments, run = COMMAND.add_arguments, COMMAND.run
