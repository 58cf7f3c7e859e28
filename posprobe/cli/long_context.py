"""`posprobe long-context`: loss by position beyond the trained context and passkey retrieval, per preset."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.cli.command import AnalysisCommand

HELP = ("Loss by position past the trained context and passkey retrieval (length x depth) under each "
        "surgery preset, on the plain Hugging Face model with chunked attention (memory linear in length).")


def _checks(args: argparse.Namespace, config: Any, early: Any) -> None:
    from posprobe.cli import checks

    _refuse_unused(args, config)
    if any(p.strip().lower() != "none" for p in config.presets):
        checks.require_rotary(early, "long-context presets")


def _summary(args: argparse.Namespace, result: Any) -> None:
    s = result.tables["long_context_summary"]
    table = s.pivot_table(index=["length", "preset"], columns="metric", values="value", sort=False, dropna=False)
    print(f"trained context {result.meta['trained_ctx']} tokens; NLL in nats/token; break_pos -1 = never")
    beyond = result.meta["beyond_context"]
    if beyond["lengths"]:
        print(f"note: length(s) {', '.join(map(str, beyond['lengths']))} past the model's context of "
              f"{beyond['context']} positions (max_position_embeddings)")
    print(table.to_string(float_format=lambda v: f"{v:.4f}"))
    acc = result.tables.get("passkey_accuracy")
    if acc is not None:
        print("passkey accuracy (exact match) [95% Wilson interval over trials], rows preset x length, columns depth:")
        print(_grid(acc, ["preset", "length"]))
    acc = result.tables.get("needle_accuracy")
    if acc is not None:
        print("needle accuracy (RULER string_match_all) [95% Wilson interval where scores are 0/1], rows task x preset "
              "x length, columns depth:")
        print(_grid(acc, ["task", "preset", "length"]))


def _grid(acc: Any, rows: list[str]) -> str:
    # One cell per depth: "0.80 [0.49, 0.94]", the interval left out where it is undefined (fractional scores).
    def cell(r: Any) -> str:
        return f"{r.value:.2f}" + ("" if r.ci_low != r.ci_low else f" [{r.ci_low:.2f}, {r.ci_high:.2f}]")

    shown = acc.assign(cell=[cell(r) for r in acc.itertuples()])
    return shown.pivot_table(index=rows, columns="depth", values="cell", aggfunc="first", sort=False).to_string()


def _refuse_unused(args: argparse.Namespace, config: Any) -> None:
    # An option that cannot change the result is refused rather than silently ignored. (Needle tasks without a
    # passkey length are refused by the config itself, for the API too.)
    from posprobe.analyses.configs import LongContextConfig
    from posprobe.cli.checks import given_flags

    def refuse(flags: list[str], why: str) -> None:
        if flags:
            raise ValueError(f"{', '.join(flags)} {'applies' if len(flags) == 1 else 'apply'} only {why}")

    if not config.passkey_lengths:
        refuse(given_flags(args, LongContextConfig, "depths", "tasks", "trials", "new_tokens", "needle_tokens", "seed"),
               "to the passkey / needle test: add --passkey-length N")
        return
    if "passkey" not in config.tasks:
        refuse(given_flags(args, LongContextConfig, "new_tokens"),
               "to the passkey task (needle tasks decode --needle-tokens)")
    if all(t == "passkey" for t in config.tasks):
        refuse(given_flags(args, LongContextConfig, "needle_tokens"),
               "to needle tasks (the passkey decodes --new-tokens)")


COMMAND = AnalysisCommand(
    "LongContextConfig", "posprobe.analyses.long_context:run_long_context", loader="hf", text="required",
    resume=True, checks=_checks, summary=_summary,
    no_n_ctx="--n-ctx does not apply to long-context (the model runs at full length); use --trained-ctx to set the "
             "trained context")
add_arguments, run = COMMAND.add_arguments, COMMAND.run
