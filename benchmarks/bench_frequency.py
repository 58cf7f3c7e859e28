"""Benchmark: the frequency-usage measurement pass vs a bare forward pass over the same tokens.

Per token count, interleaved rounds (order rotated each round) of three runs over the same windows:
  bare   the model's full forward with logits, batch by batch (what a user's bare forward costs)
  stop   the forward stopped after the last block (no final norm, no unembedding): the floor the
         measurement pass can reach, since it needs nothing after the last attention layer
  measure  `frequency_usage(model, rows, queries=...)`, tables included
CPU time (this process, one torch thread by default) is the headline; wall time is printed beside it.
Ratios are paired within a round (median [min-max] over rounds). Peak RSS above the pre-run level is
sampled every 5 ms; token counts grow by adding windows of a fixed size, so a streaming pass shows
flat memory. The load average is printed before and after each token count.
Targets: measure/bare <= 1.3 in CPU time (queries=32); memory flat in token count.

    python benchmarks/bench_frequency.py --model smollm2 --tokens 2048 8192 --rounds 2
    python benchmarks/bench_frequency.py --tokens 32768 --rounds 1
    python benchmarks/bench_frequency.py --tokens 2048 --queries 0     # exact all-pairs mode
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _timing import Timed, loadavg, ratio_summary, rotate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--queries", type=int, default=32, help="query positions per window for score stats (0: all)")
    ap.add_argument("--runs", nargs="+", default=["bare", "stop", "measure"], choices=["bare", "stop", "measure"],
                    help="which runs to time (bare and measure are always kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: CPU time is then "
                                                            "comparable across loads)")
    args = ap.parse_args()

    import torch

    from posprobe.analyses.frequency import frequency_usage
    from posprobe.backend.loading import load_model
    from posprobe.backend.model import forward, n_layers
    from posprobe.core.capture import batches

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    gen = torch.Generator().manual_seed(0)
    print(f"model={args.model} window={args.window} batch={args.batch_size} rounds={args.rounds} "
          f"queries={args.queries or 'all'} threads={torch.get_num_threads()} torch={torch.__version__}", flush=True)

    def bare(rows: torch.Tensor) -> None:
        with torch.no_grad():
            for toks in batches(rows, args.batch_size):
                model(toks)

    def stop(rows: torch.Tensor) -> None:
        with torch.no_grad():
            for toks in batches(rows, args.batch_size):
                forward(model, toks, stop_at_layer=n_layers(model))

    def measure(rows: torch.Tensor) -> None:
        frequency_usage(model, rows, batch_size=args.batch_size, queries=args.queries or None, progress=False)

    runs = {k: f for k, f in (("bare", bare), ("stop", stop), ("measure", measure))
            if k in args.runs or k != "stop"}
    measure(torch.randint(0, model.cfg.d_vocab, (1, args.window), generator=gen))  # warm-up (lazy inits)
    table = []
    for n_tok in args.tokens:
        n_win = max(1, n_tok // args.window)
        rows = torch.randint(0, model.cfg.d_vocab, (n_win, args.window), generator=gen)
        la_before = loadavg()
        print(f"tokens={rows.numel()} before: {la_before}", flush=True)
        res: dict[str, list[Timed]] = {k: [] for k in runs}
        for r in range(args.rounds):
            for name in rotate(list(runs), r):
                with Timed() as t:
                    runs[name](rows)
                res[name].append(t)
                print(f"  round={r} {name:8s} cpu {t.cpu:7.2f}s wall {t.wall:7.2f}s peak +{t.peak / 2**20:.0f} MiB "
                      f"({loadavg()})", flush=True)
        la_after = loadavg()
        print(f"tokens={rows.numel()} after: {la_after}", flush=True)
        col = lambda k, f: [getattr(t, f) for t in res[k]]  # noqa: E731
        has_stop = "stop" in res
        table.append(dict(
            tokens=rows.numel(), windows=n_win, la=(la_before, la_after),
            cpu={k: statistics.median(col(k, "cpu")) if k in res else math.nan for k in ("bare", "stop", "measure")},
            wall={k: statistics.median(col(k, "wall")) for k in runs},
            r_cpu=ratio_summary(col("measure", "cpu"), col("bare", "cpu")),
            r_cpu_stop=ratio_summary(col("measure", "cpu"), col("stop", "cpu")) if has_stop else None,
            r_bare_stop=ratio_summary(col("bare", "cpu"), col("stop", "cpu")) if has_stop else None,
            r_wall=ratio_summary(col("measure", "wall"), col("bare", "wall")),
            mem={k: max(col(k, "peak")) / 2**20 for k in runs}))

    fmt = lambda r: "-" if r is None else f"{r[0]:.2f} [{r[1]:.2f}-{r[2]:.2f}]"  # noqa: E731
    print(f"\nmedians of {args.rounds} interleaved rounds; ratios paired within rounds: median [min-max]")
    print(f"{'tokens':>7} {'bare cpu':>8} {'stop cpu':>8} {'meas cpu':>8} {'meas/bare cpu':>18} "
          f"{'meas/stop cpu':>18} {'bare/stop cpu':>18} {'meas/bare wall':>18} {'bare MiB':>8} {'meas MiB':>8}")
    for row in table:
        c = row["cpu"]
        print(f"{row['tokens']:>7} {c['bare']:8.2f} {c['stop']:8.2f} {c['measure']:8.2f} {fmt(row['r_cpu']):>18} "
              f"{fmt(row['r_cpu_stop']):>18} {fmt(row['r_bare_stop']):>18} {fmt(row['r_wall']):>18} "
              f"{row['mem']['bare']:8.0f} {row['mem']['measure']:8.0f}")
    for row in table:
        print(f"  tokens={row['tokens']}: {row['la'][0]} -> {row['la'][1]}")
    first = table[0]
    for row in table[1:]:
        print(
            f"memory growth {first['tokens']} -> {row['tokens']} tokens: measure "
            f"{row['mem']['measure'] - first['mem']['measure']:+.0f} MiB, "
            f"bare {row['mem']['bare'] - first['mem']['bare']:+.0f} MiB"
        )


if __name__ == "__main__":
    main()
