"""Report page of emergence over training (`zoo-emergence`): each positional metric against the training tokens seen,
one line per member and seed, and the models measured. Tables and meta only."""

from __future__ import annotations

from typing import Any

from posprobe.report.html import Section
from posprobe.report.style import COLORS, caption, style

#: Each metric's panel title (the page's intro and docs/zoo.md say what each is, with units).
METRICS = {
    "sink_share_random": "Sink_1^0.3, random tokens",
    "sink_share_text": "Sink_1^0.3, text",
    "massive_ratio": "top |activation| / layer median",
    "shift_accuracy_k0": "pair accuracy at k 0",
}


def title(result: Any) -> str:
    """Report title."""
    return "Emergence over training"


def _described(metric: str) -> str:
    if metric in METRICS:
        return METRICS[metric]
    if metric.startswith("heads_"):
        return f"{metric[6:].replace('_', '-')} heads"
    if metric.startswith("shift_drop_k"):
        return f"pair accuracy drop, k 0 to {metric[12:]}"
    return metric


def figures(result: Any) -> list:
    """One small plot per metric: its value against training tokens, a colour per member, a dash per seed."""
    import plotly.express as px

    df = result.tables["emergence"]
    if not len(df):
        return []
    x = "tokens" if df["tokens"].notna().all() else "step"
    df = df.assign(seed=df["seed"].astype(str), metric=df["metric"].map(_described))
    fig = px.line(df.sort_values(x), x=x, y="value", color="member",
                  line_dash="seed" if df["seed"].nunique() > 1 else None, facet_col="metric", facet_col_wrap=2,
                  facet_row_spacing=0.06, markers=True, color_discrete_sequence=list(COLORS),
                  title="Positional metrics over training",
                  labels={"tokens": "training tokens", "step": "training step", "value": ""})
    fig.update_yaxes(matches=None, showticklabels=True)
    fig.update_xaxes(showticklabels=True)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    rows = (df["metric"].nunique() + 1) // 2
    return [style(fig, height=max(380, 240 * rows), caption=caption(result.meta, {"sections": ", ".join(
        result.meta.get("sections") or [])}))]


def sections(result: Any) -> list[Section]:
    """The metrics over training, then the models measured and what was refused."""
    intro = ("<p>Every checkpoint measured with the atlas's own sections (the same windows and seeds as "
             "<code>zoo atlas</code>), one number per metric. A zoo member's checkpoints are the folders "
             "<code>zoo train --save-every K</code> saved (step 0 included) and the member itself at its last step; "
             "a hub model's are its revisions (<code>MODEL@step&lt;N&gt;</code>), whose tokens are the step times "
             "<code>--tokens-per-step</code>. Sink_1^0.3: the share of (sequence, layer, head) whose mean attention on "
             "the first token exceeds 0.3 (Gu et al. 2025); top |activation| / layer median: the largest residual "
             "activation against its layer's median, on random tokens (Sun et al. 2024 call ~1,000 massive); heads: "
             "how many heads hold each class of <code>posprobe heads</code>; pair accuracy: minimal pairs at "
             "position 0, and its drop with the sentences started at the largest k (Sinha et al. 2022).</p>")
    out = [Section("Metrics over training", html=intro, figures=figures(result),
                   table=result.tables["emergence"])]
    out.append(Section("Models", table=result.tables["models"]))
    refused = result.tables.get("refused")
    if refused is not None and len(refused):
        out.append(Section("Not measured", table=refused))
    return out
