from __future__ import annotations

import argparse
import json

HELP = ("Print a model's positional facts (kind, context, rotary dims/bases, heads, GQA), how positions enter each "
        "layer, and whether posprobe's position analyses support it.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from posprobe.cli.checks import peek_model

    peek_model(args)  # a bad path or --n-ctx fails before torch / TransformerLens are imported

    from posprobe.backend.facts import model_facts
    from posprobe.backend.loading import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    facts = model_facts(model).summary()
    facts.update(_zoo_record(args.model))
    if args.json:
        print(json.dumps(facts, indent=2, default=str))
    else:
        facts["unsupported"] = facts["unsupported"] or "none: position analyses proven against Hugging Face"
        facts["attention_unsupported"] = facts["attention_unsupported"] or "none: attention patterns proven"
        width = max(map(len, facts))
        for k, v in facts.items():
            lines = v if isinstance(v, list) and k == "layer_positions" else [v]
            for i, line in enumerate(lines):
                print(f"{k if i == 0 else '':<{width}}  {line}")
    return 0


def _zoo_record(spec: str) -> dict:
    """A posprobe zoo member's own record (member, block, seed, what differs beyond positions), or nothing."""
    from pathlib import Path

    from posprobe.zoo.train import ZOO_FILE

    path = Path(spec) / ZOO_FILE
    if not path.is_file():
        return {}
    rec = json.loads(path.read_text(encoding="utf-8"))
    return {"zoo_member": f"{rec.get('member')} (seed {rec.get('seed')}, block {rec.get('block')}: "
                          f"{rec.get('positions')})",
            "zoo_differences": rec.get("differences") or "none beyond positions within its block"}
