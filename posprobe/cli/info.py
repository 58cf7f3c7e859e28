from __future__ import annotations

import argparse
import json

HELP = ("Print a model's positional facts (kind, context, rotary dims/bases, heads, GQA), how positions enter each "
        "layer, and whether posprobe's position analyses support it.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--theory", action="store_true",
                   help="add the RoPE theory of every rotary layer group: critical dimension (Liu et al.), first "
                        "negative rotation sum (Xu et al.), Chen et al.'s B(s) and bound ratio")
    p.add_argument("--context", type=int, default=None, metavar="L",
                   help="with --theory: the trained length in tokens (default: the model's context)")
    p.add_argument("--target", type=int, default=None, metavar="L2",
                   help="with --theory: a target length L2 > L; adds PI, NTK-aware and YaRN's per-band factors")


def run(args: argparse.Namespace) -> int:
    from posprobe.cli.checks import peek_model

    early = peek_model(args)  # a bad path or --n-ctx fails before torch / TransformerLens are imported
    _check_theory_flags(args, early)

    from posprobe.backend.facts import model_facts
    from posprobe.backend.loading import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    facts = model_facts(model).summary()
    facts.update(_zoo_record(args.model))
    theory = _theory(model, args) if args.theory else None
    if args.json:
        if theory is not None:
            facts["rope_theory"] = theory if isinstance(theory, str) else theory.to_dict("records")
        print(json.dumps(facts, indent=2, default=str))
    else:
        facts["unsupported"] = facts["unsupported"] or "none: position analyses proven against Hugging Face"
        facts["attention_unsupported"] = facts["attention_unsupported"] or "none: attention patterns proven"
        width = max(map(len, facts))
        for k, v in facts.items():
            lines = v if isinstance(v, list) and k == "layer_positions" else [v]
            for i, line in enumerate(lines):
                print(f"{k if i == 0 else '':<{width}}  {line}")
        if theory is not None:
            print(theory_text(theory))
    return 0


def _check_theory_flags(args: argparse.Namespace, early) -> None:
    # Bad lengths are refused before the model loads, against the context the spec states where --context is unset.
    if not args.theory:
        if args.context is not None or args.target is not None:
            raise ValueError("--context and --target go with --theory")
        return
    if args.context is not None and args.context < 2:
        raise ValueError(f"--context must be >= 2 tokens; got {args.context}")
    context = args.context or (early.context_after_load(args.n_ctx) if early is not None else None)
    if args.target is not None and context is not None and args.target <= context:
        raise ValueError(f"--target {args.target} must exceed the context L = {context} tokens")


def _theory(model, args: argparse.Namespace):
    """The theory table, or the sentence saying why a model has none (the rest of `info` still prints)."""
    from posprobe.analyses.rope_tables import rope_theory_table
    from posprobe.backend.facts import WrongModelKind

    try:
        return rope_theory_table(model, context=args.context, target=args.target)
    except WrongModelKind as e:
        return f"not applicable: {e}"


def theory_text(theory) -> str:
    """The theory table as text: one block per rotary layer group, one line per quantity with its unit and note."""
    if isinstance(theory, str):
        return f"rope_theory  {theory}"
    lines = []
    for (layers, dim, base), g in theory.groupby(["layers", "rotary_dim", "base"], sort=False):
        lines.append(f"rope_theory  layers {layers} (rotary dim {dim}, base {base:g})")
        width = int(g["quantity"].str.len().max())
        for r in g.itertuples():
            v = float(r.value)
            value = "" if v != v else f"{v:,.0f} {r.unit}" if v.is_integer() else f"{v:.4g} {r.unit}"
            lines.append(f"  {r.quantity:<{width}}  {value}" + (f"  ({r.note})" if r.note else ""))
    return "\n".join(lines)


def _zoo_record(spec: str) -> dict:
    """A posprobe zoo member's own record (member, block, seed, what differs beyond positions), or nothing."""
    from pathlib import Path

    from posprobe.zoo.folder import ZOO_FILE

    path = Path(spec) / ZOO_FILE
    if not path.is_file():
        return {}
    rec = json.loads(path.read_text(encoding="utf-8"))
    return {"zoo_member": f"{rec.get('member')} (seed {rec.get('seed')}, block {rec.get('block')}: "
                          f"{rec.get('positions')})",
            "zoo_differences": rec.get("differences") or "none beyond positions within its block"}
