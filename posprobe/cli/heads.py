"""`posprobe heads`: which heads are positional, and how (signatures and classes per head)."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.cli.command import AnalysisCommand

HELP = ("Head signatures: attention to self, i-1 and the first token, attention sinks, offset profiles, "
        "entropy, induction and relative-position fit per head, with classes by written-out rules.")


def _checks(args: argparse.Namespace, config: Any, early: Any) -> int:
    from posprobe.cli import checks

    checks.check_window(early, args, config.window)
    checks.check_window(early, args, 1 + 2 * config.induction_len, "--induction-len (1 + 2 x)")
    return config.window


def _summary(args: argparse.Namespace, result: Any) -> None:
    from posprobe.report.heads import summary_text

    print(summary_text(result))  # the sentence the atlas prints for this section, from the same numbers


COMMAND = AnalysisCommand("HeadsConfig", "posprobe.analyses.heads:run_heads", resume=True, distributed=True,
                          checks=_checks, summary=_summary)
add_arguments, run = COMMAND.add_arguments, COMMAND.run
