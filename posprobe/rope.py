"""Rotary position maths on plain tensors: frequencies, rotation by arbitrary positions, bands.

Conventions follow TransformerLens 3 exactly (so integer positions reproduce the model bit for bit):
`freq_b = base ** (b / (rotary_dim/2))` is the inverse angular frequency of band b, the angle at
position p is `p / freq_b`, and band b pairs dims (b, b + rotary_dim/2) ("half-split", GPT-NeoX,
Llama) or (2b, 2b+1) ("adjacent", GPT-J). Angles are computed in float32 (float64 for float64
models) and cast, as TL does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import einops
import torch
from jaxtyping import Float


@dataclass(frozen=True)
class RotarySpec:
    """How one attention layer rotates: dims rotated, base, pairing, and per-band frequency scale.

    `freq_scale` multiplies each band's inverse frequency (TL's `rotary_scaling_factor` is a scalar
    case); `None` means 1. `removed` bands get no rotation (cos=1, sin=0), p-RoPE style.
    `attention_factor` multiplies cos and sin (YaRN's and LongRoPE's attention scaling in HF): the rotated
    dims of q and k each grow by it, so their scores by its square; unrotated dims are left alone.
    """

    rotary_dim: int
    base: float
    adjacent: bool = False
    freq_scale: tuple[float, ...] | None = None
    removed: frozenset[int] = frozenset()
    attention_factor: float = 1.0

    @property
    def n_bands(self) -> int:
        return self.rotary_dim // 2


def inv_freq_table(spec: RotarySpec, dtype: torch.dtype = torch.float32) -> Float[torch.Tensor, " band"]:
    """`freq_b` per band (angle = position / freq_b), in TL's precision for `dtype`."""
    hp = torch.float64 if dtype == torch.float64 else torch.float32
    dim = torch.arange(spec.n_bands, dtype=hp)
    freq = spec.base ** (dim / (spec.rotary_dim / 2))
    if spec.freq_scale is not None:
        freq = freq * torch.tensor(spec.freq_scale, dtype=hp)
    return freq


def angular_frequency(spec: RotarySpec) -> list[float]:
    """Radians per token for each band (band 0 is the fastest); 0 for a band that never turns (`removed`)."""
    return [0.0 if b in spec.removed else 1.0 / float(f) for b, f in enumerate(inv_freq_table(spec, torch.float64))]


def wavelength(spec: RotarySpec) -> list[float]:
    """Wavelength in tokens for each band: 2*pi / angular frequency (infinite for a band that never turns)."""
    return [2 * math.pi / w if w else math.inf for w in angular_frequency(spec)]


def band_dims(spec: RotarySpec, band: int) -> tuple[int, int]:
    """The two head dims that band `band` rotates together."""
    if spec.adjacent:
        return 2 * band, 2 * band + 1
    return band, band + spec.n_bands


#: Per-dim frequency rows and removed-band masks already on a device, keyed by (spec, dtype, device).
#: Small (rotary_dim numbers each) and few (one per distinct layer rotation), so never evicted. Without
#: it every rotation rebuilt the row on the CPU and copied it over: ~65 host->device copies per batch
#: on a GPU (issue 13).
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}


def _device_tables(
    spec: RotarySpec, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    key = (spec, dtype, torch.device(device))
    got = _TABLES.get(key)
    if got is None:
        # Built once on the CPU (the same float recipe as TL's tables), then copied once.
        freq = inv_freq_table(spec, dtype)
        freq = einops.repeat(freq, "d -> (d 2)") if spec.adjacent else einops.repeat(freq, "d -> (2 d)")
        gone = None
        if spec.removed:
            gone = torch.zeros(spec.rotary_dim, dtype=torch.bool)
            for b in spec.removed:
                gone[list(band_dims(spec, b))] = True
            gone = gone.to(device)
        got = _TABLES[key] = (freq.to(device), gone)
    return got


def sin_cos(
    positions: Float[torch.Tensor, "*shape"], spec: RotarySpec, dtype: torch.dtype
) -> tuple[Float[torch.Tensor, "*shape rotary_dim"], Float[torch.Tensor, "*shape rotary_dim"]]:
    """sin and cos tables for arbitrary (float) positions, laid out like TL's `rotary_sin/cos`.

    Computed on `positions.device` from a per-(spec, dtype, device) cached frequency row: no host
    round trip when the positions already live on the model's device."""
    hp = torch.float64 if dtype == torch.float64 else torch.float32
    freq, gone = _device_tables(spec, dtype, positions.device)
    angles = positions.to(hp)[..., None] / freq
    sin, cos = torch.sin(angles), torch.cos(angles)
    if gone is not None:
        sin = torch.where(gone, torch.zeros_like(sin), sin)
        cos = torch.where(gone, torch.ones_like(cos), cos)
    if spec.attention_factor != 1.0:
        sin, cos = sin * spec.attention_factor, cos * spec.attention_factor
    return sin.to(dtype), cos.to(dtype)


def rotate_half(x: Float[torch.Tensor, "... rotary_dim"], adjacent: bool) -> Float[torch.Tensor, "... rotary_dim"]:
    """Map each pair (a, b) to (-b, a), the 90-degree turn RoPE adds with weight sin."""
    out = x.clone()
    if adjacent:
        out[..., ::2] = -x[..., 1::2]
        out[..., 1::2] = x[..., ::2]
    else:
        n = x.size(-1) // 2
        out[..., :n] = -x[..., n:]
        out[..., n:] = x[..., :n]
    return out


def rotate(
    x: Float[torch.Tensor, "batch pos head_index d_head"],
    positions: Float[torch.Tensor, " pos"] | Float[torch.Tensor, "batch pos"],
    spec: RotarySpec,
) -> Float[torch.Tensor, "batch pos head_index d_head"]:
    """Rotate the first `rotary_dim` dims of each head vector to the given positions (floats allowed).

    Dims past `rotary_dim` pass through unchanged (partial rotary).
    """
    if positions.dim() == 1:
        positions = positions[None, :]
    if positions.shape[-1] != x.shape[1]:
        raise ValueError(f"{positions.shape[-1]} positions for a sequence of {x.shape[1]} tokens")
    sin, cos = sin_cos(positions.to(x.device), spec, x.dtype)
    x_rot, x_pass = x[..., : spec.rotary_dim], x[..., spec.rotary_dim:]
    out = x_rot * cos[:, :, None, :] + rotate_half(x_rot, spec.adjacent) * sin[:, :, None, :]
    return torch.cat([out, x_pass], dim=-1)


def hf_cos_sin(positions: Float[torch.Tensor, "*shape"], inv_freq: Float[torch.Tensor, " band"], *,
               adjacent: bool = False, scaling: float = 1.0
               ) -> tuple[Float[torch.Tensor, "*shape rotary_dim"], Float[torch.Tensor, "*shape rotary_dim"]]:
    """(cos, sin) in float32 exactly as Hugging Face builds them: angle = position * inv_freq (rad/token) in
    float32, each band's angle written to both of its dims (half-split or adjacent layout), times `scaling`.

    HF's recipe, not posprobe's `sin_cos` (angle = position / freq): the one-ulp difference between the two
    alone moved SmolLM2's logits by 4e-5, so replaying a model's own rotation must use this one."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device, torch.float32)
    emb = freqs.repeat_interleave(2, dim=-1) if adjacent else torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def hf_rotate(
    x: Float[torch.Tensor, "... d_head"],
    cos: Float[torch.Tensor, "... rotary_dim"],
    sin: Float[torch.Tensor, "... rotary_dim"],
    *,
    adjacent: bool = False,
) -> Float[torch.Tensor, "... d_head"]:
    """Rotate the first `rotary_dim` dims of `x` with HF-style (cos, sin) tables that broadcast to them, as HF
    does: half-split pairs (`rotate_half`) in the activations' dtype; adjacent pairs (GPT-J / GLM) in float32.
    Dims past `rotary_dim` pass through (partial rotary)."""
    rd = cos.shape[-1]
    xr, rest = x[..., :rd], x[..., rd:]
    if adjacent:
        turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
        out = (xr.float() * cos + turned.float() * sin).to(x.dtype)
    else:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        turned = torch.cat((-xr[..., rd // 2:], xr[..., : rd // 2]), dim=-1)
        out = xr * cos + turned * sin
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def inv_freq_of(spec: RotarySpec) -> Float[torch.Tensor, " band"]:
    """Angular frequency per band (rad/token, float32, HF's `inv_freq` layout) of a RotarySpec; removed bands
    get 0 (no rotation)."""
    inv = 1.0 / inv_freq_table(spec, torch.float64)
    for b in spec.removed:
        inv[b] = 0.0
    return inv.float()


def band_pairs(x: Float[torch.Tensor, "... d_head"], spec: RotarySpec) -> Float[torch.Tensor, "... band 2"]:
    """The two coordinates of every band of each head vector, as a view of `x` (no copy)."""
    x = x[..., : spec.rotary_dim]
    if spec.adjacent:
        return x.unflatten(-1, (spec.n_bands, 2))
    return x.unflatten(-1, (2, spec.n_bands)).transpose(-1, -2)


def band_norms(
    x: Float[torch.Tensor, "batch pos head_index d_head"], spec: RotarySpec
) -> Float[torch.Tensor, "batch pos head_index band"]:
    """2-norm of each band's pair (rotation-invariant: equal before and after RoPE)."""
    pairs = band_pairs(x, spec)
    return torch.hypot(pairs[..., 0], pairs[..., 1])


def expand_kv(k: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat GQA key heads (axis 2) to query heads, as TL does."""
    return k if k.shape[2] == n_heads else torch.repeat_interleave(k, n_heads // k.shape[2], dim=2)


def _grouped_band_products(
    q_rot: Float[torch.Tensor, "batch query_pos head_index d_head"],
    k_rot: Float[torch.Tensor, "batch key_pos kv_head d_head"],
    spec: RotarySpec,
    scale: float,
    out: torch.Tensor | None = None,
) -> Float[torch.Tensor, "batch kv_head band group_query key_pos"]:
    """Per-band partial dot products q_b.k_b / `scale` in the layout one batched matmul produces.

    Query head h = kv * group + g shares key head kv (TL's repeat order); axis 3 runs over (g, query_pos),
    g slowest. Keys are never repeated. `out`, if given, is a contiguous buffer of the result's shape
    that is written in place (a streaming caller reuses it instead of allocating a large block per call).
    """
    B, n_q, H, _ = q_rot.shape
    kv = k_rot.shape[2]
    nb = spec.n_bands
    qp = band_pairs(q_rot[..., : spec.rotary_dim] / scale, spec)  # scale q: far smaller than the products
    qp = qp.reshape(B, n_q, kv, H // kv, nb, 2).permute(0, 2, 4, 3, 1, 5).reshape(B, kv, nb, H // kv * n_q, 2)
    kp = band_pairs(k_rot, spec).permute(0, 2, 3, 4, 1)  # [batch, kv, band, 2, key_pos]
    return torch.matmul(qp, kp, out=out)


def band_contributions(
    q_rot: Float[torch.Tensor, "batch query_pos head_index d_head"],
    k_rot: Float[torch.Tensor, "batch key_pos head_index d_head"],
    spec: RotarySpec,
    scale: float,
) -> tuple[
    Float[torch.Tensor, "batch head_index band query_pos key_pos"],
    Float[torch.Tensor, "batch head_index query_pos key_pos"],
]:
    """Per-band partial dot products of rotated q and k / `scale`, and the unrotated remainder.

    Bands + remainder sum to the layer's pre-softmax score. GQA keys (fewer heads than queries, shared
    by consecutive query heads as TL repeats them) need no expanding.
    """
    B, n_q, H, _ = q_rot.shape
    kv, n_k = k_rot.shape[2], k_rot.shape[1]
    grouped = _grouped_band_products(q_rot, k_rot, spec, scale)
    bands = grouped.view(B, kv, spec.n_bands, H // kv, n_q, n_k).transpose(2, 3).reshape(B, H, spec.n_bands, n_q, n_k)
    if q_rot.shape[-1] == spec.rotary_dim:
        return bands, bands.new_zeros(B, H, n_q, n_k)
    qg = (q_rot[..., spec.rotary_dim:] / scale).reshape(B, n_q, kv, H // kv, -1)
    rest = torch.einsum("bqvgd,bkvd->bvgqk", qg, k_rot[..., spec.rotary_dim:])
    return bands, rest.reshape(B, H, n_q, n_k)
