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
# # Per-frequency RoPE usage per head
#
# Which rotary bands (2-D pairs, band 0 = fastest) carry each head's q/k norm and attention score,
# how each band's score contribution depends on relative distance, and what removing bands at
# inference time costs in loss (p-RoPE style "drop the lowest frequencies" vs the reverse).
# Set `POSPROBE_FREQ_MODEL` to run on another model (default: SmolLM2-135M, real weights).

# %%
import os

import torch

from posprobe import load_model, model_facts
from posprobe.analyses.frequency import frequency_usage, top_heads
from posprobe.analyses.frequency_ablation import band_ablation, head_ablations, p_sweep
from posprobe.data import BUILTIN_TEXT, framed_windows
from posprobe.report.frequency import band_head_heatmap, head_band_profile, layer_band_overview, sweep_figure

MODEL = os.environ.get("POSPROBE_FREQ_MODEL", "smollm2")
model = load_model(MODEL)
facts = model_facts(model)
rows = framed_windows(model.tokenizer(BUILTIN_TEXT, add_special_tokens=False)["input_ids"], 48,
                      pre=[model.tokenizer.bos_token_id], max_windows=2)
print(facts.name, "bands per head:", facts.rotary[0].n_bands, "windows:", len(rows), "x", len(rows[0]))

# %% [markdown]
# ## Measurement (one streaming pass)

# %%
with torch.no_grad():
    usage = frequency_usage(model, rows, batch_size=2, progress=False)
usage.df.head()

# %%
# Mean q norm per band over all heads and layers: most norm sits in the slow (high-index) bands?
q = usage.df[usage.df.metric == "q_norm"].groupby("band").value.mean()
print("q_norm, fastest 4 bands:", q.head(4).round(3).tolist(), " slowest 4:", q.tail(4).round(3).tolist())
layer_band_overview(usage.df, "q_norm")

# %%
usage.heads.sort_values("eta2", ascending=False).head(8)

# %%
top = top_heads(usage.heads, 2)
layer, head = top[0]
band_head_heatmap(usage.df, layer, "abs_share")

# %%
head_band_profile(usage.df, layer, head)

# %% [markdown]
# ## Ablation: unrotate bands model-wide (p sweep) and per head

# %%
with torch.no_grad():
    abl = band_ablation(model, rows[:1], p_sweep(facts, ps=(0.5, 0.0)) + head_ablations(facts, top[:1]),
                        batch_size=1, progress=False)
abl[["condition", "bands", "value", "delta_loss"]]

# %%
sweep_figure(abl)
