"""`posprobe surgery-eval`: loss vs position on long text under several position presets."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.cli.command import AnalysisCommand

HELP = "Loss (nats/token) vs position on a text under each position/frequency preset, in one tidy table."


def _checks(args: argparse.Namespace, config: Any, early: Any) -> int:
    from posprobe.cli import checks

    checks.require_rotary(early, "surgery-eval")
    checks.check_window(early, args, config.window)
    return config.window


def _summary(args: argparse.Namespace, result: Any) -> None:
    for spec, v in result.df.groupby("preset", sort=False).value.mean().items():
        print(f"{spec:<40} mean loss {v:.4f} nats/token")


COMMAND = AnalysisCommand("SurgeryEvalConfig", "posprobe.analyses.squish:run_surgery_eval", text="required",
                          out_required=False, at_least=((2, ("window",)), (1, ("max_windows",))), checks=_checks,
                          summary=_summary)
add_arguments, run = COMMAND.add_arguments, COMMAND.run
