"""Seeded tiny random Hugging Face models of the positional families the TransformerBridge boots, as bridges.

Offline and small (2-4 layers, d_model 32): the first rows of the support matrix. Every parameter is drawn at
random (`randomize_`), so biases and norm weights are not the trivial zeros and ones of a default init.
"""

from __future__ import annotations

import warnings
from typing import NoReturn

import torch

from posprobe.backend.tiny import byte_tokenizer, randomize_

# TL's init scale (0.8 / sqrt(d_model)) rather than HF's 0.02: attention far from uniform, so positions matter.
_INIT = dict(initializer_range=0.8 / 32**0.5)
_COMMON = dict(vocab_size=259, bos_token_id=256, eos_token_id=257, pad_token_id=258, **_INIT)


def _configs() -> dict:
    import transformers as T

    c = _COMMON
    return {
        "gpt_neo": (T.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=128,
                                   attention_types=[[["global", "local"], 1]], window_size=16, intermediate_size=64,
                                   **c), T.GPTNeoForCausalLM),
        "opt": (T.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                            max_position_embeddings=128, word_embed_proj_dim=32, **c), T.OPTForCausalLM),
        "gpt_neox": (T.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=128, rotary_pct=0.25, **c), T.GPTNeoXForCausalLM),
        "gptj": (T.GPTJConfig(n_embd=32, n_layer=2, n_head=4, n_positions=128, rotary_dim=4, **c), T.GPTJForCausalLM),
        "smollm3": (T.SmolLM3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=128, no_rope_layers=[1, 1, 1, 0],
                                    **c), T.SmolLM3ForCausalLM),
        "bloom": (T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **c), T.BloomForCausalLM),
        "phi3": (T.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, max_position_embeddings=128, partial_rotary_factor=0.5, **c),
                 T.Phi3ForCausalLM),
        "mistral": (T.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=128, **c), T.MistralForCausalLM),
        "llama": (T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=128, attention_bias=True, rope_theta=1e5,
                                **c), T.LlamaForCausalLM),
        "gpt2": (T.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **c), T.GPT2LMHeadModel),
        "gemma3": (T.Gemma3TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=128,
                                      layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                      query_pre_attn_scalar=8, **c), T.Gemma3ForCausalLM),
        "bert": (T.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=128, vocab_size=259, pad_token_id=258, **_INIT),
                 T.BertForMaskedLM),
        "qwen2": (T.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=128, **c), T.Qwen2ForCausalLM),
        "qwen3": (T.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, **c),
                  T.Qwen3ForCausalLM),
        "gemma2": (T.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=8,
                                  query_pre_attn_scalar=8, **c), T.Gemma2ForCausalLM),
        "phi": (T.PhiConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=128, partial_rotary_factor=0.5, **c), T.PhiForCausalLM),
        "gemma": (T.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, **c),
                  T.GemmaForCausalLM),
        "granite": (T.GraniteConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=128, attention_multiplier=0.3,
                                    residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=4.0, **c),
                    T.GraniteForCausalLM),
        "olmo2": (T.Olmo2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=128, **c), T.Olmo2ForCausalLM),
        # OLMo (1) clips q/k/v: the refused rotary family the gate tests use (position control does not clip yet).
        "olmo": (T.OlmoConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=128, clip_qkv=0.5, **c),
                 T.OlmoForCausalLM),
        "stablelm": (T.StableLmConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, max_position_embeddings=128, partial_rotary_factor=0.25,
                                      **c), T.StableLmForCausalLM),
        "starcoder2": (T.Starcoder2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          **c), T.Starcoder2ForCausalLM),
        "roberta": (T.RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    max_position_embeddings=130, vocab_size=259, pad_token_id=1, **_INIT),
                    T.RobertaForMaskedLM),
        "mpt": (T.MptConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=128, **c), T.MptForCausalLM),
        "falcon": (T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  new_decoder_architecture=False, alibi=False, **c), T.FalconForCausalLM),
        "cohere": (T.CohereConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128, **c), T.CohereForCausalLM),
        "cohere2": (T.Cohere2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=128, sliding_window=8,
                                    layer_types=["sliding_attention"] * 3 + ["full_attention"], **c),
                    T.Cohere2ForCausalLM),
        "glm": (T.GlmConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, **c), T.GlmForCausalLM),
        "t5": (T.T5Config(vocab_size=259, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                          relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=258,
                          eos_token_id=257, decoder_start_token_id=258, initializer_factor=1.0),
               T.T5ForConditionalGeneration),
        "xglm": (T.XGLMConfig(vocab_size=259, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                              max_position_embeddings=128, pad_token_id=1, bos_token_id=256, eos_token_id=257,
                              init_std=_INIT["initializer_range"]), T.XGLMForCausalLM),
        # Decoder-only T5 bias (posprobe's own bridge adapter): 8 buckets to distance 16, so a 20-token input
        # reaches the logarithmic buckets and the shared last one.
        "pix2struct": (T.Pix2StructTextConfig(hidden_size=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                              relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                              dense_act_fn="silu", is_decoder=True, use_cache=False,
                                              decoder_start_token_id=258, **c), T.Pix2StructTextModel),
        "falcon_rw": (T.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=False,
                                     parallel_attn=False, bias=True, new_decoder_architecture=False, alibi=True, **c),
                      T.FalconForCausalLM),
    }


#: A family whose position analyses are refused as a whole (facts say why): OLMo (1) clips q/k/v (clip_qkv).
FAMILIES = ("olmo",)
#: Partial rotary (rotary_pct / partial_rotary_factor), in both of TL's rotary attention components.
PARTIAL = ("gpt_neox", "phi3", "phi", "stablelm")
#: Adjacent pairs (2b, 2b+1): Cohere's interleaved cos/sin, GLM's partial rotary (GPT-J: its own test).
ADJACENT = ("cohere", "cohere2", "glm")
#: Every family of the support matrix, in its row order.
ALL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "smollm3", "gpt2", "gpt_neo", "opt",
                "bert", "gpt_neox", "gptj", "bloom", "phi3", "phi", "gemma", "granite", "olmo2", "olmo", "stablelm",
                "starcoder2", "roberta", "mpt", "falcon", "falcon_rw", "cohere", "cohere2", "glm", "t5", "pix2struct",
                "xglm")


#: The families' HF classes each TransformerLens major version is known to have no bridge adapter for: a family
#: whose class is listed skips with the reason; any other missing adapter fails (a TL upgrade must not make a family
#: vanish from the suite). TL 3.9.0 (.ci/legacy): no RobertaForMaskedLM in its SUPPORTED_ARCHITECTURES; TL 4.3.0
#: (.ci/setup's default) has an adapter for every family in ALL_FAMILIES.
EXPECTED_ADAPTER_GAPS: dict[str, frozenset[str]] = {
    "3": frozenset({"RobertaForMaskedLM"}),
    "4": frozenset(),
}


def missing_adapter(family: str, cls_name: str, tl_version: str) -> NoReturn:
    """TransformerLens `tl_version` has no adapter for `cls_name` (family `family`): a skip where that gap is
    declared in EXPECTED_ADAPTER_GAPS for its major version, a failure otherwise."""
    import pytest

    if cls_name in EXPECTED_ADAPTER_GAPS.get(tl_version.split(".")[0], frozenset()):
        pytest.skip(f"TransformerLens {tl_version} has no adapter for {cls_name} ({family}): an expected gap "
                    "(EXPECTED_ADAPTER_GAPS in tests/families.py)")
    pytest.fail(f"TL {tl_version} has no adapter for {cls_name} (family {family}): add it to the expected gaps "
                "(EXPECTED_ADAPTER_GAPS in tests/families.py) deliberately or pin TL", pytrace=False)


def model_type_of(name: str) -> str | None:
    """The Hugging Face `model_type` (the text config's) of support-matrix family `name`, None where this file builds
    no such family."""
    got = _configs().get(name)
    if got is None:
        return None
    cfg = got[0]
    return str(cfg.get_text_config(decoder=True).model_type if hasattr(cfg, "get_text_config") else cfg.model_type)


def tiny_family(name: str, seed: int = 0) -> tuple[object, object]:
    """(bridge, reference) for family `name`, every weight random and seeded. The reference is a plain HF model
    rebuilt from the same config and a clone of the same weights before TransformerLens boots
    (hf_util.independent_hf): HF's own forward, sharing no module or storage with the bridge. Never the model the
    bridge wraps, which TL rewires in place (calling that one runs the bridge: bit-equal, a check that cannot fail)."""
    from hf_util import independent_hf
    from transformer_lens.model_bridge import TransformerBridge

    from posprobe.backend import t5_decoder

    t5_decoder.register()  # the decoder-only T5-bias class's adapter (posprobe's; TransformerLens has none)
    cfg, cls = _configs()[name]
    cfg.architectures = [cls.__name__]  # what a saved folder's config says; the bridge picks its adapter by it
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = cls(cfg).eval()
    randomize_(hf, seed)
    reference = independent_hf(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TL warns about name aliases; the weights are the in-memory model
        try:
            bridge = TransformerBridge.boot_transformers(f"posprobe-tiny-{name}", hf_model=hf,
                                                         tokenizer=byte_tokenizer())
        except ValueError as e:
            if "supported architecture" not in str(e):
                raise
            from importlib.metadata import version

            missing_adapter(name, cls.__name__, version("transformer-lens"))
    bridge.cfg.model_name = name
    if cfg.model_type in ("bert", "roberta"):  # encoders read [CLS] ... [SEP]: the byte tokenizer's <bos> / <eos>
        bridge.tokenizer.cls_token, bridge.tokenizer.sep_token = "<bos>", "<eos>"
        bridge.has_lm_head = False  # BertForMaskedLM's head here is random, as a bare encoder's would be
    bridge.eval()
    return bridge, reference
