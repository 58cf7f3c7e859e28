"""--threads: torch's compute threads for a command, and the one line that names a busy machine.

On 2 cores that other jobs already keep busy, torch's default of one thread per core oversubscribes the CPU: measured
5-16x slower (docs/getting-started.md, "Threads"). posprobe never changes the count by itself: a training run that
resumes must compute as the run it resumes, and a thread count can change a float sum's order.
"""

from __future__ import annotations

import os
import sys

__all__ = ["set_threads", "warn_if_busy"]


def set_threads(threads: int | None) -> None:
    """Apply --threads before any work: torch's intra-op threads if torch is loaded, else OMP_NUM_THREADS and
    MKL_NUM_THREADS, which torch reads when it starts (commands import it only after their input checks)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1; got {threads}")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    else:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)


def warn_if_busy() -> None:
    """One line on stderr when other processes already fill every core and torch would still use several threads
    (called where the heavy work starts, after the input checks, so a refusal stays one line)."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    torch = sys.modules.get("torch")
    one = os.environ.get("OMP_NUM_THREADS", "").strip() == "1" or (torch is not None and torch.get_num_threads() == 1)
    if cores > 1 and load >= cores - 0.5 and not one:
        print(f"posprobe: the machine is busy (1-minute load {load:.1f} on {cores} cores): torch's one thread per "
              "core competes with the other jobs and can run several times slower; --threads 1 avoids it",
              file=sys.stderr)
