"""Worker for tests/test_distributed.py: one rank of a 2-process gloo group on the CPU."""

from __future__ import annotations

import os
import pickle
import sys


def work(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Run the corpus-scale analyses as rank `rank`; rank 0 pickles the merged results to `out_dir`."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from posprobe.core import distributed

        results = compute()
        assert distributed.active() and distributed.world() == (rank, world)
        if distributed.is_writer():
            with open(os.path.join(out_dir, "merged.pkl"), "wb") as f:
                pickle.dump(results, f)
        # Both ranks leave the group together: a rank that tears gloo down while its peer is still
        # sending aborted once in CI ("terminate called without an active exception", SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's threads can still abort in static destructors at interpreter exit on a loaded 2-core
    # machine; the result is on disk and checked by the parent, so skip the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def compute() -> dict:
    """Frequency usage, head signatures and the shift test on tiny-rope: the tables, picklable."""
    import torch

    from posprobe.analyses.configs import HeadsConfig, ShiftConfig
    from posprobe.analyses.frequency import frequency_usage
    from posprobe.analyses.frequency_ablation import BandAblation, band_ablation
    from posprobe.analyses.heads import head_signatures
    from posprobe.analyses.shift import run_shift_test
    from posprobe.backend.loading import load_model
    from posprobe.core import distributed
    from posprobe.core.capture import RunningMean
    from posprobe.data import builtin_pairs

    model = load_model("tiny-rope")
    rows = torch.randint(3, 200, (7, 20), generator=torch.Generator().manual_seed(1))  # 4 batches of 2 (last 1)
    freq = frequency_usage(model, rows, batch_size=2, queries=8, progress=False)
    heads = head_signatures(model, rows, HeadsConfig(batch_size=2, progress=False, induction_len=6, induction_batch=2))
    shift = run_shift_test(model, builtin_pairs(seed=0, max_pairs=12), config=ShiftConfig(ks=(0, 9), progress=False,
                                                                                             batch_size=4))
    ablation = band_ablation(model, rows, [BandAblation(name="fast", bands=frozenset({0, 1}))], batch_size=2,
                             progress=False)
    # A running mean over this rank's share of 11 samples, merged over ranks.
    x = torch.randn(11, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    rm = RunningMean()
    for i, _ in distributed.shard(list(range(11))):
        rm.update(x[i:i + 1])
    distributed.merge_running_means([rm])
    return {"freq": freq.tables, "heads": heads.tables, "shift": shift.tables["shift_pairs"], "ablation": ablation,
            "mean": (rm.count, rm.mean, rm.var)}
