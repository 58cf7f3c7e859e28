"""Simulating "a device that is not the CPU" on a CPU-only machine, and counting host syncs.

What can be simulated: a model moved to PyTorch's `meta` device. Meta tensors carry shape, dtype and
device but no data, and PyTorch refuses to mix a non-scalar CPU tensor with a meta one ("Tensor on
device meta is not on the expected device cpu"), exactly as it refuses CPU + cuda. So an analysis
that runs through on a meta model creates its tensors on the model's device. Reading a meta tensor
on the host (`.item()`, `.tolist()`, `.numpy()`, `.cpu()`, `bool()`/`float()`/`int()`, `torch.equal`)
is the CPU-side analogue of a cuda device->host sync; `SyncCounter` counts every such read of a
non-CPU tensor and, for meta tensors, answers with zeros so the analysis can go on to the end.

What cannot be simulated: real cuda numerics (kernels, tolerances), streams and asynchronous
copies, two different accelerators (cuda:0 vs cuda:1), mps' missing float64, and numbers after the
final move to the CPU (they are placeholders). `torch.cuda.set_sync_debug_mode` covers the real thing
where a GPU exists (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import torch

_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


def _zeros(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=dtype or t.dtype)


def _placeholder(name: str, t: torch.Tensor) -> Any:
    if name == "cpu":
        return _zeros(t)
    if name == "numpy":
        return _zeros(t).numpy()
    if name == "tolist":
        return _zeros(t).tolist()
    return _zeros(t).reshape(-1)[0].item() if name == "item" else {"__bool__": False, "__int__": 0,
                                                                     "__float__": 0.0, "__index__": 0}[name]


def is_core_module(name: str) -> bool:
    """Whether a module named `name` is posprobe's own code above the backend (core, analyses, ...).

    Classified by the module's import name, never by its file's path: a checkout folder named `posprobe`
    (git's default) holds the venv, so transformers' and torch's files also have `/posprobe/` in their
    paths (README command 2 failed that way)."""
    return (name == "posprobe" or name.startswith("posprobe.")) and not (
        name == "posprobe.backend" or name.startswith("posprobe.backend."))


class SyncCounter:
    """Counts host reads of non-CPU tensors while active (`counts`: per method, `total`) and, apart,
    host->device copies (`h2d`: `.to(device)` of a CPU tensor, `torch.tensor(..., device=...)`;
    `h2d_core`: those called from posprobe's core and analyses code)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.h2d = 0
        # Those made by posprobe's core and analyses code, not by its backend, transformers or TransformerLens.
        self.h2d_core = 0

    def copied(self, caller: Any) -> None:
        self.h2d += 1
        if is_core_module(caller.f_globals.get("__name__", "")):
            self.h2d_core += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @contextmanager
    def active(self) -> Iterator[SyncCounter]:
        saved = {m: getattr(torch.Tensor, m) for m in _METHODS}
        saved_to, saved_equal, saved_tensor = torch.Tensor.to, torch.equal, torch.tensor

        def wrap(name: str):
            real = saved[name]

            def method(self: torch.Tensor, *a: Any, **k: Any) -> Any:
                if self.device.type != "cpu":
                    counter.counts[name] += 1
                    if self.device.type == "meta":
                        return _placeholder(name, self)
                return real(self, *a, **k)

            return method

        def to(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            device, dtype, *_ = torch._C._nn._parse_to(*a, **k)
            if self.device.type != "cpu":
                if device is not None and device.type == "cpu":
                    counter.counts["to(cpu)"] += 1
                    if self.device.type == "meta":
                        return _zeros(self, dtype)
            elif device is not None and device.type != "cpu":
                counter.copied(sys._getframe(1))  # a host->device copy (pageable memory: a stream sync on cuda)
            return saved_to(self, *a, **k)

        def tensor(data: Any, *a: Any, **k: Any) -> torch.Tensor:
            dev = k.get("device")
            if dev is not None and torch.device(dev).type != "cpu":
                counter.copied(sys._getframe(1))
            return saved_tensor(data, *a, **k)

        def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
            if a.device.type != "cpu" or b.device.type != "cpu":
                counter.counts["torch.equal"] += 1
                if "meta" in (a.device.type, b.device.type):
                    return False
            return saved_equal(a, b)

        counter = self
        try:
            for m in _METHODS:
                setattr(torch.Tensor, m, wrap(m))
            torch.Tensor.to = to  # type: ignore[method-assign]
            torch.equal = equal  # type: ignore[assignment]
            torch.tensor = tensor  # type: ignore[assignment]
            yield self
        finally:
            for m, f in saved.items():
                setattr(torch.Tensor, m, f)
            torch.Tensor.to = saved_to  # type: ignore[method-assign]
            torch.equal = saved_equal  # type: ignore[assignment]
            torch.tensor = saved_tensor  # type: ignore[assignment]


def count_syncs(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, SyncCounter]:
    """Run `fn(*args, **kwargs)` under a SyncCounter; (its result, the counter)."""
    c = SyncCounter()
    with c.active():
        out = fn(*args, **kwargs)
    return out, c


def on_meta(spec: str) -> Any:
    """A built-in tiny model (`tiny-rope`, `tiny-ape`) with its weights on the meta device.

    Rotary frequency buffers (`inv_freq`) stay on the CPU: they are constants of the config that the
    model facts read once (on a GPU: one copy at set-up), and HF's rotary module moves them to the
    activations' device itself, so the forward pass still runs entirely on meta."""
    from posprobe.backend.kind import is_bridge
    from posprobe.backend.loading import load_model

    model = load_model(spec)
    if not is_bridge(model):  # legacy TL HookedTransformer: its own .to() moves every block, sets cfg.device
        return model.to("meta")
    inner = model.original_model
    keep = {n: b for n, b in inner.named_buffers() if n.endswith("inv_freq")}
    inner.to("meta")
    for name, buf in keep.items():
        owner, _, leaf = name.rpartition(".")
        inner.get_submodule(owner)._buffers[leaf] = buf
    if hasattr(model, "cfg"):
        model.cfg.device = "meta"
    return model
