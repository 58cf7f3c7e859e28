"""One cell of the support matrix: run an analysis on a tiny family bridge and check it against Hugging Face.

A cell is "ok" when the analysis runs and its identity check against an independent Hugging Face computation
holds (assertion errors fail the test), "refused: why" when posprobe refuses the family with one message before
any forward pass, and "n/a: why" when the analysis does not apply to the family's positional kind.
"""

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


def _alibi_control(bridge: Any, hf: Any) -> None:
    # HF's ALiBi takes no position ids; its bias is slope * key position (BLOOM) or slope * (key position - length +
    # 1) (MPT). The independent reference for a plan that doubles every distance: HF's own forward with every slope
    # doubled. MPT builds its bias in a method; BLOOM (transformers 5.x), when nothing is padded, builds it inline
    # from its module's `_get_alibi_slopes` (patching its `build_alibi_tensor` there changes nothing: that was the
    # "unexplained" BLOOM mismatch).
    from posprobe.core.positions import PositionPlan, alibi_positions

    n = IDS.shape[1]
    p = torch.arange(n, dtype=torch.float64)
    base = hf.base_model
    with torch.no_grad():
        with alibi_positions(bridge, PositionPlan(p, p.clone())):  # a refusal comes here, before any forward
            identity = bridge(IDS)
        own = bridge(IDS)
        assert torch.equal(identity, own), "the identity plan must leave an ALiBi model bit-equal"
        with alibi_positions(bridge, PositionPlan(2 * p, 2 * p)):
            got = bridge(IDS)
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


def shift_test(bridge: Any) -> None:
    from posprobe.analyses.shift import run_shift_test
    from posprobe.data import builtin_pairs

    f = model_facts(bridge)
    pairs = builtin_pairs(max_pairs=2, seed=0)
    cfg = ShiftConfig(ks=(0, 9), n_bootstrap=20, progress=False)
    hooks = run_shift_test(bridge, pairs, config=cfg, backend="tl")
    if f.positional_kind == "alibi":  # HF takes no position ids here; the position control cell proves the numbers
        at = {k: torch.tensor(hooks.pairs[hooks.pairs.k == k].logp_good.to_numpy()) for k in (0, 9)}
        _close(at[9], at[0], "ALiBi: a common shift leaves every distance, so every log-prob, unchanged")
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


def freq_report(bridge: Any) -> None:
    from posprobe.analyses.frequency import run_frequency
    from posprobe.core.capture import capture

    res = run_frequency(bridge, TEXT, FrequencyConfig(window=16, max_windows=2, ablate=False, progress=False))
    f = model_facts(bridge)
    assert len(set(zip(res.tables["heads"]["layer"], res.tables["heads"]["head"]))) == len(f.rotary_layers) * f.n_heads
    got = capture(bridge, IDS, ["rot_q", "rot_k"], layers=[1])
    q, k = _hf_rotated_qk(_plain(bridge), IDS, 1)
    _close(got[("rot_q", 1)], q, "rotated q vs HF's")
    _close(got[("rot_k", 1)], k, "rotated k vs HF's")


def heads(bridge: Any) -> None:
    from posprobe.analyses.heads import run_heads
    from posprobe.core.capture import capture

    f = model_facts(bridge)
    res = run_heads(bridge, TEXT, HeadsConfig(window=16, max_windows=2, induction_len=4, progress=False))
    assert len(set(zip(res.tables["heads"]["layer"], res.tables["heads"]["head"]))) == f.n_layers * f.n_heads
    got = capture(bridge, IDS, ["pattern"], layers=[0])[("pattern", 0)]
    att = _hf_attention_weights(bridge, IDS, 0)
    _close(got, att, "hook_pattern vs HF's attention weights")


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
    from posprobe.analyses.probes import run_probes

    run_probes(bridge, TEXT, ProbeConfig(points=("resid_post",), n_splits=2, window=16, max_windows=4, max_tokens=40,
                                         progress=False))
    probes_capture(bridge)


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


def surgery_eval(bridge: Any) -> None:
    from posprobe.analyses.squish import run_surgery_eval

    res = run_surgery_eval(bridge, TEXT, SurgeryEvalConfig(presets=("none", "shift:k=3"), window=16, max_windows=1))
    t = res.tables["surgery_eval"]
    none, shifted = (t[t.preset == p].value.to_numpy() for p in ("none", "shift:k=3"))
    _close(torch.tensor(none), torch.tensor(shifted), "a common shift on a RoPE model (invariance)")


def long_context(bridge: Any) -> None:
    from posprobe.core import long_engine as LA
    from posprobe.core.generation import logits_under, token_logprobs
    from posprobe.core.presets import preset_pairs, preset_plan

    f = model_facts(bridge)
    if not f.is_rotary:
        raise WrongModelKind(f"long-context presets rotate q and k; {f.name} uses {f.positional_kind} positions")
    hf, ids = _plain(bridge), IDS[0]
    LA.require_supported(hf)
    got = LA.token_nll(hf, ids, preset_pairs("pi:scale=2"), chunk=7)
    want = -token_logprobs(logits_under(bridge, ids[None], preset_plan("pi:scale=2", bridge, len(ids))), ids[None])[0]
    _close(got, want, "chunked engine vs hook surgery (pi:scale=2)")


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


def atlas(bridge: Any) -> None:
    from posprobe.analyses.atlas import run_atlas

    res = run_atlas(bridge, TEXT, AtlasConfig(window=16, max_windows=2, max_pairs=2, probe_tokens=40, induction_len=4,
                                              ks=(0, 9), progress=False))
    assert "facts" in res.meta["sections"]


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
