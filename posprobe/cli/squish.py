"""`posprobe squish`: generate with an instruction's keys squished, next to the unmodified model."""

from __future__ import annotations

import argparse
import textwrap

HELP = ("Squish the key positions of an instruction span (cache or global variant) and compare the "
        "continuation, attention onto the span, reference loss and next-token KL with the unmodified model.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--instruction", required=True, help="instruction text (its tokens are the squished span)")
    p.add_argument("--prompt", required=True, help="text after the instruction in the same user turn")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--squish-to", type=float, default=None, help="put every span key at this position (default 0)")
    g.add_argument("--squish-range", type=float, nargs=2, metavar=("LO", "HI"), default=None,
                   help="spread the span keys linearly over [LO, HI]")
    p.add_argument("--query-start", type=float, default=None,
                   help="position of the first token after the span (default: unchanged)")
    p.add_argument("--variant", choices=["cache", "global"], default="cache",
                   help="cache: the span sees itself normally, later tokens see it squished; global: everyone does")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", default=None, help="a reference continuation to score (nats/token)")
    p.add_argument("--no-chat", action="store_true", help="do not use the tokenizer's chat template")
    p.add_argument("--out", default=None, help="directory for squish.parquet/.csv, meta.json, report.html")


def side_by_side(left: str, right: str, titles: tuple[str, str], width: int = 48) -> str:
    """Two texts as wrapped columns under their titles."""
    cols = [textwrap.wrap(t.replace("\n", " / "), width) or [""] for t in (left, right)]
    n = max(map(len, cols))
    cols = [c + [""] * (n - len(c)) for c in cols]
    lines = [f"{titles[0]:<{width}} | {titles[1]}", "-" * (2 * width + 3)]
    lines += [f"{a:<{width}} | {b}" for a, b in zip(*cols)]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from posprobe.cli import checks

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_at_least(args, 1, "max_new_tokens", "top_k")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0; got {args.temperature}")
    if not args.instruction.strip():
        raise ValueError("--instruction is empty")
    checks.check_out(args.out)
    checks.require_rotary(checks.peek_model(args), "squish")

    from posprobe.backend.loading import load_model
    from posprobe.analyses.squish import squish_run

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    to = 0.0 if args.squish_to is None else args.squish_to
    result = squish_run(model, args.instruction, args.prompt, to=to, range_=args.squish_range,
                          query_start=args.query_start, variant=args.variant, max_new_tokens=args.max_new_tokens,
                          reference=args.reference, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                          chat=False if args.no_chat else None)
    df, meta = result.df, result.meta
    c = meta["continuations"]
    print(f"variant: {args.variant}  plan: {meta['plan'][args.variant]}  span tokens: {meta['span']}")
    print(side_by_side(c["baseline"], c[args.variant], ("baseline", f"squished ({args.variant})")))
    mass = df[df.metric == "attn_mass"].groupby("variant").value.mean()
    print(f"attention mass on the instruction (generated tokens, mean over layers/heads): "
          + ", ".join(f"{v} {mass[v]:.4f}" for v in mass.index))
    kl = df[df.metric == "kl"].value
    print(f"KL(baseline || {args.variant}) next-token, nats: mean {kl.mean():.4f}, max {kl.max():.4f}")
    if args.reference is not None:
        nll = df[df.metric == "ref_nll"].set_index("variant").value
        print("reference loss (nats/token): " + ", ".join(f"{v} {x:.4f}" for v, x in nll.items()))
        print(f"fraction of the instruction's effect kept ({args.variant}): {meta['effect_kept'][args.variant]:.3f}")
    if args.out:
        paths = result.save(args.out)
        print(f"wrote {paths['report']}")
    return 0
