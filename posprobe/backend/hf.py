"""The one door to plain Hugging Face models: the only module that reads an HF config or touches HF modules.

Everything here takes a `transformers` PreTrainedModel (a TransformerBridge's is `model.original_model`):
its text config, trained context, positional kind, rotary facts per layer (inverse frequencies, rope type,
layer types), final-logit soft-cap, attention modules and the registration of an attention function of
posprobe's own; and loading an HF folder or a GGUF file (dequantised once, cached). Scoring, the shift
test, the long-context engine and the bridge adapter all ask this module; none reads `config` itself.
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from posprobe.backend.peek import hf_positional_kind
from posprobe.backend.sources import ModelLoadError, Source, gguf_cache_path, read_hf_config
from posprobe.rope import RotarySpec, inv_freq_table

log = logging.getLogger(__name__)

# HF rope types whose frequencies are fixed tables (a per-band scale of the default frequencies).
# "dynamic" rescales with the sequence length and "longrope" switches tables with it; yarn/longrope also
# scale cos/sin (attention_scaling), which posprobe's rotation does not reproduce.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

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
    """"rotary", "learned_absolute", "alibi", "relative_bias" or "unknown", from the model's config."""
    return hf_positional_kind(text_config(hf_model).to_dict())


def is_rotary(hf_model: Any) -> bool:
    """True where the config describes rotary positions."""
    return positional_kind(hf_model) == "rotary"


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
    if str(getattr(cfg, "model_type", "")).startswith("cohere") and mult and mult != 1:
        logits = logits * mult
    return softcap_logits(logits, final_logit_softcap(hf_model))


def logits_from_hidden(hf_model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The model's output logits from its final hidden states, as its own forward makes them."""
    return finish_logits(hf_model, hf_model.get_output_embeddings()(hidden))


def rope_parameters(hf_model: Any, layer: int) -> dict:
    """The rope parameters of `layer` (rope_type, rope_theta, scaling keys), per layer type where the config
    has one table per type (Gemma 3's local/global)."""
    cfg = text_config(hf_model)
    rp = getattr(cfg, "rope_parameters", None)
    if rp is None:  # older configs: rope_theta + rope_scaling
        rp = dict(getattr(cfg, "rope_scaling", None) or {})
        rp.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    lt = layer_type(hf_model, layer)
    if lt is not None and isinstance(rp.get(lt), dict):
        rp = rp[lt]
    return dict(rp)


def rotary_emb(hf_model: Any) -> Any:
    """The model's rotary-embedding module (unwrapped from a bridge component where needed)."""
    dec = hf_model.get_decoder() if hasattr(hf_model, "get_decoder") else hf_model
    emb = getattr(dec, "rotary_emb", None)
    emb = emb if emb is not None else getattr(hf_model, "rotary_emb", None)
    if emb is None:
        raise NotImplementedError(f"cannot find the rotary embedding of {type(hf_model).__name__}")
    return getattr(emb, "original_component", emb)


def _table_inv_freq(hf_model: Any) -> torch.Tensor | None:
    # GPT-J / CodeGen keep no rotary module: each attention holds `embed_positions`, a [position, rotary_dim] table of
    # sin | cos built from inv_freq = 1 / 10000^(2i / rotary_dim). Rebuilt with HF's own expression and checked
    # against the table's first rows, so a model with another recipe is refused rather than guessed.
    mods = attention_modules(hf_model)
    table = getattr(mods[0], "embed_positions", None) if mods else None
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        return None
    rd = table.shape[-1]
    inv = (1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.int64) / rd))).float()
    n = min(table.shape[0], 512)
    angle = torch.arange(n, dtype=torch.float32)[:, None] * inv
    want = torch.cat([angle.sin(), angle.cos()], dim=-1)
    return inv if (table[:n].detach().float().cpu() - want).abs().max() <= 1e-6 else None


def inv_freq(hf_model: Any, layer: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies in rad/token `[band]`, cos/sin multiplier) HF rotates `layer` with."""
    try:
        emb = rotary_emb(hf_model)
    except NotImplementedError:
        inv = _table_inv_freq(hf_model)
        if inv is None:
            raise
        return inv, 1.0
    lt = layer_type(hf_model, layer)
    if lt is not None and hasattr(emb, f"{lt}_inv_freq"):  # Gemma 3: one table per layer type
        return getattr(emb, f"{lt}_inv_freq"), float(getattr(emb, f"{lt}_attention_scaling", 1.0))
    return emb.inv_freq, float(getattr(emb, "attention_scaling", 1.0))


#: HF model types whose rotary code pairs adjacent dims (2b, 2b+1), its cos/sin interleaved (`repeat_interleave`),
#: rotated in float32; every other rotary model pairs (b, b + rotary_dim/2) (`rotate_half`).
ADJACENT_PAIR_MODEL_TYPES = ("cohere", "cohere2", "glm", "gptj", "codegen")


def adjacent_pairs(hf_model: Any) -> bool:
    """True where the model's rotary code pairs adjacent dims (Cohere, GLM, GPT-J, CodeGen), False for half-split
    pairs."""
    return str(getattr(text_config(hf_model), "model_type", "")) in ADJACENT_PAIR_MODEL_TYPES


def rotary_spec(hf_model: Any, layer: int, *, adjacent: bool | None = None, name: str | None = None) -> RotarySpec:
    """The rotation `layer` applies, as a RotarySpec: base from the config, rotated dims and any static scaling
    (linear, llama3, yarn frequencies) from HF's own frequency table, as a per-band factor on the defaults; the
    pairing from `adjacent` (a bridge's own flag) or else the model type.

    Raises NotImplementedError for rope types whose table changes with length (dynamic, longrope) and for
    cos/sin scaling, which a RotarySpec does not express."""
    who = name or type(hf_model).__name__
    rp = rope_parameters(hf_model, layer)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in STATIC_ROPE_TYPES:
        raise NotImplementedError(f"{who} uses {kind!r} RoPE scaling, which posprobe's position control does not "
                                  "reproduce yet")
    inv, attention_scaling = inv_freq(hf_model, layer)
    if attention_scaling != 1.0:
        raise NotImplementedError(f"{who} scales cos/sin by {attention_scaling} ({kind} RoPE); posprobe's rotation "
                                  "does not")
    base = float(rp.get("rope_theta", getattr(text_config(hf_model), "rope_theta", 10000.0)))
    adjacent = adjacent_pairs(hf_model) if adjacent is None else adjacent
    spec = RotarySpec(rotary_dim=2 * inv.numel(), base=base, adjacent=adjacent)
    ratio = (1.0 / inv.detach().double().cpu()) / inv_freq_table(spec, torch.float64)
    if (ratio - 1).abs().max() > 1e-5:
        spec = RotarySpec(rotary_dim=spec.rotary_dim, base=base, adjacent=adjacent, freq_scale=tuple(ratio.tolist()))
    return spec


def nope_layers(hf_model: Any) -> tuple[int, ...]:
    """Layers that apply no positional encoding although the model is rotary elsewhere: SmolLM3 / Llama 4 mark
    them in `no_rope_layers` (1 = rotary, 0 = NoPE); Cohere 2's full-attention layers carry no rotation."""
    cfg = text_config(hf_model)
    flags = getattr(cfg, "no_rope_layers", None)
    if flags:
        return tuple(i for i, f in enumerate(flags) if not f)
    if str(getattr(cfg, "model_type", "")) == "cohere2" and getattr(cfg, "layer_types", None):
        return tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
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

