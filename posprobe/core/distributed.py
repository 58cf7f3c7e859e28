"""Data parallel over processes, as launched by `torchrun` / `accelerate launch` (issue 13).

Interface: start the same script or command on every process (`torchrun --nproc_per_node 4 -m posprobe
freq-report ...`). Each rank takes a shard of the token batches (or of the pairs), runs the usual
streaming pass on its own device, and the reducer states are merged exactly: sums by all_reduce,
running means by the Chan et al. pairwise update, tables by gathering. Every rank ends with the
same merged result; only rank 0 writes files (`is_writer`).

A single process (no `WORLD_SIZE` > 1 in the environment, no initialised process group) takes every
batch, makes no collective call and needs no process group; `torch.distributed` is already imported by
`import torch`, so this module adds no import cost.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist  # already imported by `import torch`: no extra cost

T = TypeVar("T")


def _ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def world() -> tuple[int, int]:
    """(rank, world size) of this process: from the initialised process group, else from torchrun's
    `RANK` / `WORLD_SIZE` environment variables, else (0, 1)."""
    if _ready():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def active() -> bool:
    """True when more than one process takes part. Initialises the process group when torchrun started
    this process and nobody has yet (nccl when cuda is available, else gloo)."""
    if _ready():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1 or not dist.is_available():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0") or 0))  # nccl talks through this GPU
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return dist.get_world_size() > 1


class Ranks:
    """The processes of a job whose ranks work apart and only wait for each other (the zoo: one member per rank),
    met through torchrun's key-value store. No process group is initialised: transformers' `save_pretrained`
    writes nothing on a rank other than 0 once one is (transformers 5.24), and each rank here saves its own members.
    A single process (no `WORLD_SIZE` > 1) is rank 0 of 1 and never waits.

    Args:
        hours: how long `wait` may wait for the slowest rank (a rank may wait for another's whole training)."""

    def __init__(self, hours: float = 168.0) -> None:
        self.store, self.rank, self.world = None, 0, 1
        self._waits = 0
        if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and dist.is_available():
            self.store, self.rank, self.world = next(dist.rendezvous("env://", timeout=timedelta(hours=hours)))

    def wait(self) -> None:
        """Return once every rank has called `wait` as often as this one (at once in a single process)."""
        if self.store is None:
            return
        import time

        self._waits += 1
        key = f"posprobe/ranks/wait/{self._waits}"
        self.store.add(key, 1)
        while self.store.add(key, 0) < self.world:  # add 0 reads the count without blocking on the store's timeout
            time.sleep(0.2)


def _comm_device() -> torch.device:
    # nccl reduces cuda tensors only, gloo CPU tensors (and cuda ones, through the host).
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def is_writer() -> bool:
    """Whether this process writes outputs (rank 0, or the only process)."""
    return world()[0] == 0


def shard_batches(n_items: int, batch_size: int) -> list[tuple[int, int]]:
    """This rank's share of `n_items` cut into consecutive batches of `batch_size`: the (start, stop) of
    every batch whose index is congruent to the rank modulo the world size. Batches are the same ones a
    single process would form, so per-batch arithmetic is identical and only the order of the final
    float64 sums differs. Raises where some rank would get no batch."""
    rank, size = world() if active() else (0, 1)
    spans = [(i, min(i + batch_size, n_items)) for i in range(0, n_items, batch_size)]
    if len(spans) < size:
        raise ValueError(f"{len(spans)} batches of {batch_size} cannot feed {size} processes; "
                         "use more data or a smaller batch size")
    return spans[rank::size]


def shard(items: Sequence[T]) -> list[tuple[int, T]]:
    """(index, item) of this rank's items (round robin); all items in a single process."""
    rank, size = world() if active() else (0, 1)
    return [(i, items[i]) for i in range(rank, len(items), size)]


def all_reduce_sums(tensors: Sequence[torch.Tensor]) -> None:
    """Sum each tensor over all ranks, in place (one collective per dtype for all of them)."""
    if not active() or not tensors:
        return
    comm = _comm_device()
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    for ts in groups.values():
        flat = torch.cat([t.reshape(-1).to(comm) for t in ts])
        dist.all_reduce(flat)
        for t, piece in zip(ts, flat.split([t.numel() for t in ts])):
            t.copy_(piece.view(t.shape))  # back to each tensor's own device


def all_reduce_ints(values: Sequence[int]) -> list[int]:
    """Python integers summed over all ranks."""
    if not active():
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    all_reduce_sums([t])  # counts are far below 2**53, exact in float64
    return [int(v) for v in t.tolist()]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank; `[obj]` in a single process."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_indexed(pairs: Sequence[tuple[int, T]]) -> list[T]:
    """Merge every rank's (index, value) shards back into one list in index order."""
    merged = [p for part in gather_objects(list(pairs)) for p in part]
    return [v for _, v in sorted(merged, key=lambda p: p[0])]


def merge_running_means(means: Sequence[Any]) -> None:
    """Merge every rank's `core.capture.RunningMean`s (same order on every rank), in place: each ends
    holding the statistics of all ranks' samples (Chan et al. pairwise update, float64)."""
    if not active():
        return
    states = gather_objects([(None if m.count is None else (m.count.cpu(), m.mean.cpu(), m.m2.cpu())) for m in means])
    from posprobe.core.capture import RunningMean

    for i, m in enumerate(means):
        device = m.mean.device if m.mean is not None else None
        total = RunningMean()
        for rank_states in states:
            s = rank_states[i]
            if s is not None:
                total.merge(RunningMean(*s))
        if total.count is not None:
            m.count, m.mean, m.m2 = (
                t.to(device) if device is not None else t for t in (total.count, total.mean, total.m2)
            )


def local_device(device: str) -> str:
    """Under torchrun, a bare "cuda" means this process's own GPU (`cuda:LOCAL_RANK`); else `device`."""
    if device == "cuda" and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0') or 0)}"
    return device
