"""Attention sinks (#26, first step): Sink_1^epsilon with per-sample thresholding, and the first token's key/value
norm ratios and query cosines, against a plain-torch recomputation from Hugging Face's own attention weights and
q/k/v (tiny random Llama with GQA, Gemma 3 with QK-norm and local layers, SmolLM3 with a NoPE layer, GPT-2, BERT),
float32 models; measured gaps are at most 1.2e-7 (tolerance 1e-6: float32 rounding in the two forwards)."""

from __future__ import annotations

import pytest
import torch
from families import tiny_family
from matrix_cells import _hf_attention_weights, _hf_rotated_qk, _plain

from posprobe.analyses.sinks import HEAD_METRICS, SinksConfig, run_sinks, sink_statistics
from posprobe.backend.facts import model_facts

TOL = 1e-6
N, T = 5, 24


def _hf_qkv(name: str, hf, ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
    """q, k (as the scores see them) and v of `layer` from HF's own modules, `batch pos head d`."""
    got = {}

    def keep(key):
        return lambda m, i, o: got.__setitem__(key, o)

    b, n = ids.shape
    if name == "gpt2":
        attn = hf.transformer.h[layer].attn
        h = attn.c_attn.register_forward_hook(keep("qkv"))
        with torch.no_grad():
            hf(ids)
        h.remove()
        q, k, v = got["qkv"].split(attn.embed_dim, dim=-1)
        return tuple(x.view(b, n, attn.num_heads, attn.head_dim) for x in (q, k, v))
    if name == "bert":
        att = hf.bert.encoder.layer[layer].attention.self
        hs = [getattr(att, w).register_forward_hook(keep(w)) for w in ("query", "key", "value")]
        with torch.no_grad():
            hf(ids)
        for h in hs:
            h.remove()
        d = att.attention_head_size
        return tuple(got[w].view(b, n, -1, d) for w in ("query", "key", "value"))
    attn = [m for m in hf.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")][layer]
    hs = [getattr(attn, f"{w}_proj").register_forward_hook(keep(w)) for w in "qkv"]
    with torch.no_grad():
        hf(ids)
    for h in hs:
        h.remove()
    q, k, v = (got[w].view(b, n, -1, attn.head_dim) for w in "qkv")
    if getattr(attn, "use_rope", True):  # SmolLM3's NoPE layers score the projections as they are
        q, k = _hf_rotated_qk(hf, ids, layer)  # after QK-norm and rotation: what the scores see
    return q, k, v


def _reference(name: str, bridge, ids: torch.Tensor, eps: float, encoder: bool) -> dict:
    f = model_facts(bridge)
    hf = _plain(bridge)
    group = f.n_heads // f.n_kv_heads
    n = ids.shape[1]
    see = torch.ones(n, n, dtype=torch.bool) if encoder else torch.ones(n, n, dtype=torch.bool).tril()
    out = {}
    for layer in range(f.n_layers):
        att = _hf_attention_weights(bridge, ids, layer).double()  # batch head q k
        alpha = att[..., 0].mean(-1)  # every query, query 0 included (Gu et al.)
        q, k, v = (x.double() for x in _hf_qkv(name, hf, ids, layer))
        kq = k.repeat_interleave(group, dim=2)
        kn, vn = kq.norm(dim=-1), v.repeat_interleave(group, dim=2).norm(dim=-1)  # batch pos head
        cos = torch.nn.functional.cosine_similarity(q[:, :, None], kq[:, None], dim=-1)  # batch q k head
        first_cos = cos[:, 1:, 0].mean(1)  # batch head
        mask = see.clone()
        mask[0], mask[:, 0] = False, False
        other_cos = cos[:, mask].mean(1)
        out[layer] = {
            "first_attention": alpha.mean(0), "sink_rate": (alpha > eps).double().mean(0),
            "first_key_norm_ratio": (kn[:, 0] / kn[:, 1:].mean(1)).mean(0),
            "first_value_norm_ratio": (vn[:, 0] / vn[:, 1:].mean(1)).mean(0),
            "first_key_cos": first_cos.mean(0), "other_key_cos": other_cos.mean(0),
            "sink_share": float((alpha > eps).double().mean()),
        }
        # The first delimiter of each row (after position 0, not last), written out row by row.
        delim = {bridge.tokenizer(d, add_special_tokens=False)["input_ids"][0] for d in (".", ",", "\n", ";", ":",
                                                                                         "!", "?")}
        per_row = []
        for b in range(ids.shape[0]):
            d = next((t for t in range(1, n) if int(ids[b, t]) in delim), None)
            if d is None or d == n - 1:
                continue
            per_row.append(torch.stack([att[b, :, d + 1:, d].mean(-1), kn[b, d] / kn[b, 1:].mean(0),
                                        vn[b, d] / vn[b, 1:].mean(0), cos[b, d + 1:, d].mean(0)]))
        assert per_row, "the test rows must hold delimiters"
        m = torch.stack(per_row).mean(0)
        out[layer].update(delim_attention=m[0], delim_key_norm_ratio=m[1], delim_value_norm_ratio=m[2],
                          delim_key_cos=m[3])
    return out


@pytest.mark.parametrize("name", ["llama", "gemma3", "smollm3", "gpt2", "bert"])
def test_sink_statistics_equal_a_recomputation_from_hf(name):
    bridge, _ = tiny_family(name)
    f = model_facts(bridge)
    ids = torch.randint(3, 250, (N, T), generator=torch.Generator().manual_seed(1))
    dot = bridge.tokenizer(".", add_special_tokens=False)["input_ids"][0]
    ids[0, 5], ids[1, 9], ids[2, 1] = dot, dot, dot  # delimiters at chosen places (others may occur by chance)
    if f.attention_unsupported:  # TL 3.9 never fires hook_pattern on delegated attention (BERT): refused up front
        with pytest.raises(NotImplementedError, match="Attention sinks is not available"):
            sink_statistics(bridge, ids, SinksConfig(length=T, progress=False))
        pytest.skip(f"refused as it should be: {f.attention_unsupported}")
    # epsilon at the median alpha: some (sequence, head) pairs above, some below, so thresholding per sequence
    # (not of the mean) is what the test sees.
    att0 = _hf_attention_weights(bridge, ids, 0)
    eps = float(att0[..., 0].mean(-1).median())
    heads, shares = sink_statistics(bridge, ids, SinksConfig(length=T, epsilon=eps, batch_size=2, progress=False),
                                    condition="c")
    want = _reference(name, bridge, ids, eps, f.is_encoder)
    got = heads.set_index(["layer", "metric", "head"]).value
    for layer in range(f.n_layers):
        for m in HEAD_METRICS:
            g = torch.tensor(got[layer, m].sort_index().values, dtype=torch.float64)
            err = float((g - want[layer][m]).abs().max())
            assert err <= TOL, (name, layer, m, err)
        share = float(shares.set_index("layer").value[layer])
        assert abs(share - want[layer]["sink_share"]) <= 1e-12, (name, layer)
    rates = torch.tensor(heads[heads.metric == "sink_rate"].value.values)
    assert 0 < float(rates.mean()) < 1  # the threshold splits the pairs: the test can tell per-sample from mean


def test_run_sinks_tables_meta_and_refusals(tiny_rope, tiny_ape):
    from posprobe.report.schema import unknown_columns, validate_meta

    res = run_sinks(tiny_rope, None, SinksConfig(length=20, random_samples=4, max_windows=3, progress=False))
    validate_meta(res.meta)
    for df in res.tables.values():
        assert unknown_columns(df) == []
    share = res.tables["sink_share"]
    assert set(share.condition) == {"random", "text"} and set(share["count"]) == {4, 3}
    assert set(res.meta["sink_share"]) == {"random", "text"}
    assert res.meta["qk_points"] == {"rot_q/rot_k": [0, 1]}
    assert res.meta["first_tokens"]["random"] == ["<bos>"] * 3  # framed as the model expects by default
    raw = run_sinks(tiny_ape, None, SinksConfig(length=20, random_samples=4, max_windows=0, first="random",
                                                progress=False))
    assert "<bos>" not in raw.meta["first_tokens"]["random"] and set(raw.tables["sink_share"].condition) == {"random"}
    with pytest.raises(ValueError, match="exceeds the model's context"):
        run_sinks(tiny_rope, None, SinksConfig(length=10_000, progress=False))
    with pytest.raises(ValueError, match="nothing to measure"):
        SinksConfig(random_samples=0, max_windows=0)


def test_cli_writes_the_report_and_refuses_bad_input_before_loading(tmp_path, capsys, monkeypatch):
    from posprobe.backend import loading
    from posprobe.cli.main import main

    out = tmp_path / "sinks"
    assert main(["sinks", "tiny-rope", "--length", "20", "--random-samples", "2", "--max-windows", "1",
                 "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Sink_1^0.3 on 20-token sequences") and (out / "report.html").is_file()
    assert "Attention sinks: tiny-rope" in (out / "report.html").read_text()
    loads = []
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loads.append(a))
    assert main(["sinks", "tiny-rope", "--length", "100000", "--out", str(tmp_path / "x")]) == 2
    assert "--length 100000 exceeds the context" in capsys.readouterr().err
    assert main(["sinks", "tiny-rope", "--epsilon", "1.5", "--out", str(tmp_path / "x")]) == 2
    assert "epsilon must be within [0, 1]" in capsys.readouterr().err
    assert loads == []


def test_massive_activation_intervention_equals_hf_with_the_same_edit_by_a_forward_hook():
    # posprobe edits the bridge's residual stream after block L*; the reference edits Hugging Face's decoder layer
    # L* output with a forward hook written here from the rule (entries of the massive dims above ratio x the
    # sequence's median |activation|), and scores with HF's own logits and eager attention weights.
    from posprobe.analyses.massive import intervene, massive_table

    bridge, _ = tiny_family("llama")
    hf = _plain(bridge, eager=True)
    ids = torch.randint(3, 250, (4, 20), generator=torch.Generator().manual_seed(2))
    table = massive_table(bridge, ids, top=3, batch_size=3, progress=False, condition="c")
    # Tiny random models have no massive activations: lower the bar to just under layer 0's third largest.
    ratio = 0.99 * float(table[table.layer == 0].ratio.min())
    effect, meta = intervene(bridge, ids, table, ratio=ratio, batch_size=3)
    layer, dims = meta["layer"], meta["dims"]
    assert layer == 0 and meta["massive_entries"] >= 1 and list(effect.variant.unique()) == ["none", "zero", "mean"]
    block = hf.model.layers[layer]

    def hidden(out):
        return out[0] if isinstance(out, tuple) else out

    seen = {}
    h = block.register_forward_hook(lambda m, i, o: seen.__setitem__("x", hidden(o).detach().clone()))
    with torch.no_grad():
        hf(ids)
    h.remove()
    x = seen["x"].double()
    med = x.abs().reshape(x.shape[0], -1).median(-1).values
    hit = x[..., dims].abs() > ratio * med[:, None, None]
    means = ((x[..., dims] * hit).sum((0, 1)) / hit.sum((0, 1))).nan_to_num(0.0)  # a dim with no hit: never used
    assert torch.allclose(torch.tensor(meta["means"], dtype=torch.float64), means, atol=1e-5)
    got = effect.set_index(["variant", "metric"]).value
    for mode in ("none", "zero", "mean"):
        def edit(m, i, o, mode=mode):
            y = hidden(o).clone()
            if mode != "none":
                sub = y[..., dims]
                mask = sub.abs() > ratio * med[:, None, None].to(y.dtype)
                fill = torch.zeros_like(sub) if mode == "zero" else means.to(y.dtype).expand_as(sub)
                y[..., dims] = torch.where(mask, fill, sub)
            return (y, *o[1:]) if isinstance(o, tuple) else y

        h = block.register_forward_hook(edit)
        with torch.no_grad():
            out = hf(ids, output_attentions=True)
        h.remove()
        lp = out.logits[:, :-1].double().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        assert abs(got[mode, "nll"] - float(-lp.mean())) <= 1e-5, mode
        later = out.attentions[layer + 1:]
        first = torch.stack([a[..., 0].double().mean(-1).mean() for a in later]).mean()
        assert abs(got[mode, "first_attention"] - float(first)) <= 1e-5, mode
    assert got["zero", "nll"] != got["none", "nll"]  # the edit reached the forward


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_first_token_moved_equals_hf_with_those_position_ids(name):
    # The control's position variant (posprobe's position plan on the bridge) against HF's own forward given the
    # same position ids, eager attention weights.
    from posprobe.analyses.sinks import control_variants
    from posprobe.core.positions import token_positions

    bridge, _ = tiny_family(name)
    ids = torch.randint(3, 250, (3, 16), generator=torch.Generator().manual_seed(3))
    variants = control_variants(bridge, ids)
    assert list(variants) == ["as is", "first token at position 8", "second token at position 0", "'the' first",
                              "newline first"]
    assert variants["second token at position 0"][1].tolist() == [1, 0, *range(2, 16)]
    assert variants["first token at position 8"][1].tolist() == [8, *range(1, 16)]
    hf = _plain(bridge, eager=True)
    for variant in ("first token at position 8", "second token at position 0"):
        toks, pos = variants[variant]
        heads, _ = sink_statistics(bridge, toks, SinksConfig(length=16, progress=False), condition="moved",
                                   context=lambda pos=pos: token_positions(bridge, pos))
        with torch.no_grad():
            out = hf(toks, position_ids=pos[None].expand(len(toks), -1), output_attentions=True)
        got = heads[heads.metric == "first_attention"].set_index(["layer", "head"]).value
        for layer, att in enumerate(out.attentions):
            want = att[..., 0].double().mean(-1).mean(0)  # alpha_1 per head, over sequences
            err = float((torch.tensor(got[layer].sort_index().values) - want).abs().max())
            assert err <= TOL, (name, variant, layer, err)
        plain, _ = sink_statistics(bridge, toks, SinksConfig(length=16, progress=False), condition="as is")
        moved = torch.tensor(got.values)
        assert float((moved - torch.tensor(plain[plain.metric == "first_attention"].value.values)).abs().max()) > 1e-4


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_zeroing_a_head_equals_hf_with_its_slice_of_the_output_projection_input_zeroed(name):
    # head_ablation zeroes hook_z[:, :, head] on the bridge; the reference zeroes that head's d_head slice of the
    # input to HF's output projection (o_proj / c_proj) with a forward pre-hook, and scores with HF's logits.
    import pandas as pd

    from posprobe.analyses.dormant import ABLATION_LABELS, head_ablation

    bridge, _ = tiny_family(name)
    f = model_facts(bridge)
    hf = _plain(bridge)
    ids = torch.randint(3, 250, (3, 16), generator=torch.Generator().manual_seed(4))
    picks = pd.DataFrame({"layer": [0, 1, 1], "head": [2, 0, 3], "value": [0.9, 0.8, 0.7]})
    found, meta = head_ablation(bridge, ids, picks, min_attention=0.5, max_delta=0.01, max_heads=3, batch_size=2)
    assert len(found) == 3 and set(found.kind) <= set(ABLATION_LABELS)

    def nll(pre_hook=None, layer=None):
        proj = (hf.transformer.h[layer].attn.c_proj if name == "gpt2" else hf.model.layers[layer].self_attn.o_proj
                ) if layer is not None else None
        h = proj.register_forward_pre_hook(pre_hook) if proj is not None else None
        with torch.no_grad():
            logits = hf(ids).logits
        if h is not None:
            h.remove()
        return float(-logits[:, :-1].double().log_softmax(-1).gather(-1, ids[:, 1:, None]).mean())

    base = nll()
    assert abs(meta["base_loss"] - base) <= 1e-5
    for r in found.itertuples():
        def zero(m, args, head=r.head):
            x = args[0].clone()
            x[..., head * f.d_head:(head + 1) * f.d_head] = 0
            return (x, *args[1:])

        want = nll(zero, r.layer) - base
        assert abs(r.delta_loss - want) <= 1e-5, (name, r.layer, r.head, r.delta_loss, want)
        assert abs(want) > 1e-6  # the head mattered: the edit reached the forward


def test_zeroed_heads_are_labelled_by_what_the_text_loss_did_with_the_definition_in_meta_and_report():
    # Tiny BLOOM with every head a candidate and a 0.01 bar: zeroing moves its 16-token text loss up, down and
    # barely, so each label occurs; each must follow from the measured delta alone, and no word may claim more.
    from posprobe.analyses.dormant import LOSS_FALLS, LOSS_RISES, LOW_EFFECT
    from posprobe.report.sinks import summary_text

    bridge, _ = tiny_family("bloom")
    bar = 0.01
    res = run_sinks(bridge, None, SinksConfig(length=16, random_samples=0, max_windows=3, massive_top=0,
                                              control=False, ablate_heads=8, ablate_attention=0.0, ablate_delta=bar,
                                              progress=False))
    t = res.tables["head_ablation"]
    assert set(t.kind) == {LOW_EFFECT, LOSS_RISES, LOSS_FALLS}
    for r in t.itertuples():
        want = LOW_EFFECT if abs(r.delta_loss) < bar else LOSS_RISES if r.delta_loss > 0 else LOSS_FALLS
        assert r.kind == want, (r.layer, r.head, r.delta_loss, r.kind)
    labels = res.meta["ablation"]["labels"]
    assert set(labels) == {LOW_EFFECT, LOSS_RISES, LOSS_FALLS}
    assert all(f"{bar} nats/token" in v and "16-token text windows" in v for v in labels.values())
    text = summary_text(res)
    for label in labels:
        heads = ", ".join(f"L{int(r.layer)}H{int(r.head)}" for r in t[t.kind == label].itertuples())
        assert f"{(t.kind == label).sum()} {label} ({heads})" in text
    assert "16-token text windows" in text and "may matter elsewhere" in text
    import re

    from plotly.offline import get_plotlyjs

    page = res.to_html().replace(get_plotlyjs(), "")
    assert not re.search(r"\b(dormant|active)\b", text + page, re.I)


@pytest.mark.parametrize("name", ["bloom", "llama"])
def test_the_position_control_is_read_by_what_the_family_predicts(name):
    # ALiBi: the distance bias alone gives the first token, moved nearer every later query, more attention; the text
    # must say so and compare it with the measured change. RoPE: the offsets reading, no bias claim.
    from posprobe.backend.families import find
    from posprobe.report.sinks import summary_text

    bridge, _ = tiny_family(name)
    res = run_sinks(bridge, None, SinksConfig(length=16, random_samples=0, max_windows=3, massive_top=0,
                                              ablate_heads=0, progress=False))
    kind = model_facts(bridge).positional_kind
    ctl = res.meta["control"]
    assert ctl["mechanism"] == find(kind).phrase and ctl["moved_to"] == 8
    text = summary_text(res)
    first = res.tables["sink_control"].query("metric == 'first_attention'").set_index("variant").value
    moved, still = first["first token at position 8"], first["as is"]
    if find(kind).control == "score bias":
        assert "the bias alone predicts more attention on it" in text and "not evidence that the sink follows" in text
        assert moved > still  # what the mechanism predicts, measured on the model
        assert f"{still:.3f} as is, {moved:.3f} moved (the direction the mechanism predicts)" in text
    else:
        assert "scores see only query-key offsets" in text and "bias" not in text


def _resid_post(hf, ids: torch.Tensor) -> list:
    # The residual stream after every decoder block, read by forward hooks on HF's own layers (HF's last
    # hidden_states entry is after the final norm, so output_hidden_states is not used), as float64 numpy.
    import numpy as np

    seen = []
    hooks = [blk.register_forward_hook(lambda m, i, o: seen.append((o[0] if isinstance(o, tuple) else o).detach()))
             for blk in hf.model.layers]
    try:
        with torch.no_grad():
            hf(ids)
    finally:
        for h in hooks:
            h.remove()
    return [np.abs(x.double().numpy()) for x in seen]


def test_massive_activations_equal_a_numpy_recomputation_and_find_the_planted_dimension():
    # Sun et al. 2024: an activation is massive when its |value| exceeds 100 and about 1000x the median |activation|
    # of its hidden state (posprobe's defaults `massive_abs` 100, `massive_ratio` 1000, against each sequence's
    # median; the table's ratio is to the layer median, the mean over sequences of each sequence's median
    # |activation| over positions x dims). A planted massive dimension: layer 1's MLP writes dim 7 scaled by 3000
    # (|value| in the thousands, up to ~7000x the median). The
    # reference is numpy on HF's residual stream; the median is the lower middle value of the even count (as
    # torch.median), within 1% of numpy's midpoint median here. The mean in place of the median gives ratios ~100x
    # smaller on layer 1, so a mean-for-median slip fails both the ratio and the layer/dims checks.
    import numpy as np

    from posprobe.analyses.configs import SinksConfig as Cfg
    from posprobe.analyses.massive import intervene, massive_table

    bridge, _ = tiny_family("llama")
    hf = _plain(bridge)  # the HF model the bridge runs (tiny_family's second item is not it)
    DIM, TOP = 7, 3
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[DIM] *= 3000.0
    ids = torch.randint(3, 250, (4, 20), generator=torch.Generator().manual_seed(2))
    table = massive_table(bridge, ids, top=TOP, batch_size=3, progress=False, condition="c")
    ratio, min_abs = Cfg().massive_ratio, Cfg().massive_abs
    assert (ratio, min_abs) == (1000.0, 100.0)
    first_massive = None
    for layer, a in enumerate(_resid_post(hf, ids)):  # a: [batch, pos, d] |activations|
        flat = np.sort(a.reshape(a.shape[0], -1), axis=1)
        med_seq = flat[:, (flat.shape[1] - 1) // 2]  # lower median per sequence
        assert np.allclose(med_seq, np.median(a.reshape(a.shape[0], -1), axis=1), rtol=1e-2)
        median_abs = med_seq.mean()
        best = a.max(0)  # [pos, d]: each (position, dimension)'s largest instance over the sequences
        order = np.argsort(-best, axis=None, kind="stable")[:TOP]
        want = [(float(best.flat[i]), int(i // a.shape[2]), int(i % a.shape[2])) for i in order]
        got = table[table.layer == layer].sort_values("rank")
        assert list(got["rank"]) == list(range(1, TOP + 1))
        assert [(int(r.pos), int(r.dim)) for r in got.itertuples()] == [(p, d) for _, p, d in want], layer
        assert np.allclose(got.value, [v for v, _, _ in want], rtol=1e-5), layer
        assert np.allclose(got.median_abs, median_abs, rtol=1e-5), (layer, float(got.median_abs.iloc[0]), median_abs)
        assert np.allclose(got.ratio, [v / median_abs for v, _, _ in want], rtol=1e-5), layer
        massive = (a > ratio * med_seq[:, None, None]) & (a > min_abs)
        if first_massive is None and massive.any():
            first_massive = layer
            hits = int(massive[..., DIM].sum())
            assert not np.delete(massive, DIM, axis=2).any()  # only the planted dim is massive
    assert first_massive == 1  # layer 0 is untouched: its top ratio is single-digit
    assert table[table.layer == 1].ratio.max() > ratio and table[table.layer == 0].ratio.max() < ratio / 100
    assert set(table[table.layer == 1].dim) == {DIM}
    _, meta = intervene(bridge, ids, table, ratio=ratio, min_abs=min_abs, batch_size=3)
    assert meta["layer"] == first_massive and meta["dims"] == [DIM] and meta["massive_entries"] == hits
    res = run_sinks(bridge, None, SinksConfig(length=20, random_samples=0, max_windows=3, control=False,
                                              ablate_heads=0, progress=False))
    assert res.meta["massive"]["layer"] == 1 and res.meta["massive"]["dims"] == [DIM]  # through the analysis too


def test_massive_needs_both_the_ratio_and_the_absolute_bar_as_a_numpy_recomputation_says():
    # Two plants: layer 0's MLP writes dim 9 x600 (|value| ~ 600, ~1700x the median) and layer 1's writes dim 7
    # x3000 (~4400). With Sun et al.'s bars (100, 1000x) layer 0 is the first massive layer; an absolute bar of 1000
    # passes over it to layer 1 (its dim 9 entries carried in the residual stay under 1000); a ratio bar of 1e9
    # leaves none. Layer, dims and the number of edited entries must equal numpy's rule on HF's residual stream.
    import numpy as np

    from posprobe.analyses.massive import intervene, massive_table

    bridge, _ = tiny_family("llama")
    hf = _plain(bridge)
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight[9] *= 600.0
        hf.model.layers[1].mlp.down_proj.weight[7] *= 3000.0
    ids = torch.randint(3, 250, (4, 20), generator=torch.Generator().manual_seed(2))
    table = massive_table(bridge, ids, top=3, batch_size=3, progress=False, condition="c")
    acts = _resid_post(hf, ids)

    def numpy_rule(ratio, min_abs):
        for layer, a in enumerate(acts):
            flat = np.sort(a.reshape(a.shape[0], -1), axis=1)
            med = flat[:, (flat.shape[1] - 1) // 2]  # torch.median's lower middle value per sequence
            massive = (a > ratio * med[:, None, None]) & (a > min_abs)
            if massive.any():
                dims = sorted(set(np.nonzero(massive)[2].tolist()))
                return layer, dims, int(massive[..., dims].sum())
        return None

    seen = []
    for ratio, min_abs in ((1000.0, 100.0), (1000.0, 1000.0), (1e9, 100.0)):
        want = numpy_rule(ratio, min_abs)
        effect, meta = intervene(bridge, ids, table, ratio=ratio, min_abs=min_abs, batch_size=3)
        if want is None:
            assert not len(effect) and "no activation exceeds" in meta["skipped"]
        else:
            assert (meta["layer"], meta["dims"], meta["massive_entries"]) == want, (ratio, min_abs, meta, want)
        seen.append(want and want[:2])
    assert seen == [(0, [9]), (1, [7]), None]  # the plants did what they should: each bar decides once


def test_head_ablation_labels_a_silent_head_low_effect_and_a_loud_head_by_the_hf_measured_sign():
    # Planted: L0H1's columns of o_proj are zero, so its output never reaches the residual stream and zeroing it
    # cannot move the loss (delta exactly 0: low-effect). L1H2's columns are scaled by 40, so zeroing it moves the
    # loss by far more than the bar; its sign is measured here on HF with that head's o_proj input slice zeroed by a
    # forward pre-hook, and the label must follow it (loss-rises when the loss goes up, loss-falls when down).
    import pandas as pd

    from posprobe.analyses.dormant import LOSS_FALLS, LOSS_RISES, LOW_EFFECT, head_ablation

    bridge, _ = tiny_family("llama")
    hf = _plain(bridge)  # the HF model the bridge runs (tiny_family's second item is not it)
    d = model_facts(bridge).d_head
    silent, loud = (0, 1), (1, 2)
    with torch.no_grad():
        hf.model.layers[silent[0]].self_attn.o_proj.weight[:, silent[1] * d:(silent[1] + 1) * d] = 0.0
        hf.model.layers[loud[0]].self_attn.o_proj.weight[:, loud[1] * d:(loud[1] + 1) * d] *= 40.0
    ids = torch.randint(3, 250, (3, 16), generator=torch.Generator().manual_seed(4))

    def nll(layer=None, head=None):
        h = None
        if layer is not None:
            def zero(m, args):
                x = args[0].clone()
                x[..., head * d:(head + 1) * d] = 0
                return (x, *args[1:])
            h = hf.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(zero)
        try:
            with torch.no_grad():
                logits = hf(ids).logits
        finally:
            if h is not None:
                h.remove()
        return float(-logits[:, :-1].double().log_softmax(-1).gather(-1, ids[:, 1:, None]).mean())

    bar = 0.01
    base = nll()
    loud_delta = nll(*loud) - base
    assert abs(loud_delta) > 10 * bar and nll(*silent) == base  # the plants did what they should, on HF
    picks = pd.DataFrame({"layer": [silent[0], loud[0]], "head": [silent[1], loud[1]], "value": [0.9, 0.8]})
    found, meta = head_ablation(bridge, ids, picks, min_attention=0.5, max_delta=bar, max_heads=2, batch_size=2)
    rows = found.set_index(["layer", "head"])
    assert abs(rows.loc[silent, "delta_loss"]) <= 1e-6 and rows.loc[silent, "kind"] == LOW_EFFECT
    assert rows.loc[loud, "delta_loss"] == pytest.approx(loud_delta, abs=1e-5)
    assert rows.loc[loud, "kind"] == (LOSS_RISES if loud_delta > 0 else LOSS_FALLS), (loud_delta, rows.loc[loud])
    # A candidate needs alpha_1 >= min_attention: a head at 0.4 is never zeroed.
    few, _ = head_ablation(bridge, ids, picks.assign(value=[0.9, 0.4]), min_attention=0.5, max_delta=bar,
                           max_heads=2, batch_size=2)
    assert list(zip(few["layer"], few["head"])) == [silent]
