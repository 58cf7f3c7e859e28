"""Property tests over random cases (Hypothesis; profile in conftest: 30 examples, derandomised in CI).

Position plans and surgery rules have a large input space (float and per-row positions, removed bands, base and
per-band overrides, windows, groups and chunk sizes up to the boundaries); the hand-picked identity tests elsewhere
would miss a corner. Each property is checked against an independent computation: complex numbers for the rotation,
the papers' rules applied pair by pair in a plain-torch attention over HF's modules for the per-pair rules and the
per-query plans, a float64 recomputation for the frequency reducer, HF's own forward (per-layer cos/sin) for plans on
some layers.
"""

from __future__ import annotations

import math

import torch
from hf_util import complex_rotate
from hypothesis import assume, given
from hypothesis import strategies as st

from posprobe.rope import RotarySpec, rotate


@st.composite
def rotations(draw):
    n_bands = draw(st.integers(1, 8))
    rd = 2 * n_bands
    spec = RotarySpec(
        rotary_dim=rd,
        base=draw(st.floats(10.0, 1e6)),
        adjacent=draw(st.booleans()),
        freq_scale=draw(st.none() | st.lists(st.floats(0.25, 4.0), min_size=n_bands, max_size=n_bands).map(tuple)),
        removed=frozenset(draw(st.sets(st.integers(0, n_bands - 1), max_size=n_bands))),
    )
    d_head = rd + draw(st.integers(0, 6))
    batch, pos, heads = draw(st.integers(1, 2)), draw(st.integers(1, 12)), draw(st.integers(1, 3))
    per_row = draw(st.booleans())
    shape = (batch, pos) if per_row else (pos,)
    flat = draw(st.lists(st.floats(-1e4, 1e4), min_size=math.prod(shape), max_size=math.prod(shape)))
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(batch, pos, heads, d_head, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return spec, x, torch.tensor(flat, dtype=torch.float64).reshape(shape)


@given(rotations())
def test_rotation_by_any_plan_equals_complex_multiplication(case):
    spec, x, positions = case
    got = rotate(x, positions, spec)
    want = complex_rotate(x, positions, spec)
    assert (got - want).abs().max() <= 1e-9 * (1 + positions.abs().max())
    assert torch.equal(got[..., spec.rotary_dim:], x[..., spec.rotary_dim:])  # only the rotary dims move


@st.composite
def presets(draw):
    n = draw(st.integers(2, 40))
    kind = draw(st.sampled_from(["self-extend", "rerope", "streaming", "string", "pi", "ntk", "yarn", "shift"]))
    w = draw(st.integers(1, n + 2))  # windows up to past the length: the boundaries included
    if kind == "self-extend":
        spec = f"self-extend:group={draw(st.integers(1, 5))},window={w}"
    elif kind == "rerope":
        spec = f"rerope:window={w}"
    elif kind == "streaming":
        spec = f"streaming:sink={draw(st.integers(0, 4))},window={w}"
    elif kind == "string":
        spec = f"string:offset={w},window={draw(st.integers(0, w))}"
    elif kind == "yarn":
        spec = f"yarn:scale={draw(st.sampled_from([0.5, 2.0, 3.5]))},original={draw(st.integers(2, 64))}"
    elif kind in ("pi", "ntk"):
        spec = f"{kind}:scale={draw(st.sampled_from([0.5, 1.0, 2.0, 3.5]))}"
    else:
        spec = f"shift:k={draw(st.integers(0, 50))}"
    return spec, n, draw(st.integers(1, n + 1)), draw(st.integers(0, 2**16))


@given(presets())
def test_per_pair_rules_equal_the_papers_rules_on_random_lengths_and_chunks(tiny_rope, case):
    # The chunked long-context engine (per-pair rule, chunks of any size incl. 1 and length +- 1) against the
    # preset as its paper states it, pair by pair (tests/paper_rules.py: HF's own modules, the attention scores in
    # plain float64 torch with q_i turned by rel(i, j)); and the same preset as a per-query position plan through
    # the bridge's hooks against the same reference.
    from paper_rules import pairwise_logits, preset_reference
    from paper_rules import token_nll as reference_nll

    from posprobe.backend.bridge import plain_hf_model
    from posprobe.core import long_engine
    from posprobe.core.generation import logits_under, token_logprobs
    from posprobe.core.presets import is_identity, parse, preset_pairs, preset_plan

    spec, n, chunk, seed = case
    try:
        parse(spec)
    except ValueError:
        assume(False)  # an invalid combination is refused by the parser (tested elsewhere)
    assume(not is_identity(spec))
    ids = torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(seed))
    hf = plain_hf_model(tiny_rope)
    cfg = hf.config
    rel, freqs, factor = preset_reference(spec, n, cfg)
    want = reference_nll(pairwise_logits(hf, ids, rel, freqs=lambda layer: freqs,
                                         score_factor=lambda layer: factor), ids)
    got = long_engine.token_nll(hf, ids, preset_pairs(spec), chunk=chunk)
    assert (got.double() - want).abs().max() <= 1e-4, spec  # float32 model vs float64 scores
    with torch.no_grad():
        plan = -token_logprobs(logits_under(tiny_rope, ids[None], preset_plan(spec, tiny_rope, n)), ids[None])[0]
    assert (plan.double() - want).abs().max() <= 1e-4, spec


@st.composite
def corpus_passes(draw):
    window = draw(st.integers(2, 24))
    return dict(n_rows=draw(st.integers(1, 4)), window=window, batch_size=draw(st.integers(1, 4)),
                queries=draw(st.none() | st.integers(1, window + 2)),
                chunk=draw(st.sampled_from([1, 37, 100, 1 << 24])), seed=draw(st.integers(0, 2**16)))


@given(corpus_passes())
def test_frequency_reducer_equals_a_float64_recomputation_on_random_shapes(tiny_rope64, case):
    # The streaming reducer (batches, query subsets, query blocks of any size down to one row) against the band
    # products of HF's own rotated q/k (caught at its apply_rotary_pos_emb, scaled by HF's attention scaling),
    # written out pair by pair in float64 over the kept causal entries.
    from matrix_cells import hf_rope_io

    import posprobe.analyses.frequency as fr
    from posprobe.backend.bridge import plain_hf_model
    from posprobe.backend.facts import model_facts

    facts = model_facts(tiny_rope64)
    n = case["window"]
    toks = torch.randint(0, 200, (case["n_rows"], n), generator=torch.Generator().manual_seed(case["seed"]))
    old = fr.CHUNK_ELEMENTS
    fr.CHUNK_ELEMENTS = case["chunk"]
    try:
        res = fr.frequency_usage(tiny_rope64, toks, batch_size=case["batch_size"], queries=case["queries"],
                                 progress=False)
    finally:
        fr.CHUNK_ELEMENTS = old
    hf = plain_hf_model(tiny_rope64)
    first_q = 0 if case["queries"] is None else max(0, n - case["queries"])
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    causal[:first_q] = False
    d = res.df.set_index(["layer", "head", "band", "metric"]).value
    for layer in range(facts.n_layers):
        spec = facts.rotary[layer]
        half, group = spec.rotary_dim // 2, facts.n_heads // facts.n_kv_heads
        _, (q, k), _, attn = hf_rope_io(hf, toks, layer)  # [batch, head, pos, d]
        q, k = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, dim=2)  # [batch, pos, head, d]
        scale = 1.0 / float(attn.scaling)
        for b in range(half):
            dims = [2 * b, 2 * b + 1] if spec.adjacent else [b, b + half]
            part = torch.einsum("bqhd,bkhd->bhqk", q[..., dims], k[..., dims]) / scale  # [batch, head, q, k]
            kept = part[:, :, causal]  # [batch, head, entry]
            # |q_b . k_b| <= |q_b| |k_b| (Cauchy-Schwarz): the scale a rounding of the rotation acts on, even where the
            # two products of a band cancel and its mean contribution is tiny (one entry, a window of 2).
            norms = torch.einsum("bqh,bkh->bhqk", q[..., dims].norm(dim=-1), k[..., dims].norm(dim=-1)) / scale
            bound = norms[:, :, causal]
            for h in range(facts.n_heads):
                want_abs, want = kept[:, h].abs().mean().item(), kept[:, h].mean().item()
                # HF turns float64 q/k with float32 cos/sin (its recipe for every dtype); the bridge's rotation
                # hooks differ from it by up to ~2e-6 of a band's mean |q_b| |k_b| here: tolerance 1e-5 of it.
                tol = 1e-5 * bound[:, h].mean().item() + 1e-12
                assert abs(d[layer, h, b, "mean_abs_contrib"] - want_abs) <= tol
                assert abs(d[layer, h, b, "mean_contrib"] - want) <= tol


@st.composite
def analysis_configs(draw):
    from posprobe.analyses.configs import FrequencyConfig, HeadsConfig

    window = draw(st.integers(3, 40))  # 2 leaves one text token after BOS: refused with its reason
    common = dict(window=window, max_windows=draw(st.integers(1, 5)), batch_size=draw(st.integers(1, 4)),
                  progress=False)
    if draw(st.booleans()):
        return HeadsConfig(**common, induction_len=draw(st.integers(0, 10)),
                           sink_threshold=draw(st.floats(0.05, 0.95)))
    return FrequencyConfig(**common, queries=draw(st.none() | st.integers(1, window)), ablate=False,
                           layers=draw(st.none() | st.sets(st.integers(0, 1), min_size=1).map(tuple)))


@given(analysis_configs())
def test_tables_follow_the_schema_and_survive_a_save_on_random_configs(tiny_rope, cfg):
    # Whatever the configuration: every table's columns are in the one vocabulary, meta follows the schema, the
    # per-head tables have one row per layer x head (x metric), and a saved result loads back equal.
    import tempfile

    import pandas as pd

    from posprobe.analyses.configs import HeadsConfig
    from posprobe.analyses.frequency import run_frequency
    from posprobe.analyses.heads import METRICS, run_heads
    from posprobe.backend.facts import model_facts
    from posprobe.report.result import Result
    from posprobe.report.schema import unknown_columns, validate_meta

    facts = model_facts(tiny_rope)
    heads = isinstance(cfg, HeadsConfig)
    res = run_heads(tiny_rope, None, cfg) if heads else run_frequency(tiny_rope, None, cfg)
    validate_meta(res.meta)
    for name, df in res.tables.items():
        assert len(df) and unknown_columns(df) == [], (name, unknown_columns(df))
    layers = facts.n_layers if heads or cfg.layers is None else len(cfg.layers)
    if heads:
        assert len(res.tables["heads"]) == layers * facts.n_heads * len(METRICS)
        assert len(res.tables["head_classes"]) == layers * facts.n_heads
    else:
        assert len(res.tables["heads"]) == layers * facts.n_heads
        assert res.tables["heads"].kind.isin(["position-driven", "content-driven", "mixed"]).all()
    with tempfile.TemporaryDirectory() as tmp:
        res.save(f"{tmp}/out", csv="none")
        back = Result.load(f"{tmp}/out")
    for name, df in res.tables.items():
        pd.testing.assert_frame_equal(back.tables[name].reset_index(drop=True), df.reset_index(drop=True))


@st.composite
def per_layer_plans(draw):
    n = draw(st.integers(2, 24))
    pos = draw(st.lists(st.floats(0.0, 200.0), min_size=n, max_size=n))  # repeated, unordered, fractional: any
    layers = draw(st.sets(st.integers(0, 1), min_size=1))
    return n, torch.tensor(pos, dtype=torch.float64), frozenset(layers), draw(st.integers(0, 2**16))


@given(per_layer_plans())
def test_per_layer_plans_equal_hf_given_those_positions_in_those_layers(tiny_rope, case):
    # A plan on some layers only (the others at their own positions), against Hugging Face's own forward with each
    # decoder layer handed the cos/sin of its positions by HF's rotary module (a forward pre-hook per layer).
    from posprobe.backend.bridge import plain_hf_model
    from posprobe.core.generation import logits_under
    from posprobe.core.positions import PositionPlan

    n, pos, layers, seed = case
    ids = torch.randint(3, 200, (1, n), generator=torch.Generator().manual_seed(seed))
    got = logits_under(tiny_rope, ids, PositionPlan(pos, pos.clone(), layers=layers))
    hf = plain_hf_model(tiny_rope)

    def pre(layer):
        def hook(module, args, kwargs):
            p = pos if layer in layers else torch.arange(n, dtype=torch.float64)
            h = args[0] if args else kwargs["hidden_states"]
            kwargs["position_embeddings"] = hf.model.rotary_emb(h, p[None].float())
            return args, kwargs

        return hook

    handles = [block.register_forward_pre_hook(pre(i), with_kwargs=True) for i, block in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            want = hf(ids).logits
    finally:
        for h in handles:
            h.remove()
    # float32 angles on both sides (HF's recipe); positions up to 200 leave ~1e-5 of rounding in the logits.
    assert (got - want).abs().max() <= 1e-4
