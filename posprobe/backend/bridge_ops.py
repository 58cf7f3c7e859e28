"""The TransformerBridge adapter: how each model operation the façades (`model.py`, `hooks.py`, `facts.py`)
offer is done on a TransformerBridge (TL 3.9 / 4.x). `dispatch.ops(model)` picks this module or
`legacy_ops`; both define the same functions with the same meaning.

The bridge's own config is trusted for shapes; rotary facts, scaling and soft-caps come from the wrapped
Hugging Face modules (`bridge.py`, `hf.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch

from posprobe.backend import families, hf, t5_decoder
from posprobe.backend.architectures import PATTERN, POSITIONS, of_config, proven
from posprobe.backend.attach import hooked
from posprobe.backend.bridge import (
    layer_type,
    qk_norms,
    rotary_adjacent,
    rotary_freqs,
    rotary_spec,
    unsupported_qk_path,
)
from posprobe.backend.families import alibi, learned, relative, rotary, sinusoidal
from posprobe.backend.fast_attention import sdpa_attention
from posprobe.backend.kind import hf_attention, is_encoder, n_layers
from posprobe.backend.vocab import NormSpec, hook_name
from posprobe.rope import RotarySpec, hf_cos_sin, hf_rotate, rotate

# ---- the model object


def device_of(model: Any) -> torch.device:
    # A bridge moved with .to() keeps a stale cfg.device: ask the weights.
    return next(model.original_model.parameters()).device


def dtype_of(model: Any) -> torch.dtype:
    return next(model.original_model.parameters()).dtype


def forward(model: Any, tokens: torch.Tensor, *, stop_at_layer: int | None, attention_mask: torch.Tensor | None,
            fused_attention: bool) -> torch.Tensor:
    with sdpa_attention(model) if fused_attention else contextlib.nullcontext():
        kwargs: dict[str, Any] = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if stop_at_layer is None or is_encoder(model):
            return model(tokens, **kwargs)
        if stop_at_layer < n_layers(model):
            return model(tokens, stop_at_layer=stop_at_layer, **kwargs)
        # The bridge's stop_at_layer only stops *before* a block, so "after the last block" (the residual
        # the final norm reads) would run the unembedding. Stop there with the bridge's own exception, which
        # its forward catches and returns; the hook is removed before returning.
        from transformer_lens.model_bridge.exceptions import StopAtLayerException

        def stop(resid: torch.Tensor, hook: Any) -> torch.Tensor:
            raise StopAtLayerException(resid)

        with model.hooks(fwd_hooks=[(f"blocks.{n_layers(model) - 1}.hook_resid_post", stop)]):
            return model(tokens, **kwargs)


def finish_logits(model: Any, logits: torch.Tensor) -> torch.Tensor:
    return hf.finish_logits(model.original_model, logits)


class Recompute:
    """The bridge's stand-in for a KV cache: the tokens seen so far. Each step recomputes the full forward:
    HF's cache stores keys after rotation, and position control must be able to re-rotate every key."""

    def __init__(self) -> None:
        self.tokens: torch.Tensor | None = None


def new_kv_cache(model: Any, batch: int) -> Any:
    return Recompute()


def forward_cached(model: Any, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
    cache.tokens = tokens if cache.tokens is None else torch.cat([cache.tokens, tokens], dim=1)
    return model(cache.tokens)[:, -tokens.shape[1]:]


def embedding_positions(model: Any, position_ids: torch.Tensor) -> Any:
    # XGLM: the bridge has no pos_embed component; HF's sinusoidal module is handed the ids instead.
    if not _sinusoidal(model):
        raise NotImplementedError(f"{type(model.original_model).__name__} has no position module posprobe sets ids on")
    return sinusoidal.positions_at(model.original_model, position_ids)


def position_table(model: Any) -> torch.Tensor:
    # Row i is position i, as the forward reads the table (the learned family knows where position 0 sits).
    emb = model.pos_embed.original_component
    return emb.weight[learned.first_row(emb):]


def token_table(model: Any) -> torch.Tensor:
    # HF's input embedding as the forward reads it (any scale such as XGLM's sqrt(d) is applied later, in HF's code).
    return model.embed.original_component.weight


# ---- weights and norms (score decomposition)


#: T5's norm classes: called LayerNorm, computed as RMSNorm (scale only, no centring, no bias).
_RMS_CALLED_LAYERNORM = frozenset({"T5LayerNorm", "Pix2StructLayerNorm"})


def norm_spec(module: Any, scale_point: str) -> NormSpec:
    """A bridge's NormalizationBridge around an HF LayerNorm / RMSNorm, read as an affine map."""
    orig = module.original_component
    kind = type(orig).__name__
    w, b = getattr(orig, "weight", None), getattr(orig, "bias", None)
    if kind.startswith("Gemma") and w is not None:
        w = 1.0 + w  # Gemma's RMSNorm multiplies by (1 + weight)
    if not ("LayerNorm" in kind or "RMSNorm" in kind):
        raise NotImplementedError(f"Cannot freeze a {kind} norm")
    return NormSpec(centre="LayerNorm" in kind and kind not in _RMS_CALLED_LAYERNORM,
                    weight=None if w is None else w.detach(), bias=None if b is None else b.detach(),
                    scale_point=scale_point)


def qk_weights(model: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # The bridge's W_* views of the HF projections (keys at the KV-head count); no bias (Llama): zeros.
    a = model.blocks[layer].attn
    W_Q, W_K = a.W_Q.detach(), a.W_K.detach()
    b_Q, b_K = (b.detach() if b is not None else W.new_zeros(W.shape[0], W.shape[2])
                for b, W in ((a.b_Q, W_Q), (a.b_K, W_K)))
    return W_Q, b_Q, W_K, b_K


def pre_attention_norm(model: Any, layer: int) -> NormSpec | None:
    ln1 = getattr(model.blocks[layer], "ln1", None)
    return None if ln1 is None else norm_spec(ln1, "ln1_scale")


def embedding_norm(model: Any) -> NormSpec | None:
    ln = getattr(model, "embed_ln", None)
    return None if ln is None else norm_spec(ln, "bridge_embed_ln_scale")


def embedding_points(model: Any) -> dict[str, str]:
    known = model.hook_dict
    out = {"word": "bridge_embed", "position": "bridge_pos_embed", "token_type": "bridge_token_type_embed"}
    return {k: v for k, v in out.items() if hook_name(v, 0) in known}


def kept_pairs(model: Any, layer: int, n_q: int, n_k: int) -> torch.Tensor:
    # Queries are the last n_q of the n_k positions.
    if is_encoder(model):
        return torch.ones(n_q, n_k, dtype=torch.bool)
    i = torch.arange(n_k - n_q, n_k)[:, None]
    j = torch.arange(n_k)[None, :]
    window = hf.attention_window(model.original_model, layer)
    return (j <= i) & (j > i - window) if window else j <= i


def scores_not_bilinear(model: Any) -> str | None:
    # ALiBi's distance bias is not q.k, but the decomposition carries it as a term of its own (families.alibi).
    for layer in range(n_layers(model)):
        if any(n is not None for n in qk_norms(model, layer)):
            return "normalises q/k (QK-norm)"
        why = unsupported_qk_path(model, layer)
        if why is not None:
            return why
    return "soft-caps attention scores" if score_soft_cap(model) else None


# ---- hooks and attention internals


def encoder_layer_hooks(model: Any) -> list[str]:
    return [hook_name("bridge_embed_normalized", 0)] + [
        hook_name("bridge_resid_post_normalized", l) for l in range(n_layers(model))]


def layer_rotary_spec(model: Any, layer: int, length: int | None = None) -> RotarySpec:
    return rotary_spec(model, layer, length)


def table_length(model: Any, layer: int, length: int) -> int | None:
    return hf.table_length(model.original_model, layer, length)


def length_rule(model: Any, layer: int) -> str | None:
    return hf.length_rule_text(model.original_model, layer)


def scaled_rotary_spec(model: Any, layer: int, params: dict, length: int | None = None) -> RotarySpec:
    inv, factor = hf.scaled_rope_table(model.original_model, layer, params, length)
    return hf.spec_from_table(model.original_model, layer, inv, factor, adjacent=rotary_adjacent(model))


def _fires_rotation_hooks(attn: Any) -> bool:
    # TL's rotary attention components that call hook_rot_q/k themselves, and the joint-QKV one posprobe routes
    # through them (exposed); GPT-J's delegated AttentionBridge and CodeGen's component rotate without them.
    from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
        PositionEmbeddingsAttentionBridge,
    )

    return isinstance(attn, PositionEmbeddingsAttentionBridge) or "_apply_rotary_pos_emb" in type(attn).__dict__


def _intercepts_rotation(model: Any) -> bool:
    # GPT-J from transformers 5.24: HF's own attention module rotates q and k and hands them to the attention
    # interface, where TL's delegated component fires no hook_rot_q/k; posprobe's interceptor fires them there.
    if _tl_kind(model) != families.ROTARY or _fires_rotation_hooks(model.blocks[0].attn):
        return False
    return _delegated(model) and hf.uses_attention_interface(hf_attention(model, 0))


def rotation_unhooked(model: Any) -> str | None:
    if (_tl_kind(model) != families.ROTARY or _fires_rotation_hooks(model.blocks[0].attn)
            or _intercepts_rotation(model)):
        return None
    arch = type(model.original_model).__name__
    attn = model.blocks[0].attn
    where = "Hugging Face's own attention module" if _delegated(model) else f"TL's {type(attn).__name__}"
    return f"{arch} rotates q and k inside {where}, which fires no hook_rot_q/k"


def score_edits_apply(model: Any) -> bool:
    return not _delegated(model)


@contextlib.contextmanager
def exposed(model: Any, names: Any) -> Any:
    # Rotation hook points TL's component never fires, made to fire for the block when a hook asks for them.
    names = [str(n) for n in names]
    if not any(".hook_rot_" in n for n in names):
        yield
        return
    _expose_joint_qkv(model)
    if not _intercepts_rotation(model) or model.__dict__.get("_posprobe_intercepting"):
        yield  # nested inside another block that already fires them (once per forward: position control counts)
        return

    def wrap(attn: Any) -> Any:
        # HF's layout [batch, head, pos, d_head]: the bridge's rotation HookPoints convert to TL's and back.
        return lambda q, k: (attn.hook_rot_q(q), attn.hook_rot_k(k))

    model.__dict__["_posprobe_intercepting"] = True
    try:
        with hf.intercepted_qk(model.original_model, {l: wrap(model.blocks[l].attn) for l in range(n_layers(model))}):
            yield
    finally:
        model.__dict__.pop("_posprobe_intercepting", None)


def _expose_joint_qkv(model: Any) -> None:
    # TL's joint-QKV rotary attention (GPT-NeoX / Pythia, Phi-3) rotates q and k in `_apply_rotary_pos_emb` and
    # never calls its hook_rot_q / hook_rot_k. Route that method's output through them (HF layout, as the other
    # rotary bridges fire them) so position control and capture reach the rotated q and k. Once per attention
    # module; without hooks attached a HookPoint returns its input unchanged.
    for block in model.blocks:
        attn = block.attn
        if "_apply_rotary_pos_emb" not in type(attn).__dict__ or attn.__dict__.get("_posprobe_rot_hooks"):
            continue
        original = attn._apply_rotary_pos_emb

        def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, _o=original, _a=attn):
            q_rot, k_rot = _o(q, k, cos, sin)
            return _a.hook_rot_q(q_rot), _a.hook_rot_k(k_rot)

        attn._apply_rotary_pos_emb = apply
        attn._posprobe_rot_hooks = True


def _plain(spec: RotarySpec) -> RotarySpec:
    # A per-band scale of exactly 1 everywhere (YaRN or NTK at scale 1) is the unscaled rotation.
    if spec.freq_scale is not None and all(f == 1.0 for f in spec.freq_scale):
        return replace(spec, freq_scale=None)
    return spec


def rotate_at(model: Any, layer: int, x: torch.Tensor, positions: torch.Tensor, spec: RotarySpec,
              length: int | None = None) -> torch.Tensor:
    # The layer's own rotation replays HF's cos/sin recipe (angle = position * inv_freq, not position / freq:
    # the one-ulp angle difference alone moved SmolLM2's logits by 4e-5); other specs use posprobe's rotation.
    if _plain(spec) != _plain(layer_rotary_spec(model, layer, length)):
        return rotate(x, positions, spec)
    inv_freq, scaling = rotary_freqs(model, layer, length)
    adjacent = rotary_adjacent(model)
    cos, sin = hf_cos_sin(positions.to(x.device), inv_freq.to(x.device), adjacent=adjacent, scaling=scaling)
    return hf_rotate(x, cos[..., None, :], sin[..., None, :], adjacent=adjacent)  # broadcast over heads


def pre_rotation(model: Any, layer: int, x: torch.Tensor, which: str) -> torch.Tensor:
    why = unsupported_qk_path(model, layer)
    if why is not None:
        raise NotImplementedError(f"Position control on a TransformerBridge whose attention {why} is not supported yet")
    norm = qk_norms(model, layer)[0 if which == "q" else 1]
    if norm is None:
        return x
    if getattr(model.blocks[layer].attn, "_qk_norm_phase", None) == "pre_reshape":
        # OLMo-2 normalises the whole projection (every head at once) before splitting it into heads.
        return norm(x.flatten(-2)).view_as(x)
    return norm(x)  # per-head QK-norms (Gemma 3 style) act on the last dim, so TL's layout is fine


def _scaling(model: Any, layer: int) -> float:
    a = hf_attention(model, layer)
    a = getattr(a, "self", a)  # BERT: BertAttention holds BertSelfAttention
    if hasattr(a, "scaling"):
        return float(a.scaling)
    if hasattr(a, "scale_attn"):  # GPT-J divides the scores by scale_attn
        return 1.0 / float(a.scale_attn)
    if of_config(hf.text_config(model.original_model)).unscaled_scores:
        return 1.0  # GPT-Neo does not scale its scores
    return float(getattr(a, "head_dim", getattr(a, "attention_head_size", 0)) ** -0.5)


def _soft_cap(model: Any, layer: int) -> float | None:
    cap = getattr(hf_attention(model, layer), "attn_logit_softcapping", None)
    return float(cap) if cap else None


def attention_scores(model: Any, layer: int, q_rot: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    # The bridge's own recipe: q.k * HF's `scaling`, keys repeated per query group, then the soft-cap.
    h, kv = q_rot.shape[2], k_rot.shape[2]
    k = k_rot.repeat_interleave(h // kv, dim=2) if h != kv else k_rot
    scores = torch.einsum("bqhd,bkhd->bhqk", q_rot, k) * _scaling(model, layer)
    return hf.softcap_logits(scores, _soft_cap(model, layer))


def _tl_version() -> str:
    from importlib.metadata import version

    return version("transformer-lens")


def _tl_major() -> int:
    return int(_tl_version().split(".")[0])


def _delegated(model: Any) -> bool:
    """True where TL's attention component hands the whole computation to the HF module and fires its hooks after
    the fact (BERT, RoBERTa, GPT-Neo, OPT, GPT-J on TL 4.3): hook edits cannot reach the output, and
    hook_attn_scores carries the softmax pattern."""
    from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge

    return type(model.blocks[0].attn).forward is AttentionBridge.forward


def scores_hook_is_pattern(model: Any) -> bool:
    # Measured on BERT (TL 3.9 and 4.3) and GPT-Neo / OPT (4.3): hook_attn_scores equals hook_pattern.
    return is_encoder(model) or _delegated(model)


def kept_scores(model: Any, scores: torch.Tensor) -> torch.Tensor:
    # The bridge masks with the dtype's most negative finite value (-inf only in compatibility mode).
    return scores > torch.finfo(scores.dtype).min


def score_scale(model: Any, layer: int) -> float:
    return 1.0 / _scaling(model, layer)


def score_soft_cap(model: Any) -> float | None:
    return _soft_cap(model, 0)


# ---- positional facts (read by facts.model_facts)

def forward_unsupported(model: Any) -> str | None:
    # Encoder-decoder bridges (T5) have no `blocks`: every analysis walks one stack. Other known departures of the
    # bridge from HF's forward are the architecture row's measured defects (backend.architectures).
    cfg = hf.text_config(model.original_model)
    if not hasattr(model, "blocks"):
        return relative.encoder_decoder(type(model.original_model).__name__)
    arch = type(model.original_model).__name__
    row = of_config(cfg)
    why = row.not_causal(arch, cfg)
    if why is not None:
        return why
    defect = next((d for d in row.defects if d.holds(_tl_major(), cfg)), None)
    return None if defect is None else defect.why.format(tl=_tl_version(), arch=arch)


def attention_unsupported(model: Any) -> str | None:
    cfg = hf.text_config(model.original_model)
    mt = str(getattr(cfg, "model_type", ""))
    if _delegated(model) and _tl_major() < 4:
        arch = type(model.original_model).__name__
        return (f"TransformerLens {_tl_version()} does not fire hook_pattern on {arch}'s delegated attention "
                "(TransformerLens >= 4 does)")
    if PATTERN in of_config(cfg).proven:
        return None
    return (f"{type(model.original_model).__name__} ({mt}): its hook_pattern has not been proven equal to Hugging "
            "Face's attention weights in posprobe")


def rotary_specs(model: Any) -> tuple[RotarySpec | None, ...] | None:
    # None where the model has no rotary layers, or a rotation posprobe does not read (see positional_unsupported);
    # a None entry for a NoPE layer.
    if _tl_kind(model) != families.ROTARY:
        return None
    nope = hf.nope_layers(model.original_model)
    try:
        return tuple(None if l in nope else layer_rotary_spec(model, l) for l in range(n_layers(model)))
    except NotImplementedError:
        return None


def alibi_slopes(model: Any) -> tuple[tuple[float, ...], ...]:
    """Per layer, per head: the ALiBi slope the model actually applies, measured from its own computation (a
    6-token forward: bias = hook_attn_scores - scale * q.k, fitted as slope * key position per query row), never
    from the formula (Falcon-RW in transformers 5.23 applies its bias twice). Cached on the model; raises
    NotImplementedError where the bias is not linear in the key position."""
    cached = model.__dict__.get("_posprobe_alibi_slopes")
    if cached is not None:
        return cached
    n, L = 6, n_layers(model)
    got: dict[tuple[str, int], torch.Tensor] = {}

    def keep(point: str, layer: int):
        def hook(x: torch.Tensor, hook: Any) -> torch.Tensor:
            got[(point, layer)] = x.detach().double().cpu()
            return x

        return hook

    ids = torch.arange(10, 10 + n)[None].to(device_of(model))  # any tokens: the bias does not depend on them
    names = [(hook_name(p, l), keep(p, l)) for l in range(L) for p in ("q", "k", "scores")]
    with torch.no_grad(), hooked(model, names):
        model(ids)
    arch = type(model.original_model).__name__
    out = []
    for l in range(L):
        q, k, s = got[("q", l)], got[("k", l)], got[("scores", l)]
        h, kv = q.shape[2], k.shape[2]
        k = k.repeat_interleave(h // kv, dim=2) if h != kv else k
        out.append(alibi.fit_slopes(s[0] - torch.einsum("qhd,khd->hqk", q[0], k[0]) * _scaling(model, l), arch))
    model.__dict__["_posprobe_alibi_slopes"] = tuple(out)
    return tuple(out)


def bucket_bias(model: Any, rel: torch.Tensor) -> torch.Tensor:
    if not t5_decoder.bridged(model):
        raise NotImplementedError(relative.unsupported(type(model.original_model).__name__))
    table = t5_decoder.bias_table(model.original_model)
    buckets = t5_decoder.bucket_ids(rel.to(table.device), hf.text_config(model.original_model))
    return table[buckets].movedim(-1, -3)


def _sinusoidal(model: Any) -> bool:
    # XGLM (and fairseq-style models) add a fixed sinusoidal table; TL's config calls it "standard".
    return sinusoidal.detect(model.original_model)


def _tl_kind(model: Any) -> str:
    return families.from_tl(model.cfg.positional_embedding_type)


def layer_kinds(model: Any) -> tuple[str, ...]:
    # The families' own detection on the wrapped HF model's config (the loop `peek` runs before loading), TL's name
    # for the kind where the config names none, a sinusoidal module where TL says "standard" for it.
    kind = hf.positional_kind(model.original_model)
    if kind == families.UNKNOWN or kind == families.NOPE:  # NoPE: every layer is marked below, by the same flags
        kind = _tl_kind(model)
    if _sinusoidal(model):
        kind = families.SINUSOIDAL
    nope = hf.nope_layers(model.original_model)
    return tuple(families.NOPE if l in nope else kind for l in range(n_layers(model)))


def positional_unsupported(model: Any) -> str | None:
    hf_model = model.original_model
    cfg = hf.text_config(hf_model)
    mt = str(getattr(cfg, "model_type", ""))
    arch = type(hf_model).__name__
    kind = _tl_kind(model)
    if kind == families.ALIBI:
        try:
            alibi_slopes(model)  # measured; a bias that is not linear in the key position is refused
        except NotImplementedError as e:
            return str(e)
    if kind == learned.FAMILY.kind and not hasattr(model, "pos_embed"):
        if not _sinusoidal(model):
            return (f"{arch} adds its position embedding inside Hugging Face's model (TL's bridge has no pos_embed "
                    "component), which posprobe cannot read or control yet")
        if not sinusoidal.known(hf_model):
            return sinusoidal.unsupported(arch)  # a known module still needs a proven model type (below)
    if kind == families.RELATIVE and not t5_decoder.bridged(model):
        return relative.unsupported(arch)
    if kind == families.ROTARY and getattr(cfg, "num_kv_shared_layers", 0):
        return rotary.kv_shared(arch, cfg.num_kv_shared_layers)
    if kind == families.ROTARY:
        try:
            hf.refuse_unknown_rope(hf_model, 0, arch)
        except NotImplementedError as e:
            return str(e)
        try:
            inv, _ = hf.inv_freq(hf_model, 0)  # NoPE layers share the rotary module
        except NotImplementedError:
            return rotary.no_rotary_module(arch)
    why = next((w for w in (unsupported_qk_path(model, l) for l in range(n_layers(model))) if w), None)
    if why is not None:
        return f"{arch}'s attention {why}, which posprobe's position control does not reproduce yet"
    if POSITIONS not in of_config(cfg).proven:
        return (f"{arch} ({mt}) has not been proven against Hugging Face in posprobe yet "
                f"(proven: {', '.join(proven(POSITIONS))})")
    return None


def attn_types(model: Any) -> tuple[str, ...]:
    return tuple("local" if (layer_type(model, l) or "").startswith("sliding") else "global"
                 for l in range(n_layers(model)))
