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
from posprobe import evaluate_zoo
from posprobe.analyses.configs import ExtrapolationConfig
from posprobe.data import builtin_corpus
from posprobe.report.extrapolation import ratio_table
from posprobe.zoo import MEMBERS, ZooConfig, train_zoo

for m in MEMBERS.values():
    print(f"{m.name:11s} {m.family:17s} {m.block:6s} {m.positions}")

# %%
# Training steps of the smoke zoo and of the task members (the test suite runs every cell with fewer).
STEPS = int(os.environ.get("POSPROBE_ZOO_STEPS", "150"))
TASK_STEPS = int(os.environ.get("POSPROBE_ZOO_TASK_STEPS", "300"))
out = Path(tempfile.mkdtemp()) / "zoo"
config = ZooConfig(d_model=64, n_layers=4, n_heads=4, length=64, vocab_size=512, batch_size=8, steps=STEPS,
                   progress=False)
training = train_zoo(config, builtin_corpus(), out)
training.tables["members"][["member", "family", "block", "params", "seconds", "tokens_per_s", "loss"]]

# %%
training.figures()[0]

# %% [markdown]
# Every member folder loads with `AutoModelForCausalLM.from_pretrained` and with every posprobe command:
# `posprobe info <zoo>/nope-s0` names its family. (The t5 member's class, Pix2Struct's text decoder, has no causal-LM
# auto class of its own: posprobe registers it when it loads one; `Pix2StructTextModel.from_pretrained` works anywhere.)

# %%
from posprobe import load_model, model_facts  # noqa: E402

for name in ("learned", "alibi", "hybrid", "p-rope", "t5"):
    print(name, "|", " / ".join(model_facts(load_model(str(out / f"{name}-s0"))).layer_positions))

# %%
result = evaluate_zoo([str(out)], ExtrapolationConfig(factors=(1, 2, 4), max_tokens=2048, progress=False))
ratio_table(result)

# %%
result.figures()[0]

# %% [markdown]
# ## Inside the zoo: every analysis on every member
#
# `run_zoo_atlas` (`posprobe zoo atlas DIR`) runs the shift test, position probes per layer, head classes, head
# similarity across members (Kazemnejad et al.'s Fig. 4), sinks, add-or-concatenate, the score decomposition and RoPE
# frequency usage on every member with the same text, and says for every (model, section) it skips why. Here four
# sections, bounded for the smoke zoo.

# %%
from posprobe import ZooAtlasConfig, run_zoo_atlas  # noqa: E402
from posprobe.report.zoo_atlas import headline_table, similarity_matrix  # noqa: E402

atlas = run_zoo_atlas([str(out)], ZooAtlasConfig(sections=("shift", "probes", "similarity", "sinks"), window=48,
                                                 ks=(0, 8, 16), max_windows=4, probe_tokens=600, progress=False))
headline_table(atlas)

# %%
similarity_matrix(atlas.tables["head_similarity_layer"]).round(3)

# %% [markdown]
# ## Synthetic tasks (Kazemnejad et al. 2023)
#
# `train_task_zoo` (`posprobe zoo tasks --out DIR`) trains every member on copy, reverse, addition and sorting at
# instance lengths 1..L and measures exact-answer accuracy up to 3L. A smoke run: two members, two tasks, 300 steps.

# %%
from posprobe.report.zoo_tasks import accuracy_table  # noqa: E402
from posprobe.zoo import TaskConfig, train_task_zoo  # noqa: E402

tasks = train_task_zoo(ZooConfig(members=("nope", "rope"), d_model=64, n_layers=2, n_heads=4, steps=TASK_STEPS,
                                 progress=False),
                       TaskConfig(tasks=("copy", "reverse"), train_max=4, test_count=16, steps=TASK_STEPS),
                       Path(tempfile.mkdtemp()) / "tasks")
accuracy_table(tasks)

# %%
tasks.figures()[0]
