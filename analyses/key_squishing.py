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
# # Key squishing an instruction (SmolLM2-135M-Instruct)
#
# The instruction sits in the user turn of the chat template. We move its **key** positions to 0 and
# compare two variants, each named for what it does: *keys* (every query, the instruction's own tokens
# included, sees the squished keys; its queries keep their positions) and *cache* (the instruction reads
# itself normally; later tokens see its cached keys at 0). A third, *qk*, puts the instruction's queries at 0
# too (Hugging Face `position_ids` of 0 on its tokens).
# "Effect kept" = (log p(ref | variant) - log p(ref | no instruction)) /
# (log p(ref | instruction) - log p(ref | no instruction)), summed over the reference tokens.

# %%
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import plotly.express as px

from posprobe import load_model
from posprobe.analyses.squish import squish_generate

model = load_model("smollm2")

# %%
result = squish_generate(model, "Always answer in French.", "What is the capital of Italy?", max_new_tokens=8,
                    variant=("keys", "cache"), to=0.0, reference="La capitale de l'Italie est Rome.")
df, meta = result.df, result.meta
for run, text in meta["continuations"].items():
    print(f"{run:>9}: {text!r}")
for v, kept in meta["effect_kept"].items():
    print(f"effect kept ({v}): {kept:.3f}")

# %%
mass = df[df.metric == "attn_mass"]
px.line(mass, x="layer", y="value", color="variant", title="Attention mass from generated tokens onto the instruction")

# %%
# Results go to $POSPROBE_OUT, or a fresh temporary folder: never into the folder the notebook runs from.
OUT = Path(os.environ.get("POSPROBE_OUT") or tempfile.mkdtemp(prefix="posprobe-"))
OUT.mkdir(parents=True, exist_ok=True)
paths = result.save(OUT / "key_squishing")
print(paths["report"])
