"""Rotary positions (RoPE): q and k rotated by position-dependent angles in each band (pair of dims).

Covers full and partial rotation (`rotary_pct`, `partial_rotary_factor`), half-split (Llama / NeoX) and adjacent
(GPT-J / Cohere / GLM) pairing, per-layer bases (local / global), scaled tables (HF rope types) and NoPE layers
between rotary ones (those layers belong to `nope`). The per-layer RotarySpec is read through `backend.hf`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from posprobe.backend.families.base import Family

if TYPE_CHECKING:  # torch-free at import: peek runs before torch loads
    from posprobe.rope import RotarySpec

#: Config keys whose presence names rotary positions in a Hugging Face config.
HF_KEYS = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim", "rotary_pct", "rotary_emb_base",
           "rotary_emb_fraction", "partial_rotary_factor")



def uses_rotary(cfg: Mapping[str, Any]) -> bool:
    """True where an HF config dict names rotary positions (a `position_embedding_type` of rotary / rope, or any
    rope key), whether or not any layer applies them (`nope` asks this too)."""
    pet = str(cfg.get("position_embedding_type") or "").lower()
    return pet in ("rotary", "rope") or any(cfg.get(k) is not None for k in HF_KEYS)


FAMILY = Family(
    kind="rotary",
    label="RoPE",
    tl_names=frozenset({"rotary"}),
    shift_invariant=True,
    gguf_key_prefix="rope.",
    detect_hf=lambda cfg, row_family: uses_rotary(cfg),
    phrase="rotary",
    control="q/k rotation",
    decompositions=("data-driven",),
    not_applicable={"geometry": "position geometry reads a learned position table; rotary models have none"},
)


def phrase(spec: RotarySpec, d_head: int) -> str:
    """How one rotary layer rotates: share of the head dim, pairing, base, and any scaling of the table."""
    pct = 100 * spec.rotary_dim / d_head if d_head else 100
    scaled = ", scaled frequencies" if spec.freq_scale is not None else ""
    if spec.removed:  # Gemma 4's proportional RoPE: the slow bands never turn
        scaled += f", {spec.n_bands - len(spec.removed)} of {spec.n_bands} bands rotate"
    if spec.attention_factor != 1.0:
        scaled += f", cos/sin x{spec.attention_factor:.6g}"
    return (f"rotary {pct:.0f}% of head dim, {'adjacent' if spec.adjacent else 'half-split'} pairing, "
            f"base {spec.base:g}{scaled}")


def no_rotary_module(arch: str) -> str:
    """Refusal for a model that rotates inside its attention with no rotary-embedding module to read."""
    return (f"{arch} rotates inside its attention without a rotary-embedding module (GPT-J style interleaved "
            "pairs), which posprobe does not read yet")


def kv_shared(arch: str, n_shared: int) -> str:
    """Refusal for a model whose last layers reuse earlier layers' keys (Gemma 4's num_kv_shared_layers)."""
    # Measured on a tiny Gemma 4: the sharing layers have no hook_k (they read an earlier layer's cached keys).
    return (f"{arch} reuses earlier layers' keys and values in its last {n_shared} layers (num_kv_shared_layers), "
            "which posprobe's position control does not reach yet")
