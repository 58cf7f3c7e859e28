"""`posprobe brittleness`: loss vs Gaussian noise on the key positions of near or far (query, key) pairs."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.cli.command import AnalysisCommand

HELP = ("Loss (nats/token) vs Gaussian noise (sigma, tokens) on the key positions of only the pairs in a distance "
        "bucket (near:K = the K nearest earlier keys, far:D = keys more than D back), one curve per bucket, on the "
        "plain Hugging Face RoPE model.")


def _checks(args: argparse.Namespace, config: Any, early: Any) -> int:
    from posprobe.analyses.configs import check_length
    from posprobe.cli import checks

    check_length(config.window, config.buckets, what="--window")
    checks.require_rotary(early, "brittleness")
    checks.check_window(early, args, config.window)
    return config.window


def _summary(args: argparse.Namespace, result: Any) -> None:
    s = result.tables["brittleness_summary"]
    grid = s.pivot_table(index="bucket", columns="sigma", values="delta_nll", sort=False)
    grid.columns = [f"sigma={c:g}" for c in grid.columns]
    base = float(s[s.sigma == 0].nll.mean())
    n, lengths = result.meta["data"]["n_items"], result.meta["window_lengths"]
    print(f"{n} window(s) of {', '.join(map(str, lengths))} tokens; loss at sigma 0: {base:.4f} nats/token")
    print("loss increase over sigma 0 (nats/token), rows bucket, columns noise sigma (tokens):")
    print(grid.to_string(float_format=lambda v: f"{v:.4f}"))


COMMAND = AnalysisCommand(
    "BrittlenessConfig", "posprobe.analyses.brittleness:run_brittleness", loader="hf", checks=_checks,
    summary=_summary,
    no_n_ctx="--n-ctx does not apply to brittleness (the model runs at full length); a --window past the model's "
             "trained context is refused")
add_arguments, run = COMMAND.add_arguments, COMMAND.run
