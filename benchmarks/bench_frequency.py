"""Benchmark: the frequency-usage measurement pass vs a bare forward pass over the same tokens.

Interleaved rounds (bare, measure, bare, measure, ...), medians; peak RSS above the pre-pass level,
sampled every 5 ms by a thread (torch's allocator is invisible to tracemalloc). Token counts grow by
adding windows of a fixed size, so a streaming pass should show flat memory.
Targets: measure/bare <= 1.5; memory flat in token count.

    python benchmarks/bench_frequency.py --model smollm2 --tokens 2048 8192 32768 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Context manager: `.peak` is the highest RSS seen inside the block minus RSS at entry (bytes)."""

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak_abs = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_abs = max(self.peak_abs, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak_abs = max(self.peak_abs, _rss())
        self.peak = self.peak_abs - self.base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--queries", type=int, default=32, help="query positions per window for score stats (0: all)")
    args = ap.parse_args()

    import torch

    from posprobe.core.capture import batches
    from posprobe.analyses.frequency import frequency_usage
    from posprobe.backend.loading import load_model

    model = load_model(args.model)
    gen = torch.Generator().manual_seed(0)
    print(f"model={args.model} window={args.window} batch={args.batch_size} rounds={args.rounds} "
          f"queries={args.queries or 'all'} threads={torch.get_num_threads()}", flush=True)

    def bare(rows: torch.Tensor) -> None:
        with torch.no_grad():
            for toks in batches(rows, args.batch_size):
                model(toks)

    def measure(rows: torch.Tensor) -> None:
        frequency_usage(model, rows, batch_size=args.batch_size, queries=args.queries or None, progress=False)

    table = []
    for n_tok in args.tokens:
        n_win = max(1, n_tok // args.window)
        rows = torch.randint(0, model.cfg.d_vocab, (n_win, args.window), generator=gen)
        times: dict[str, list[float]] = {"bare": [], "measure": []}
        mem: dict[str, list[int]] = {"bare": [], "measure": []}
        for r in range(args.rounds):
            for name, fn in (("bare", bare), ("measure", measure)):
                with PeakRSS() as pk:
                    t0 = time.perf_counter()
                    fn(rows)
                    times[name].append(time.perf_counter() - t0)
                mem[name].append(pk.peak)
                print(f"  tokens={n_win * args.window} round={r} {name}: {times[name][-1]:.2f}s "
                      f"peak +{pk.peak / 2**20:.0f} MiB", flush=True)
        tb, tm = statistics.median(times["bare"]), statistics.median(times["measure"])
        table.append((n_win * args.window, n_win, tb, tm, tm / tb, max(mem["bare"]) / 2**20, max(mem["measure"]) / 2**20))

    print()
    print(f"{'tokens':>7} {'windows':>7} {'bare s':>8} {'measure s':>9} {'ratio':>6} {'bare MiB':>9} {'meas MiB':>9}")
    for tok, nw, tb, tm, ratio, mb, mm in table:
        print(f"{tok:>7} {nw:>7} {tb:>8.2f} {tm:>9.2f} {ratio:>6.2f} {mb:>9.0f} {mm:>9.0f}")
    first = table[0]
    for row in table[1:]:
        print(f"memory growth {first[0]} -> {row[0]} tokens: measure {row[6] - first[6]:+.0f} MiB, "
              f"bare {row[5] - first[5]:+.0f} MiB")


if __name__ == "__main__":
    main()
