"""posprobe/core/positions.py against independent computations (issue #36's mutation testing).

Position control on a float64 tiny Llama is compared with `paper_rules.pairwise_logits`: HF's own modules with the
attention scores recomputed in plain float64 torch, query i against key j at q_pos[i] - k_pos[j] (per view, per
batch row, per layer), at fractional positions. Tolerance 1e-5: the model's own rotation replays HF's recipe, whose
angles are float32 (position * inv_freq), while the reference turns by the float64 difference; at positions below
~60 the two differ by ~1e-6 in the logits, and every defect the tests target moves them by 1e-3 or more.
PositionPlan's construction and extension are checked by hand, learned ids against HF GPT-2's own position_ids.
"""

from __future__ import annotations

import types

import pytest
import torch
from hf_util import hf_of
from paper_rules import inv_freq, pairwise_logits, plan_relative, rope_of

from posprobe.backend.bridge import plain_hf_model
from posprobe.backend.hooks import hooked
from posprobe.core import positions as P
from posprobe.core.positions import KeyView, PositionError, PositionPlan, rope_positions

F64 = torch.float64
TOL64 = 1e-5  # float64 model (HF's float32 angles) vs float64 reference, CPU


def _setup(model):
    hf = plain_hf_model(model)
    return hf, inv_freq(*rope_of(hf.config))


def _ids(n, batch=1, seed=0):
    return torch.randint(0, 200, (batch, n), generator=torch.Generator().manual_seed(seed))


def _rel(q, k, views=(), row=None):
    """[query, key] q_pos[i] - k_pos[j], each query through the last view listing it (one batch row)."""
    pick = (lambda t: t) if row is None else (lambda t: t[row] if t.dim() == 2 else t)
    return plan_relative(pick(q), pick(k), [KeyView(pick(v.queries), pick(v.k_pos), v.name) for v in views])


def _far_fractional(n):
    i = torch.arange(n, dtype=F64)
    return 40.3 + 0.37 * i, 7.1 + 1.13 * i


def test_fractional_positions_far_out_equal_the_reference_in_float64(tiny_rope64):
    hf, f = _setup(tiny_rope64)
    n = 11
    q, k = _far_fractional(n)
    ids = _ids(n)
    want = pairwise_logits(hf, ids[0], _rel(q, k), freqs=lambda layer: f)
    with torch.no_grad():
        # positions as Python lists: converted to float64 without a float32 detour
        with rope_positions(tiny_rope64, q_pos=q.tolist(), k_pos=k.tolist()) as plan:
            got = tiny_rope64(ids)[0]
        assert plan.q_pos.dtype == F64 and torch.equal(plan.q_pos, q)
        with rope_positions(tiny_rope64, PositionPlan(q.tolist(), k.tolist(), label="far")) as plan:
            again = tiny_rope64(ids)[0]
        assert plan.label == "far"
    assert (got - want).abs().max() <= TOL64 and (again - want).abs().max() <= TOL64
    own = pairwise_logits(hf, ids[0], _rel(torch.arange(n, dtype=F64), torch.arange(n, dtype=F64)),
                          freqs=lambda layer: f)
    assert (own - want).abs().max() > 1e-3  # the plan moved the logits


def test_batched_plan_with_per_row_views_equals_the_reference_row_by_row(tiny_rope64):
    hf, f = _setup(tiny_rope64)
    n = 9
    q0, k0 = _far_fractional(n)
    q = torch.stack([q0, torch.arange(n, dtype=F64) * 0.5])
    k = torch.stack([k0, torch.arange(n, dtype=F64) * 0.5])
    rows = torch.zeros(2, n, dtype=torch.bool)
    rows[0, 3:6] = True  # row 0: queries 3..5 see the view; row 1: queries 7, 8
    rows[1, 7:] = True
    view = KeyView(rows, torch.stack([torch.arange(n, dtype=F64) * 3.0 + 0.25, -torch.arange(n, dtype=F64)]), "v")
    plan = PositionPlan(q, k, views=(view,))
    ids = _ids(n, batch=2, seed=1)
    with torch.no_grad(), rope_positions(tiny_rope64, plan):
        got = tiny_rope64(ids)
    for b in range(2):
        want = pairwise_logits(hf, ids[b], _rel(q, k, (view,), row=b), freqs=lambda layer: f)
        assert (got[b] - want).abs().max() <= TOL64, b
        plain = pairwise_logits(hf, ids[b], _rel(q, k, row=b), freqs=lambda layer: f)
        assert (plain - want).abs().max() > 1e-4, b  # the view mattered in this row


def test_a_view_selecting_nothing_does_not_stop_the_views_after_it(tiny_rope64):
    hf, f = _setup(tiny_rope64)
    n = 8
    q, k = _far_fractional(n)
    empty = KeyView(torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=F64), "empty")
    rows = torch.zeros(n, dtype=torch.bool)
    rows[[2, 5, 7]] = True
    view = KeyView(rows, torch.arange(n, dtype=F64) * -2.0, "after")
    ids = _ids(n, seed=2)
    with torch.no_grad(), rope_positions(tiny_rope64, PositionPlan(q, k, views=(empty, view))):
        got = tiny_rope64(ids)[0]
    want = pairwise_logits(hf, ids[0], _rel(q, k, (view,)), freqs=lambda layer: f)
    assert (got - want).abs().max() <= TOL64


def test_a_plan_on_some_layers_leaves_the_others_at_their_own_positions(tiny_rope64):
    hf, f = _setup(tiny_rope64)
    n = 8
    q, k = _far_fractional(n)
    own = torch.arange(n, dtype=F64)
    ids = _ids(n, seed=3)
    for layers in ({0}, {1}):
        with torch.no_grad(), rope_positions(tiny_rope64, PositionPlan(q, k, layers=frozenset(layers))):
            got = tiny_rope64(ids)[0]
        want = pairwise_logits(hf, ids[0], lambda layer: _rel(q, k) if layer in layers else _rel(own, own),
                               freqs=lambda layer: f)
        assert (got - want).abs().max() <= TOL64, layers
    with pytest.raises(PositionError, match=r"Plan names layers \[2\]; the model has 2"):
        with rope_positions(tiny_rope64, PositionPlan(q, k, layers=frozenset({2}))):
            pass


@pytest.mark.parametrize("layers", [None, frozenset({1})])
@pytest.mark.parametrize("override", [False, True])
def test_pre_rotation_control_equals_the_reference(tiny_rope64, layers, override):
    # The route for attentions whose rotation no hook sees (GPT-J before transformers 5.24): the projections are
    # turned ahead of the model's own rotation. Llama rotates right after hook_q / hook_k, so the route applies to it
    # as well and is checked here on the float64 model, with and without a rotary override (turn back with the
    # layer's own rotation, then on with the override's).
    from dataclasses import replace

    from posprobe.backend.hooks import layer_rotary_spec

    hf, f = _setup(tiny_rope64)
    n = 9
    q, k = _far_fractional(n)
    spec = layer_rotary_spec(tiny_rope64, 0)
    rotary = {l: replace(spec, freq_scale=(1.7,) * spec.n_bands) for l in (0, 1)} if override else None
    plan = PositionPlan(q, k, layers=layers, rotary=rotary)
    ids = _ids(n, seed=4)
    ctl = P._PreRotationControl(tiny_rope64, plan, (0, 1))
    with torch.no_grad(), hooked(tiny_rope64, ctl.hooks()):
        got = tiny_rope64(ids)[0]
    on = layers if layers is not None else {0, 1}
    own = torch.arange(n, dtype=F64)
    want = pairwise_logits(hf, ids[0], lambda layer: _rel(q, k) if layer in on else _rel(own, own),
                           freqs=lambda layer: f / 1.7 if override and layer in on else f)
    assert (got - want).abs().max() <= TOL64
    with pytest.raises(PositionError, match="covers 9 tokens but the sequence has 10"):
        with torch.no_grad(), hooked(tiny_rope64, P._PreRotationControl(tiny_rope64, plan, (0, 1)).hooks()):
            tiny_rope64(_ids(10))


def test_token_positions_on_a_rotary_model_places_each_token_and_names_the_plan(tiny_rope64):
    hf, f = _setup(tiny_rope64)
    n = 7
    pos = torch.arange(n, dtype=F64) * 0.5 + 30.25
    ids = _ids(n, seed=5)
    with torch.no_grad(), P.token_positions(tiny_rope64, pos, label="halved") as plan:
        got = tiny_rope64(ids)[0]
    assert plan.label == "halved" and plan.q_pos.dtype == F64
    want = pairwise_logits(hf, ids[0], _rel(pos, pos), freqs=lambda layer: f)
    assert (got - want).abs().max() <= TOL64


def test_token_positions_refuses_a_family_without_control_naming_it(monkeypatch):
    fake = types.SimpleNamespace(cfg=types.SimpleNamespace(model_name="fake-model"))
    monkeypatch.setattr(P, "model_name", lambda model: "fake-model")
    from posprobe.backend.families import family

    for kind in ("nope", "no-such-kind"):
        monkeypatch.setattr(P, "model_facts", lambda model, kind=kind: types.SimpleNamespace(positional_kind=kind))
        with pytest.raises(P.WrongModelKind) as e:
            P.token_positions(fake, torch.arange(3))
        msg = str(e.value)
        assert msg.startswith("Positions can be set on learned, sinusoidal, rotary, ALiBi or T5-bias models; "
                              f"fake-model uses {kind}"), msg
        if kind == "nope":
            assert msg.endswith(f"positions ({family('nope').why_no_control})"), msg


def test_one_learned_position_id_is_a_valid_input(tiny_ape):
    ids = torch.tensor([[17]])
    with torch.no_grad(), P.learned_positions(tiny_ape, torch.tensor([5])):
        got = tiny_ape(ids)
    with torch.no_grad():
        want = plain_hf_model(tiny_ape)(ids, position_ids=torch.tensor([[5]])).logits
    assert (got - want).abs().max() <= 1e-5  # float32
    with pytest.raises(PositionError, match="No positions given"):
        P.check_learned_positions(tiny_ape, torch.tensor([], dtype=torch.long))
    assert hf_of(tiny_ape) is not None


# ---- PositionPlan by hand ---------------------------------------------------------------------------------------

def test_plan_positions_are_float64_from_lists_and_from_float32_tensors():
    plan = PositionPlan([0.1, 1.7], [0.2, 2.9])
    assert plan.q_pos.dtype == plan.k_pos.dtype == F64
    assert plan.q_pos.tolist() == [0.1, 1.7] and plan.k_pos.tolist() == [0.2, 2.9]  # exact: no float32 detour
    from_f32 = PositionPlan(torch.tensor([1.5, 2.5]), torch.tensor([0.25, 3.0]))
    assert from_f32.q_pos.dtype == from_f32.k_pos.dtype == F64
    assert from_f32.q_pos.tolist() == [1.5, 2.5] and from_f32.k_pos.tolist() == [0.25, 3.0]
    ints = PositionPlan(torch.arange(3), torch.arange(3))
    assert ints.q_pos.dtype == F64 and P._as_tensor([1, 2], F64).dtype == F64
    default = PositionPlan.default(3, label="d")
    assert default.q_pos.dtype == F64 and default.q_pos.tolist() == [0.0, 1.0, 2.0] and default.label == "d"
    assert PositionPlan.default(2).label == "default"


def test_plan_shape_and_view_checks():
    with pytest.raises(PositionError, match=r"q_pos has shape \(3,\) but k_pos has \(2,\)"):
        PositionPlan([0, 1, 2], [0, 1])
    ok_rows = torch.zeros(3, dtype=torch.bool)
    for rows, k in ((ok_rows, torch.zeros(2)), (torch.zeros(2, dtype=torch.bool), torch.zeros(3))):
        with pytest.raises(PositionError, match=r"view 'bad' covers \d tokens, plan has 3"):
            PositionPlan([0, 1, 2], [0, 1, 2], views=(KeyView(rows, k, "bad"),))


def test_extended_by_hand():
    rows = torch.tensor([False, True, False])
    plan = PositionPlan([0.5, 2.0, 4.0], [0.0, 1.0, 9.0], views=(KeyView(rows, torch.tensor([7.0, 8.0, 9.0]), "v"),),
                        label="x", meta={"a": 1})
    assert plan.extended(3) is plan and plan.extended(2) is plan
    one = plan.extended(4)  # one new token: after the last query position, q = k
    assert one.q_pos.tolist() == [0.5, 2.0, 4.0, 5.0] and one.k_pos.tolist() == [0.0, 1.0, 9.0, 5.0]
    assert one.q_pos.dtype == F64 and one.label == "x" and dict(one.meta) == {"a": 1}
    (v,) = one.views
    assert v.name == "v" and v.queries.dtype == torch.bool and v.queries.tolist() == [False, True, False, False]
    assert v.k_pos.tolist() == [7.0, 8.0, 9.0, 5.0]
    three = plan.extended(6)
    assert three.q_pos.tolist()[3:] == [5.0, 6.0, 7.0] and three.views[0].k_pos.tolist()[3:] == [5.0, 6.0, 7.0]
    batched = PositionPlan(torch.tensor([[0.0, 1.0], [3.0, 4.0]]), torch.tensor([[0.0, 1.0], [3.0, 4.0]]))
    assert batched.extended(3).q_pos.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_shifted_plan_by_hand():
    p = P.shifted_plan(3, 2.5)
    assert p.q_pos.tolist() == p.k_pos.tolist() == [2.5, 3.5, 4.5] and p.label == "shift:2.5"
    q_only = P.shifted_plan(3, 4, q_only=True)
    assert q_only.q_pos.tolist() == [4.0, 5.0, 6.0] and q_only.k_pos.tolist() == [0.0, 1.0, 2.0]
    assert q_only.k_pos.dtype == F64 and q_only.label == "shift-q:4"
