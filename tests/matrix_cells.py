"""One cell of the support matrix: run an analysis on a tiny family bridge and check it against Hugging Face.

A cell is "ok" when the analysis runs and its check against an independent Hugging Face computation holds
(assertion errors fail the test; CHECKS says, per analysis, exactly what is checked), "refused: why" when posprobe
refuses the family with one message before any forward pass, and "n/a: why" when the analysis does not apply to
the family's positional kind."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch

from posprobe.analyses.configs import (
    AtlasConfig,
    DecomposeConfig,
    FrequencyConfig,
    GeometryConfig,
    HeadsConfig,
    ProbeConfig,
    ShiftConfig,
    SinksConfig,
    SurgeryEvalConfig,
)
from posprobe.backend.facts import WrongModelKind, model_facts
from posprobe.core.positions import PositionError

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 12
IDS = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
TOL = 1e-4  # float32 tiny models; the bridge and HF run the same kernels, so measured gaps are <= 1e-5


def _plain(bridge: Any, eager: bool = False) -> Any:
    from posprobe.backend.bridge import plain_hf_model

    hf = plain_hf_model(bridge)
    if eager:
        hf.set_attn_implementation("eager")
    return hf


def _close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> None:
    err = float((a.double() - b.double()).abs().max())
    assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol}"


def facts(bridge: Any) -> None:
    from posprobe.backend import hf as HF

    f, hf = model_facts(bridge), _plain(bridge)
    cfg = HF.text_config(hf)
    assert f.n_layers == cfg.num_hidden_layers and f.n_heads == cfg.num_attention_heads
    for layer, spec in enumerate(f.rotary or ()):
        if spec is not None:  # posprobe's frequencies (angle = p / freq) against HF's inv_freq table
            from posprobe.rope import inv_freq_table

            ours, theirs = 1.0 / inv_freq_table(spec, torch.float64), HF.inv_freq(hf, layer)[0]
            kept = [i for i in range(len(ours)) if i not in spec.removed]
            _close(ours[kept], theirs[kept], "inverse frequencies", 1e-6)
            # p-RoPE / proportional: the bands posprobe calls removed are exactly those HF never rotates
            assert all(float(theirs[i]) == 0.0 for i in spec.removed), "removed bands rotate in HF"


def _hf_position_ids(hf: Any, n: int, k: int = 0) -> torch.Tensor:
    # HF's own position ids for a pad-free sequence of n tokens, moved by k: RoBERTa numbers tokens from
    # padding_idx + 1 (its create_position_ids_from_input_ids); the others from 0 (OPT adds its offset of 2 inside
    # its embedding).
    emb = getattr(hf.base_model, "embeddings", None)
    if emb is not None and hasattr(emb, "create_position_ids_from_input_ids"):
        pad = emb.padding_idx
        return emb.create_position_ids_from_input_ids(torch.full((1, n), pad + 1), pad) + k
    return (torch.arange(n) + k)[None]


def position_control(bridge: Any) -> None:
    from posprobe.core.positions import PositionPlan, learned_positions, rope_positions

    f, hf = model_facts(bridge), _plain(bridge)
    n, k = IDS.shape[1], 7
    if f.positional_kind == "alibi":
        return _alibi_control(bridge, hf)
    if f.positional_kind == "relative_bias":
        return _bucket_control(bridge, hf)
    with torch.no_grad():
        want = hf(IDS, position_ids=_hf_position_ids(hf, n, k)).logits
        if f.is_rotary:
            p = torch.arange(n, dtype=torch.float64) + k
            with rope_positions(bridge, PositionPlan(p, p.clone())):
                got = bridge(IDS)
            with rope_positions(bridge, PositionPlan(p, p - k)):  # queries alone moved: must change the logits
                moved = bridge(IDS)
        else:  # learned positions; any other kind is refused here by posprobe itself
            with learned_positions(bridge, (torch.arange(n) + k)[None]):
                got = bridge(IDS)
            moved = bridge(IDS)
    _close(got, want, "logits at positions +7 vs HF position_ids")
    assert (moved - want).abs().max() > 1e-3, "the comparison is vacuous: positions did not matter"


def _identity_and_doubled(bridge: Any, control: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    # A score-bias control's logits (ALiBi, T5 buckets) without a plan and with every position doubled; the identity
    # plan must leave them bit-equal. A refusal comes at the first `control`, before any forward.
    from posprobe.core.positions import PositionPlan

    p = torch.arange(IDS.shape[1], dtype=torch.float64)
    with torch.no_grad():
        with control(bridge, PositionPlan(p, p.clone())):
            identity = bridge(IDS)
        own = bridge(IDS)
        assert torch.equal(identity, own), "the identity plan must leave the model bit-equal"
        with control(bridge, PositionPlan(2 * p, 2 * p)):
            got = bridge(IDS)
    return own, got


def _alibi_control(bridge: Any, hf: Any) -> None:
    # HF's ALiBi takes no position ids; its bias is slope * key position (BLOOM) or slope * (key position - length +
    # 1) (MPT). The independent reference for a plan that doubles every distance: HF's own forward with every slope
    # doubled. MPT builds its bias in a method; BLOOM (transformers 5.x), when nothing is padded, builds it inline
    # from its module's `_get_alibi_slopes` (patching its `build_alibi_tensor` there changes nothing: that was the
    # "unexplained" BLOOM mismatch).
    from posprobe.core.positions import alibi_positions

    base = hf.base_model
    own, got = _identity_and_doubled(bridge, alibi_positions)
    with torch.no_grad():
        if hasattr(base, "build_mpt_alibi_tensor"):
            build = base.build_mpt_alibi_tensor
            base.build_mpt_alibi_tensor = lambda *a, **kw: 2 * build(*a, **kw)
            try:
                want = hf(IDS).logits
            finally:
                del base.build_mpt_alibi_tensor
        else:
            mod = sys.modules[type(base).__module__]
            slopes = mod._get_alibi_slopes
            mod._get_alibi_slopes = lambda *a, **kw: 2 * slopes(*a, **kw)
            try:
                want = hf(IDS).logits
            finally:
                mod._get_alibi_slopes = slopes
        assert (want - hf(IDS).logits).abs().max() > 1e-3, "the reference is vacuous: doubling HF's slopes did nothing"
    _close(got, want, "every distance doubled vs HF with its ALiBi slopes doubled")
    assert (got - own).abs().max() > 1e-3, "the comparison is vacuous: distances did not matter"


def _bucket_control(bridge: Any, hf: Any) -> None:
    # HF's T5 bias takes no position ids; its layer-0 attention computes the bias of offsets j - i in
    # `compute_bias(query_length, key_length)`. The independent reference for a plan that doubles every offset: that
    # same HF function over 2n positions, every other row and column (positions 2i, 2j), patched in.
    from posprobe.core.positions import bucket_positions

    attn = hf.get_submodule("layer.0.self_attention.attention")
    own, got = _identity_and_doubled(bridge, bucket_positions)
    with torch.no_grad():
        compute = attn.compute_bias
        attn.compute_bias = lambda q_len, k_len, **kw: compute(2 * q_len, 2 * k_len, **kw)[..., ::2, ::2]
        try:
            want = hf(IDS).logits
        finally:
            del attn.compute_bias
        assert (want - hf(IDS).logits).abs().max() > 1e-3, "the reference is vacuous: doubling HF's offsets did nothing"
    _close(got, want, "every offset doubled vs HF's own bias of doubled offsets")
    assert (got - own).abs().max() > 1e-3, "the comparison is vacuous: offsets did not matter"


def shift_test(bridge: Any) -> None:
    from posprobe.analyses.shift import run_shift_test
    from posprobe.data import builtin_pairs

    f = model_facts(bridge)
    pairs = builtin_pairs(max_pairs=2, seed=0)
    cfg = ShiftConfig(ks=(0, 9), n_bootstrap=20, progress=False)
    hooks = run_shift_test(bridge, pairs, config=cfg, backend="tl")
    if f.positional_kind in ("alibi", "relative_bias"):  # HF takes no position ids: the position control cell
        # proves the numbers
        at = {k: torch.tensor(hooks.pairs[hooks.pairs.k == k].logp_good.to_numpy()) for k in (0, 9)}
        _close(at[9], at[0], "a common shift leaves every distance, so every log-prob, unchanged")
        return
    if f.is_encoder or not f.has_lm_head:
        assert len(hooks.drift), "an encoder's shift test reports representation drift"
        return
    native = run_shift_test(bridge, pairs, config=cfg, backend="hf")  # HF's own forward with position_ids
    both = hooks.pairs.merge(native.pairs, on=["paradigm", "pair_id", "k"], suffixes=("_tl", "_hf"))
    assert len(both) == len(hooks.pairs) > 0
    _close(torch.tensor(both.logp_good_tl.to_numpy()), torch.tensor(both.logp_good_hf.to_numpy()), "log p at k")


def decompose(bridge: Any) -> None:
    from posprobe.analyses.decompose import decompose_heads

    f = model_facts(bridge)
    layer = 0 if f.has_w_pos else 1
    dec, _ = decompose_heads(bridge, DecomposeConfig(layer=layer, text=TEXT, max_windows=2, progress=False))
    att = _hf_attention_weights(bridge, dec.tokens, layer)
    rec = dec.reconstructed()
    _close(torch.softmax(rec, dim=-1), att, "softmax of the summed terms vs HF's attention weights")


def _hf_attention_weights(bridge: Any, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """HF's attention weights of `layer` (`batch head query key`): its eager path's `attentions`, where that path
    computes the model's own forward. Falcon's eager path in transformers 5.23 adds the boolean causal mask to its
    scores (True = +1: nothing masked) while its SDPA path, the default, masks: its weights are then recomputed from
    HF's own rotated q and k (softmax of q.k / sqrt(head_dim), causal)."""
    eager, default = _plain(bridge, eager=True), _plain(bridge)
    with torch.no_grad():
        out = eager(ids, output_attentions=True)
        if (out.logits - default(ids).logits).abs().max() <= TOL:
            return out.attentions[layer]
    q, k = _hf_rotated_qk(default, ids, layer)  # batch pos head d
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    n = ids.shape[1]
    return s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


def hf_rope_io(hf: Any, ids: torch.Tensor, layer: int) -> tuple[tuple, tuple, dict, Any]:
    """HF's own forward on `ids`, caught at its modeling module's apply_rotary_pos_emb for `layer`: ((q, k) handed to
    it, (q, k) it returned, {"q"/"k": that attention's q_proj / k_proj output where it has them}, the attention)."""
    attn = [m for m in hf.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")][layer]
    mod = sys.modules[type(attn).__module__]
    orig, seen, proj = mod.apply_rotary_pos_emb, [], {}
    one_at_a_time = next(iter(inspect.signature(orig).parameters)) == "tensor"  # GPT-J: (tensor, sin, cos), k then q
    half: list = []

    def spy(q, k, *a, **kw):
        if one_at_a_time:
            out = orig(q, k, *a, **kw)
            half.append((q, out))
            if len(half) == 2:  # GPT-J rotates [batch, pos, head, d]: stored as the others hand it, head before pos
                (k_in, k_out), (q_in, q_out) = ((x.transpose(1, 2) for x in pair) for pair in half)
                seen.append(((q_in, k_in), (q_out, k_out)))
                half.clear()
            return out
        out = orig(q, k, *a, **kw)
        seen.append(((q, k), out))
        return out

    def keep(name):
        return lambda m, i, o: proj.__setitem__(name, o)

    handles = [getattr(attn, f"{w}_proj").register_forward_hook(keep(w)) for w in "qk" if hasattr(attn, f"{w}_proj")]
    mod.apply_rotary_pos_emb = spy
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        mod.apply_rotary_pos_emb = orig
        for h in handles:
            h.remove()
    ins, outs = seen[layer]
    return ins, outs, proj, attn


def _hf_rotated_qk(hf: Any, ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    # HF's own rotated q and k of `layer` (full head: rotated dims then the pass-through ones). Phi / StableLM hand
    # apply_rotary_pos_emb the rotated slice only: the pass-through dims are then HF's q_proj / k_proj outputs, which
    # that attention passes on unchanged.
    _, outs, proj, attn = hf_rope_io(hf, ids, layer)
    out = []
    for w, rot in zip("qk", outs):
        rot = rot.transpose(1, 2)  # TL layout: batch pos head d_head
        if w in proj and rot.shape[-1] < attn.head_dim:
            full = proj[w].view(*rot.shape[:2], -1, attn.head_dim)
            rot = torch.cat([rot, full[..., rot.shape[-1]:]], dim=-1)
        out.append(rot)
    return out[0], out[1]


def _hf_band_shares(bridge: Any, rows: torch.Tensor, layer: int, queries: int) -> torch.Tensor:
    """Per head, each rotary band's share of the summed |partial score| over causal entries of the last `queries`
    queries (then the unrotated remainder's, partial rotary), from HF's own rotated q / k. Bands as HF rotates
    them: rd = 2 x HF's inv_freq length, band 0 = HF's first inv_freq entry (the fastest), and the pairing, split
    halves (b, b + rd/2) or interleaved (2b, 2b+1; GPT-J, Cohere, GLM), is the one whose pair norms HF's own
    rotation (its apply_rotary_pos_emb's input vs output) preserves."""
    from posprobe.backend import hf as HF

    hf = _plain(bridge)
    q, k = _hf_rotated_qk(hf, rows, layer)  # batch pos head d
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    nb = HF.inv_freq(hf, layer)[0].shape[0]
    rd = 2 * nb
    b = torch.arange(nb)
    (q_in, _), (q_out, _), _, _ = hf_rope_io(hf, rows, layer)

    def moved(d1: torch.Tensor, d2: torch.Tensor) -> float:  # how far HF's rotation moves these pairs' norms
        norm = lambda x: x[..., d1].double() ** 2 + x[..., d2].double() ** 2  # noqa: E731
        return float((norm(q_out) - norm(q_in)).abs().max())

    pairings = [(b, b + nb), (2 * b, 2 * b + 1)]
    d1, d2 = min(pairings, key=lambda p: moved(*p))
    assert moved(d1, d2) <= 1e-4, "HF's rotation preserves neither pairing's norms"
    assert nb == 1 or max(moved(*p) for p in pairings) > 1e-4, "HF's band pairing not identified"
    n = rows.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    causal[: n - min(n, queries)] = False
    q, k = q.double(), k.double()
    band = torch.einsum("bqhd,bkhd->bhdqk", q[..., d1], k[..., d1]) + torch.einsum("bqhd,bkhd->bhdqk", q[..., d2],
                                                                                      k[..., d2])
    parts = [band]
    if q.shape[-1] > rd:
        parts.append(torch.einsum("bqhd,bkhd->bhqk", q[..., rd:], k[..., rd:])[:, :, None])
    c = torch.cat(parts, 2).abs()[..., causal].sum((0, -1))  # head band(+rest), |.| per window
    return c / c.sum(-1, keepdim=True)


def freq_report(bridge: Any) -> None:
    # The bands table's abs_share per layer, head and band equals the same share computed from HF's own rotated q
    # and k (_hf_band_shares), and the heads table's self / prev / first masses equal HF's attention weights'
    # (queries 1..), over the same windows (BOS + text). float32; measured max |diff| 7.5e-8.
    from posprobe.analyses.frequency import run_frequency
    from posprobe.backend.model import encode_text, tokenizer_of
    from posprobe.data import framed_windows

    f = model_facts(bridge)
    cfg = FrequencyConfig(window=16, max_windows=2, queries=12, ablate=False, progress=False)
    res = run_frequency(bridge, TEXT, cfg)
    assert len(set(zip(res.tables["heads"]["layer"], res.tables["heads"]["head"]))) == len(f.rotary_layers) * f.n_heads
    bos = tokenizer_of(bridge).bos_token_id
    rows = torch.tensor(framed_windows(encode_text(bridge, TEXT), cfg.window, pre=[bos] if bos is not None else [],
                                       max_windows=cfg.max_windows))
    bands, heads_t = res.tables["bands"], res.tables["heads"]
    for layer in f.rotary_layers:
        want = _hf_band_shares(bridge, rows, layer, cfg.queries)
        t = bands[(bands.layer == layer) & (bands.metric == "abs_share")]
        got = torch.zeros_like(want)
        for h, band, v in zip(t["head"], t["band"], t["value"]):
            got[h, band] = v  # band -1 (unrotated remainder) lands in the last column
        assert len(t) == want.numel()
        _close(got, want, f"layer {layer} band abs_share vs HF's rotated q/k")
        masses = _hf_head_masses(_hf_attention_weights(bridge, rows, layer), encoder=False)
        h = heads_t[heads_t.layer == layer].sort_values("head")
        for metric in ("self_mass", "prev_mass", "first_mass"):
            _close(torch.tensor(h[metric].to_numpy()), masses[metric], f"layer {layer} {metric} vs HF's attention")


def _analysis_rows(bridge: Any, window: int, max_windows: int) -> torch.Tensor:
    # The windows run_heads cuts: the model's framing (BOS, or CLS ... SEP) around consecutive text slices.
    from posprobe.backend.model import encode_text, first_token, special_tokens
    from posprobe.data import framed_windows

    pre, post = special_tokens(bridge)
    if not pre:
        first = first_token(bridge)
        pre = [first] if first is not None else []
    return torch.tensor(framed_windows(encode_text(bridge, TEXT), window, pre=pre, post=post,
                                       max_windows=max_windows))


def _hf_head_masses(att: torch.Tensor, encoder: bool) -> dict[str, torch.Tensor]:
    """Per head, from HF attention weights `[batch, head, query, key]` (plain torch): prev_mass = mean over
    windows and queries i >= 1 of A[i, i-1]; self_mass / first_mass = mean of A[i, i] / A[i, 0] over the queries
    that choose (i >= 1 in a decoder, every i in an encoder); sink_score = mean of A[i, 0] over every query."""
    a = att.double()
    lo = 0 if encoder else 1
    i = torch.arange(a.shape[-1])
    return {"prev_mass": a[:, :, i[1:], i[:-1]].mean((0, 2)),
            "self_mass": a[:, :, i[lo:], i[lo:]].mean((0, 2)),
            "first_mass": a[:, :, lo:, 0].mean((0, 2)),
            "sink_score": a[:, :, :, 0].mean((0, 2))}


def heads(bridge: Any) -> None:
    # The heads table's prev-token, self, first-token and sink masses per layer and head equal the same statistics
    # of HF's eager attention weights over the same windows (float32; measured max |diff| 7.5e-8).
    from posprobe.analyses.heads import run_heads

    f = model_facts(bridge)
    cfg = HeadsConfig(window=16, max_windows=2, induction_len=4, progress=False)
    res = run_heads(bridge, TEXT, cfg)
    t = res.tables["heads"]
    assert len(set(zip(t["layer"], t["head"]))) == f.n_layers * f.n_heads
    rows = _analysis_rows(bridge, cfg.window, cfg.max_windows)
    assert rows.shape == (res.meta["n_windows"], cfg.window)
    for layer in range(f.n_layers):
        want = _hf_head_masses(_hf_attention_weights(bridge, rows, layer), f.is_encoder)
        for metric, v in want.items():
            got = t[(t.layer == layer) & (t.metric == metric)].sort_values("head").value.to_numpy()
            _close(torch.tensor(got), v, f"layer {layer} {metric} vs HF's attention weights")


def sinks(bridge: Any) -> None:
    from posprobe.analyses.sinks import run_sinks, sink_statistics

    f = model_facts(bridge)
    res = run_sinks(bridge, TEXT, SinksConfig(length=16, random_samples=2, max_windows=2, progress=False))
    assert len(res.tables["sink_share"]) == 2 * f.n_layers
    got = sink_statistics(bridge, IDS, SinksConfig(length=IDS.shape[1], progress=False), condition="ids")[0]
    got = got[got.layer == 0].set_index(["metric", "head"]).value
    alpha = _hf_attention_weights(bridge, IDS, 0)[0, :, :, 0].double().mean(-1)  # Gu et al.'s alpha_1 per head
    _close(torch.tensor(got["first_attention"].sort_index().values), alpha, "alpha_1 vs HF's attention weights")
    if f.is_rotary:  # the key norm as the scores see it: HF's own rotated key
        _, k = _hf_rotated_qk(_plain(bridge), IDS, 0)
        kn = k[0].double().norm(dim=-1)  # pos kv_head
        want = (kn[0] / kn[1:].mean(0)).repeat_interleave(f.n_heads // f.n_kv_heads)
        _close(torch.tensor(got["first_key_norm_ratio"].sort_index().values), want, "first key norm ratio vs HF's")


def probes(bridge: Any) -> None:
    # What the probe fits: every sampled vector X[i] is HF's own hidden state after block 0 (hidden_states[1]; an
    # encoder's is post-LayerNorm, as the bridge's hook_resid_post there) at window row groups[i], position y[i], of
    # the windows the analysis cut, so the probe's target is that token's true position; and each fold's chance MAE
    # is mean |y_test - mean(y_train)| recomputed from those labels (the table stores float32). float32; measured
    # max |diff| 7e-7 (inputs), 9e-8 (chance).
    import numpy as np

    import posprobe.analyses.probes as P

    cfg = ProbeConfig(points=("resid_post",), layers=(0,), n_splits=2, window=16, max_windows=4, max_tokens=40,
                      progress=False)
    seen: list = []
    fit = P.probe_scores

    def spy(X, positions, groups, n_pos, c):
        seen.append((X.copy(), np.asarray(positions).copy(), np.asarray(groups).copy()))
        return fit(X, positions, groups, n_pos, c)

    P.probe_scores = spy
    try:
        res = P.run_probes(bridge, TEXT, cfg)
    finally:
        P.probe_scores = fit
    (X, y, g), = seen
    rows = torch.tensor(P.text_rows(bridge, TEXT, cfg.window, cfg.max_windows))
    hf = _plain(bridge)
    with torch.no_grad():
        want = hf(rows, output_hidden_states=True).hidden_states[1]
    assert len(y) == min(cfg.max_tokens, rows.numel()) and y.max() < cfg.window
    at = want[torch.tensor(g), torch.tensor(y) + cfg.skip_first]
    _close(torch.tensor(X), at, "probe inputs vs HF's residual at (row, position)")
    t = res.tables["probes"]
    chance = t[(t.condition == "chance") & (t.metric == "mae")].sort_values("fold").value.to_numpy()
    from sklearn.model_selection import GroupKFold

    ref = [float(np.abs(y[te] - y[tr].mean()).mean()) for tr, te in GroupKFold(cfg.n_splits).split(X, y, g)]
    _close(torch.tensor(chance), torch.tensor(ref), "chance MAE vs |y - mean(y_train)|", 1e-6)


def probes_capture(bridge: Any) -> None:
    """posprobe's residual capture after block 0 equals HF's hidden state there."""
    from posprobe.core.capture import capture

    point = "bridge_resid_post_normalized" if model_facts(bridge).is_encoder else "resid_post"
    got = capture(bridge, IDS, [point], layers=[0])[(point, 0)]
    with torch.no_grad():
        want = _plain(bridge)(IDS, output_hidden_states=True).hidden_states[1]
    _close(got, want, "residual stream after block 0 vs HF's hidden state")


def geometry(bridge: Any) -> None:
    from posprobe.analyses.geometry import run_geometry
    from posprobe.backend.model import position_table

    run_geometry(bridge, TEXT, GeometryConfig(window=16, max_windows=2, components=2, progress=False))
    if not model_facts(bridge).has_w_pos:
        return probes_capture(bridge)  # residual geometry only: its input is the residual stream
    hf = _plain(bridge)
    base = hf.base_model
    emb = (getattr(base, "wpe", None) or getattr(getattr(base, "embeddings", None), "position_embeddings", None)
           or base.get_decoder().embed_positions)  # GPT-2 / GPT-Neo, BERT, OPT
    # Row i of W_pos is what HF adds at position i: OPT reads its table `offset` rows in, RoBERTa numbers tokens from
    # padding_idx + 1 (the position control cell proves the rows against HF's position_ids too).
    W_pos = position_table(bridge).detach()
    rows = _hf_position_ids(hf, W_pos.shape[0])[0] + int(getattr(emb, "offset", 0) or 0)
    _close(W_pos, emb.weight.detach()[rows], "W_pos vs HF's position table", 0.0)


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """-log p(token t+1 | <= t) in nats from `[batch, pos, vocab]` logits (plain torch)."""
    lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return -lp.gather(-1, ids[:, 1:, None])[..., 0]


def _hf_linear_twin(hf: Any, factor: float) -> Any | None:
    """HF's own model with the same weights and its config's rope scaling set to `linear` (Position Interpolation,
    inv_freq / factor) in every rope parameter set (Gemma 3: one per layer type); None where HF's architecture
    reads no rope parameters (GPT-J builds its sin/cos table from rotary_dim alone)."""
    import copy

    cfg = copy.deepcopy(hf.config)
    rp = getattr(cfg, "rope_parameters", None)
    if not isinstance(rp, dict):
        return None
    for sub in (rp.values() if all(isinstance(v, dict) for v in rp.values()) else (rp,)):
        sub.update(rope_type="linear", factor=float(factor))
    out = type(hf)(cfg).eval()
    out.load_state_dict(hf.state_dict())  # inv_freq is a non-persistent buffer: the twin keeps its scaled one
    return out


def _hf_preset_nll(bridge: Any, ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Per preset, HF's own NLL `[batch, pos - 1]` of `ids` computed independently of posprobe's surgery:
    none = the plain forward; shift:k=3 = position_ids + 3; pi:scale=0.5 = position_ids 2p (integers: exact in
    every rotary family, GPT-J included); pi:scale=2 = the same weights with HF's `linear` rope scaling, factor 2
    (None for GPT-J, which HF cannot scale)."""
    hf = _plain(bridge)
    p = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    twin = _hf_linear_twin(hf, 2.0)
    with torch.no_grad():
        return {"none": _nll(hf(ids).logits, ids),
                "shift:k=3": _nll(hf(ids, position_ids=p + 3).logits, ids),
                "pi:scale=0.5": _nll(hf(ids, position_ids=2 * p).logits, ids),
                "pi:scale=2": None if twin is None else _nll(twin(ids).logits, ids)}


SURGERY_PRESETS = ("none", "shift:k=3", "pi:scale=0.5", "pi:scale=2")


def surgery_eval(bridge: Any) -> None:
    # The table's NLL by query position under each preset equals HF's own NLL of the same window with HF's own
    # position handling (see _hf_preset_nll); a preset that did nothing would fail the PI rows (measured >= 0.086
    # nats from `none` on every family; float32, measured max |diff| vs HF 5.6e-6).
    from posprobe.analyses.squish import run_surgery_eval
    from posprobe.backend.model import encode_text
    from posprobe.data import token_windows

    res = run_surgery_eval(bridge, TEXT, SurgeryEvalConfig(presets=SURGERY_PRESETS, window=16, max_windows=2))
    t = res.tables["surgery_eval"]
    ids = torch.tensor(token_windows(encode_text(bridge, TEXT), 16, max_windows=2))
    want = _hf_preset_nll(bridge, ids)
    got = {}
    for spec in SURGERY_PRESETS:
        rows = t[t.preset == spec].sort_values(["window", "query_pos"])
        got[spec] = torch.tensor(rows.value.to_numpy()).view(ids.shape[0], -1)
        if want[spec] is not None:
            _close(got[spec], want[spec], f"surgery-eval NLL under {spec} vs HF's")
    for spec in ("pi:scale=0.5", "pi:scale=2"):
        assert (got[spec] - got["none"]).abs().max() > 1e-2, f"{spec} left the loss unchanged"


def long_context(bridge: Any) -> None:
    # The long_context table's binned NLL (mean over windows and query positions of each bin) equals the same bins
    # of HF's own NLL on the same windows (BOS + consecutive text slices), per preset as in surgery_eval (float32;
    # measured max |diff| 2.6e-6).
    from posprobe.analyses.long_context import LongContextConfig, run_long_context
    from posprobe.backend.model import tokenizer_of
    from posprobe.core import long_engine as LA

    f = model_facts(bridge)
    if not f.is_rotary:
        raise WrongModelKind(f"long-context presets rotate q and k; {f.name} uses {f.positional_kind} positions")
    hf, tok = _plain(bridge), tokenizer_of(bridge)
    LA.require_supported(hf)  # a refusal comes here, before any forward
    L, bins, nw = 20, 6, 2
    # The harness runs a plain HF model (given a bridge, it refuses one whose attention cannot run as HF's own
    # modules: Gemma 2, GPT-NeoX, GPT-J, Phi, Phi-3 here): the model the bridge wraps, with the bridge's tokenizer.
    res = run_long_context(hf, TEXT, LongContextConfig(lengths=(L,), presets=SURGERY_PRESETS, max_windows=nw,
                                                       bin_size=bins, chunk=7, progress=False), tokenizer=tok)
    t = res.tables["long_context"]
    bos = list(tok("", add_special_tokens=True)["input_ids"])
    body = list(tok(TEXT, add_special_tokens=False)["input_ids"])
    step = L - len(bos)
    ids = torch.tensor([bos + body[s:s + step] for s in range(0, nw * step, step)])
    want = _hf_preset_nll(bridge, ids)
    for spec in SURGERY_PRESETS:
        rows = t[t.preset == spec].sort_values("bin_start")
        got = torch.tensor(rows.value.to_numpy())
        assert list(rows.bin_start) == list(range(0, L - 1, bins))
        if want[spec] is not None:
            ref = torch.stack([want[spec][:, a:a + bins].mean() for a in range(0, L - 1, bins)])
            _close(got, ref, f"long-context binned NLL under {spec} vs HF's")
        if spec.startswith("pi"):
            base = torch.tensor(t[t.preset == "none"].sort_values("bin_start").value.to_numpy())
            # bins average the effect down: measured >= 7e-3 nats (Cohere 2's pi:scale=0.5), vs HF gaps <= 3e-6
            assert (got - base).abs().max() > 1e-3, f"{spec} left the loss unchanged"


def retrieval(bridge: Any) -> None:
    # The retrieval analysis reads each answer step's last-query attention weights from the long-context engine:
    # they must be HF's own (eager attention of a full forward on the same tokens), and masking must reach HF.
    from posprobe.core import long_engine as LA
    from posprobe.core.presets import preset_pairs

    hf, ids = _plain(bridge, eager=True), IDS[0]
    LA.require_supported(hf, "Retrieval heads (read through the long-context engine)")  # before any forward
    seen: dict[int, list[torch.Tensor]] = {}
    new = LA.greedy_decode(hf, ids, preset_pairs("none"), 2, record=lambda l, w: seen.setdefault(l, []).append(w))
    seq = ids.tolist() + new.tolist()
    with torch.no_grad():
        for s in range(len(new)):
            out = hf(torch.tensor([seq[:len(ids) + s]]), output_attentions=True)
            for layer, a in enumerate(out.attentions):
                _close(seen[layer][s], a[0, :, -1], f"layer {layer} step {s}: engine's weights vs HF eager", 1e-5)
    masked = LA.token_nll(hf, ids, preset_pairs("none"), masked={0: (0,)})
    assert (masked - LA.token_nll(hf, ids, preset_pairs("none"))).abs().max() > 1e-4, "masking changed nothing"


def _same_tables(got: Any, want: Any, what: str) -> None:
    import pandas as pd

    assert set(got.tables) == set(want.tables), f"{what}: tables {sorted(got.tables)} vs {sorted(want.tables)}"
    for name in want.tables:
        try:
            pd.testing.assert_frame_equal(got.tables[name].reset_index(drop=True),
                                          want.tables[name].reset_index(drop=True), check_exact=True)
        except AssertionError as e:
            raise AssertionError(f"{what}: table {name} differs: {e}") from None


def atlas(bridge: Any) -> None:
    # The atlas's heads and sinks sections equal the standalone analyses run with the configs the atlas documents
    # (bit-equal: same code, same seed, CPU), and those analyses are the ones the heads / sinks cells prove against
    # HF; a section that ran with another window, seed or text would differ.
    from posprobe.analyses.atlas import SINK_LENGTH, run_atlas
    from posprobe.analyses.heads import run_heads
    from posprobe.analyses.sinks import run_sinks

    f = model_facts(bridge)
    cfg = AtlasConfig(window=16, max_windows=2, max_pairs=2, probe_tokens=40, induction_len=4, ks=(0, 9),
                      progress=False)
    res = run_atlas(bridge, TEXT, cfg)
    sections = res.meta["sections"]
    assert "facts" in sections
    w = cfg.window_for(f.n_ctx)
    if "heads" in sections:
        want = run_heads(bridge, TEXT, HeadsConfig(window=w, max_windows=cfg.max_windows, seed=cfg.seed,
                                                   induction_len=min(cfg.induction_len, (f.n_ctx - 1) // 2),
                                                   progress=False))
        _same_tables(res.parts["heads"], want, "atlas heads vs run_heads")
    if "sinks" in sections:
        want = run_sinks(bridge, TEXT, SinksConfig(length=min(SINK_LENGTH, w), random_samples=8,
                                                   max_windows=cfg.max_windows, seed=cfg.seed, progress=False,
                                                   ablate_heads=cfg.ablate_heads if "retrieval" in sections else 0))
        _same_tables(res.parts["sinks"], want, "atlas sinks vs run_sinks")


#: What a ✓ proves, per column (docs/support-matrix.md's header is generated from it).
CHECKS: dict[str, str] = {
    "facts": "layer and head counts equal HF's config; every rotary layer's frequencies equal HF's inv_freq "
             "(removed bands unrotated in HF).",
    "position control": "logits with every position moved by 7 equal HF's forward with position_ids + 7 (ALiBi: "
                        "every distance doubled equals HF with its slopes doubled; T5 buckets: every offset doubled "
                        "equals HF's own bias of the doubled offsets, the identity plan bit-equal); moving queries "
                        "alone changes them.",
    "shift-test": "the analysis's log p(good) at each start k equals HF's own forward with position_ids (ALiBi, T5 "
                  "buckets: equal across k; encoders: only that a drift table is produced).",
    "decompose": "the softmax of the analysis's summed score terms equals HF's attention weights of that layer "
                 "(ALiBi and T5 buckets: with the bias as a term of its own).",
    "freq-report": "the bands table's abs_share per layer, head and band equals the share from HF's rotated q/k; "
                   "the heads table's self/prev/first masses equal HF's attention weights'.",
    "heads": "the heads table's prev/self/first/sink masses per layer and head equal the same means of HF's eager "
             "attention weights over the analysis's windows.",
    "sinks": "the sink statistics' first-token attention (and, RoPE, first-key norm ratio) per layer-0 head equal "
             "HF's attention weights (rotated keys), on a fixed 20-token input; run_sinks's tables only run.",
    "probes": "every vector the probe fits equals HF's hidden state after block 0 at the (row, position) it is "
              "labelled with; each fold's chance MAE is recomputed from those labels.",
    "geometry": "the analysis runs; its input, W_pos, equals HF's position table row by row (no table: the residual "
                "after block 0 equals HF's hidden state). Its output is not checked against HF.",
    "surgery-eval": "NLL per position under none / shift:k=3 / pi:scale=0.5 / pi:scale=2 equals HF's plain forward / "
                    "position_ids + 3 / position_ids 2p / HF's linear rope scaling x2 (GPT-J: HF has no scaling, "
                    "pi:scale=2 unchecked); both PI presets change the loss.",
    "long-context": "the binned NLL table under the surgery-eval presets equals the same bins of the same HF "
                    "references. The harness is given the plain HF model the bridge wraps: given the bridge itself "
                    "it refuses Gemma 2, GPT-NeoX, GPT-J, Phi and Phi-3 (ValueError, before any forward).",
    "retrieval": "the engine's last-query attention weights at each decode step equal HF's eager full forward; "
                 "masking a head changes the loss.",
    "atlas": "the heads and sinks sections' tables equal run_heads / run_sinks with the atlas's configs "
             "(bit-equal); the other sections only run.",
}

CELLS: dict[str, Callable[[Any], None]] = {
    "facts": facts, "position control": position_control, "shift-test": shift_test, "decompose": decompose,
    "freq-report": freq_report, "heads": heads, "sinks": sinks, "probes": probes, "geometry": geometry,
    "surgery-eval": surgery_eval,
    "long-context": long_context, "retrieval": retrieval, "atlas": atlas,
}


def run_cell(bridge: Any, analysis: str) -> str:
    """"ok", "refused: why" or "n/a: why" for one cell (AssertionError where an identity check fails, and any
    other exception propagates: a cell that is neither right nor refused fails the matrix)."""
    try:
        CELLS[analysis](bridge)
    except WrongModelKind as e:
        return "n/a: " + _short(e)
    except PositionError as e:
        return "n/a: " + _short(e)
    except NotImplementedError as e:
        return "refused: " + _short(e)
    return "ok"


def _short(e: Exception) -> str:
    text = str(e).split(": ", 1)[-1] if "is not available for" in str(e) else str(e)
    return text.replace("|", "/").replace("\n", " ")
