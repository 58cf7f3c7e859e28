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
# # Position probes and position-embedding geometry
#
# How much absolute position does each layer's residual stream carry, and in what shape?
# (Wang & Chen 2020; Haviv et al. 2022.) Linear probes predict a token's absolute position from its
# residual vector, on held-out token rows (GroupKFold by row), next to a control trained on positions
# shuffled within each row and a chance baseline. Then the geometry of W_pos (learned APE) and of the
# per-position mean of the residual stream (RoPE). Set `MODEL` to "minilm" or "smollm2" for real weights;
# the default tiny random models run offline in seconds.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from posprobe import load_model, model_facts
from posprobe.analyses.geometry import residual_geometry, wpos_geometry
from posprobe.analyses.probes import ProbeConfig, fold_summary, position_probes, text_rows
from posprobe.data import BUILTIN_TEXT

MODEL = os.environ.get("POSPROBE_MODEL", "tiny-ape")
model = load_model(MODEL)
rows = text_rows(model, BUILTIN_TEXT, window=64, max_windows=16)
print(MODEL, len(rows), "rows of", len(rows[0]), "tokens")

# %% [markdown]
# ## Probes: held-out MAE (positions) and bucket accuracy, per layer, with control and chance

# %%
result = position_probes(model, rows, ProbeConfig(points=("resid_pre", "resid_post"), max_tokens=800, progress=False))
table = (
    fold_summary(result.df)
    .pivot_table(index=["point", "layer"], columns=["metric", "condition"], values="mean")
    .round(3)
)
table

# %%
for fig in result.figures():
    fig.show()

# %% [markdown]
# ## Geometry of W_pos (learned absolute models) or of the residual stream's positional part

# %%
try:
    geo = wpos_geometry(model, n_components=4)
except ValueError as e:  # WrongModelKind: no W_pos, so look at the residual stream instead
    print(e)
    last = model_facts(model).n_layers - 1
    geo = residual_geometry(model, rows, [last], point="resid_post", skip_first=1, progress=False)
geo.df[geo.df.metric.isin(["explained_variance", "sin_period", "sin_r2"])].pivot_table(
    index="k", columns="metric", values="value")

# %%
for fig in geo.figures()[:3]:
    fig.show()

# %% [markdown]
# ## A RoPE model has no W_pos: the residual-stream view

# %%
rope = load_model("tiny-rope")
rope_rows = text_rows(rope, BUILTIN_TEXT, window=64, max_windows=16)
rgeo = residual_geometry(rope, rope_rows, [0, 1], point="resid_post", skip_first=1, n_components=4, progress=False)
rgeo.df[rgeo.df.metric == "explained_variance"].pivot_table(index="k", columns="layer", values="value")
