"""Long inputs under a surgery preset without T x T tensors: a posprobe attention function for plain
Hugging Face models, registered through transformers' `AttentionInterface`.

How it works. Inside `long_attention(model, rule)` the model is run with position ids all zero, so HF's
own rotation is the identity (cos = 1, sin = 0) and every attention layer hands this module its query and
key *before* rotation (after QK-norm, as HF computes them). The function rotates them itself, to the
positions and with the frequencies of the preset's `PairRule` (posprobe.core.surgery), with the layer's own
HF inverse-frequency table where the preset keeps the frequencies. Then:
  * one view, no per-pair selector, no sliding window or soft-cap (none, shift, PI, NTK, YaRN, p-RoPE):
    PyTorch's `scaled_dot_product_attention` (memory-efficient kernels, no T x T pattern);
  * otherwise (Self-Extend, ReRoPE, StreamingLLM; Gemma 3's sliding layers) queries go in chunks of
    `chunk` rows: each view's scores for the chunk (chunk x keys per head), merged by the rule's selector,
    masked (causal, sliding window, evicted keys), softmax, times V. Memory O(chunk x T) per head.
Preset "none" never enters this module: `token_nll` / `greedy_decode` run the model's own forward.

Positions are in tokens. Rotation uses HF's formula (float32 angles `position * inv_freq`, half-split pairs),
so a preset that keeps positions and frequencies reproduces HF's rotation bit for bit.
Keys are cached unrotated (generation), so a decode step re-rotates the cached keys: O(T) per step.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int

from posprobe.core.positions import PositionError
from posprobe.core.rope import RotarySpec, inv_freq_table
from posprobe.core.surgery import PairRule

#: Name under which the attention function is registered in transformers' AttentionInterface.
IMPLEMENTATION = "posprobe_long"

# HF model types whose attention rotates the whole head with half-split pairs (`rotate_half`) and passes
# q/k to the attention interface unchanged after rotation. Others are refused rather than guessed.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2",
                         "granite", "smollm3")

_ENGINES: dict[int, "_Engine"] = {}  # id(attention module) -> engine in force


def text_config(model: Any) -> Any:
    """The decoder's HF config (the text config of multimodal wrappers)."""
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def trained_context(model: Any) -> int | None:
    """Context length the model was trained for (tokens): the config's original_max_position_embeddings
    (rope scaling) or max_position_embeddings."""
    cfg = text_config(model)
    rp = getattr(cfg, "rope_parameters", None) or {}
    orig = rp.get("original_max_position_embeddings") if isinstance(rp, dict) else None
    return int(orig or getattr(cfg, "max_position_embeddings", 0) or 0) or None


def attention_modules(model: Any) -> list[Any]:
    """The decoder's attention modules in layer order (each has `layer_idx`)."""
    # Inside a TransformerBridge each HF attention module sits in a bridge component that forwards attribute
    # reads to it: count the HF modules only (the bridge's own has `original_component`).
    mods = [m for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "q_proj") and not hasattr(m, "original_component")]
    return sorted(mods, key=lambda m: m.layer_idx)


def require_supported(model: Any, what: str = "Long-context presets") -> None:
    """Raise PositionError (learned positions) or NotImplementedError (other layouts) before any forward."""
    cfg = text_config(model)
    mt = str(getattr(cfg, "model_type", "")).lower()
    rotary = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_theta", None)
    if not rotary:
        raise PositionError(f"{what} rotate queries and keys; this {mt or type(model).__name__} model has no rotary "
                            "positions (learned or other position embeddings)")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"{what}: {mt!r} models are not supported "
                                  f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    for l in range(len(attention_modules(model))):
        inv, scaling = hf_inv_freq(model, l)
        if scaling != 1.0:
            raise NotImplementedError(f"{what}: layer {l} scales cos/sin by {scaling} (its config's RoPE scaling); "
                                      "position ids 0 would not give unrotated q/k")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if 2 * inv.numel() != head_dim:
            raise NotImplementedError(f"{what}: partial rotary (rotary dim {2 * inv.numel()} of {head_dim}) "
                                      "is not supported")


def _layer_type(model: Any, layer: int) -> str | None:
    types = getattr(text_config(model), "layer_types", None)
    return types[layer] if types else None


def _rotary_emb(model: Any) -> Any:
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model
    emb = getattr(dec, "rotary_emb", None)
    if emb is None:
        raise NotImplementedError(f"cannot find the rotary embedding of {type(model).__name__}")
    return emb


def hf_inv_freq(model: Any, layer: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies in rad/token `[band]`, cos/sin multiplier) HF rotates `layer` with."""
    emb, lt = _rotary_emb(model), _layer_type(model, layer)
    if lt is not None and hasattr(emb, f"{lt}_inv_freq"):  # Gemma 3: one table per layer type
        return getattr(emb, f"{lt}_inv_freq"), float(getattr(emb, f"{lt}_attention_scaling", 1.0))
    return emb.inv_freq, float(getattr(emb, "attention_scaling", 1.0))


def hf_rotary_spec(model: Any, layer: int) -> RotarySpec:
    """The layer's rotation as a posprobe RotarySpec (base from the config, half-split, full head)."""
    cfg = text_config(model)
    rp = getattr(cfg, "rope_parameters", None) or {}
    lt = _layer_type(model, layer)
    if lt is not None and isinstance(rp.get(lt), dict):
        rp = rp[lt]
    base = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    inv, _ = hf_inv_freq(model, layer)
    spec = RotarySpec(rotary_dim=2 * inv.numel(), base=base)
    # A static scaling already in the config (linear, llama3, ...) is a per-band factor on the default table;
    # keep it, so NTK / YaRN act on the frequencies the model was actually trained with.
    ratio = (1.0 / inv.detach().double().cpu()) / inv_freq_table(spec, torch.float64)
    if (ratio - 1).abs().max() > 1e-5:
        spec = RotarySpec(rotary_dim=spec.rotary_dim, base=base, freq_scale=tuple(ratio.tolist()))
    return spec


def inv_freq_of(spec: RotarySpec) -> Float[torch.Tensor, "band"]:
    """Angular frequency per band (rad/token, float32) of a RotarySpec; removed bands get 0 (no rotation)."""
    inv = 1.0 / inv_freq_table(spec, torch.float64)
    for b in spec.removed:
        inv[b] = 0.0
    return inv.float()


def rotate_hf(x: Float[torch.Tensor, "batch head pos d_head"], positions: Float[torch.Tensor, "pos"],
              inv_freq: Float[torch.Tensor, "band"]) -> Float[torch.Tensor, "batch head pos d_head"]:
    """Rotate head vectors to `positions` exactly as HF's Llama/Gemma code does (float32 angles, half-split)."""
    freqs = positions.to(x.device, torch.float32)[:, None] * inv_freq.to(x.device, torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass
class _Engine:
    rule: PairRule
    inv_freq: dict[int, torch.Tensor]
    chunk: int

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               window: int | None, softcap: float | None) -> torch.Tensor:
        B, H, n_q, d = query.shape
        KV, n_k = key.shape[1], key.shape[2]
        g = H // KV
        inv = self.inv_freq[module.layer_idx]
        # Absolute token indices: queries are the last n_q of the n_k keys (batch of one sequence, no padding).
        i = torch.arange(n_k - n_q, n_k, dtype=torch.float64)
        j = torch.arange(n_k, dtype=torch.float64)
        scale = scaling * self.rule.score_scale
        views = self.rule.views
        if len(views) == 1 and self.rule.select is None and not window and not softcap and n_q in (1, n_k):
            q_r = rotate_hf(query, views[0][0](i), inv)
            k_r = rotate_hf(key, views[0][1](j), inv)
            k_r, v = k_r.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
            return F.scaled_dot_product_attention(q_r, k_r, v, is_causal=n_q > 1, scale=scale)
        k_rot = [rotate_hf(key, kf(j), inv) for _, kf in views]
        out = query.new_empty(B, H, n_q, d)
        for a in range(0, n_q, self.chunk):
            b = min(a + self.chunk, n_q)
            ii = i[a:b]
            hi = int(ii[-1]) + 1
            lo = max(0, int(ii[0]) - window + 1) if window else 0
            jj = j[lo:hi]
            # The selector is computed from host indices: column ranges are read there (no device sync).
            sel_host = self.rule.select(ii, jj) if self.rule.select is not None else None
            sel = sel_host.to(query.device) if sel_host is not None else None
            scores = query.new_full((B, H, b - a, hi - lo), float("-inf"))
            for v, (qf, _) in enumerate(views):
                # Only the key columns where some query of the chunk uses view v (Self-Extend's neighbours lie
                # within W of the chunk, StreamingLLM's sinks are the first S keys): each pair is scored once.
                c0, c1 = 0, hi - lo
                if sel_host is not None:
                    cols = (sel_host == v).any(dim=0).nonzero()
                    if cols.numel() == 0:
                        continue
                    c0, c1 = int(cols[0]), int(cols[-1]) + 1
                q_r = rotate_hf(query[:, :, a:b], qf(ii), inv).reshape(B, KV, g * (b - a), d)
                s = torch.matmul(q_r, k_rot[v][:, :, lo + c0:lo + c1].transpose(-1, -2)).view(B, H, b - a, c1 - c0)
                s = s * scale
                scores[..., c0:c1] = s if sel is None else torch.where(sel[:, c0:c1] == v, s, scores[..., c0:c1])
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            keep = (jj[None, :] <= ii[:, None]).to(query.device)
            if window:
                keep &= (jj[None, :] > ii[:, None] - window).to(query.device)
            if sel is not None:
                keep &= sel >= 0
            p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1, dtype=torch.float32).to(value.dtype)
            out[:, :, a:b] = torch.matmul(p.view(B, KV, g * (b - a), hi - lo), value[:, :, lo:hi]).view(B, H, b - a, d)
        return out


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
               softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    # The mask HF would build is ignored on purpose: the engine masks (causal, window, eviction) itself.
    engine = _ENGINES.get(id(module))
    if engine is None:
        raise RuntimeError("posprobe's long-context attention ran outside `long_attention(...)`")
    if query.shape[0] != 1:
        raise ValueError("long-context attention takes one sequence at a time (batch 1)")
    cap = softcap if softcap is not None else getattr(module, "attn_logit_softcapping", None)
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    s = scaling if scaling is not None else module.scaling
    out = engine.attend(module, query, key, value, s, window, cap)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)


@contextmanager
def long_attention(model: Any, rule: PairRule, *, chunk: int = 256) -> Iterator[None]:
    """Within the block, `model` (plain HF, batch 1) attends under `rule`; call it with position ids all 0
    (`zero_positions`). Restores the model's own attention implementation on exit, even after errors."""
    if rule.identity:
        raise ValueError("preset 'none' runs the model's own forward; long_attention is for the other presets")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    require_supported(model)
    mods = attention_modules(model)
    inv = {}
    for m in mods:
        l = m.layer_idx
        if rule.rotary is None:
            inv[l] = hf_inv_freq(model, l)[0].detach().float()
        else:
            inv[l] = inv_freq_of(rule.rotary(hf_rotary_spec(model, l))).to(hf_inv_freq(model, l)[0].device)
    engine = _Engine(rule, inv, chunk)
    _register()
    before = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        if any(getattr(m.config, "_attn_implementation", None) != IMPLEMENTATION for m in mods):
            # Running on would rotate nothing (position ids 0) and attend with the model's own kernel.
            raise NotImplementedError(f"{type(model).__name__} does not accept a custom attention implementation")
        for m in mods:
            _ENGINES[id(m)] = engine
        yield
    finally:
        for m in mods:
            _ENGINES.pop(id(m), None)
        model.set_attn_implementation(before)


def zero_positions(n: int, device: Any = "cpu") -> Int[torch.Tensor, "batch pos"]:
    """Position ids for a forward inside `long_attention`: all 0, so HF's rotation is the identity."""
    return torch.zeros(1, n, dtype=torch.long, device=device)


def _hidden(model: Any, ids: torch.Tensor, engine_on: bool, cache: Any = None, start: int = 0) -> Any:
    n = ids.shape[1]
    pos = zero_positions(n, ids.device) if engine_on else torch.arange(start, start + n, device=ids.device)[None]
    return model.get_decoder()(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=cache is not None)


def _logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(text_config(model), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def token_nll(model: Any, ids: Int[torch.Tensor, "pos"], rule: PairRule, *, chunk: int = 256,
              logit_chunk: int = 1024) -> Float[torch.Tensor, "query_pos"]:
    """NLL (nats) of token t+1 given tokens 0..t, for t = 0..T-2, under `rule` (one sequence).

    Logits are made `logit_chunk` rows at a time (a 16k x 49k logit matrix would be 3 GB)."""
    ids = torch.as_tensor(ids)[None].to(next(model.parameters()).device)
    if rule.identity:
        h = _hidden(model, ids, False).last_hidden_state
    else:
        with long_attention(model, rule, chunk=chunk):
            h = _hidden(model, ids, True).last_hidden_state
    out = []
    for a in range(0, ids.shape[1] - 1, logit_chunk):
        b = min(a + logit_chunk, ids.shape[1] - 1)
        lp = torch.log_softmax(_logits(model, h[0, a:b]).float(), dim=-1)
        out.append(-lp.gather(-1, ids[0, a + 1:b + 1, None])[:, 0])
    return torch.cat(out).cpu()


@torch.no_grad()
def greedy_decode(model: Any, ids: Int[torch.Tensor, "pos"], rule: PairRule, max_new_tokens: int, *,
                  chunk: int = 256, stop_token: int | None = None) -> Int[torch.Tensor, "new"]:
    """Greedy continuation (token ids) of one prompt under `rule`, with a KV cache (keys stored unrotated)."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    ids = torch.as_tensor(ids)[None].to(dev)
    engine_on = not rule.identity
    # A cache without the config keeps every key of every layer (a sliding-window cache would drop keys the
    # engine indexes by absolute position); the engine applies the window itself.
    cache = DynamicCache()
    new: list[int] = []
    ctx = long_attention(model, rule, chunk=chunk) if engine_on else _nothing()
    with ctx:
        h = _hidden(model, ids, engine_on, cache).last_hidden_state
        for step in range(max_new_tokens):
            tok = int(_logits(model, h[0, -1:]).argmax(-1))
            new.append(tok)
            if tok == stop_token or step == max_new_tokens - 1:
                break
            nxt = torch.tensor([[tok]], device=dev)
            h = _hidden(model, nxt, engine_on, cache, start=ids.shape[1] + step).last_hidden_state
    return torch.tensor(new, dtype=torch.long)


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def estimate_bytes(model: Any, length: int, rule: PairRule, *, chunk: int = 256, logit_chunk: int = 1024,
                   cache: bool = False) -> int:
    """Rough peak memory (bytes) of one forward of `length` tokens under `rule`: weights + one layer's
    activations + the chunked score blocks + a logit block (+ the KV cache when generating).

    Deliberately generous (x1.5 on activations): it only has to refuse lengths that cannot fit."""
    cfg = text_config(model)
    e = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    D, F_ = cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
    H, KV = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    hd = getattr(cfg, "head_dim", None) or D // H
    L, T = cfg.num_hidden_layers, length
    act = T * (8 * D + 3 * F_ + 4 * (H + 2 * KV) * hd + 2 * H * hd) * e
    windowed = getattr(cfg, "sliding_window", None) and getattr(cfg, "layer_types", None)
    chunked = len(rule.views) > 1 or rule.select is not None or bool(windowed)
    scores = min(chunk, T) * T * H * 4 * (len(rule.views) + 3) if chunked else 0
    logits = min(logit_chunk, T) * cfg.vocab_size * 4 * 3
    kv = 2 * L * T * KV * hd * e if cache else 0
    hidden = T * D * e * 2  # the final hidden states kept for the logit chunks
    return int(weights + 1.5 * act + scores + logits + kv + hidden)


def available_bytes() -> int:
    """Memory the OS can give this process now (bytes), psutil's `available`."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_memory(model: Any, length: int, rule: PairRule, *, chunk: int = 256, cache: bool = False,
                 available: int | None = None) -> int:
    """Raise MemoryError-style ValueError when `estimate_bytes` exceeds 90% of available memory; return the estimate."""
    need = estimate_bytes(model, length, rule, chunk=chunk, cache=cache)
    have = available_bytes() if available is None else available
    if need > 0.9 * have:
        raise ValueError(f"length {length} under {rule.label!r} needs about {need / 2**30:.1f} GiB "
                         f"(estimate) but only {have / 2**30:.1f} GiB is available; use a shorter length "
                         "or a smaller --chunk")
    return need


__all__ = ["IMPLEMENTATION", "long_attention", "token_nll", "greedy_decode", "rotate_hf", "hf_inv_freq",
           "hf_rotary_spec", "trained_context", "require_supported", "estimate_bytes", "check_memory",
           "zero_positions", "inv_freq_of"]
