"""Chen et al.'s (2023, Position Interpolation) Theorem 2.1 per head, from the frequency pass's measured h_j.

For a query and key whose unrotated band pairs (as complex numbers) give h_j = q_j conj(k_j) / scale, the rotary
part of their score at distance s is a(s) = Re sum_j h_j e^{i s theta_j}. The frequency pass records h_j for each
head's mean pair (the mean unrotated query and key over positions >= 1): a(s) is then the score a typical query
gives a typical key s tokens back, the part of the head's score that depends on distance alone. Per head this module
tabulates a(s) inside the trained context L and beyond it, and Chen's two bounds:
interpolation (between integer positions) errs by at most d max|h_j| / (32 ln b), extrapolation only by
2 max|h_j| B(s). The bounds are evaluated with the head's typical pair (max_j of the mean band norms' product), the
magnitude of one token pair's h_j; a(s) itself uses the mean pair.

>>> import numpy as np
>>> from posprobe.rope import RotarySpec
>>> spec = RotarySpec(rotary_dim=4, base=10_000.0)
>>> theta = np.array([1.0, 0.01])
>>> h = np.array([[1.0 + 0j, 2.0 + 0j]])   # one head: both bands agree at s = 0
>>> float(round(score_by_distance(h, theta, [0])[0, 0], 6))
3.0
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from posprobe.backend.facts import ModelFacts
from posprobe.rope import angular_frequency
from posprobe.rope_theory import chen_B, interpolation_bound, score_by_distance, score_range

__all__ = ["TOLERANCE", "head_bounds", "score_by_distance"]

#: Score units (pre-softmax logits) a verdict tolerates: one logit moves a key's attention weight by a factor e at
#: most, the smallest change that reorders what a head attends to.
TOLERANCE = 1.0

#: a(s) beyond the context is evaluated up to this many times L unless a target is given.
BEYOND = 4


def head_bounds(bands: pd.DataFrame, facts: ModelFacts, *, context: int | None = None,
                target: int | None = None) -> pd.DataFrame:
    """One row per measured head: its layer's `attention` ("local" for a sliding-window layer, whose a(s) past its
    window is never used, else "global"); h_max (max_j |h_j| of the mean pair) and h_max_typical (max_j of mean
    |q_j| times mean |k_j| over scale); a(s)'s range over s = 0..L-1 (a_in_min, a_in_max) and over s = L..L'-1
    (a_out_min, a_out_max); excess (how far a(s) beyond L leaves its range inside L); Chen's interpolation bound and
    his extrapolation bound at its largest over L..L'-1 (both with h_max_typical); two verdicts: interpolation_safe
    (interpolation bound <= TOLERANCE) and extrapolation_leaves_range (excess > TOLERANCE). Score units (pre-softmax
    logits) throughout; L = `context` (default: the model's context), L' = `target` (default 4L), both in tokens.
    ValueError if the table's frequencies are not `facts`' rotation."""
    length = int(context or facts.n_ctx)
    stop = int(target or BEYOND * length)
    if length < 2 or stop <= length:
        raise ValueError(f"the theory needs a context L >= 2 and a target L' > L; got L = {length}, L' = {stop}")
    d = bands[bands.band >= 0]
    if not len(d):
        return pd.DataFrame()
    # One pivot for every layer, and a(s), B(s) once per distinct rotation (every layer of most models shares one):
    # the theory costs a few hundredths of the frequency pass, not a pivot and 8k-distance sums per layer (#64).
    wide = d.pivot_table(index=["layer", "head", "kv_head"], columns=["metric", "band"], values="value")
    listed = d[d.metric == "h_re"].drop_duplicates(["layer", "band"]).sort_values(["layer", "band"])
    groups: dict[bytes, list[int]] = {}
    for layer, f in listed.groupby("layer"):
        theta = np.asarray(angular_frequency(facts.rotary[int(layer)]))
        if f.frequency.shape != theta.shape or not np.allclose(f.frequency.to_numpy(), theta, rtol=1e-9, atol=0):
            raise ValueError(f"layer {layer}: the table's band frequencies are not this model's rotation (another "
                             "model's table, or one measured at another length under a length-dependent rope type)")
        groups.setdefault(theta.tobytes(), []).append(int(layer))
    per_layer: dict[int, pd.DataFrame] = {}
    for layers in groups.values():
        spec = facts.rotary[layers[0]]
        theta = np.asarray(angular_frequency(spec))
        w = wide.loc[layers]
        h = w["h_re"].to_numpy() + 1j * w["h_im"].to_numpy()  # [layer x head, band]
        typical = w["h_typical"].to_numpy().max(1)
        in_lo, in_hi = score_range(h, theta, 0, length)
        out_lo, out_hi = score_range(h, theta, length, stop)
        B = chen_B(spec, np.arange(length, stop)).max()
        interp = interpolation_bound(spec, typical)
        excess = np.maximum(np.maximum(out_hi - in_hi, in_lo - out_lo), 0.0)
        block = pd.DataFrame(dict(
            model=facts.name, layer=w.index.get_level_values("layer").astype(int),
            head=w.index.get_level_values("head").astype(int), kv_head=w.index.get_level_values("kv_head").astype(int),
            attention="global", h_max=np.abs(h).max(1), h_max_typical=typical, a_in_min=in_lo, a_in_max=in_hi,
            a_out_min=out_lo, a_out_max=out_hi, excess=excess, interpolation_bound=interp,
            extrapolation_bound=2 * typical * B, interpolation_safe=interp <= TOLERANCE,
            extrapolation_leaves_range=excess > TOLERANCE, theory_context=length, theory_target=stop))
        for layer, part in block.groupby("layer", sort=False):
            per_layer[int(layer)] = part
    out = pd.concat([per_layer[k] for k in sorted(per_layer)], ignore_index=True)
    # A local (sliding-window) layer never attends past its window: its a(s) beyond it is moot, not a prediction.
    if facts.attn_types:
        out["attention"] = [facts.attn_types[int(lay)] for lay in out.layer]
    return out
