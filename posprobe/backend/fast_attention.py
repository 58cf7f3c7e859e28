"""Fused attention (PyTorch SDPA) inside a TransformerBridge, for passes that read nothing inside attention.

TransformerLens forces `attn_implementation="eager"` on the model it wraps and re-implements each attention
layer step by step, so that `hook_rot_q/k`, `hook_attn_scores` and `hook_pattern` can fire: every forward
builds the T x T scores and pattern (CPU: ~1.25x an SDPA forward at 512 tokens; GPU: T^2 memory per layer).
A pass that hooks only the residual stream, q/k/v or z does not need that. Inside `sdpa_attention(model)`
each attention layer runs the wrapped Hugging Face attention module itself with transformers' "sdpa"
attention function (the bridge's q/k/v/o projections are still the bridge's, so `hook_q/k/v/z` fire with the
same values), and the model's masks are built for SDPA. Logits equal the plain HF model's (same kernels).

The context does nothing (the bridge's own attention runs) where any hook sits on a HookPoint of an attention
layer itself (hook_in/out, rot_q/k, attn_scores, pattern, ...), for encoders, in training mode, with TL's
split-input / per-head-result options on, or for attention modules that are not q/k/v/o-projection modules
(GPT-2's fused c_attn, BERT). So a pass that does need attention internals gets them, always from TL's code.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from posprobe.backend.kind import is_bridge, is_encoder

# TL options under which the bridge's attention computes something HF's module does not.
_TL_OPTIONS = ("use_split_qkv_input", "use_attn_in", "use_attn_result", "use_hook_mlp_in")


@dataclass(frozen=True)
class _Plan:
    attns: tuple[Any, ...]  # the bridge's attention components, one per layer
    points: tuple[Any, ...]  # their own HookPoints (not those of the q/k/v/o projections)
    configs: tuple[Any, ...]  # every HF config object whose _attn_implementation decides the kernel


def _plan(model: Any) -> _Plan | None:
    cached = getattr(model, "_posprobe_sdpa_plan", None)
    if cached is not None:
        return cached or None
    plan = _build_plan(model)
    object.__setattr__(model, "_posprobe_sdpa_plan", plan or False)
    return plan


def _build_plan(model: Any) -> _Plan | None:
    from transformer_lens.hook_points import HookPoint

    if not is_bridge(model) or is_encoder(model):
        return None
    attns = tuple(block.attn for block in model.blocks)
    points, configs = [], {}
    for attn in attns:
        hf = getattr(attn, "original_component", None)
        if hf is None or not all(hasattr(hf, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "config")):
            return None
        if getattr(hf, "attn_logit_softcapping", None):  # Gemma 2: transformers' SDPA refuses a score soft-cap
            return None
        points += [m for m in attn.children() if isinstance(m, HookPoint)]
        configs[id(hf.config)] = hf.config
    hf_model = model.original_model
    for cfg in (hf_model.config, getattr(hf_model.config, "get_text_config", lambda: None)()):
        if cfg is not None:
            configs[id(cfg)] = cfg
    return _Plan(attns, tuple(points), tuple(configs.values()))


def sdpa_usable(model: Any) -> bool:
    """True where `sdpa_attention(model)` would run SDPA now (no hook inside attention, supported model)."""
    plan = _plan(model)
    return (plan is not None and not model.training and not any(getattr(model.cfg, o, False) for o in _TL_OPTIONS)
            and not any(p.has_hooks() for p in plan.points))


@contextmanager
def sdpa_attention(model: Any) -> Iterator[bool]:
    """Run the model's attention layers with SDPA inside the block; yields whether it does (see the module
    docstring for when it does not). Everything is restored on exit, also on error."""
    if not sdpa_usable(model):
        yield False
        return
    plan = _plan(model)
    assert plan is not None
    if "forward" in plan.attns[0].__dict__:  # nested inside another sdpa_attention: the outer one restores
        yield True
        return
    before = [c._attn_implementation for c in plan.configs]
    try:
        for attn in plan.attns:
            # An instance attribute shadows the bridge's forward; nn.Module.__call__ looks it up per call.
            object.__setattr__(attn, "forward", attn.original_component)
        for c in plan.configs:
            c._attn_implementation = "sdpa"
        yield True
    finally:
        for c, impl in zip(plan.configs, before):
            c._attn_implementation = impl
        for attn in plan.attns:
            if "forward" in attn.__dict__:
                object.__delattr__(attn, "forward")


@contextmanager
def hf_model_inside(model: Any) -> Iterator[Any]:
    """The Hugging Face model a TransformerBridge wraps, made runnable with HF's own attention modules inside the
    block (SDPA, or any function registered with transformers' `AttentionInterface`, as posprobe's long-context
    engine does). The bridge's projections, norms and MLPs still run; hooks outside attention still fire.
    ValueError where the bridge's attention cannot be bypassed (see `sdpa_attention`)."""
    with sdpa_attention(model) as fused:
        if not fused:
            raise ValueError("this model's attention cannot run as Hugging Face's own modules here: it needs a "
                             "decoder TransformerBridge with q/k/v/o projection modules and no hook inside attention")
        yield model.original_model
