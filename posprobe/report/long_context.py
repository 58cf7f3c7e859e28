"""Report page of the long-context harness (`long-context`): loss-vs-position curves per preset with the
trained context marked, a summary table, passkey and needle-task accuracy heatmaps (length x depth) per preset.
Built from the result's tables and meta only."""

from __future__ import annotations

import html
from typing import Any

from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, caption, style


def figure_caption(meta: dict | None) -> str:
    """Caption: model, data, presets, lengths, bin size, trained context."""
    m = meta or {}
    cfg = m.get("config") or {}
    return caption(m, {"presets": cfg.get("presets"), "lengths": cfg.get("lengths"), "bin": cfg.get("bin_size"),
                       "trained context": m.get("trained_ctx")})


def title(result: Any) -> str:
    """Report title."""
    return f"Long context: {result.meta['model']['name']}"


def figures(result: Any) -> list:
    """One loss-vs-position figure per length (presets as lines, the trained context as a dashed line), and
    one accuracy heatmap (length x depth) per preset for the passkey and per task and preset for the needle tasks."""
    import plotly.express as px

    m = result.meta
    ctx = m.get("trained_ctx")
    cap = figure_caption(m)
    df = result.tables["long_context"]
    out = []
    for length, part in df.groupby("length", sort=True):
        fig = px.line(part, x="bin_start", y="value", color="preset", markers=len(part) < 200,
                      title=f"Loss vs position, windows of {length:,} tokens",
                      labels={"value": "NLL (nats/token, bin mean)", "bin_start": "query position (bin start)"},
                      color_discrete_sequence=list(COLORS))
        if ctx and ctx < length:
            fig.add_vline(x=ctx, line_dash="dash", line_color="#555555", annotation_text=f"trained context {ctx:,}")
        out.append(style(fig, caption=cap))
    acc = result.tables.get("passkey_accuracy")
    if acc is not None and len(acc):
        out += [_accuracy_heatmap(part, f"Passkey accuracy: {preset}", "filler", "exact match", cap)
                for preset, part in acc.groupby("preset", sort=False)]
    acc = result.tables.get("needle_accuracy")
    if acc is not None and len(acc):
        out += [_accuracy_heatmap(part, f"{task}: {preset}", "haystack", "string_match_all", cap)
                for (task, preset), part in acc.groupby(["task", "preset"], sort=False)]
    return out


def _accuracy_heatmap(part: Any, title: str, haystack: str, score: str, cap: str) -> Any:
    # Length x depth grid of one preset's (and task's) accuracy, both axes categorical.
    import plotly.express as px

    grid = part.pivot_table(index="length", columns="depth", values="value").sort_index(ascending=False)
    fig = px.imshow(grid, zmin=0, zmax=1, color_continuous_scale="Blues", text_auto=".2f", aspect="auto", title=title,
                    labels={"x": f"depth (fraction of the {haystack} before the needle)", "y": "length (tokens)",
                            "color": score})
    fig.update_yaxes(type="category")
    fig.update_xaxes(type="category")
    return style(fig, caption=cap)


def sections(result: Any) -> list[Section]:
    """Summary (mean loss inside / beyond the trained context, break position; passkey accuracy) and figures."""
    m = result.meta
    s = result.tables["long_context_summary"]
    table = s.pivot_table(index=["preset", "length"], columns="metric", values="value", sort=False,
                          dropna=False).reset_index()
    cfg = m.get("config") or {}
    intro = (f"<p>{m['data']['n_items']} text window(s) from {html.escape(str(m['data']['source']))}; trained "
             f"context {m.get('trained_ctx')} tokens. NLL in nats/token by query position t (predicting token t+1). "
             f"Break position: first bin from position {cfg.get('warmup')} on from which the mean over "
             f"{cfg.get('break_span')} positions exceeds the mean over [{cfg.get('warmup')}, trained context) by "
             f"{cfg.get('margin')} nats (-1: never).</p>")
    beyond = m.get("beyond_context") or {}
    if beyond.get("lengths"):
        lengths = ", ".join(f"{L:,}" for L in beyond["lengths"])
        which = f"length {lengths} is" if len(beyond["lengths"]) == 1 else f"lengths {lengths} are"
        intro += (f"<p>Note: {which} past the model's context of {beyond['context']:,} positions "
                  "(max_position_embeddings).</p>")
    out = [Section("Summary", html=intro + table_html(table))]
    acc = result.tables.get("passkey_accuracy")
    if acc is not None and len(acc):
        by = acc.groupby(["preset", "length"], sort=False).value.mean().unstack("length").reset_index()
        by.columns = [str(c) for c in by.columns]
        out.append(Section("Passkey accuracy (mean over depths)",
                           html="<p>Exact match of the first run of digits in the greedy answer.</p>" + table_html(by)))
    acc = result.tables.get("needle_accuracy")
    if acc is not None and len(acc):
        by = acc.groupby(["task", "preset", "length"], sort=False).value.mean().unstack("length").reset_index()
        by.columns = [str(c) for c in by.columns]
        out.append(Section("Needle accuracy (mean over depths)",
                           html="<p>RULER's string_match_all: the fraction of the expected values found in the greedy "
                                "answer, case-insensitive, averaged over trials.</p>" + table_html(by)))
    out.append(Section("Figures", figures=figures(result)))
    return out
