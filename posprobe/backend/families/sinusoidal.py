"""Fixed sinusoidal positions added to the embedding (XGLM, fairseq-style models). TransformerLens calls them
"standard" like a learned table, but its bridge has no pos_embed component for them: the table lives in a Hugging
Face module (XGLMSinusoidalPositionalEmbedding, read from row `offset` = 2), which posprobe reaches directly.
Position control hands that module the plan's position ids, exactly as HF's own `position_ids` argument does."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from posprobe.backend.families.base import Family, listed

FAMILY = Family(
    kind="sinusoidal",
    label="fixed sinusoidal",
    fixed_table=True,
    detect_hf=listed("sinusoidal"),
    phrase="fixed sinusoidal (added to the embedding)",
    control="position ids",
    decompositions=("data-driven",),
    not_applicable={
        "frequency": "per-frequency RoPE usage needs rotary positions; sinusoidal positions are added, not rotated",
        "geometry": "position geometry reads a learned position table; a sinusoidal table is fixed by its formula",
        "retrieval": "retrieval heads are read through the long-context engine, which rotates q and k",
    },
)


def detect(hf_model: Any) -> bool:
    """True where the Hugging Face model holds a sinusoidal position module (XGLM's
    XGLMSinusoidalPositionalEmbedding and its fairseq-style kin)."""
    return module(hf_model) is not None


def module(hf_model: Any) -> Any:
    """The model's sinusoidal position module, or None."""
    return next((m for m in hf_model.modules() if "Sinusoidal" in type(m).__name__), None)


def unsupported(arch: str) -> str:
    """Refusal for position analyses on a sinusoidal model whose position module posprobe does not know."""
    return (f"{arch} adds fixed sinusoidal positions through a module posprobe does not know (it reads XGLM's, "
            "called with position ids)")


def known(hf_model: Any) -> bool:
    """True where the sinusoidal module is called as XGLM's is, `forward(position_ids, ...)` (ids 0-based, the
    module adding its own offset): the only layout posprobe has proven against Hugging Face."""
    import inspect

    m = module(hf_model)
    if m is None:
        return False
    params = list(inspect.signature(m.forward).parameters)
    return bool(params) and params[0] == "position_ids"


@contextmanager
def positions_at(hf_model: Any, position_ids: Any) -> Iterator[None]:
    """Within the block every forward of `hf_model` adds the sinusoid of `position_ids[t]` (`[pos]` or
    `[batch, pos]`, long) to token t: the module is handed these ids in place of the ones HF built. ValueError
    during a forward whose length differs from the ids'."""
    m = module(hf_model)

    def pre(mod: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        given = args[0] if args else kwargs["position_ids"]
        n = given.shape[-1]
        if position_ids.shape[-1] != n:
            raise ValueError(f"{position_ids.shape[-1]} position ids given for a sequence of {n} tokens")
        ids = position_ids.to(given.device)
        ids = ids.expand(given.shape[0], -1) if ids.dim() == 1 else ids
        if args:
            return (ids, *args[1:]), kwargs
        return args, {**kwargs, "position_ids": ids}

    handle = m.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
