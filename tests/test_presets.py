"""The preset registry: parsing and bounds, both forms of every preset agreeing pair by pair, and a preset added
as one entry reaching --help, validation and both scoring forms."""

from __future__ import annotations

import pytest
import torch

from posprobe.core import presets as P
from posprobe.core import surgery as S
from posprobe.core.presets import preset_pairs, preset_plan


def _relative_of_plan(plan, n):
    """`[query, key]` q_pos - k_pos of a per-query plan (each query's KeyView where it has one); NaN where evicted."""
    from paper_rules import plan_relative

    rel = plan_relative(plan.q_pos, plan.k_pos, plan.views)
    if plan.meta.get("keep"):
        i = torch.arange(n, dtype=torch.float64)
        rel = rel.masked_fill(S.evicted(i, i, *plan.meta["keep"]), float("nan"))
    return rel


@pytest.mark.parametrize("name", sorted(P.PRESETS))
def test_both_forms_of_every_preset_agree(tiny_rope, name):
    """Per (query, key) pair: the same relative position, the same rotation per layer, the same score scale."""
    from posprobe.backend.hooks import layer_rotary_spec, scaled_rotary_spec

    spec = P.PRESETS[name].example
    n = 37
    plan, rule = preset_plan(spec, tiny_rope, n), preset_pairs(spec)
    i = torch.arange(n, dtype=torch.float64)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    want = _relative_of_plan(plan, n)[causal].nan_to_num(-999.0)
    got = rule.relative(i, i)[causal].nan_to_num(-999.0)
    assert torch.equal(got, want), spec
    assert rule.score_scale == float(plan.meta.get("score_scale", 1.0))
    for layer in range(2):
        own = layer_rotary_spec(tiny_rope, layer)
        plan_spec = (plan.rotary or {}).get(layer, own)
        if rule.hf_rope is not None:  # HF's own table for the config the preset names (tests/test_rope_types.py)
            own = scaled_rotary_spec(tiny_rope, layer, dict(rule.hf_rope), n)
        assert (rule.rotary(own) if rule.rotary else own) == plan_spec, spec
    assert rule.label == plan.label == (spec if name != "none" else "none")


PAPERS = ("none", "shift", "pi", "ntk", "yarn", "self-extend", "rerope", "string", "streaming")


@pytest.mark.parametrize("name", PAPERS)
def test_every_preset_with_a_paper_is_its_papers_rule(tiny_rope, name):
    """Per (query, key) pair, both forms give the relative position the paper's formula gives (tests/paper_rules.py,
    plain integers), and every layer turns at the paper's angle per band (HF's config for the base)."""
    from paper_rules import preset_reference

    from posprobe.backend.bridge import plain_hf_model
    from posprobe.backend.hooks import layer_rotary_spec
    from posprobe.rope import angular_frequency

    assert set(PAPERS) <= set(P.PRESETS)
    spec, n = P.PRESETS[name].example, 37
    cfg = plain_hf_model(tiny_rope).config
    rel, freqs, factor = preset_reference(spec, n, cfg)
    plan, rule = preset_plan(spec, tiny_rope, n), preset_pairs(spec)
    i = torch.arange(n, dtype=torch.float64)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    want = rel[causal].nan_to_num(-999.0)
    assert torch.equal(_relative_of_plan(plan, n)[causal].nan_to_num(-999.0), want), spec
    assert torch.equal(rule.relative(i, i)[causal].nan_to_num(-999.0), want), spec
    for layer in range(cfg.num_hidden_layers):
        rot = (plan.rotary or {}).get(layer, layer_rotary_spec(tiny_rope, layer))
        assert angular_frequency(rot) == pytest.approx(freqs.tolist(), rel=1e-12), spec
    assert float(plan.meta.get("score_scale", 1.0)) == pytest.approx(factor, rel=1e-15)


@pytest.mark.parametrize("spec,message", [
    ("bogus", "unknown preset 'bogus'"),
    ("pi", "needs argument 'scale'"),
    ("pi:scale=0", "scale in preset 'pi:scale=0' must be > 0"),
    ("pi:scale=-1", "must be > 0"),
    ("pi:scal=2", "has no argument 'scal'"),
    ("pi:scale=two", "must look like key=number"),
    ("pi:scale", "must look like key=number"),
    ("self-extend:group=2.5,window=4", "group in preset .* must be a whole number"),
    ("streaming:sink=-1,window=4", "sink .* must be >= 0"),
    ("p-rope:p=1.5", "p in preset .* must be <= 1"),
    ("yarn:scale=2,original=inf", "must be finite"),
])
def test_bad_specs_raise_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        P.parse(spec)


def test_specs_parse_to_typed_values_with_defaults():
    preset, a = P.parse(" YARN:scale=4, original=64.0 ,beta-fast=16")
    assert preset.name == "yarn" and a == {"scale": 4.0, "original": 64, "beta_fast": 16.0, "beta_slow": 1.0}
    assert isinstance(a["original"], int)
    assert P.parse("drop")[1] == {"lowest": 0, "highest": 0}
    assert P.is_identity("none") and not P.is_identity("pi:scale=2")


def test_help_is_generated_from_the_registry():
    text = P.help_text()
    assert text.split(" | ") == [p.usage for p in P.PRESETS.values()]
    assert "yarn:scale=S,original=L[,beta_fast=32,beta_slow=1]" in text and "drop[:lowest=0,highest=0]" in text


def test_a_configs_bad_preset_is_refused_when_the_config_is_built():
    from posprobe.analyses.configs import LongContextConfig, SurgeryEvalConfig

    for cls in (SurgeryEvalConfig, LongContextConfig):
        with pytest.raises(ValueError, match="must be > 0"):
            cls(presets=("pi:scale=-1",))


# ---- one new preset = one entry ---------------------------------------------------------------------------

def _stretch_plan(model, n, a):
    p = torch.arange(n, dtype=torch.float64) * a["factor"]
    return S.PositionPlan(p, p.clone(), label="stretch", meta={"preset": "stretch", "factor": a["factor"]})


def _stretch_pairs(a):
    f = a["factor"]
    return S.PairRule("stretch", ((lambda p: p * f, lambda p: p * f),), meta={"preset": "stretch", "factor": f})


@pytest.fixture
def stretch():
    """A test-only preset, registered as one entry and removed afterwards."""
    preset = P.register(P.Preset("stretch", "q = k = i * F (test only)",
                                 (P.Param("factor", float, metavar="F", low=0.0, low_open=True),),
                                 plan=_stretch_plan, pairs=_stretch_pairs, example="stretch:factor=0.5"))
    yield preset
    P.unregister("stretch")


def test_a_registered_preset_reaches_help_validation_and_both_forms(stretch, tiny_rope, capsys):
    from posprobe.cli.main import build_parser
    from posprobe.core import long_engine as LA
    from posprobe.core.generation import logits_under, token_logprobs

    assert "stretch:factor=F" in P.help_text()
    for command in ("surgery-eval", "long-context"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        assert "stretch:factor=F" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")
    with pytest.raises(ValueError, match="must be > 0"):
        P.parse("stretch:factor=0")
    n = 30
    tokens = torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(0))
    plan = preset_plan("stretch:factor=0.5", tiny_rope, n)
    want = -token_logprobs(logits_under(tiny_rope, tokens[None], plan), tokens[None])[0]
    from test_long_context import _unwrapped

    got = LA.token_nll(_unwrapped(tiny_rope), tokens, preset_pairs("stretch:factor=0.5"), chunk=7)
    assert (got - want.float()).abs().max() <= 1e-4  # float32; bridge vs HF kernels (as for the built-in presets)
    plain = -token_logprobs(logits_under(tiny_rope, tokens[None], preset_plan("none", tiny_rope, n)), tokens[None])[0]
    assert (plain - want).abs().max() > 1e-3  # the preset changes the model: the comparison is not vacuous


def test_a_taken_name_and_an_example_that_does_not_parse_are_refused():
    with pytest.raises(ValueError, match="already registered"):
        P.register(P.PRESETS["pi"])
    with pytest.raises(ValueError, match="needs argument"):
        P.register(P.Preset("broken", "", (P.Param("x"),), plan=_stretch_plan, pairs=_stretch_pairs, example="broken"))
    assert "broken" not in P.PRESETS
