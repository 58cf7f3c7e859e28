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
# # Long context: loss by position and passkey retrieval per surgery preset (SmolLM2-135M-Instruct)
#
# SmolLM2 was trained on 8,192-token contexts (RoPE base 1e5). Each preset changes how queries and keys are
# rotated: Position Interpolation divides positions by s, NTK-aware scaling raises the base, YaRN interpolates
# the slow bands only and sharpens attention (temperature), Self-Extend groups distant positions.
# `run_long_context` runs the plain Hugging Face model with posprobe's chunked attention (memory linear in
# length) and returns loss by position (binned), a summary (mean loss inside / beyond the trained context,
# break position) and passkey accuracy by length x depth.
#
# The defaults here are small so the notebook runs in a few minutes on a laptop CPU: 1,024-token windows stay
# inside the trained context, so they show what each preset costs *inside* it. For the picture beyond it run
# `posprobe long-context smollm2 --text wikitext-2/test.txt --length 16384 --preset none --preset pi:scale=2
# --preset ntk:scale=2 --preset yarn:scale=2,original=8192 --out lc16k` (see the README for timings).

# %%
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import posprobe
from posprobe import load_hf_model
from posprobe.analyses.long_context import LongContextConfig, run_long_context
from posprobe.data import BUILTIN_TEXT, read_text

model, tokenizer = load_hf_model("smollm2")
wiki = Path(posprobe.__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"
if wiki.is_file():
    text, source = read_text(wiki), "WikiText-2 test"
else:  # a fresh checkout has no data folder: the built-in text, repeated (copying makes later losses low)
    text, source = BUILTIN_TEXT * 20, "posprobe built-in text x 20"
print(source)

# %%
config = LongContextConfig(
    lengths=(1024,),
    presets=("none", "yarn:scale=2,original=8192", "self-extend:group=4,window=256"),
    bin_size=128,
    warmup=128,
    passkey_lengths=(512, 1024),
    depths=(0.0, 1.0),
    trials=1,
)
result = run_long_context(model, text, config, tokenizer=tokenizer, source=source)
summary = result.tables["long_context_summary"]
print(
    summary.pivot_table(index="preset", columns="metric", values="value", sort=False, dropna=False).round(4).to_string()
)

# %%
acc = result.tables["passkey_accuracy"]
print(acc.pivot_table(index=["preset", "length"], columns="depth", values="value", sort=False).to_string())
print(result.tables["passkey"][["preset", "length", "depth", "target", "prediction"]].to_string(index=False))

# %%
figs = result.figures()
figs[0]

# %%
# Results go to $POSPROBE_OUT, or a fresh temporary folder: never into the folder the notebook runs from.
OUT = Path(os.environ.get("POSPROBE_OUT") or tempfile.mkdtemp(prefix="posprobe-"))
OUT.mkdir(parents=True, exist_ok=True)
paths = result.save(OUT / "long_context")
print(paths["report"])
