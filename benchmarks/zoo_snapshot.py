"""Numbers unchanged across a refactor of the zoo's factory: a fixed tiny zoo trained (`zoo train`, with the passkey
skill), a task zoo (`zoo tasks`) and the zoo extended by every method (`zoo extend`: direct, pi, ntk, yarn, abf, pose,
drope, custom, and copy for the learned control), each Result's tables and every saved weight file recorded.

    OMP_NUM_THREADS=1 python benchmarks/zoo_snapshot.py write before.pkl     # on the tree before the change
    OMP_NUM_THREADS=1 python benchmarks/zoo_snapshot.py write after.pkl      # on the tree after it
    python benchmarks/zoo_snapshot.py compare before.pkl after.pkl

`compare` asserts every table `assert_frame_equal(check_exact=True)` (wall-clock columns dropped: seconds and
tokens/s are timings, not numbers of the models) and every member folder's weights, config.json and zoo.json equal by
sha256, and prints what it compared.
Run both writes alone on the machine with the same thread count (float order follows the threads). About 2 minutes
on one CPU thread."""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tempfile
from pathlib import Path

#: Wall-clock columns (seconds, rates): timings of the machine, not numbers of the models.
TIMINGS = ("seconds", "tokens_per_s", "scoring_seconds", "checkpoint_seconds")
#: meta.json fields that carry the time or the machine.
META_VOLATILE = ("created", "seconds", "timing", "environment", "elapsed", "versions", "posprobe_version", "git")


def _tables(result) -> dict:
    return {name: df.drop(columns=[c for c in TIMINGS if c in df.columns]) for name, df in result.tables.items()}


def _weights(folder: Path) -> dict:
    # Every member folder's weights, HF config and zoo.json (what the member says it is), by sha256.
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for pattern in ("*/*.safetensors", "*/config.json", "*/zoo.json") for p in sorted(folder.glob(pattern))}


def write(path: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from posprobe.analyses.context_extension import extend_zoo
    from posprobe.data import builtin_corpus
    from posprobe.zoo.config import TaskConfig, ZooConfig
    from posprobe.zoo.extend import ExtendConfig
    from posprobe.zoo.run import train_zoo
    from posprobe.zoo.task_zoo import train_task_zoo

    snap: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = ZooConfig(members=("rope", "partial", "rope-llama", "hybrid", "p-rope", "alibi", "learned"), d_model=32,
                        n_layers=2, n_heads=2, length=64, vocab_size=300, batch_size=4, steps=20, warmup=2,
                        checkpoint_every=10, passkey=0.25, progress=False)
        got = train_zoo(cfg, builtin_corpus(), tmp / "zoo")
        snap["train"] = (_tables(got), _weights(tmp / "zoo"))
        tasks = TaskConfig(tasks=("copy", "reverse"), train_max=3, test_factor=2.0, test_count=4, steps=12,
                           batch_size=4)
        got = train_task_zoo(ZooConfig(members=("rope", "nope", "learned"), d_model=16, n_layers=1, n_heads=2,
                                       progress=False), tasks, tmp / "tasks")
        snap["tasks"] = (_tables(got), _weights(tmp / "tasks"))
        ext = ExtendConfig(methods=("direct", "pi", "ntk", "yarn", "abf", "pose", "drope", "copy"),
                           rope_parameters={"rope_type": "linear", "factor": 2.0}, steps=4, checkpoints=(0, 2),
                           checkpoint_every=2, eval_tokens=512, passkey_trials=2, passkey_step=32, passkey=0.25,
                           progress=False)
        got = extend_zoo(tmp / "zoo", ext, tmp / "ext")
        snap["extend"] = (_tables(got), _weights(tmp / "ext"))
    Path(path).write_bytes(pickle.dumps(snap))
    print(f"wrote {path}: " + ", ".join(f"{k} {len(t)} tables, {len(w)} weight files" for k, (t, w) in snap.items()))


def compare(before: str, after: str) -> None:
    from pandas.testing import assert_frame_equal

    a, b = (pickle.loads(Path(p).read_bytes()) for p in (before, after))
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for run in a:
        (ta, wa), (tb, wb) = a[run], b[run]
        assert ta.keys() == tb.keys(), (run, sorted(ta), sorted(tb))
        for name in ta:
            assert_frame_equal(ta[name], tb[name], check_exact=True, obj=f"{run}/{name}")
        assert wa == wb, (run, {k for k in wa.keys() | wb.keys() if wa.get(k) != wb.get(k)})
        rows = sum(len(df) for df in ta.values())
        print(f"{run}: {len(ta)} tables ({rows} rows) equal exactly, {len(wa)} weight files byte-identical")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "write":
        write(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
