"""Checkpoints: the completed units of a long run (a preset x length window, a passkey prompt, a batch of pairs,
a reducer's state after some windows) kept in a work folder, so that rerunning the same command resumes.

Each unit is one file written to a hidden temp name, flushed to disk and renamed into place: a unit is either
all there or absent, whatever kills the process. The folder's `run.json` holds the run's key (analysis, model,
data, config, versions) and its hash; a rerun with a different key is refused with the fields that differ,
instead of mixing two runs' numbers. Values are plain Python containers, numbers, strings and torch tensors
(loaded with `weights_only=True`), so a resumed run rebuilds exactly the tables an uninterrupted one does.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

__all__ = ["Checkpoint", "CheckpointMismatch", "StreamResume", "work_folder_for", "discard_work_folder", "run_key",
           "rows_sha256", "stream_resume", "source_digest", "WORK_SUFFIX"]

T = TypeVar("T")

WORK_SUFFIX = ".work"
_RUN_FILE = "run.json"
_UNITS = "units"


class CheckpointMismatch(ValueError):
    """The work folder belongs to a run with another model, data or configuration."""


def work_folder_for(out: str | os.PathLike) -> Path:
    """The work folder beside a result folder: `<out>.work`."""
    out = Path(out)
    return out.with_name(out.name + WORK_SUFFIX)


def discard_work_folder(folder: str | os.PathLike | None) -> None:
    """Delete a work folder once its run's results are written (no-op if absent or None)."""
    if folder is not None and Path(folder).exists():
        Checkpoint(folder, {}, check=False).discard()


def run_key(analysis: str, *, model: dict, data: dict, config: Any, **extra: Any) -> dict:
    """Everything a run's numbers depend on: analysis, model identity, data identity, its configuration (less
    the progress switch), the versions of posprobe, torch and transformers, and a digest of posprobe's source."""
    from dataclasses import asdict, is_dataclass

    import torch

    from posprobe import __version__

    cfg = asdict(config) if is_dataclass(config) and not isinstance(config, type) else dict(config)
    cfg.pop("progress", None)
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {"analysis": analysis, "model": model, "data": data, "config": cfg, **extra,
            "versions": {"posprobe": __version__, "posprobe_code": source_digest(), "torch": torch.__version__,
                         "transformers": tf_version}}


_SOURCE_DIGESTS: dict[str, str] = {}


def source_digest(root: str | os.PathLike | None = None) -> str:
    """sha256 of every `.py` file under `root` (default: the installed posprobe package), names and contents in
    path order: a resumed run must have been started by the same code, not only the same version number (an edited
    checkout keeps its version). Computed once per root and process (~100 files, milliseconds)."""
    base = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    key = str(base)
    if key not in _SOURCE_DIGESTS:
        h = hashlib.sha256()
        for f in sorted(base.rglob("*.py")):
            h.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
        _SOURCE_DIGESTS[key] = h.hexdigest()
    return _SOURCE_DIGESTS[key]


def rows_sha256(rows: Any) -> str:
    """sha256 of a token-id tensor's shape and values (the exact windows a corpus pass streams)."""
    import torch

    t = torch.as_tensor(rows).to("cpu", torch.int64).contiguous()
    return hashlib.sha256(repr(tuple(t.shape)).encode() + t.numpy().tobytes()).hexdigest()


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _diff(old: dict, new: dict) -> list[str]:
    a, b = _flatten(json.loads(json.dumps(old, default=str))), _flatten(json.loads(json.dumps(new, default=str)))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _unit_file(unit: str) -> str:
    return hashlib.sha1(unit.encode()).hexdigest()[:20] + ".pt"


class Checkpoint:
    """Completed units of one run in `folder` (None: nothing is kept, every unit is computed).

    `key`: everything the run's numbers depend on (JSON-able). An existing folder with another key raises
    `CheckpointMismatch` naming the differing fields; `fresh=True` discards an existing folder first.
    """

    def __init__(self, folder: str | os.PathLike | None, key: dict, *, fresh: bool = False,
                 check: bool = True) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.key = json.loads(json.dumps(key, sort_keys=True, default=str))
        self.hash = _digest(self.key)
        self._done: set[str] = set()
        self.resumed = 0
        if self.folder is None or not check:
            return
        run_file = self.folder / _RUN_FILE
        if fresh and self.folder.exists():
            self.discard()
        if self.folder.exists():
            if not run_file.is_file():
                raise CheckpointMismatch(f"{self.folder} exists and is not a posprobe work folder (no {_RUN_FILE}); "
                                         "move it away or choose another --out")
            old = json.loads(run_file.read_text())
            if old.get("hash") != self.hash:
                fields = ", ".join(_diff(old.get("key", {}), self.key)[:8]) or "the key"
                raise CheckpointMismatch(
                    f"the work folder {self.folder} holds an interrupted run with a different model, data or "
                    f"configuration (differs in: {fields}); rerun with --fresh to discard it and start over, or "
                    "choose another --out")
        else:
            (self.folder / _UNITS).mkdir(parents=True)
            self._atomic_write(run_file, json.dumps({"hash": self.hash, "key": self.key}, indent=1).encode())
        for p in (self.folder / _UNITS).iterdir():
            if p.name.startswith("."):  # a temp file left by a killed write: never renamed, never valid
                p.unlink(missing_ok=True)
            elif p.suffix == ".pt":
                self._done.add(p.name)

    @property
    def enabled(self) -> bool:
        """True when units are kept on disk."""
        return self.folder is not None

    def has(self, unit: str) -> bool:
        """Whether `unit` was completed by this or an earlier run."""
        return _unit_file(unit) in self._done

    def count(self, units: Iterable[str]) -> int:
        """How many of `units` are already done."""
        return sum(self.has(u) for u in units)

    def get(self, unit: str) -> Any:
        """The value stored for a done `unit` (KeyError if it is not done)."""
        import torch

        if not self.has(unit):
            raise KeyError(unit)
        assert self.folder is not None
        payload = torch.load(self.folder / _UNITS / _unit_file(unit), weights_only=True)
        if payload.get("unit") != unit:  # a hash collision or a foreign file: never return another unit's numbers
            raise CheckpointMismatch(f"{self.folder}: unit file for {unit!r} holds {payload.get('unit')!r}")
        return payload["value"]

    def put(self, unit: str, value: Any) -> Any:
        """Store `value` as the result of `unit` (atomically; no-op without a folder); returns `value`."""
        if self.folder is None:
            return value
        import io

        import torch

        buf = io.BytesIO()
        torch.save({"unit": unit, "value": value}, buf)
        name = _unit_file(unit)
        self._atomic_write(self.folder / _UNITS / name, buf.getvalue())
        self._done.add(name)
        return value

    def compute(self, unit: str, fn: Any) -> Any:
        """The stored value of `unit`, or `fn()` computed now and stored."""
        if self.has(unit):
            self.resumed += 1
            return self.get(unit)
        return self.put(unit, fn())

    def announce(self, units: Iterable[str], what: str, noun: str = "units") -> int:
        """Print (stderr) how many of `units` a rerun finds done, counted as `noun` (what the user sees being
        computed: "answers", "windows"); returns that count. `units` must be every unit the run will compute,
        so the two numbers are the ones its progress bar shows."""
        units = list(units)
        n = self.count(units) if self.enabled else 0
        if self.enabled and n:
            print(f"resuming {what}: {n} of {len(units)} {noun} already done in {self.folder}", file=sys.stderr)
        return n

    def map(self, items: Sequence[T], fn: Callable[[T], Any], *, name: Callable[[T], str], desc: str,
            progress: bool = True, noun: str = "units") -> list[Any]:
        """`fn(item)` for every item, in order, each one a unit named `name(item)`: done units are read back,
        the others computed and stored. The progress bar starts at the resumed count, so its rate and ETA are
        those of the units computed now."""
        from tqdm.auto import tqdm

        ids = [name(it) for it in items]
        done = self.announce(ids, desc, noun)
        out = []
        with tqdm(total=len(ids), initial=done, desc=desc + (f" (resumed {done})" if done else ""), unit=noun[:-1]
                  if noun.endswith("s") else noun, disable=not progress) as bar:
            for it, uid in zip(items, ids):
                if self.has(uid):
                    self.resumed += 1
                    out.append(self.get(uid))
                else:
                    out.append(self.put(uid, fn(it)))
                    bar.update()
        return out

    def discard(self) -> None:
        """Delete the work folder (after the results are safely written, or for --fresh)."""
        if self.folder is None or not self.folder.exists():
            return
        if not (self.folder / _RUN_FILE).is_file():
            raise CheckpointMismatch(f"{self.folder} is not a posprobe work folder (no {_RUN_FILE}); not deleting it")
        shutil.rmtree(self.folder)
        self._done.clear()

    def _atomic_write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            from posprobe.report.result import disk_full

            if disk_full(e):
                raise OSError(errno.ENOSPC, f"no space left on the device holding {self.folder} while saving a "
                                            "checkpoint; the units done so far are kept there: free space and rerun "
                                            "the same command to resume") from e
            raise


class StreamResume:
    """Resume for `posprobe.core.capture.stream`: the reducers' states after the first n batches, saved as one
    unit (replaced atomically) at most every `every_s` seconds of work and after the last batch. A rerun skips the
    n batches and folds the rest into the restored states in the same order, so the sums are bit-equal.

    `pack(state) -> value` turns a reducer's state into what a checkpoint holds (containers, numbers, tensors);
    `unpack(value) -> state` rebuilds it. Identity by default (states that are dicts of tensors).
    """

    UNIT = "stream"

    def __init__(self, ckpt: Checkpoint, *, pack: Callable[[dict], Any] | None = None,
                 unpack: Callable[[Any], dict] | None = None, every_s: float = 30.0) -> None:
        import time

        self.ckpt, self.every_s = ckpt, every_s
        self.pack = pack or (lambda st: st)
        self.unpack = unpack or (lambda v: v)
        self._last = time.monotonic()
        self.saved = 0

    def load(self) -> tuple[int, list[dict]] | None:
        """(batches done, reducer states) from an earlier run, or None."""
        if not self.ckpt.has(self.UNIT):
            return None
        v = self.ckpt.get(self.UNIT)
        print(f"resuming: {v['batches']} batches done in {self.ckpt.folder}", file=sys.stderr)
        self.saved = v["batches"]
        return v["batches"], [self.unpack(s) for s in v["states"]]

    def due(self) -> bool:
        """Whether enough work passed since the last save."""
        import time

        return time.monotonic() - self._last >= self.every_s

    def save(self, batches: int, states: Sequence[dict]) -> None:
        """Keep the states after `batches` batches."""
        import time

        if batches > self.saved:
            self.ckpt.put(self.UNIT, {"batches": batches, "states": [self.pack(s) for s in states]})
            self.saved = batches
        self._last = time.monotonic()


def stream_resume(work: str | os.PathLike | None, *, fresh: bool, analysis: str, model: Any, rows: Any, config: Any,
                  pack: Callable[[dict], Any] | None = None,
                  unpack: Callable[[Any], dict] | None = None) -> StreamResume | None:
    """The `StreamResume` of a corpus pass of `model` over token `rows` in `work` (None without a folder, and
    under torchrun, where every rank would write the same unit). The key: analysis, model facts and weight
    digest, the rows' hash, `config`."""
    if work is None:
        return None
    from posprobe.core import distributed

    if distributed.active():
        print(f"{analysis}: no checkpoints under torchrun (every rank would write the same unit)", file=sys.stderr)
        return None
    from posprobe.backend.facts import model_facts
    from posprobe.backend.model import weights_fingerprint

    key = run_key(analysis, model={"facts": model_facts(model).summary(), "weights": weights_fingerprint(model)},
                  data={"rows": rows_sha256(rows)}, config=config)
    return StreamResume(Checkpoint(work, key, fresh=fresh), pack=pack, unpack=unpack)
