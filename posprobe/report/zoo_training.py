"""Report page of zoo training (`zoo-train`): the members (family, block, parameters, time, tokens/s, final loss,
what differs beyond positions) and their training curves. Tables and meta only."""

from __future__ import annotations

from typing import Any

from posprobe.report.compare import by_member, compare_caption, line_figure, member_order, table
from posprobe.report.html import Section
from posprobe.report.style import COLORS, caption, style


def title(result: Any) -> str:
    """Report title."""
    return "Zoo training"


def figures(result: Any) -> list:
    """Training loss vs tokens seen, one colour per member, one dash per seed."""
    import plotly.express as px

    df = result.tables["training"]
    fig = px.line(df, x="tokens", y="loss", color="member", line_dash="seed" if df["seed"].nunique() > 1 else None,
                  color_discrete_sequence=list(COLORS), title="Training loss",
                  labels={"loss": "training loss (nats/token, mean of 10 steps)", "tokens": "training tokens"})
    return [style(fig, caption=caption(result.meta, {"steps": (result.meta.get("config") or {}).get("steps")}))]


def sections(result: Any) -> list[Section]:
    """Members table and the training curves."""
    cfg = result.meta.get("config") or {}
    intro = (f"<p>Every member: {cfg.get('n_layers')} blocks of width {cfg.get('d_model')} with {cfg.get('n_heads')} "
             f"heads, trained for {cfg.get('steps')} steps of {cfg.get('batch_size')} x {cfg.get('length')} tokens "
             f"(AdamW, lr {cfg.get('lr')}, {cfg.get('warmup')} warmup steps, cosine decay) on the same tokens in the "
             "same order. Block 'gpt': pre-LayerNorm, GELU MLP, biases; block 'llama': pre-RMSNorm, SwiGLU, no "
             "biases. 'differences' names what else differs from the block's other members.</p>")
    members = result.tables["members"]
    return [Section("Members", html=intro, table=members), Section("Training curves", figures=figures(result))]


# --- the atlas over many models: this analysis's models side by side -----------------------------------------

def compare_section(result: Any) -> Section | None:
    """The atlas over many models' training section: every member's loss curve (mean over seeds, seeds' range).
    None where no model measured it."""
    df = table(result, "training")
    if not len(df):
        return None
    members = table(result, "training_members")
    final = by_member(members, "loss", member_order(result)).sort_values()
    text = ("Final training loss (nats/token, mean of the last 10 steps, mean over seeds): "
            + ", ".join(f"{m} {v:.2f}" for m, v in final.items()) + ".")
    # The caption names the training text, not the text the other sections were measured on.
    trained = {**result.meta, "data": result.meta.get("training_data") or {"source": "the zoo's training text"}}
    fig = line_figure(df, "tokens", "loss", member_order(result), "Training loss", "training tokens",
                      "training loss (nats/token)",
                      compare_caption(result, "Read from the zoo's training folder.", meta=trained))
    return Section("Training", html=f"<p>{text}</p>", figures=[fig])
