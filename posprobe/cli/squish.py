"""`posprobe squish`: generate with an instruction's keys squished, next to the unmodified model."""

from __future__ import annotations

import argparse
import textwrap

HELP = ("Squish the key positions of an instruction span (variant cache, keys or qk) and compare the "
        "continuation, attention onto the span, reference loss and next-token KL with the unmodified model.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import SquishConfig
    from posprobe.cli.args import add_config_arguments, add_model_arguments, add_output_arguments

    add_model_arguments(p)
    p.add_argument("--instruction", required=True, help="instruction text (its tokens are the squished span)")
    p.add_argument("--prompt", required=True, help="text after the instruction in the same user turn")
    add_config_arguments(p, SquishConfig)
    add_output_arguments(p, required=False)


def side_by_side(left: str, right: str, titles: tuple[str, str], width: int = 48) -> str:
    """Two texts as wrapped columns under their titles."""
    cols = [textwrap.wrap(t.replace("\n", " / "), width) or [""] for t in (left, right)]
    n = max(map(len, cols))
    cols = [c + [""] * (n - len(c)) for c in cols]
    lines = [f"{titles[0]:<{width}} | {titles[1]}", "-" * (2 * width + 3)]
    lines += [f"{a:<{width}} | {b}" for a, b in zip(*cols)]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import SquishConfig
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 1, "max_new_tokens", "top_k")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0; got {args.temperature}")
    if not args.instruction.strip():
        raise ValueError("--instruction is empty")
    checks.check_out(args.out)
    config = config_from_args(SquishConfig, args)
    checks.require_rotary(checks.peek_model(args), "squish")

    from posprobe.analyses.squish import run_squish
    from posprobe.backend.loading import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    result = run_squish(model, args.instruction, args.prompt, config)
    df, meta, v = result.df, result.meta, config.variant
    c = meta["continuations"]
    print(f"variant: {v}  plan: {meta['plan'][v]}  span tokens: {meta['span']}")
    print(side_by_side(c["baseline"], c[v], ("baseline", f"squished ({v})")))
    mass = df[df.metric == "attn_mass"].groupby("variant").value.mean()
    print("attention mass on the instruction (generated tokens, mean over layers/heads): "
          + ", ".join(f"{name} {mass[name]:.4f}" for name in mass.index))
    kl = df[df.metric == "kl"].value
    print(f"KL(baseline || {v}) next-token, nats: mean {kl.mean():.4f}, max {kl.max():.4f}")
    if config.reference is not None:
        nll = df[df.metric == "ref_nll"].set_index("variant").value
        print("reference loss (nats/token): " + ", ".join(f"{name} {x:.4f}" for name, x in nll.items()))
        print(f"fraction of the instruction's effect kept ({v}): {meta['effect_kept'][v]:.3f}")
    if args.out:
        paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
        print(f"wrote {paths['report']}")
    return 0
