"""What an analysis needs to know about a model's positional machinery: one `ModelFacts` shape for every model
object, built by one constructor from small readers — the backend adapter (`dispatch.ops`: TransformerBridge or
TL 3) for loaded TransformerLens models, the Hugging Face door (`hf.py`) for plain HF models."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from posprobe.backend import families, hf
from posprobe.backend.dispatch import ops
from posprobe.backend.kind import is_encoder
from posprobe.backend.model import has_lm_head
from posprobe.backend.peek import (  # torch-free, so the CLI can raise WrongModelKind before loading
    WrongModelKind,
    hf_is_encoder,
    tl_positional_kind,
)
from posprobe.rope import RotarySpec


@dataclass(frozen=True)
class ModelFacts:
    """Positional facts about a model. `rotary` holds one RotarySpec per layer (an entry None for a NoPE layer;
    the whole None if not RoPE, or where the model's rotation is one posprobe does not read: see `unsupported`)."""

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
    rotary: tuple[RotarySpec | None, ...] | None
    attn_types: tuple[str, ...]
    normalization: str
    #: Per layer: how positions enter ("rotary 100% of head dim, half-split pairing, base 1e+05", "NoPE", ...).
    layer_positions: tuple[str, ...] = ()
    #: Why posprobe refuses its position analyses on this model (None: proven against Hugging Face).
    unsupported: str | None = None
    #: Why posprobe refuses its attention-pattern analyses (heads) on this model (None: proven).
    attention_unsupported: str | None = None
    #: ALiBi models: per layer, each head's slope as measured from the model's own scores (None otherwise).
    alibi_slopes: tuple[tuple[float, ...], ...] | None = None
    #: Why the rotated q/k are not at hook_rot_q/k (the model rotates where no hook fires), or None. Position control
    #: then rotates hook_q/hook_k ahead of the model's own rotation; analyses that read rotated q/k refuse.
    rotation_unhooked: str | None = None

    @property
    def is_rotary(self) -> bool:
        return self.positional_kind == families.ROTARY

    @property
    def family(self) -> families.Family | None:
        """The positional family's adapter (its answers: shift invariance, position ids, tables, ...), None for a
        kind posprobe has no adapter for."""
        return families.find(self.positional_kind)

    @property
    def rotary_layers(self) -> tuple[int, ...]:
        """Layers that rotate q and k (all but NoPE layers; none for other kinds)."""
        return tuple(l for l, s in enumerate(self.rotary or ()) if s is not None)

    @property
    def first_rotary(self) -> RotarySpec | None:
        """The rotation of the first rotary layer (band count and rotary dim are shared by every rotary layer)."""
        return next((s for s in self.rotary or () if s is not None), None)

    def check_rotary_layers(self, layers: Any, what: str) -> list[int]:
        """`layers` (None: every rotary layer) as a list, ValueError for one out of range or without rotation."""
        chosen = list(self.rotary_layers) if layers is None else list(layers)
        if not chosen or any(not 0 <= l < self.n_layers for l in chosen):
            raise ValueError(f"layers must be within 0..{self.n_layers - 1}; got {chosen}")
        nope = [l for l in chosen if l not in self.rotary_layers]
        if nope:
            raise ValueError(f"{what}: layer{'s' if len(nope) > 1 else ''} {', '.join(map(str, nope))} of "
                             f"{self.name} apply no positional encoding (NoPE)")
        return chosen

    def summary(self) -> dict[str, Any]:
        """Flat dict for printing and meta.json."""
        d = asdict(self)
        d.pop("rotary")
        specs = [s for s in self.rotary or () if s is not None]
        if specs:
            d["rotary_dim"] = specs[0].rotary_dim
            d["rotary_pairing"] = "adjacent" if specs[0].adjacent else "half-split"
            bases = [s.base for s in specs]
            d["rotary_base_per_layer"] = bases if len(set(bases)) > 1 else bases[0]
        d["attn_types"] = sorted(set(self.attn_types))
        d["layer_positions"] = _runs(self.layer_positions)
        if self.alibi_slopes is not None:
            d["alibi_slopes"] = [[round(s, 8) for s in layer] for layer in self.alibi_slopes]
        return d


def _runs(items: tuple[str, ...]) -> list[str]:
    """Consecutive equal items as "layers a-b: item" (one line per run), for printing per-layer facts."""
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[i]:
            j += 1
        out.append(f"layer{'s' if j > i else ''} {i}{f'-{j}' if j > i else ''}: {items[i]}")
        i = j + 1
    return out


def _whole_model_kind(kinds: tuple[str, ...], kind: str) -> str:
    """The model's positional kind: "nope" where every layer is NoPE (a rotary architecture with rotary switched off
    everywhere, as SmolLM3's `no_rope_layers` all 0), else `kind`. Position plans cannot move such a model."""
    return families.NOPE if kinds and all(k == families.NOPE for k in kinds) else kind


def model_facts(model: Any) -> ModelFacts:
    """Positional facts of a TransformerLens model (TransformerBridge, HookedTransformer or HookedEncoder): shapes
    from its config, rotary specs and layer types from the backend adapter (on a bridge: from the wrapped HF
    model, whose rotary base the bridge's own config can get wrong). NotImplementedError, naming why, for a model
    whose bridge forward is known not to be Hugging Face's: every analysis asks for the facts first.

    Read once per model and kept on it (every analysis asks, an atlas a dozen times); read again where what they
    are read from has changed (the name, context, source, head or positional type set on the model).

    Args:
        model: a TransformerLens model (as `load_model` returns).

    Returns:
        The model's `ModelFacts`.
    """
    key = _facts_key(model)
    kept = model.__dict__.get("_posprobe_facts")
    if kept is not None and kept[0] == key:
        return kept[1]
    facts = _read_facts(model)
    model.__dict__["_posprobe_facts"] = (key, facts)
    return facts


def _facts_key(model: Any) -> tuple:
    cfg = model.cfg
    return (str(cfg.model_name), int(cfg.n_ctx), str(cfg.positional_embedding_type),
            str(getattr(model, "posprobe_source", "object")), has_lm_head(model), id(getattr(model, "tokenizer", None)))


def _read_facts(model: Any) -> ModelFacts:
    cfg = model.cfg
    pet = cfg.positional_embedding_type
    adapter = ops(model)
    broken = adapter.forward_unsupported(model)
    if broken is not None:
        raise NotImplementedError(broken)
    rotary, attn_types, kinds = adapter.rotary_specs(model), adapter.attn_types(model), adapter.layer_kinds(model)
    rules = tuple(adapter.length_rule(model, l) for l in range(len(kinds))) if rotary is not None else None
    slopes = None
    if families.ALIBI in kinds:
        try:
            slopes = adapter.alibi_slopes(model)
        except NotImplementedError:
            slopes = None  # positional_unsupported says why
    return ModelFacts(
        name=str(cfg.model_name),
        source=str(getattr(model, "posprobe_source", "object")),
        # TL calls a fixed sinusoidal table "standard" too (XGLM): the adapter's per-layer kinds tell them apart.
        positional_kind=_whole_model_kind(kinds, families.SINUSOIDAL if families.SINUSOIDAL in kinds
                                          else tl_positional_kind(pet)),
        is_encoder=is_encoder(model),
        n_ctx=int(cfg.n_ctx),
        n_layers=int(cfg.n_layers),
        d_model=int(cfg.d_model),
        n_heads=int(cfg.n_heads),
        n_kv_heads=int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads),
        d_head=int(cfg.d_head),
        has_lm_head=has_lm_head(model),
        has_w_pos=(tl_positional_kind(pet) == families.LEARNED or pet == "shortformer")
        and families.SINUSOIDAL not in kinds and hasattr(model, "pos_embed"),
        rotary=rotary,
        attn_types=attn_types,
        normalization=str(cfg.normalization_type),
        layer_positions=families.describe_layers(kinds, rotary, int(cfg.d_head), attn_types, alibi_slopes=slopes,
                                        length_rules=rules),
        unsupported=adapter.positional_unsupported(model),
        attention_unsupported=adapter.attention_unsupported(model),
        alibi_slopes=slopes,
        rotation_unhooked=adapter.rotation_unhooked(model),
    )


def hf_facts(hf_model: Any, name: str | None = None) -> ModelFacts:
    """Positional facts of a plain Hugging Face model, read through `backend.hf` (the long-context harness and
    the shift test's HF path).

    Args:
        hf_model: a plain Hugging Face model (as `load_hf_model` returns).
        name: the model's name in the facts (default: the config's `_name_or_path`, else the class name).

    Returns:
        The model's `ModelFacts`. `rotary` is None where the rope type's table is not static (dynamic,
            longrope): the model's own forward still runs, posprobe's rotation does not claim to reproduce it.
    """
    cfg = hf.text_config(hf_model)
    kind = hf.positional_kind(hf_model)
    layers = len(hf.attention_modules(hf_model)) or int(getattr(cfg, "num_hidden_layers", 0))
    rotary = None
    nope = hf.nope_layers(hf_model)
    if kind == families.ROTARY:
        try:
            rotary = tuple(None if l in nope else hf.rotary_spec(hf_model, l, name=name) for l in range(layers))
        except NotImplementedError:
            rotary = None
    kinds = tuple(families.NOPE if l in nope else kind for l in range(layers))
    kind = _whole_model_kind(kinds, kind)
    rules = tuple(hf.length_rule_text(hf_model, l) for l in range(layers)) if rotary is not None else None
    attn_types = tuple("local" if (hf.layer_type(hf_model, l) or "").startswith("sliding") else "global"
                       for l in range(layers))
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    norms = [type(m).__name__ for m in hf_model.modules() if type(m).__name__.endswith(("Norm", "LayerNorm"))]
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    return ModelFacts(
        name=name or str(getattr(cfg, "_name_or_path", "") or type(hf_model).__name__),
        source=str(getattr(cfg, "_name_or_path", "") or "object"),
        positional_kind=kind,
        is_encoder=hf_is_encoder(cfg.to_dict()),
        n_ctx=int(hf.position_table_size(hf_model) or 0),
        n_layers=layers,
        d_model=int(getattr(cfg, "hidden_size", 0) or 0),
        n_heads=heads,
        n_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        d_head=hf.head_dim(hf_model) if heads else 0,
        has_lm_head=head is not None,
        has_w_pos=kind == families.LEARNED,
        rotary=rotary,
        attn_types=attn_types,
        normalization=norms[0] if norms else "none",
        layer_positions=families.describe_layers(kinds, rotary, hf.head_dim(hf_model) if heads else 0, attn_types,
                                        length_rules=rules),
    )


# ---- a plain Hugging Face model's config facts, for analyses that drive HF models directly (the long-context
# harness, jitter, the shift test's HF path): the analyses ask here, never backend.hf itself.

def hf_positional_kind(hf_model: Any) -> str:
    """The positional kind a plain HF model's config names ("unknown" where none)."""
    return hf.positional_kind(hf_model)


def hf_trained_context(hf_model: Any) -> int | None:
    """Tokens the model was trained for: the config's original_max_position_embeddings under rope scaling, else
    max_position_embeddings / n_positions; None where the config gives none."""
    return hf.trained_context(hf_model)


def hf_position_table(hf_model: Any) -> int | None:
    """Positions the config declares (max_position_embeddings / n_positions), or None."""
    return hf.position_table_size(hf_model)


def hf_vocab_size(hf_model: Any) -> int:
    """Rows of the model's vocabulary (token ids are below this)."""
    return int(hf.text_config(hf_model).vocab_size)


def hf_attention_modules(hf_model: Any) -> list[Any]:
    """The decoder's HF attention modules in layer order."""
    return hf.attention_modules(hf_model)


def at_length(model: Any, facts: ModelFacts, length: int) -> ModelFacts:
    """`facts` with each rotary layer's spec for inputs of `length` tokens: differs from the loaded tables only on
    dynamic / longrope layers past their threshold (the frequencies a window of that length is rotated with)."""
    if facts.rotary is None or all(ops(model).table_length(model, l, length) is None for l in facts.rotary_layers):
        return facts
    at = ops(model).layer_rotary_spec
    return replace(facts, rotary=tuple(None if s is None else at(model, l, length) for l, s in enumerate(facts.rotary)))


def require_fixed_table(model: Any, facts: ModelFacts, what: str) -> None:
    """NotImplementedError where a rotary layer's table changes with the input's length (dynamic, longrope) and
    `what` builds its rotation from one table for every input."""
    rules = {r for r in (ops(model).length_rule(model, l) for l in facts.rotary_layers) if r}
    if rules:
        raise NotImplementedError(f"{what} is not available for {facts.name} yet: its rotation changes with the "
                                  f"input's length ({'; '.join(sorted(rules))})")


def require_supported(facts: ModelFacts, what: str) -> None:
    """Raise NotImplementedError, naming what is unsupported, unless posprobe has proven its position handling of
    this model's family against Hugging Face."""
    if facts.unsupported is not None:
        raise NotImplementedError(f"{what} is not available for {facts.name}: {facts.unsupported}")


def require_attention_supported(facts: ModelFacts, what: str) -> None:
    """Raise NotImplementedError unless posprobe has proven this family's attention pattern equal to Hugging Face's."""
    if facts.attention_unsupported is not None:
        raise NotImplementedError(f"{what} is not available for {facts.name}: {facts.attention_unsupported}")


def require_rotary(facts: ModelFacts, what: str) -> None:
    """Raise WrongModelKind unless the model uses RoPE; NotImplementedError where its RoPE layout is not one
    posprobe has proven (partial or interleaved without hooks, NoPE layers, ...)."""
    if not facts.is_rotary:
        raise WrongModelKind(
            f"{what} needs a RoPE model, but {facts.name} uses {facts.positional_kind} positions"
        )
    require_supported(facts, what)


def require_rotated_qk(facts: ModelFacts, what: str) -> None:
    """`require_rotary`, and NotImplementedError where the model's rotated q/k cannot be read at hook_rot_q/k."""
    require_rotary(facts, what)
    if facts.rotation_unhooked is not None:
        raise NotImplementedError(f"{what} is not available for {facts.name}: {facts.rotation_unhooked}, and this "
                                  "analysis reads the rotated q and k")


def require_learned(facts: ModelFacts, what: str) -> None:
    """Raise WrongModelKind unless the model adds learned absolute position embeddings; NotImplementedError
    where their layout is not one posprobe has proven (e.g. OPT's offset table)."""
    if facts.family is not None and facts.family.fixed_table:  # a table posprobe may not reach yet (XGLM)
        require_supported(facts, what)
    if not facts.has_w_pos:
        raise WrongModelKind(
            f"{what} needs learned absolute position embeddings (W_pos), but {facts.name} uses "
            f"{facts.positional_kind} positions"
        )
    require_supported(facts, what)
