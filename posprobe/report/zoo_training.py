"""Report page of zoo training (`zoo-train`): the members (family, block, parameters, time, tokens/s, final loss,
what differs beyond positions) and their training curves. Tables and meta only."""

from __future__ import annotations

from typing import Any

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
