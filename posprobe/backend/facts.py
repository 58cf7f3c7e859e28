"""What an analysis needs to know about a model's positional machinery, read off a TL model."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from posprobe.backend.bridge import layer_type
from posprobe.backend.hooks import layer_rotary_spec
from posprobe.backend.kind import is_bridge, is_encoder
from posprobe.backend.model import has_lm_head
from posprobe.backend.peek import WrongModelKind  # one class, torch-free, so the CLI can raise it before loading
from posprobe.rope import RotarySpec

PositionalKind = Literal["learned_absolute", "rotary", "shortformer", "sinusoidal", "alibi", "relative_bias", "none"]

_KINDS = {
    "standard": "learned_absolute",
    "rotary": "rotary",
    "shortformer": "shortformer",
    "alibi": "alibi",
    "relative_positional_bias": "relative_bias",
}


@dataclass(frozen=True)
class ModelFacts:
    """Positional facts about a model. `rotary` holds one RotarySpec per layer (None if not RoPE)."""

    name: str
    source: str
    positional_kind: str
    is_encoder: bool
    n_ctx: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    has_lm_head: bool
    has_w_pos: bool
    rotary: tuple[RotarySpec, ...] | None
    attn_types: tuple[str, ...]
    normalization: str

    @property
    def is_rotary(self) -> bool:
        return self.positional_kind == "rotary"

    def summary(self) -> dict[str, Any]:
        """Flat dict for printing and meta.json."""
        d = asdict(self)
        d.pop("rotary")
        if self.rotary:
            d["rotary_dim"] = self.rotary[0].rotary_dim
            d["rotary_pairing"] = "adjacent" if self.rotary[0].adjacent else "half-split"
            bases = [s.base for s in self.rotary]
            d["rotary_base_per_layer"] = bases if len(set(bases)) > 1 else bases[0]
        d["attn_types"] = sorted(set(self.attn_types))
        return d


def model_facts(model: Any) -> ModelFacts:
    """Read positional facts from a TransformerLens HookedTransformer, HookedEncoder or TransformerBridge."""
    if is_bridge(model):
        return _bridge_facts(model)

    cfg = model.cfg
    pet = cfg.positional_embedding_type
    kind = _KINDS.get(pet, pet)
    rotary = tuple(layer_rotary_spec(model, layer) for layer in range(cfg.n_layers)) if pet == "rotary" else None
    attn_types = tuple(getattr(b.attn, "attn_type", "global") for b in model.blocks)
    return ModelFacts(
        name=cfg.model_name,
        source=str(getattr(model, "posprobe_source", "object")),
        positional_kind=kind,
        is_encoder=is_encoder(model),
        n_ctx=cfg.n_ctx,
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_key_value_heads or cfg.n_heads,
        d_head=cfg.d_head,
        has_lm_head=bool(getattr(model, "has_lm_head", True)),
        has_w_pos=pet in ("standard", "shortformer"),
        rotary=rotary,
        attn_types=attn_types,
        normalization=str(cfg.normalization_type),
    )


def _bridge_facts(model: Any) -> ModelFacts:
    # The bridge's cfg is right about shapes and the positional kind; rotary facts and layer types come
    # from the wrapped HF model (cfg.rotary_base is wrong for SmolLM2).
    cfg = model.cfg
    pet = cfg.positional_embedding_type
    kind = _KINDS.get(pet, pet)
    rotary = tuple(layer_rotary_spec(model, layer) for layer in range(cfg.n_layers)) if pet == "rotary" else None
    attn_types = tuple("local" if (layer_type(model, l) or "").startswith("sliding") else "global"
                       for l in range(cfg.n_layers))
    return ModelFacts(
        name=str(cfg.model_name),
        source=str(getattr(model, "posprobe_source", "object")),
        positional_kind=kind,
        is_encoder=is_encoder(model),
        n_ctx=int(cfg.n_ctx),
        n_layers=int(cfg.n_layers),
        d_model=int(cfg.d_model),
        n_heads=int(cfg.n_heads),
        n_kv_heads=int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads),
        d_head=int(cfg.d_head),
        has_lm_head=has_lm_head(model),
        has_w_pos=pet in ("standard", "shortformer"),
        rotary=rotary,
        attn_types=attn_types,
        normalization=str(cfg.normalization_type),
    )


def require_rotary(facts: ModelFacts, what: str) -> None:
    """Raise WrongModelKind unless the model uses RoPE."""
    if not facts.is_rotary:
        raise WrongModelKind(
            f"{what} needs a RoPE model, but {facts.name} uses {facts.positional_kind} positions"
        )


def require_learned(facts: ModelFacts, what: str) -> None:
    """Raise WrongModelKind unless the model adds learned absolute position embeddings."""
    if not facts.has_w_pos:
        raise WrongModelKind(
            f"{what} needs learned absolute position embeddings (W_pos), but {facts.name} uses "
            f"{facts.positional_kind} positions"
        )
