# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The positional zoo: matched models that differ only in positions, and how they extrapolate
#
# posprobe trains one small causal LM per positional family — learned absolute, fixed sinusoidal, ALiBi, rotary,
# 25% partial rotary, p-RoPE, NoPE and a RoPE/NoPE hybrid — with the same widths, tokenizer, data order, steps,
# optimiser and seed, each saved as an ordinary Hugging Face folder. Then it asks Press et al.'s (2022) question:
# what happens to perplexity when the evaluation sequences are longer than the training length L?
#
# This notebook trains a *smoke* zoo on posprobe's built-in corpus in about a minute (tiny widths, 150 steps): the
# code path of the README's CPU tier (`posprobe zoo train --text wikitext-2/valid.txt --eval-text
# wikitext-2/test.txt --seed 0 --seed 1 --out reports/zoo-cpu`, ~20 minutes), not its numbers.

# %%
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import posprobe  # noqa: F401
from posprobe.analyses.configs import ExtrapolationConfig
from posprobe.data import builtin_corpus
from posprobe.report.extrapolation import ratio_table
from posprobe.zoo import MEMBERS, ZooConfig, evaluate_zoo, train_zoo

for m in MEMBERS.values():
    print(f"{m.name:11s} {m.family:17s} {m.block:6s} {m.positions}")

# %%
out = Path(tempfile.mkdtemp()) / "zoo"
config = ZooConfig(d_model=64, n_layers=4, n_heads=4, length=64, vocab_size=512, batch_size=8, steps=150,
                   progress=False)
training = train_zoo(config, builtin_corpus(), out)
training.tables["members"][["member", "family", "block", "params", "seconds", "tokens_per_s", "loss"]]

# %%
training.figures()[0]

# %% [markdown]
# Every member folder loads with `AutoModelForCausalLM.from_pretrained` and with every posprobe command:
# `posprobe info <zoo>/nope-s0` names its family.

# %%
from posprobe import load_model, model_facts  # noqa: E402

for name in ("learned", "alibi", "hybrid", "p-rope"):
    print(name, "|", " / ".join(model_facts(load_model(str(out / f"{name}-s0"))).layer_positions))

# %%
result = evaluate_zoo([str(out)], ExtrapolationConfig(factors=(1, 2, 4), max_tokens=2048, progress=False))
ratio_table(result)

# %%
result.figures()[0]
