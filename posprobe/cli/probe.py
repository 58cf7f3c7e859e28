"""`posprobe probe`: linear probes for absolute position at every layer's residual stream."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.cli.command import AnalysisCommand

HELP = "Probe absolute position from the residual stream per layer (ridge MAE, bucket accuracy, shuffled control)."


def _checks(args: argparse.Namespace, config: Any, early: Any) -> int:
    from posprobe.cli import checks

    checks.check_layers(early, config.layers, "--layers")
    checks.check_window(early, args, config.window)
    return config.window


COMMAND = AnalysisCommand("ProbeConfig", "posprobe.analyses.probes:run_probes", resume=True,
                          at_least=((2, ("window",)), (1, ("max_windows",)), (0, ("skip_first",))), checks=_checks)
add_arguments, run = COMMAND.add_arguments, COMMAND.run
