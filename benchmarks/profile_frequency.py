"""Profile: where the frequency-usage measurement pass spends its CPU time.

One pass over random-token windows under `torch.profiler`; the reducer (the per-layer hook code in
`posprobe.analyses.frequency`) runs inside a `record_function` label, so every torch op is charged
either to the model's forward or to the reducer. Prints CPU seconds per part (forward, reducer by
hook point, tables; process CPU time) and the reducer's top ops as shares of its op time (the
profiler's own per-op times are wall-clock spans). One torch thread by default.

    python benchmarks/profile_frequency.py --model smollm2 --tokens 1024 --queries 32
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=32, help="query positions per window for score stats (0: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import posprobe.analyses.frequency as fr
    from posprobe.backend.loading import load_model
    from posprobe.core.capture import Reducer

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    rows = torch.randint(0, model.cfg.d_vocab, (max(1, args.tokens // args.window), args.window),
                         generator=torch.Generator().manual_seed(0))
    cpu_by_point: dict[str, float] = defaultdict(float)
    make = fr._reducer

    def labelled(*a, **k):  # the same reducer, its calls labelled and CPU-timed
        r = make(*a, **k)

        def fn(point, layer, x, state):
            t = time.process_time()
            with record_function("reducer"):
                r.fn(point, layer, x, state)
            cpu_by_point[point] += time.process_time() - t

        return Reducer(r.points, r.layers, fn, r.state)

    tables = fr._tables

    def timed_tables(*a, **k):
        t = time.process_time()
        out = tables(*a, **k)
        cpu_by_point["(tables)"] += time.process_time() - t
        return out

    fr._reducer, fr._tables = labelled, timed_tables
    queries = args.queries or None
    fr.frequency_usage(model, rows[:1, :16], queries=queries, progress=False)  # warm-up
    cpu_by_point.clear()
    print(f"model={args.model} tokens={rows.numel()} window={args.window} batch={args.batch_size} "
          f"queries={queries or 'all'} threads={torch.get_num_threads()} loadavg={os.getloadavg()}")
    t0 = time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fr.frequency_usage(model, rows, batch_size=args.batch_size, queries=queries, progress=False)
    total = time.process_time() - t0
    # Charge each op's self time to the reducer if a "reducer" label is among its ancestors.
    red_ops: dict[str, float] = defaultdict(float)
    red_total = 0.0
    for ev in prof.events():
        if ev.name == "reducer":
            continue
        node, inside = ev.cpu_parent, False
        while node is not None:
            if node.name == "reducer":
                inside = True
                break
            node = node.cpu_parent
        if inside:
            red_ops[ev.name] += ev.self_cpu_time_total / 1e6
            red_total += ev.self_cpu_time_total / 1e6
    red_cpu = sum(v for k, v in cpu_by_point.items() if k != "(tables)")
    print(f"pass CPU {total:.2f} s (under the profiler; its overhead inflates small ops)")
    print(
        f"  reducer hooks {red_cpu:.2f} s = "
        + ", ".join(f"{k} {v:.2f}" for k, v in cpu_by_point.items() if k != "(tables)")
    )
    print(
        f"  tables {cpu_by_point['(tables)']:.2f} s; "
        f"forward and the rest {total - red_cpu - cpu_by_point['(tables)']:.2f} s"
    )
    print(f"reducer share of the pass: {100 * red_cpu / total:.1f}% of CPU time")
    # The profiler's per-op times are wall-clock spans (they swell on a loaded machine): read the shares.
    print("reducer ops, share of the reducer's op time (profiler):")
    for name, sec in sorted(red_ops.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {100 * sec / max(red_total, 1e-9):5.1f}%  {name}")


if __name__ == "__main__":
    main()
