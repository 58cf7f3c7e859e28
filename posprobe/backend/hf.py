"""The one door to plain Hugging Face models: the only module that reads an HF config or touches HF modules.

Everything here takes a `transformers` PreTrainedModel (a TransformerBridge's is `model.original_model`):
its text config, trained context, positional kind, rotary facts per layer (inverse frequencies, rope type,
layer types), final-logit soft-cap, attention modules and the registration of an attention function of
posprobe's own; and loading an HF folder or a GGUF file (dequantised once, cached). Scoring, the shift
test, the long-context engine and the bridge adapter all ask this module; none reads `config` itself.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from posprobe.backend import families
from posprobe.backend.architectures import of_config
from posprobe.backend.peek import hf_positional_kind
from posprobe.backend.sources import ModelLoadError, Source, gguf_cache_path, read_hf_config
from posprobe.rope import RotarySpec, inv_freq_table

log = logging.getLogger(__name__)

# HF rope types posprobe reproduces. "dynamic" (its base grows with the input's length past max_position_embeddings)
# and "longrope" (short / long factors, switched at original_max_position_embeddings) change their table with the
# length of the input: `rope_table(..., length)` builds the table of a given length with HF's own function.
# yarn / longrope also scale cos/sin (the attention factor, kept in RotarySpec.attention_factor). "proportional"
# (Gemma 4) leaves its trailing bands unrotated (frequency 0: RotarySpec.removed).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "proportional")
#: Rope types whose table depends on the input's length.
LENGTH_RULE_ROPE_TYPES = ("dynamic", "longrope")

#: Name under which posprobe's attention function is registered in transformers' AttentionInterface.
ATTENTION_IMPLEMENTATION = "posprobe_long"

# The attention callable in force per attention module (id) while `custom_attention` is open.
AttendFn = Callable[..., torch.Tensor]
_ATTEND: dict[int, AttendFn] = {}


# ---- config ------------------------------------------------------------------------------------------------

def text_config(hf_model: Any) -> Any:
    """The decoder's HF config (the text config of multimodal wrappers)."""
    cfg = hf_model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def positional_kind(hf_model: Any) -> str:
    """The positional kind its config names (`families.from_hf_config`; "unknown" where it names none)."""
    return hf_positional_kind(text_config(hf_model).to_dict())


def is_rotary(hf_model: Any) -> bool:
    """True where the config describes rotary positions."""
    return positional_kind(hf_model) == families.ROTARY


def trained_context(hf_model: Any) -> int | None:
    """Context length the model was trained for (tokens): the config's original_max_position_embeddings
    (rope scaling) or max_position_embeddings / n_positions."""
    cfg = text_config(hf_model)
    rp = getattr(cfg, "rope_parameters", None) or {}
    orig = rp.get("original_max_position_embeddings") if isinstance(rp, dict) else None
    return int(orig or position_table_size(hf_model) or 0) or None


def position_table_size(hf_model: Any) -> int | None:
    """Positions the config declares (max_position_embeddings or n_positions), or None."""
    cfg = text_config(hf_model)
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    return int(n) if n else None


def layer_type(hf_model: Any, layer: int) -> str | None:
    """HF's layer type ("sliding_attention", "full_attention", ...) or None where the config has none."""
    types = getattr(text_config(hf_model), "layer_types", None)
    return types[layer] if types else None


def sliding_window(hf_model: Any) -> int | None:
    """The config's sliding-window width (tokens), or None."""
    return getattr(text_config(hf_model), "sliding_window", None) or None


def attention_window(hf_model: Any, layer: int) -> int | None:
    """How many keys back `layer` attends (a key j is kept by query i when i - window < j <= i): the sliding window
    of a "sliding_attention" layer, GPT-Neo's `window_size` on its "local" layers; None for full attention."""
    cfg = text_config(hf_model)
    if (layer_type(hf_model, layer) or "").startswith("sliding"):
        return sliding_window(hf_model)
    kinds = getattr(cfg, "attention_layers", None)  # GPT-Neo: "global" / "local" per layer
    if kinds and kinds[layer] == "local":
        return int(cfg.window_size)
    return None


def final_logit_softcap(hf_model: Any) -> float | None:
    """Gemma-style tanh cap on the output logits, or None."""
    cap = getattr(text_config(hf_model), "final_logit_softcapping", None)
    return float(cap) if cap else None


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`cap * tanh(logits / cap)` where a cap is set; the logits unchanged otherwise."""
    return torch.tanh(logits / cap) * cap if cap else logits


def finish_logits(hf_model: Any, logits: torch.Tensor) -> torch.Tensor:
    """What the model's forward does after its LM head: Granite's division by `logits_scaling`, Cohere's
    multiplication by `logit_scale`, Gemma's final soft-cap (each where the config sets it)."""
    cfg = text_config(hf_model)
    scale = getattr(cfg, "logits_scaling", None)
    if scale and scale != 1:
        logits = logits / scale
    mult = getattr(cfg, "logit_scale", None)  # other families' `logit_scale` (CLIP's) is not an LM head's
    if of_config(cfg).logit_scale and mult and mult != 1:
        logits = logits * mult
    return softcap_logits(logits, final_logit_softcap(hf_model))


def logits_from_hidden(hf_model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The model's output logits from its final hidden states, as its own forward makes them."""
    return finish_logits(hf_model, hf_model.get_output_embeddings()(hidden))


def _layer_keyed(hf_model: Any, layer: int) -> str | None:
    # The layer type under which the config keeps this layer's rope parameters (Gemma 3's local/global), or None.
    rp = getattr(text_config(hf_model), "rope_parameters", None)
    lt = layer_type(hf_model, layer)
    return lt if lt is not None and isinstance(rp, dict) and isinstance(rp.get(lt), dict) else None


def rope_parameters(hf_model: Any, layer: int) -> dict:
    """The rope parameters of `layer` (rope_type, rope_theta, scaling keys), per layer type where the config
    has one table per type (Gemma 3's local/global)."""
    cfg = text_config(hf_model)
    rp = getattr(cfg, "rope_parameters", None)
    if rp is None:  # older configs: rope_theta + rope_scaling
        rp = dict(getattr(cfg, "rope_scaling", None) or {})
        rp.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    lt = _layer_keyed(hf_model, layer)
    return dict(rp[lt] if lt is not None else rp)


def rope_type(hf_model: Any, layer: int) -> str:
    """HF's rope type of `layer` ("default", "yarn", "dynamic", ...)."""
    rp = rope_parameters(hf_model, layer)
    return str(rp.get("rope_type", rp.get("type", "default")))


def length_rule(hf_model: Any, layer: int) -> str | None:
    """"dynamic" or "longrope" where `layer`'s rotation table depends on the input's length, else None."""
    kind = rope_type(hf_model, layer)
    return kind if kind in LENGTH_RULE_ROPE_TYPES else None


def length_threshold(hf_model: Any, layer: int) -> int | None:
    """Tokens up to which a length-rule layer keeps its first table (dynamic: max_position_embeddings; longrope:
    original_max_position_embeddings), or None for a static table."""
    kind = length_rule(hf_model, layer)
    if kind == "dynamic":
        return int(text_config(hf_model).max_position_embeddings)
    if kind == "longrope":
        rp = rope_parameters(hf_model, layer)
        return int(rp.get("original_max_position_embeddings")
                   or getattr(text_config(hf_model), "original_max_position_embeddings"))
    return None


def length_rule_text(hf_model: Any, layer: int) -> str | None:
    """How `layer`'s table changes with the input's length, in words, or None for a static table."""
    kind, limit = length_rule(hf_model, layer), length_threshold(hf_model, layer)
    if kind == "dynamic":
        return f"dynamic NTK: the base grows with inputs past {limit} tokens"
    if kind == "longrope":
        return f"LongRoPE: long factors for inputs past {limit} tokens"
    return None


def table_length(hf_model: Any, layer: int, length: int | None) -> int | None:
    """The length whose table `layer` rotates an input of `length` tokens with, canonicalised so equal tables
    share a key: None for a static table or an input within the threshold; longrope's long table for any length
    past it; dynamic's own length."""
    limit = length_threshold(hf_model, layer)
    if limit is None or length is None or length <= limit:
        return None
    return limit + 1 if length_rule(hf_model, layer) == "longrope" else int(length)


def refuse_unknown_rope(hf_model: Any, layer: int, who: str | None = None) -> None:
    """NotImplementedError, naming it, where `layer`'s rope type is one posprobe does not reproduce (3-D axial
    positions, or a type transformers added since)."""
    who = who or type(hf_model).__name__
    kind = rope_type(hf_model, layer)
    axial = bool(rope_parameters(hf_model, layer).get("mrope_section")) or kind in ("mrope", "axial")
    if axial or kind not in ROPE_TYPES:
        what = "3-D (axial) positions split by mrope_section" if axial else f"{kind!r} RoPE"
        raise NotImplementedError(f"{who} uses {what}; posprobe's position control and rotary facts take one "
                                  f"position per token and reproduce these rope types: {', '.join(ROPE_TYPES)}")


def rope_table(hf_model: Any, layer: int, length: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies in rad/token `[band]`, cos/sin multiplier) `layer` rotates an input of `length`
    tokens with (None: the model's first table, as loaded). Static types read the rotary module; dynamic and
    longrope past their threshold call HF's own `ROPE_INIT_FUNCTIONS` with the length as HF's forward passes it
    (a long tensor: the same float32 arithmetic, so the same bits)."""
    at = table_length(hf_model, layer, length)
    if at is None:
        return inv_freq(hf_model, layer)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    own, _ = inv_freq(hf_model, layer)
    lt = _layer_keyed(hf_model, layer)
    kwargs = {"layer_type": lt} if lt is not None else {}
    cfg = text_config(hf_model)
    fn = ROPE_INIT_FUNCTIONS[rope_type(hf_model, layer)]
    seq = at if length_rule(hf_model, layer) == "longrope" else torch.tensor(at, dtype=torch.long, device=own.device)
    inv, factor = fn(cfg, own.device, seq_len=seq, **kwargs)
    return inv.to(own.device, torch.float32), float(factor)


def rotary_emb(hf_model: Any) -> Any:
    """The model's rotary-embedding module (unwrapped from a bridge component where needed)."""
    dec = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else hf_model
    emb = getattr(dec, "rotary_emb", None)
    emb = emb if emb is not None else getattr(hf_model, "rotary_emb", None)
    if emb is None:
        raise NotImplementedError(f"cannot find the rotary embedding of {type(hf_model).__name__}")
    return getattr(emb, "original_component", emb)


def _sincos_table(hf_model: Any) -> Any:
    # GPT-J / CodeGen keep `embed_positions`, a [position, rotary_dim] table of sin | cos: on each attention module
    # (transformers <= 5.23) or on one model-level `GPTJRotaryEmbedding` (5.24), which has no inv_freq.
    mods = attention_modules(hf_model)
    table = getattr(mods[0], "embed_positions", None) if mods else None
    if table is None:
        try:
            table = getattr(rotary_emb(hf_model), "embed_positions", None)
        except NotImplementedError:
            table = None
    return table


def _table_inv_freq(hf_model: Any) -> torch.Tensor | None:
    # The sin | cos table is built from inv_freq = 1 / 10000^(2i / rotary_dim): rebuilt with HF's own expression and
    # checked against the table's first rows, so a model with another recipe is refused rather than guessed.
    table = _sincos_table(hf_model)
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        return None
    rd = table.shape[-1]
    inv = (1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.int64) / rd))).float()
    n = min(table.shape[0], 512)
    angle = torch.arange(n, dtype=torch.float32)[:, None] * inv
    want = torch.cat([angle.sin(), angle.cos()], dim=-1)
    return inv if (table[:n].detach().float().cpu() - want).abs().max() <= 1e-6 else None


def fresh_rope_state(hf_model: Any) -> None:
    """Put a dynamic-RoPE module back to the table it was loaded with. HF's module keeps the largest table it has
    built while later inputs stay past the threshold, so without this a forward's numbers would depend on the
    inputs run before it; after it, they depend on the forward's own length only. Other modules are left alone."""
    try:
        emb = rotary_emb(hf_model)
    except NotImplementedError:
        return
    kinds = emb.rope_type if isinstance(getattr(emb, "rope_type", None), dict) else {"": getattr(emb, "rope_type", "")}
    for lt, kind in kinds.items():
        prefix = f"{lt}_" if lt else ""
        orig = getattr(emb, f"{prefix}original_inv_freq", None)
        if "dynamic" not in str(kind) or orig is None:
            continue
        emb.register_buffer(f"{prefix}inv_freq", orig.clone(), persistent=False)
        setattr(emb, f"{prefix}max_seq_len_cached", emb.original_max_seq_len)


def inv_freq(hf_model: Any, layer: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies in rad/token `[band]`, cos/sin multiplier) HF rotates `layer` with."""
    try:
        emb = rotary_emb(hf_model)
    except NotImplementedError:
        emb = None
    if emb is None or not any(name.endswith("inv_freq") for name, _ in emb.named_buffers()):
        inv = _table_inv_freq(hf_model)
        if inv is None:
            raise NotImplementedError(f"cannot read the rotary frequencies of {type(hf_model).__name__}")
        return inv, 1.0
    lt = layer_type(hf_model, layer)
    prefix = f"{lt}_" if lt is not None and hasattr(emb, f"{lt}_inv_freq") else ""  # Gemma 3: a table per type
    # Dynamic and longrope modules overwrite `inv_freq` with the table of the last input's length; the table they
    # were built with stays in `original_inv_freq`.
    name = f"{prefix}original_inv_freq" if length_rule(hf_model, layer) else f"{prefix}inv_freq"
    table = getattr(emb, name, None)
    table = table if table is not None else getattr(emb, f"{prefix}inv_freq")
    return table, float(getattr(emb, f"{prefix}attention_scaling", 1.0))


def adjacent_pairs(hf_model: Any) -> bool:
    """True where the model's rotary code pairs adjacent dims (2b, 2b+1), its cos/sin interleaved
    (`repeat_interleave`), rotated in float32 (the architecture row's pairing: Cohere, GLM, GPT-J, CodeGen); False
    for half-split pairs (b, b + rotary_dim/2), `rotate_half`."""
    return of_config(text_config(hf_model)).pairing == "adjacent"


#: Rope types a preset can apply to a loaded model exactly as HF applies them from a config (their parameters are
#: numbers; longrope's factor lists and axial sections are not).
PRESET_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "proportional")


def scaled_rope_table(hf_model: Any, layer: int, params: Mapping[str, Any], length: int | None = None
                      ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies in rad/token `[band]`, cos/sin multiplier) HF would rotate `layer` with, for an input of
    `length` tokens, had the model's config set `params` (`rope_type` and its keys, HF's names) in place of the
    layer's own scaling: HF's own `ROPE_INIT_FUNCTIONS` on a copy of the config that keeps the layer's base and
    partial_rotary_factor. Cached per model, layer, parameters and table."""
    import copy

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = str(params["rope_type"])
    if kind not in PRESET_ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} cannot be applied as a preset; these can: {', '.join(PRESET_ROPE_TYPES)}")
    cfg = text_config(hf_model)
    if kind == "proportional" and 2 * inv_freq(hf_model, layer)[0].numel() < head_dim(hf_model):
        raise NotImplementedError(f"{type(hf_model).__name__} rotates only part of each head (partial rotary); "
                                  "proportional RoPE turns bands over the full head, which its attention code cannot "
                                  "apply")
    limit = int(cfg.max_position_embeddings)
    grow = kind == "dynamic" and length is not None and length > limit
    key = (layer, tuple(sorted((k, str(v)) for k, v in params.items())), int(length) if grow else None)
    cache = hf_model.__dict__.setdefault("_posprobe_scaled_tables", {})
    if key in cache:
        return cache[key]
    own = rope_parameters(hf_model, layer)
    new = {"rope_theta": own["rope_theta"], **dict(params)}
    prf = own.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if prf is not None and "partial_rotary_factor" not in params:  # proportional's p is the preset's own
        new["partial_rotary_factor"] = prf
    cfg = copy.deepcopy(cfg)
    lt = _layer_keyed(hf_model, layer)
    cfg.rope_parameters = {**cfg.rope_parameters, lt: new} if lt is not None else new
    device = inv_freq(hf_model, layer)[0].device
    # As HF's forward hands it over: a long tensor when the dynamic table grows, the config's own length otherwise.
    seq = torch.tensor(int(length), dtype=torch.long, device=device) if grow else None
    inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, device, seq_len=seq, **({"layer_type": lt} if lt else {}))
    cache[key] = (inv.to(device, torch.float32), float(factor))
    return cache[key]


def spec_from_table(hf_model: Any, layer: int, inv: torch.Tensor, attention_factor: float, *,
                    adjacent: bool | None = None) -> RotarySpec:
    """A RotarySpec for the table `inv` (rad/token per band; 0 = a band that never turns) and cos/sin multiplier:
    the layer's base, per-band factors on the default frequencies, the pairing from `adjacent` or the model type."""
    from dataclasses import replace

    rp = rope_parameters(hf_model, layer)
    inv = inv.detach().double().cpu()
    base = float(rp.get("rope_theta", getattr(text_config(hf_model), "rope_theta", 10000.0)))
    adjacent = adjacent_pairs(hf_model) if adjacent is None else adjacent
    gone = frozenset(int(b) for b in (inv == 0).nonzero()[:, 0])
    spec = RotarySpec(rotary_dim=2 * inv.numel(), base=base, adjacent=adjacent, removed=gone,
                      attention_factor=float(attention_factor))
    ratio = (1.0 / inv) / inv_freq_table(spec, torch.float64)
    ratio[list(gone)] = 1.0  # a band that never turns has no frequency to scale
    return replace(spec, freq_scale=tuple(ratio.tolist())) if (ratio - 1).abs().max() > 1e-5 else spec


def rotary_spec(hf_model: Any, layer: int, *, adjacent: bool | None = None, name: str | None = None,
                length: int | None = None) -> RotarySpec:
    """The rotation `layer` applies to an input of `length` tokens (None: its first table), as a RotarySpec: base
    from the config; rotated dims, any scaling (linear, llama3, yarn, dynamic, longrope, proportional) as a per-band
    factor on the defaults, unrotated bands (frequency 0) and the cos/sin multiplier from HF's own table; the
    pairing from `adjacent` (a bridge's own flag) or else the model type.

    Raises NotImplementedError, naming it, for a rope type posprobe does not reproduce (3-D axial positions)."""
    refuse_unknown_rope(hf_model, layer, name)
    inv, attention_factor = rope_table(hf_model, layer, length)
    return spec_from_table(hf_model, layer, inv, attention_factor, adjacent=adjacent)


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """The keyword arguments that hand `cache` to `module.forward` and turn caching on: transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns on every call), earlier versions know only the old name."""
    return {_cache_kwarg(type(module)): cache, "use_cache": cache is not None}


@functools.cache
def _cache_kwarg(cls: type) -> str:
    # Read once per class: decoding asks for every generated token.
    import inspect

    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def nope_layers(hf_model: Any) -> tuple[int, ...]:
    """Layers that apply no positional encoding although the model is rotary elsewhere: SmolLM3 / Llama 4 mark
    them in `no_rope_layers` (1 = rotary, 0 = NoPE); Cohere 2's full-attention layers carry no rotation."""
    cfg = text_config(hf_model)
    flags = getattr(cfg, "no_rope_layers", None)
    if flags:
        return tuple(i for i, f in enumerate(flags) if not f)
    rule = of_config(cfg).nope_layer_type
    if rule and getattr(cfg, "layer_types", None):
        return tuple(i for i, t in enumerate(cfg.layer_types) if t == rule)
    return ()


def head_dim(hf_model: Any) -> int:
    """Width of one attention head."""
    cfg = text_config(hf_model)
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


# ---- attention modules and posprobe's attention function ----------------------------------------------------

def attention_modules(hf_model: Any) -> list[Any]:
    """The decoder's attention modules in layer order (each has `layer_idx`)."""
    # Inside a TransformerBridge each HF attention module sits in a bridge component that forwards attribute
    # reads to it: count the HF modules only (the bridge's own has `original_component`).
    # Joint q/k/v projections (GPT-NeoX's query_key_value, Phi-3's qkv_proj) have no q_proj: the class name says.
    mods = [m for m in hf_model.modules()
            if hasattr(m, "layer_idx") and (hasattr(m, "q_proj") or type(m).__name__.endswith("Attention"))
            and not hasattr(m, "original_component")]
    return sorted(mods, key=lambda m: m.layer_idx)


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
               softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    # The mask HF would build is ignored on purpose: the attend function masks (causal, window, eviction) itself.
    attend = _ATTEND.get(id(module))
    if attend is None:
        raise RuntimeError("posprobe's attention function ran outside `custom_attention(...)`")
    cap = softcap if softcap is not None else getattr(module, "attn_logit_softcapping", None)
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    s = scaling if scaling is not None else module.scaling
    out = attend(module, query, key, value, s, window, cap)
    return out.transpose(1, 2).contiguous(), None


@contextmanager
def custom_attention(hf_model: Any, attend: Mapping[int, AttendFn]) -> Iterator[None]:
    """Within the block every attention layer of `hf_model` calls `attend[layer](module, query, key, value,
    scaling, window, softcap)` (q/k/v `[batch, head, pos, d_head]` as HF hands them to its attention
    interface; returns `[batch, head, query_pos, d_head]`). The model's own implementation is restored on
    exit, also after errors; NotImplementedError where the model does not honour a custom implementation."""
    from transformers import AttentionInterface

    mods = attention_modules(hf_model)
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, _attention)
    before = hf_model.config._attn_implementation
    hf_model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    try:
        if any(getattr(m.config, "_attn_implementation", None) != ATTENTION_IMPLEMENTATION for m in mods):
            raise NotImplementedError(f"{type(hf_model).__name__} does not accept a custom attention implementation")
        for m in mods:
            _ATTEND[id(m)] = attend[m.layer_idx]
        yield
    finally:
        for m in mods:
            _ATTEND.pop(id(m), None)
        hf_model.set_attn_implementation(before)


#: Name under which posprobe's q/k interceptor is registered in transformers' AttentionInterface.
INTERCEPT_IMPLEMENTATION = "posprobe_qk"
QKWrap = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# Per attention module (id): (the q/k wrapper in force, the attention function the model would have run).
_INTERCEPT: dict[int, tuple[QKWrap, AttendFn]] = {}


def uses_attention_interface(attention: Any) -> bool:
    """True where the HF attention module hands its rotated q/k to transformers' attention interface (its
    modeling module looks the function up in ALL_ATTENTION_FUNCTIONS): GPT-J from transformers 5.24, the Llama
    family and most decoders; older GPT-J computes its scores itself."""
    import sys

    return "ALL_ATTENTION_FUNCTIONS" in vars(sys.modules[type(attention).__module__])


def _interface_function(attention: Any, implementation: str | None) -> AttendFn:
    # The function HF would run for `implementation`: "eager" is the modeling module's own eager_attention_forward.
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation in (None, "eager"):
        fn = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
        if fn is None:
            raise NotImplementedError(f"{type(attention).__name__} has no eager attention function to hand on to")
        return fn
    return ALL_ATTENTION_FUNCTIONS[implementation]


def _intercept(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               **kwargs: Any) -> Any:
    got = _INTERCEPT.get(id(module))
    if got is None:
        raise RuntimeError("posprobe's q/k interceptor ran outside `intercepted_qk(...)`")
    wrap, inner = got
    query, key = wrap(query, key)
    return inner(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def intercepted_qk(hf_model: Any, wrap: Mapping[int, QKWrap]) -> Iterator[None]:
    """Within the block, each attention layer `l` in `wrap` passes the q and k it hands to the attention interface
    (rotated, `[batch, head, pos, d_head]`) through `wrap[l](q, k) -> (q, k)` and then runs the attention function
    it would have run anyway, on what the wrapper returned: HF's own rotated q/k, readable and editable where the
    model rotates inside its attention module (GPT-J). Restored on exit, also after errors; NotImplementedError
    where a layer does not call the attention interface."""
    from transformers import AttentionInterface

    mods = [m for m in attention_modules(hf_model) if m.layer_idx in wrap]
    if any(id(m) in _INTERCEPT for m in mods):
        raise RuntimeError("intercepted_qk is already open on this model: nesting would pass q/k through twice")
    old = [m for m in mods if not uses_attention_interface(m)]
    if old:
        raise NotImplementedError(f"{type(old[0]).__name__} computes its attention scores itself (no attention "
                                  "interface in this transformers version), so its rotated q and k cannot be read")
    before = hf_model.config._attn_implementation
    inner = {id(m): _interface_function(m, getattr(m.config, "_attn_implementation", before)) for m in mods}
    # One name per implementation handed on to: HF builds each name's masks with the mask function registered
    # under it (a name it does not know gets SDPA's, which may drop the causal mask that eager attention needs).
    name = f"{INTERCEPT_IMPLEMENTATION}_{before or 'eager'}"
    AttentionInterface.register(name, _intercept)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[before or "eager"])
    except ImportError:  # transformers before the mask interface built eager masks for every implementation
        pass
    hf_model.set_attn_implementation(name)
    try:
        if any(getattr(m.config, "_attn_implementation", None) != name for m in mods):
            raise NotImplementedError(f"{type(hf_model).__name__} does not accept a custom attention implementation")
        for m in mods:
            _INTERCEPT[id(m)] = (wrap[m.layer_idx], inner[id(m)])
        yield
    finally:
        for m in mods:
            _INTERCEPT.pop(id(m), None)
        hf_model.set_attn_implementation(before)


def twin(hf_model: Any, state_dict: Mapping[str, torch.Tensor]) -> Any:
    """A plain model of `hf_model`'s class and config whose parameters *are* the tensors of `state_dict` (no
    copy, no weight initialisation): the model as `from_pretrained` would give it, sharing another object's
    weights. Its attention runs with SDPA where the architecture has it (eager otherwise), as a freshly loaded
    model's does."""
    import copy

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights

    cfg = copy.deepcopy(hf_model.config)
    cfg.output_attentions = False
    with no_init_weights():
        plain = type(hf_model)(cfg)
    missing, _ = plain.load_state_dict(dict(state_dict), strict=False, assign=True)
    if missing:
        raise ValueError(f"cannot rebuild {type(hf_model).__name__} from the given weights: {missing[:3]} missing")
    try:
        plain.set_attn_implementation("sdpa")
    except ValueError:  # architectures without an SDPA path (Gemma 2: soft-capped scores) load with eager
        plain.set_attn_implementation("eager")
    return plain.eval()


# ---- loading ------------------------------------------------------------------------------------------------

def hf_folder(source: Source) -> Path:
    """A Hugging Face folder for `source`, converting (and caching) a GGUF file on first use."""
    assert source.path is not None
    if source.path.suffix != ".gguf":
        return source.path
    target = gguf_cache_path(source.path)
    if (target / "config.json").is_file():
        return target
    return _convert_gguf(source.path, target)


def _convert_gguf(gguf: Path, target: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s once to %s (dequantising)", gguf, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ModelLoadError(f"Could not read GGUF file {gguf}: {e}") from e
    # save_pretrained refuses quantised models; after dequantisation the weights are plain fp32.
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    del hf
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:
        # Another process converted the same file meanwhile; its copy is identical.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def folder_architecture(folder: Path) -> str:
    """The first architecture a folder's config.json names ("" if none)."""
    return str((read_hf_config(folder).get("architectures") or [""])[0])


def auto_model(folder: Path, dtype: torch.dtype) -> Any:
    """The HF model class the folder's config names, loaded from it (BERT variants with pre-training heads)."""
    import transformers

    arch = folder_architecture(folder) or "AutoModelForCausalLM"
    if arch in ("BertModel", "BertForMaskedLM", "BertForPreTraining"):
        # TL's BERT converter wants the pre-training heads; a bare encoder gets fresh heads,
        # recorded as absent in ModelFacts (has_lm_head=False).
        return transformers.BertForPreTraining.from_pretrained(folder, dtype=dtype)
    cls = getattr(transformers, arch, None) or transformers.AutoModelForCausalLM
    return cls.from_pretrained(folder, dtype=dtype)

