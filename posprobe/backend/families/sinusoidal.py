"""Fixed sinusoidal positions added to the embedding (XGLM, fairseq-style models). TransformerLens calls them
"standard" like a learned table, but its bridge has no pos_embed component for them: posprobe can describe them
and read attention patterns, not read or move the positions yet."""

from __future__ import annotations

from typing import Any

from posprobe.backend.families.base import Family

_NO_TABLE = "the fixed sinusoidal table sits inside Hugging Face's model, where posprobe cannot reach it yet"

FAMILY = Family(
    kind="sinusoidal",
    phrase="fixed sinusoidal (added to the embedding)",
    control=None,
    why_no_control=_NO_TABLE,
    not_applicable={
        "frequency": "per-frequency RoPE usage needs rotary positions; sinusoidal positions are added, not rotated",
        "geometry": _NO_TABLE,
        "shift": _NO_TABLE,
        "retrieval": "retrieval heads are read through the long-context engine, which rotates q and k",
    },
)


def detect(hf_model: Any) -> bool:
    """True where the Hugging Face model holds a sinusoidal position module (XGLM's
    XGLMSinusoidalPositionalEmbedding and its fairseq-style kin)."""
    return any("Sinusoidal" in type(m).__name__ for m in hf_model.modules())


def unsupported(arch: str) -> str:
    """Refusal for position analyses on a model whose sinusoidal table the bridge does not expose."""
    return (f"{arch} adds fixed sinusoidal positions inside Hugging Face's model (TL's bridge has no pos_embed "
            "component), which posprobe cannot read or control yet")
