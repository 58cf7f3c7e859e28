"""Weights and facts read straight from the Hugging Face model a TransformerBridge wraps (plain tensors,
no posprobe or TransformerLens code): the independent side of the identity tests."""

from __future__ import annotations

import math

import torch


def hf_of(model):
    """The wrapped Hugging Face model (bridge fixtures) — tests on legacy HookedTransformers do not use this."""
    return model.original_model


def W_E(model) -> torch.Tensor:
    """Token embedding `[d_vocab, d_model]`."""
    return hf_of(model).get_input_embeddings().weight.detach()


def W_pos(model) -> torch.Tensor:
    """Learned position table `[n_ctx, d_model]` (GPT-2 `wpe`, BERT `position_embeddings`)."""
    hf = hf_of(model)
    if hasattr(hf, "transformer"):
        return hf.transformer.wpe.weight.detach()
    return hf.bert.embeddings.position_embeddings.weight.detach()


def attn_scale(model, layer: int = 0) -> float:
    """The divisor of q.k in HF's attention: sqrt(head_dim) for the tiny models and SmolLM2."""
    attn = _hf_layers(model)[layer].self_attn if hasattr(_hf_layers(model)[layer], "self_attn") else None
    if attn is not None and hasattr(attn, "scaling"):
        return 1.0 / float(attn.scaling)
    cfg = hf_of(model).config
    return math.sqrt(cfg.hidden_size // cfg.num_attention_heads)


def _hf_layers(model):
    hf = hf_of(model)
    return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def gpt2_layer0(model) -> dict[str, torch.Tensor | float]:
    """GPT-2 block 0 in float64: ln_1 (w, b, eps) and W_Q/b_Q/W_K/b_K split per head from `c_attn`
    (`[head, d_model, d_head]`, `[head, d_head]`)."""
    hf = hf_of(model)
    blk = hf.transformer.h[0]
    d, H = hf.config.n_embd, hf.config.n_head
    dh = d // H
    W = blk.attn.c_attn.weight.detach().double()  # Conv1D: [d_model, 3 d_model], x @ W
    b = blk.attn.c_attn.bias.detach().double()

    def heads(i):
        return (W[:, i * d:(i + 1) * d].reshape(d, H, dh).permute(1, 0, 2).contiguous(),
                b[i * d:(i + 1) * d].reshape(H, dh))

    (W_Q, b_Q), (W_K, b_K) = heads(0), heads(1)
    return dict(ln_w=blk.ln_1.weight.detach().double(), ln_b=blk.ln_1.bias.detach().double(), eps=blk.ln_1.eps,
                W_Q=W_Q, b_Q=b_Q, W_K=W_K, b_K=b_K)


def masked(scores: torch.Tensor) -> torch.Tensor:
    """Entries a layer masked out: -inf (TL 3) or the dtype's most negative value (HF / TransformerBridge)."""
    return scores <= torch.finfo(scores.dtype).min


def complex_rotate(x: torch.Tensor, positions: torch.Tensor, spec) -> torch.Tensor:
    """RoPE as complex multiplication (float64), independent of posprobe.rope: band b pairs dims (b, b + r/2)
    (half-split) or (2b, 2b + 1) (adjacent) of the first `spec.rotary_dim` dims of `x` [batch, pos, head, d_head],
    turned by position / (base^(2b/r) * freq_scale_b); removed bands and the dims past rotary_dim stay. `positions`
    [pos] or [batch, pos]; returned in x's dtype."""
    h = spec.rotary_dim // 2
    xr = x[..., : spec.rotary_dim].double()
    re, im = (xr[..., 0::2], xr[..., 1::2]) if spec.adjacent else (xr[..., :h], xr[..., h:])
    scale = spec.freq_scale or (1.0,) * h
    inv = torch.tensor([0.0 if b in spec.removed else 1.0 / (spec.base ** (2 * b / spec.rotary_dim) * scale[b])
                        for b in range(h)], dtype=torch.float64)
    pos = positions.double() if positions.dim() == 2 else positions.double()[None].expand(x.shape[0], -1)
    theta = pos[..., None, None] * inv  # batch pos 1 band
    z = torch.complex(re, im) * torch.polar(torch.ones_like(theta), theta)
    turned = torch.stack([z.real, z.imag], -1).flatten(-2) if spec.adjacent else torch.cat([z.real, z.imag], -1)
    return torch.cat([turned, x[..., spec.rotary_dim:].double()], -1).to(x.dtype)


def independent_hf(hf_model):
    """A plain Hugging Face model rebuilt from `hf_model`'s class, a deep copy of its config and a clone of its state
    dict: no module, parameter, buffer or storage in common with `hf_model`, so nothing TransformerLens later does to
    `hf_model` (it rewires the modules of the model it boots in place) reaches it. Call it *before* booting a bridge
    on `hf_model`: the reference is then HF's own forward on the same weights, never the bridge's. Plain
    transformers/torch only (no posprobe.backend.hf.twin, which shares the weight tensors by design)."""
    import copy

    cfg = copy.deepcopy(hf_model.config)
    with torch.random.fork_rng(devices=[]):  # its throwaway init must not move the caller's random stream
        ref = type(hf_model)(cfg)
    sd = {k.replace("._original_component", ""): v.detach().clone() for k, v in hf_model.state_dict().items()}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing[:3], unexpected[:3])
    return ref.eval()


def shares_storage(a, b) -> bool:
    """Whether two modules hold any tensor (parameter or buffer) on the same storage, or any submodule in common."""
    def ptrs(m):
        return {t.untyped_storage().data_ptr() for t in (*m.parameters(), *m.buffers()) if t.numel()}

    return bool(ptrs(a) & ptrs(b)) or bool({id(x) for x in a.modules()} & {id(x) for x in b.modules()})
