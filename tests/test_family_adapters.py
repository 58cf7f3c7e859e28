"""The positional-family adapters (posprobe.backend.families): one module per mechanism, each registered, each
saying how a plan reaches the model, which score terms exist and which analyses apply — and those statements
agree with what the analyses do on tiny models of every family (the support matrix proves the numbers)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest
import torch
from families import tiny_family

import posprobe.backend.families as F
from posprobe.analyses.atlas import SECTIONS, applicable, skip_reasons
from posprobe.backend.architectures import ARCHITECTURES
from posprobe.backend.facts import model_facts
from posprobe.backend.peek import WrongModelKind, hf_positional_kind


def test_every_family_module_registers_one_family():
    # Adding a family is one module: a module that defines FAMILY but is not in the registry would be silently unused.
    mods = [m.name for m in pkgutil.iter_modules(F.__path__) if m.name != "base"]
    kinds = {importlib.import_module(f"posprobe.backend.families.{m}").FAMILY.kind for m in mods}
    assert kinds == set(F.FAMILIES) and len(mods) == len(F.FAMILIES) == 6
    for fam in F.FAMILIES.values():
        assert fam.control in F.CONTROLS or (fam.control is None and fam.why_no_control), fam.kind
        assert set(fam.not_applicable) <= set(SECTIONS), fam.kind
        assert set(fam.decompositions) <= {"exact-layer0", "data-driven"}, fam.kind
        # A family that names a score term computes it (the decomposition asks the family, never branches on it).
        assert bool(fam.score_term) == (fam.score_bias is not None), fam.kind
    assert F.family("none") is F.FAMILIES["nope"]
    with pytest.raises(KeyError, match="known: rotary"):
        F.family("shortformer")


def test_peek_reads_the_families_vocabulary_without_torch():
    code = ("import sys; from posprobe.backend.peek import hf_positional_kind as k; "
            "print(k({'model_type': 'bloom'}), k({'model_type': 'opt'}), k({'model_type': 't5'}), "
            "k({'model_type': 'x', 'rotary_pct': 0.25}), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["alibi", "learned_absolute", "relative_bias", "rotary", "False"]
    for mt, row in ARCHITECTURES.items():  # every architecture row that names a family is read as that family
        if row.family is not None:
            assert hf_positional_kind({"model_type": mt}) == row.family.kind, mt


def test_alibi_fit_recovers_slopes_and_refuses_a_bias_that_is_not_linear():
    # Independent reference: Press et al.'s geometric slopes for 8 heads, 2^-1 ... 2^-8, as -m * (i - j) plus a
    # per-row constant (softmax ignores it; HF's BLOOM adds m * j only).
    n, heads = 7, 8
    m = torch.tensor([2.0 ** -(h + 1) for h in range(heads)], dtype=torch.float64)
    i, j = torch.arange(n)[:, None].double(), torch.arange(n)[None].double()
    bias = -m[:, None, None] * (i - j) + torch.randn(heads, n, 1, dtype=torch.float64)
    got = torch.tensor(F.alibi.fit_slopes(bias, "Toy"), dtype=torch.float64)
    assert torch.allclose(got, m, atol=1e-12, rtol=0)
    with pytest.raises(NotImplementedError, match="Toy's attention bias is not linear"):
        F.alibi.fit_slopes(bias - 0.1 * (i - j) ** 2, "Toy")
    assert F.alibi.phrase(tuple(m.tolist())) == "ALiBi (slopes 2^-1 … 2^-8, measured)"


@pytest.mark.parametrize("name", ["llama", "smollm3", "gpt2", "bloom", "xglm", "gptj", "olmo2"])
def test_atlas_skips_exactly_what_the_family_and_the_proofs_rule_out(name):
    facts = model_facts(tiny_family(name)[0])
    why = skip_reasons(facts, engine_runs=True)
    for section in SECTIONS:
        reason = F.not_applicable(facts.positional_kind, section)
        if reason is not None:
            assert why[section] == reason  # the family's own reason comes first
    chosen = applicable(facts, None, engine_runs=True)
    assert set(chosen) == set(SECTIONS) - set(why)
    assert "facts" in chosen and "probes" in chosen  # no family rules these out
    if facts.rotation_unhooked is not None:  # GPT-J: rotated q/k at no hook
        assert "frequency" in why and "sinks" in why


def test_position_control_follows_the_family_and_names_why_it_cannot(monkeypatch):
    # token_positions picks the mechanism from the family's `control`: XGLM's sinusoids take position ids (equal to
    # HF's forward with position_ids); a family without control (NoPE) is refused with its reason before any forward.
    import posprobe.core.positions as P
    from posprobe.backend.bridge import plain_hf_model

    bridge, _ = tiny_family("xglm")
    ids = torch.randint(3, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), P.token_positions(bridge, torch.arange(10) + 7):
        got = bridge(ids)
    with torch.no_grad():
        want = plain_hf_model(bridge)(ids, position_ids=(torch.arange(10) + 7)[None]).logits
    assert (got - want).abs().max() <= 1e-5
    facts = model_facts(bridge)
    from dataclasses import replace

    monkeypatch.setattr(P, "model_facts", lambda model: replace(facts, positional_kind="none"))
    with pytest.raises(WrongModelKind, match="uses none positions .*no positional encoding"):
        P.token_positions(bridge, torch.arange(10))
    assert F.control("relative_bias") == "bucket bias" and F.control("mystery") is None


def test_layer_phrases_come_from_each_family():
    kinds = ("rotary", "nope", "alibi", "learned_absolute", "relative_bias", "sinusoidal", "mystery")
    text = F.describe_layers(kinds, None, 16, ("local",) + ("global",) * 6, alibi_slopes=((0.5, 0.25),) * 7)
    assert text == ("rotary, sliding window", "NoPE (no positional encoding)", "ALiBi (slopes 2^-1 … 2^-2, measured)",
                    "learned absolute (added to the embedding)",
                    "T5 relative buckets (layer 0's bias table, shared by every layer)",
                    "fixed sinusoidal (added to the embedding)", "mystery")


def test_model_facts_are_read_once_and_again_when_what_they_read_changes(monkeypatch):
    # An atlas asks for the facts a dozen times: they are read once per model, and read again where the model's name,
    # context, source or head changed (a stale n_ctx would let a window past the context through).
    from families import tiny_family

    import posprobe.backend.facts as FM

    bridge, _ = tiny_family("gpt2")
    bridge.__dict__.pop("_posprobe_facts", None)
    calls = []
    real = FM._read_facts
    monkeypatch.setattr(FM, "_read_facts", lambda m: calls.append(1) or real(m))
    first = FM.model_facts(bridge)
    assert FM.model_facts(bridge) is first and len(calls) == 1
    bridge.cfg.n_ctx = 64
    assert FM.model_facts(bridge).n_ctx == 64 and len(calls) == 2
    bridge.cfg.model_name = "renamed"
    assert FM.model_facts(bridge).name == "renamed" and len(calls) == 3
