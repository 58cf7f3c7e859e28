"""`posprobe freq-report`: how much each head uses each RoPE frequency band."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.cli.command import AnalysisCommand

HELP = "Per-frequency RoPE usage per head (band norms, score shares, rel-pos profiles, ablations) as an HTML report."


def _checks(args: argparse.Namespace, config: Any, early: Any) -> int:
    from posprobe.cli import checks

    checks.require_rotary(early, "freq-report")
    checks.check_window(early, args, config.window)
    checks.check_layers(early, config.layers, "--layers")
    return config.window


def _summary(args: argparse.Namespace, result: Any) -> None:
    from posprobe.report.frequency import summary_text

    print(summary_text(result))  # the sentence the atlas prints for this section, from the same numbers


COMMAND = AnalysisCommand("FrequencyConfig", "posprobe.analyses.frequency:run_frequency", resume=True,
                          distributed=True, checks=_checks, summary=_summary,
                          at_least=((0, ("queries",)), (1, ("window", "max_windows", "batch_size", "ablate_windows",
                                                            "top_heads")), (2, ("theory_context",))))
add_arguments, run = COMMAND.add_arguments, COMMAND.run
