"""Benchmark: what `--threads` buys on a quiet and on a busy CPU (issue 53: a newcomer on a busy 2-core machine ran
5-16x slower at torch's default of one thread per core, and nothing said so).

Each round runs the same command as a user would, `posprobe zoo train --member rope ... --no-progress`, once with
torch's default thread count and once with `--threads 1` (order rotated per round), first on a quiet machine, then
with `--load N` busy-loop processes started beside it (the "other jobs"). The headline is wall-clock tokens/s read
from the command's own summary line; the ratio is --threads 1 over the default, paired within a round.

    python benchmarks/bench_threads.py --rounds 2 --steps 60 --load 2                      # Python busy loops
    python benchmarks/bench_threads.py --rounds 2 --steps 60 --load 1 --neighbour torch    # a torch job beside
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _spin() -> None:  # one busy core: what a neighbouring job does to the scheduler
    while True:
        pass


def _torch_job() -> None:  # a neighbouring torch job at torch's default threads (another analysis, a training run)
    import torch

    a = torch.randn(512, 512)
    while True:
        a = torch.tanh(a @ a)


def _run(threads: int | None, steps: int, out: Path) -> float:
    """tokens/s of one `zoo train` run (its summary line), wall clock."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "posprobe", "zoo", "train", "--member", "rope", "--steps", str(steps),
           "--checkpoint-every", str(steps), "--no-progress", "--out", str(out)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return float(re.search(r"([\d.]+)k tokens/s", done.stdout).group(1)) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--load", type=int, default=2, help="neighbouring processes for the loaded condition")
    ap.add_argument("--neighbour", choices=("spin", "torch"), default="spin",
                    help="what each neighbour runs: a Python busy loop (one core) or a torch matmul loop at torch's "
                         "default threads")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for condition in ("quiet", "loaded"):
            job = _spin if args.neighbour == "spin" else _torch_job
            spinners = [mp.Process(target=job, daemon=True) for _ in range(args.load if condition == "loaded" else 0)]
            for p in spinners:
                p.start()
            time.sleep(2 if spinners else 0)
            try:
                for r in range(args.rounds):
                    got = {}
                    for threads in ((None, 1) if r % 2 == 0 else (1, None)):
                        got[threads] = _run(threads, args.steps, Path(tmp) / f"{condition}-{r}-{threads}")
                    rows.append((condition, r, got[None], got[1], os.getloadavg()[0]))
                    print(f"{condition} round {r}: default {got[None]:.0f}, --threads 1 {got[1]:.0f} tokens/s "
                          f"(load {rows[-1][4]:.1f})", file=sys.stderr)
            finally:
                for p in spinners:
                    p.terminate()
    print(f"cores {os.cpu_count()}; {args.steps} steps of the rope member per run; loaded = {args.load} x "
          f"{args.neighbour} neighbour; wall-clock tokens/s (median)")
    print("condition  default  --threads 1  ratio (1 / default)")
    for condition in ("quiet", "loaded"):
        mine = [r for r in rows if r[0] == condition]
        d, o = statistics.median(r[2] for r in mine), statistics.median(r[3] for r in mine)
        ratios = [r[3] / r[2] for r in mine]
        print(f"{condition:9s}  {d:7.0f}  {o:11.0f}  {statistics.median(ratios):.2f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
