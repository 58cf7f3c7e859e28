"""Report pages of key squishing (`squish`) and the surgery loss-by-position evaluation (`surgery-eval`),
built from each result's table and meta only."""

from __future__ import annotations

import html
from typing import Any

from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, caption, style


def figure_caption(meta: dict | None) -> str:
    """Caption of a squish / surgery-eval figure: model, data, plans or presets, window, generation length."""
    m = meta or {}
    cfg = m.get("config") or {}
    if m.get("analysis") == "surgery-eval":
        opts = {"presets": cfg.get("presets"), "window": cfg.get("window"), "windows at most": cfg.get("max_windows")}
    else:
        plans = m.get("plan") or {}
        span = m.get("span")
        opts = {"plans": [f"{v}: {lab}" for v, lab in plans.items()],
                "instruction tokens": f"{span[0]}..{span[1] - 1} of {m.get('n_prompt_tokens')}" if span else None,
                "new tokens": m.get("max_new_tokens"), "temperature": cfg.get("temperature")}
    return caption(m, opts)


def title(result: Any) -> str:
    """Report title."""
    if result.analysis == "surgery-eval":
        return f"Surgery evaluation: {result.meta['model']['name']}"
    return f"Key squishing ({', '.join(result.meta['plan'])}) — {result.meta['model']['name']}"


def figures(result: Any) -> list:
    """squish: attention mass on the instruction by layer, KL per query; surgery-eval: loss vs position."""
    import plotly.express as px

    if result.analysis == "surgery-eval":
        df = result.tables["surgery_eval"]
        curve = df.groupby(["preset", "query_pos"], sort=False).value.mean().reset_index()
        fig = px.line(curve, x="query_pos", y="value", color="preset", title="Loss vs position (mean over windows)",
                      labels={"value": "NLL (nats/token)", "query_pos": "query position"},
                      color_discrete_sequence=list(COLORS))
        return [style(fig, caption=figure_caption(result.meta))]
    df = result.tables["squish"]
    mass = df[df.metric == "attn_mass"]
    kl = df[df.metric == "kl"]
    cap = figure_caption(result.meta)
    f1 = px.line(mass, x="layer", y="value", color="variant", markers=True, color_discrete_sequence=list(COLORS),
                 title="Attention mass from generated tokens onto the instruction span",
                 labels={"value": "fraction of attention (mean over heads)"})
    f1.update_yaxes(rangemode="tozero")
    f1.update_xaxes(dtick=1)
    f2 = px.bar(kl, x="query_pos", y="value", color="variant", barmode="group", color_discrete_sequence=list(COLORS),
                title="KL(baseline ‖ squished) per query position (teacher-forced on the baseline output)",
                labels={"value": "KL (nats)", "query_pos": "query position"})
    return [style(f1, caption=cap), style(f2, caption=cap)]


def sections(result: Any) -> list[Section]:
    """Summary (plans, continuations or mean loss per preset) and the figures."""
    m = result.meta
    if result.analysis == "surgery-eval":
        df = result.tables["surgery_eval"]
        table = df.groupby("preset", sort=False).value.mean().to_frame("mean NLL (nats/token)").reset_index()
        intro = (f"<p>{m['data']['n_items']} windows of {m['config']['window']} tokens from "
                 f"{html.escape(str(m['data']['source']))}.</p>")
        return [Section("Summary", html=intro + table_html(table)), Section("Figures", figures=figures(result))]
    rows = "".join(
        f'<tr><td class="pp-text">{html.escape(v)}</td><td class="pp-text"><pre>{html.escape(t)}</pre></td></tr>'
        for v, t in m["continuations"].items()
    )
    plans = ", ".join(f"{html.escape(v)}: <code>{html.escape(lab)}</code>" for v, lab in m["plan"].items())
    summary = (
        f"<p>Variant(s): <b>{html.escape(', '.join(m['plan']))}</b>; plans {plans}; "
        f"instruction tokens {m['span'][0]}..{m['span'][1] - 1} of {m['n_prompt_tokens']}.</p>"
        f'<div class="pp-table-wrap"><table class="pp-table"><tr><th>run</th><th>continuation</th></tr>{rows}'
        "</table></div>"
    )
    for v, k in m.get("effect_kept", {}).items():
        summary += f"<p>Fraction of the instruction's effect on the reference kept ({html.escape(v)}): {k:.3f}</p>"
    return [Section("Summary", html=summary), Section("Figures", figures=figures(result))]
