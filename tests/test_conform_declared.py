"""`posprobe conform`, check 1 (declared positions): an engine's per-band frequencies by ggml's formulas against HF's
rotary module for the same config. Every HF rope type is written out here from its paper / model card (the engine
side's parameters: what a correct engine declares) and must agree to 1e-6; each bug class the engines' issues report
is planted as a declared config and must be named.

Planted bugs seen failing (each by editing posprobe/, running this file, then reverting):
- YaRN's ramp without the floor/ceil of its boundaries: the yarn row stops conforming (its ramp bands differ).
- The YaRN multiplier's 0.1 ln(1/freq_scale) dropped: yarn is named `attention factor missing`.
- `base off`'s implied base inverted (exp(+slope ...)): the base-off sentence's +1% becomes -0.99%.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from posprobe.analyses.conform_declared import declared_tables, diagnose
from posprobe.backend.engines.reference import hf_rope_tables
from posprobe.backend.engines.rope import EngineRope, engine_table

D, L = 64, 512  # head dim (rotated fully unless said), original context


def _llama(**rope) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4 * D, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                       intermediate_size=32, vocab_size=32, max_position_embeddings=4 * L,
                       rope_parameters={"rope_theta": 1e4, **rope})


def _neox(**rope) -> object:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(hidden_size=4 * D, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32,
                         vocab_size=32, max_position_embeddings=4 * L, rope_parameters={"rope_theta": 1e4, **rope})


def _llama3_divisors(base: float, factor: float, low: float, high: float, orig: int) -> tuple[float, ...]:
    # Meta's Llama 3.1 rule: wavelengths shorter than orig/high kept, longer than orig/low divided by the factor,
    # between them a smooth mix (the model card's reference code, written out).
    out = []
    for j in range(D // 2):
        theta = base ** (-2 * j / D)
        wavelen = 2 * math.pi / theta
        if wavelen < orig / high:
            new = theta
        elif wavelen > orig / low:
            new = theta / factor
        else:
            smooth = (orig / wavelen - low) / (high - low)
            new = (1 - smooth) * theta / factor + smooth * theta
        out.append(theta / new)
    return tuple(out)


CORRECT = {  # HF rope_parameters -> what a correct engine declares for them
    "default": ({"rope_type": "default"}, EngineRope("all", D, 1e4)),
    "linear": ({"rope_type": "linear", "factor": 4.0}, EngineRope("all", D, 1e4, freq_scale=0.25)),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, EngineRope("all", D, 1e4)),  # at load: the plain table
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L},
             EngineRope("all", D, 1e4, freq_scale=0.25, ext_factor=1.0, orig_ctx=L)),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": L},
               EngineRope("all", D, 1e4, freq_factors=_llama3_divisors(1e4, 8.0, 1.0, 4.0, L))),
    "longrope": ({"rope_type": "longrope", "short_factor": [1.0 + 0.01 * j for j in range(D // 2)],
                  "long_factor": [2.0] * (D // 2), "original_max_position_embeddings": L},
                 # at load: the short factors; cos/sin x sqrt(1 + ln(L'/L) / ln L) (Phi-3's rule), L' = 4L
                 EngineRope("all", D, 1e4, freq_factors=tuple(1.0 + 0.01 * j for j in range(D // 2)),
                            attn_factor=math.sqrt(1 + math.log(4) / math.log(L)))),
    "proportional": ({"rope_type": "proportional", "partial_rotary_factor": 0.25},
                     # p-RoPE: the exponent over the whole head, the fastest quarter of the bands turn, the rest 0
                     EngineRope("all", D, 1e4, freq_factors=(1.0,) * (D // 8) + (math.inf,) * (D // 2 - D // 8))),
}


@pytest.mark.parametrize("kind", sorted(CORRECT))
def test_every_hf_rope_type_conforms_to_its_written_out_engine(kind):
    rope, engine = CORRECT[kind]
    hf = hf_rope_tables(_llama(**rope))
    summary, bands = declared_tables({"all": engine}, hf)
    row = summary.iloc[0]
    assert row["verdict"] == "conforms", (kind, row["bug_class"], row["why"])
    assert row["max_rel_diff"] <= 1e-6 and len(bands) == D // 2
    if kind == "yarn":
        assert row["hf_multiplier"] == pytest.approx(0.1 * math.log(4) + 1)  # Peng et al.'s sqrt(1/t)


def test_the_engine_table_is_ggmls_yarn_written_out():
    # ggml_rope_yarn_corr_dims: the bands turning 32 and 1 times within L, floored and ceiled; the mix per band.
    rope = EngineRope("all", D, 1e4, freq_scale=0.25, ext_factor=1.0, orig_ctx=L)
    inv, mult = engine_table(rope)

    def band(turns):
        return D * math.log(L / (turns * 2 * math.pi)) / (2 * math.log(1e4))

    low, high = math.floor(band(32)), math.ceil(band(1))
    for j in range(D // 2):
        ramp = 1 - min(1.0, max(0.0, (j - low) / (high - low)))
        theta = 1e4 ** (-2 * j / D)
        assert inv[j] == pytest.approx(theta * (0.25 * (1 - ramp) + ramp), rel=1e-12)
    assert mult == pytest.approx(1 + 0.1 * math.log(4), rel=1e-12)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L}
M = 1 + 0.1 * math.log(4)


@pytest.mark.parametrize("name,rope,engine,bug,says", [
    ("attention factor missing (vLLM #48621's reverse, mlx-lm #1507)", YARN,
     EngineRope("all", D, 1e4, freq_scale=0.25, ext_factor=1.0, orig_ctx=L, attn_factor=1 / M),
     "attention factor missing", "1 where HF has 1.13863"),
    ("attention factor doubled (sglang #33558)", YARN,
     EngineRope("all", D, 1e4, freq_scale=0.25, ext_factor=1.0, orig_ctx=L, attn_factor=M),
     "attention factor doubled", "squared"),
    ("YaRN's original context wrong", YARN,
     EngineRope("all", D, 1e4, freq_scale=0.25, ext_factor=1.0, orig_ctx=4 * L), "ramp off", "bands"),
    ("base 1% off", {"rope_type": "default", "rope_theta": 1e5}, EngineRope("all", D, 1.01e5),
     "base off", "+1%"),
    ("linear factor wrong", {"rope_type": "linear", "factor": 2.0}, EngineRope("all", D, 1e4, freq_scale=0.25),
     "scale off", "x0.5"),
    ("partial rotary applied twice", {"rope_type": "default", "partial_rotary_factor": 0.25},
     EngineRope("all", D // 16, 1e4), "rotated dims", "2 bands (4 dims) where HF rotates 8"),
])
def test_each_reported_bug_class_is_named(name, rope, engine, bug, says):
    config = _neox(**rope) if "partial_rotary_factor" in rope else _llama(**rope)  # Llama ignores the partial factor
    summary, _ = declared_tables({"all": engine}, hf_rope_tables(config))
    row = summary.iloc[0]
    assert (row["verdict"], row["bug_class"]) == ("differs", bug), (name, row["why"])
    assert says in row["why"], (name, row["why"])


def _gemma3(global_rope: dict) -> object:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_hidden_layers=6, intermediate_size=32, vocab_size=32, sliding_window=16,
                            rope_parameters={"full_attention": {"rope_theta": 1e6, **global_rope},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def test_gemma3_scales_only_its_global_layers():
    # Gemma 3 4B+: linear x8 on the global layers, base 1e4 unscaled on the local ones (llama.cpp #17945, #14367).
    hf = hf_rope_tables(_gemma3({"rope_type": "linear", "factor": 8.0}))
    assert set(hf) == {"full_attention", "sliding_attention"}
    right = {"full_attention": EngineRope("full_attention", 32, 1e6, freq_scale=0.125),
             "sliding_attention": EngineRope("sliding_attention", 32, 1e4)}
    summary, _ = declared_tables(right, hf)
    assert summary["verdict"].tolist() == ["conforms", "conforms"]
    everywhere = {**right, "sliding_attention": EngineRope("sliding_attention", 32, 1e4, freq_scale=0.125)}
    got = declared_tables(everywhere, hf)[0].set_index("layer_type")
    assert got.loc["full_attention", "verdict"] == "conforms"
    assert got.loc["sliding_attention", "bug_class"] == "scaling on every layer type"
    swapped = {**right, "sliding_attention": EngineRope("sliding_attention", 32, 1e6, freq_scale=0.125)}
    got = declared_tables(swapped, hf)[0].set_index("layer_type")
    assert got.loc["sliding_attention", "bug_class"] == "layer types swapped"
    assert "full_attention" in got.loc["sliding_attention", "why"]
    one_type = declared_tables({"all": EngineRope("all", 32, 1e6)}, hf)[0]
    assert set(one_type["bug_class"]) == {"layer types differ"}


def test_diagnose_sees_no_bug_where_there_is_none_and_reads_the_base():
    h = 1e4 ** (-2 * np.arange(16) / 32)
    assert diagnose((h.copy(), 1.0), (h, 1.0)) == ("ok", "")
    e = (1.02e4) ** (-2 * np.arange(16) / 32)
    bug, why = diagnose((e, 1.0), (h, 1.0))
    assert bug == "base off" and "x1.02 HF's (+2%)" in why
