"""Benchmark: the head-signature pass (or the attention-sink pass) vs a bare forward over the same tokens.

Per token count, interleaved rounds (order rotated each round):
  bare   the model's full forward with logits, batch by batch (TransformerLens computes every attention
         pattern inside it, so this is "a bare forward with attention patterns")
  heads  `head_signatures(model, rows, HeadsConfig(induction_len=0))`: the streamed pattern statistics
         of every layer and head, tables included (the induction pass is a separate, fixed-size forward);
         with `--analysis sinks`, `sink_statistics(model, rows, SinksConfig(...))`: alpha_1, the first token's
         key/value norms and query cosines from q, k, v and the pattern of every layer (target <= 1.3)
CPU time (this process, one torch thread by default) is the headline, wall time beside it; ratios are
paired within a round. Token counts grow by adding windows, so a streaming pass shows flat memory.
Target: heads/bare <= 1.5 in CPU time; memory flat in the number of windows.

    python benchmarks/bench_heads.py --model smollm2 --tokens 1024 4096 --rounds 2
    python benchmarks/bench_heads.py --analysis sinks --window 64 --batch-size 8
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _timing import Timed, loadavg, ratio_summary, rotate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--analysis", choices=["heads", "sinks"], default="heads")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from posprobe.analyses.configs import HeadsConfig, SinksConfig
    from posprobe.analyses.heads import head_signatures
    from posprobe.analyses.sinks import sink_statistics
    from posprobe.backend.loading import load_model
    from posprobe.core.capture import batches

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    vocab = len(model.tokenizer)
    gen = torch.Generator().manual_seed(0)
    cfg = HeadsConfig(window=args.window, batch_size=args.batch_size, induction_len=0, progress=False)
    print(f"analysis={args.analysis} model={args.model} window={args.window} batch={args.batch_size} "
          f"rounds={args.rounds} threads={torch.get_num_threads()} torch={torch.__version__}", flush=True)

    def bare(rows: torch.Tensor) -> None:
        with torch.no_grad():
            for toks in batches(rows, args.batch_size):
                model(toks)

    def heads(rows: torch.Tensor) -> None:
        if args.analysis == "sinks":
            sink_statistics(model, rows, SinksConfig(length=args.window, batch_size=args.batch_size, progress=False))
        else:
            head_signatures(model, rows, cfg)

    runs = {"bare": bare, "heads": heads}
    heads(torch.randint(0, vocab, (1, args.window), generator=gen))  # warm-up
    table = []
    for n_tok in args.tokens:
        rows = torch.randint(0, vocab, (max(1, n_tok // args.window), args.window), generator=gen)
        before = loadavg()
        res: dict[str, list[Timed]] = {k: [] for k in runs}
        for r in range(args.rounds):
            for name in rotate(list(runs), r):
                with Timed() as t:
                    runs[name](rows)
                res[name].append(t)
                print(f"  tokens={rows.numel()} round={r} {name:6s} cpu {t.cpu:7.2f}s wall {t.wall:7.2f}s "
                      f"peak +{t.peak / 2**20:.0f} MiB ({loadavg()})", flush=True)
        col = lambda k, f: [getattr(t, f) for t in res[k]]  # noqa: E731
        table.append((rows.numel(), ratio_summary(col("heads", "cpu"), col("bare", "cpu")),
                      ratio_summary(col("heads", "wall"), col("bare", "wall")),
                      statistics.median(col("bare", "cpu")), statistics.median(col("heads", "cpu")),
                      max(col("heads", "peak")) / 2**20, before, loadavg()))
    print(f"\nmedians of {args.rounds} interleaved rounds; ratios paired within rounds: median [min-max]")
    print(
        f"{'tokens':>7} {'bare cpu':>8} {'heads cpu':>9} {'heads/bare cpu':>18} {'heads/bare wall':>18} "
        f"{'heads MiB':>9}"
    )
    for n, rc, rw, b, h, mem, la0, la1 in table:
        print(f"{n:>7} {b:8.2f} {h:9.2f} {rc[0]:.2f} [{rc[1]:.2f}-{rc[2]:.2f}]".ljust(48)
              + f" {rw[0]:.2f} [{rw[1]:.2f}-{rw[2]:.2f}]   {mem:7.0f}   ({la0} -> {la1})")


if __name__ == "__main__":
    main()
