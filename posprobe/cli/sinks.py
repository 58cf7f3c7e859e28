"""`posprobe sinks`: how many heads sink on the first token (Gu et al. 2025), and what sets that token apart."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.cli.command import AnalysisCommand

HELP = ("Attention sinks: the share of heads whose attention sinks on the first token (Gu et al. 2025 Sink_1^eps, "
        "random tokens and text), with the first token's key/value norms and query cosines per head.")


def _checks(args: argparse.Namespace, config: Any, early: Any) -> int:
    from posprobe.cli import checks

    checks.check_window(early, args, config.length, "--length")
    return config.length


def _summary(args: argparse.Namespace, result: Any) -> None:
    from posprobe.report.sinks import summary_text

    print(summary_text(result))


COMMAND = AnalysisCommand("SinksConfig", "posprobe.analyses.sinks:run_sinks", checks=_checks, summary=_summary)
add_arguments, run = COMMAND.add_arguments, COMMAND.run
