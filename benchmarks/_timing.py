"""Shared by the benchmarks: CPU and wall time of a block, peak RSS, load average, paired ratios.

The machines these run on are shared. Wall time then measures the neighbours as much as the code, so
every benchmark reports process CPU time (user + system, all of this process's threads) beside it and
prints the 1/5/15-minute load average before and after, so a reader can tell a quiet run from a loaded
one. CPU time is the fairer number with one torch thread; it still rises a little under load (cache
and memory-bandwidth contention), so runs are interleaved and ratios are taken within a round.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field


def loadavg() -> str:
    """The machine's 1/5/15-minute load average, formatted."""
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Timed:
    """Context manager: `.wall` and `.cpu` seconds of the block (CPU = this process, all threads, minus
    the RSS sampler's own CPU), and `.peak` bytes of RSS above the level at entry (sampled every 5 ms
    by a thread when `rss=True`; torch's allocator is invisible to tracemalloc)."""

    rss: bool = True
    wall: float = 0.0
    cpu: float = 0.0
    peak: int = 0
    _sampler_cpu: float = field(default=0.0, repr=False)

    def __enter__(self) -> Timed:
        self.base = self.peak_abs = _rss()
        self._stop = threading.Event()
        if self.rss:
            self._t = threading.Thread(target=self._run, daemon=True)
            self._t.start()
        self._c0, self._w0 = time.process_time(), time.perf_counter()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_abs = max(self.peak_abs, _rss())
            time.sleep(0.005)
        self._sampler_cpu = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._w0
        cpu = time.process_time() - self._c0
        self._stop.set()
        if self.rss:
            self._t.join()
        self.cpu = cpu - self._sampler_cpu
        self.peak_abs = max(self.peak_abs, _rss())
        self.peak = self.peak_abs - self.base


def ratio_summary(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Median, min and max over rounds of num[r] / den[r] (paired within each round)."""
    r = [a / b for a, b in zip(num, den)]
    return statistics.median(r), min(r), max(r)


def rotate(items: list, r: int) -> list:
    """`items` rotated by round number, so no method always runs first or after the same neighbour."""
    k = r % len(items)
    return items[k:] + items[:k]


def interleaved(methods: dict, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run every method once per round, in an order rotated by round; returns (CPU s, wall s) per method and round,
    with the load average before and after on stderr."""
    import sys

    cpu: dict[str, list[float]] = {m: [] for m in methods}
    wall: dict[str, list[float]] = {m: [] for m in methods}
    print(f"before: {loadavg()}", file=sys.stderr)
    for r in range(rounds):
        for name in rotate(list(methods), r):
            with Timed(rss=False) as t:
                methods[name]()
            cpu[name].append(t.cpu)
            wall[name].append(t.wall)
    print(f"after: {loadavg()}", file=sys.stderr)
    return cpu, wall
