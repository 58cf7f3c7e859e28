"""`posprobe geometry`: geometry of W_pos (learned APE) and of the positional part of the residual stream."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.cli.command import AnalysisCommand

HELP = "PCA / cosine / sinusoid-fit geometry of W_pos and of per-position residual means."


def _checks(args: argparse.Namespace, config: Any, early: Any) -> int:
    from posprobe.cli import checks

    checks.check_layers(early, config.layers, "--layers")
    checks.check_window(early, args, config.window)
    if args.max_pos is not None and early is not None and early.known_kind:
        # Only the W_pos view reads --max-pos, and only learned-position models have W_pos.
        if not early.has_w_pos:
            raise checks.WrongModelKind(f"--max-pos selects W_pos rows, but {early.name} uses "
                                        f"{early.positional_kind} positions (no W_pos); drop --max-pos")
        checks.check_window(early, args, args.max_pos, "--max-pos")
    return config.window


def _summary(args: argparse.Namespace, result: Any) -> None:
    from posprobe.report.geometry import overlap_text

    sentence = overlap_text(result)
    if sentence:
        print(sentence)


COMMAND = AnalysisCommand("GeometryConfig", "posprobe.analyses.geometry:run_geometry", checks=_checks,
                          summary=_summary, at_least=((2, ("window",)), (1, ("max_windows", "components", "max_pos")),
                                                      (0, ("skip_first",))))
add_arguments, run = COMMAND.add_arguments, COMMAND.run
