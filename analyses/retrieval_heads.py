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
# # Retrieval heads: which heads copy the needle, and what masking them does (SmolLM2-135M-Instruct)
#
# Wu et al. (ICLR 2025) found that a few attention heads do the copying when a model retrieves a fact from its
# context: while the model writes the answer, such a head's strongest attention lies on the needle, on the very
# token being written. `run_retrieval` asks SmolLM2 RULER-style needle questions (a number hidden in a haystack of
# text), records every answer step's attention weights in posprobe's long-context engine, and scores each head:
# the share of the needle's value tokens it copied (retrieval score), its attention on the needle and on the first
# token. Then it zeroes the top-k heads' outputs and, as the control, k random heads, and asks again.
#
# Small defaults (two prompts of 1,024 tokens; about a minute on a laptop CPU). Beyond the trained context, compare
# presets with `posprobe retrieval smollm2 --text wikitext-2/test.txt --length 12288 --preset none --preset
# ntk:scale=2 --preset yarn:scale=2,original=8192 --mask-k 0 --out ret12k` (see the README for timings).

# %%
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import posprobe
from posprobe import load_hf_model
from posprobe.analyses.retrieval import RetrievalConfig, run_retrieval
from posprobe.data import BUILTIN_TEXT, read_text
from posprobe.report.retrieval import summary_text

model, tokenizer = load_hf_model("smollm2")
wiki = Path(posprobe.__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"
if wiki.is_file():
    text, source = read_text(wiki), "WikiText-2 test"
else:  # a fresh checkout has no data folder: the built-in text is the haystack
    text, source = BUILTIN_TEXT, "posprobe built-in text"
print(source)

# %%
config = RetrievalConfig(lengths=(1024,), depths=(0.3, 0.7), tasks=("niah_single_2",), mask_k=(5,), random_draws=2)
result = run_retrieval(model, text, config, tokenizer=tokenizer, source=source)
print(summary_text(result))

# %% [markdown]
# The strongest heads by retrieval score, with their attention on the needle and on the first token while the model
# answers (means over prompts and answer steps):

# %%
heads = result.tables["retrieval_heads"].pivot_table(index=["layer", "head"], columns="metric", values="value")
print(heads.sort_values("retrieval_score", ascending=False).head(10).round(3).to_string())

# %%
masking = result.tables["retrieval_masking"]
print(masking[masking.metric == "string_match_all"][["masked", "n_masked", "draw", "value", "ci_low", "ci_high"]]
      .to_string(index=False))
answers = result.tables["retrieval_answers"]
print(answers[["masked", "draw", "depth", "targets", "answer", "score"]].to_string(index=False))

# %%
figs = result.figures()
figs[0]

# %%
# Results go to $POSPROBE_OUT, or a fresh temporary folder: never into the folder the notebook runs from.
OUT = Path(os.environ.get("POSPROBE_OUT") or tempfile.mkdtemp(prefix="posprobe-"))
OUT.mkdir(parents=True, exist_ok=True)
paths = result.save(OUT / "retrieval")
print(paths["report"])
