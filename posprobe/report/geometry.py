"""Figures and report page of the position geometry (W_pos and residual-stream views), from the table only."""

from __future__ import annotations

import html
from types import SimpleNamespace
from typing import Any

import pandas as pd

from posprobe.report.compare import refused_text, table
from posprobe.report.html import Section, table_html
from posprobe.report.style import COLORS, REFERENCE_COLOR, caption, style


def title(result: Any) -> str:
    """Report title."""
    return f"Position geometry: {result.meta['model']['name']}"


def figures(result: Any) -> list:
    """Per view and layer: PCA trajectory, PCs vs position, cosine map, norm by position."""
    return geometry_figures(result.tables["geometry"], result.meta)


def figure_caption(meta: dict | None, view: str = "") -> str:
    """Caption of a geometry figure: model, data, view, capture point, positions skipped, components."""
    m = meta or {}
    cfg = m.get("config") or {}
    opts = {"view": view or None, "point": cfg.get("point"), "positions": m.get("n_pos"),
            "first positions skipped": cfg.get("skip_first"), "components": cfg.get("components")}
    return caption(m, opts)


def sections(result: Any) -> list[Section]:
    """Summary (explained variance, sinusoid fits per component) and the figures."""
    df = result.tables["geometry"]
    sin = df[df.metric.isin(["explained_variance", "sin_period", "sin_r2"])]
    sin = sin.assign(layer=sin["layer"].astype("string").fillna("-"))  # W_pos has no layer
    table = sin.pivot_table(index=["source", "layer", "k"], columns="metric", values="value").reset_index()
    table["k"] = table["k"].astype(int) + 1  # principal components are numbered from 1 in words
    table = table.rename(columns={"source": "view", "k": "component", "explained_variance": "explained variance",
                                  "sin_period": "sinusoid period (positions)", "sin_r2": "sinusoid R²"})
    skip = result.meta.get("config", {}).get("skip_first", 0)
    summary = ("<p>Residual view: mean of the residual stream at each position over the rows (content averages "
               f"out), positions from {skip}. Sinusoid fit of each principal component's score against "
               "position: period in positions, R&sup2; of the fit (a period at the search bound, 4x the span, means a "
               "monotonic component with no full cycle).</p>")
    out = [Section("Summary", html=summary + table_html(table)), Section("Figures", figures=figures(result))]
    overlap = result.tables.get("pos_token_subspace")
    if overlap is not None and len(overlap):
        wide = overlap.pivot_table(index="k", columns="metric", values="value").reset_index().round(4)
        out.append(Section("Add or concatenate? The position table against the token embeddings",
                           html=f"<p>{html.escape(overlap_text(result))}</p>", table=wide,
                           figures=[overlap_figure(overlap, result.meta)]))
    return out


def overlap_text(result: Any) -> str:
    """One sentence on whether the learned position table shares the token embeddings' principal directions ("" when
    the result has no `pos_token_subspace` table): at the smallest k whose top-k directions hold 90% of the table's
    variance (the largest k if none does), its share in the tokens' top-k subspace against a random subspace's."""
    df = result.tables.get("pos_token_subspace")
    if df is None or not len(df):
        return ""
    w = df.pivot_table(index="k", columns="metric", values="value", dropna=False).sort_index()
    if w.pos_share_in_token.isna().all():
        return ("Add or concatenate? Not measurable: the position table or the token embeddings are constant (no "
                "variance, e.g. untrained weights).")
    enough = w[w.pos_own_share >= 0.9]
    k = int(enough.index[0]) if len(enough) else int(w.index[-1])
    r = w.loc[k]
    rel = r.pos_share_in_token / r.random_share
    verdict = ("positions and tokens sit in nearly separate directions: summing learned something close to a "
               "concatenation" if rel < 0.5 else "positions share the token embeddings' main directions: summed and "
               "mixed" if rel > 2 else "positions fall in the token embeddings' main directions as often as a random "
               "subspace would")
    return (f"Add or concatenate? The top {k} principal directions of the position table hold {r.pos_own_share:.0%} "
            f"of its variance; the token embeddings' top {k} directions hold {r.pos_share_in_token:.1%} of it, "
            f"against {r.random_share:.1%} for a random {k}-dimensional subspace (smallest principal angle "
            f"{r.angle_min:.0f} degrees): {verdict}.")


def overlap_figure(df: pd.DataFrame, meta: dict | None = None) -> Any:
    """Share of the position table's variance inside the token embeddings' top-k subspace (and the converse) vs k,
    against a random subspace's k / d_model."""
    import plotly.graph_objects as go

    w = df.pivot_table(index="k", columns="metric", values="value").sort_index()
    fig = go.Figure()
    for metric, name, dash in (("pos_share_in_token", "position table in the tokens' top-k subspace", "solid"),
                               ("token_share_in_pos", "token embeddings in the positions' top-k subspace", "solid"),
                               ("random_share", "a random k-dimensional subspace (k / d_model)", "dot")):
        fig.add_trace(go.Scatter(x=w.index, y=w[metric], name=name, mode="lines+markers", line=dict(dash=dash)))
    fig.update_layout(title="Add or concatenate? Variance shared by the position table and the token embeddings",
                      xaxis_title="k (subspace dimension)", yaxis_title="share of variance", xaxis_type="log")
    return style(fig, caption=figure_caption(meta, "W_pos vs W_E"))


#: Positions per axis of a cosine map drawn in a report (larger maps are shown at every k-th position).
MAP_POSITIONS = 256


def geometry_figures(df: pd.DataFrame, meta: dict | None = None) -> list:
    """Plotly figures per (source, layer): 3-D PCA trajectory coloured by position, PCs vs position,
    cosine map, norm by position, explained variance."""
    import plotly.graph_objects as go

    figs = []
    for (source, layer), g in df.groupby(["source", df["layer"].fillna(-1)], sort=False):
        tag = source if layer == -1 else f"{source}, layer {layer}"
        cap = figure_caption(meta, tag)
        start = len(figs)
        sc = g[g.metric == "pc_score"].pivot(index="pos", columns="k", values="value")
        ev = g[g.metric == "explained_variance"].set_index("k")["value"]
        if sc.shape[1] >= 3:
            fig = go.Figure(go.Scatter3d(x=sc[0], y=sc[1], z=sc[2], mode="lines+markers", text=sc.index,
                                         marker=dict(size=3, color=sc.index, colorscale="Viridis", showscale=True,
                                                     colorbar=dict(title="pos"))))
            fig.update_layout(title=f"PCA trajectory ({tag})", scene=dict(
                xaxis_title=f"PC1 ({ev[0]:.0%})", yaxis_title=f"PC2 ({ev[1]:.0%})", zaxis_title=f"PC3 ({ev[2]:.0%})"))
            figs.append(fig)
        if sc.shape[1] >= 2:
            figs.append(go.Figure(go.Scatter(x=sc[0], y=sc[1], mode="lines+markers", text=sc.index, marker=dict(
                color=sc.index, colorscale="Viridis", showscale=True, colorbar=dict(title="pos")))).update_layout(
                title=f"PC1 vs PC2 ({tag})", xaxis_title="PC1", yaxis_title="PC2"))
        per = g[g.metric == "sin_period"].set_index("k")["value"]
        r2 = g[g.metric == "sin_r2"].set_index("k")["value"]
        fig = go.Figure(
            [
                go.Scatter(
                    x=sc.index,
                    y=sc[k],
                    mode="lines",
                    name=f"PC{k + 1} ({ev[k]:.0%}; period {per[k]:.1f}, R² {r2[k]:.2f})",
                )
                for k in sc.columns
            ]
        )
        figs.append(fig.update_layout(title=f"Principal components vs position ({tag})", xaxis_title="position"))
        cos = g[g.metric == "cosine"].pivot(index="pos", columns="pos2", values="value")
        # The page shows at most MAP_POSITIONS positions per axis, as float32 (plotly embeds arrays as binary: a
        # 256 x 256 float64 map was 0.9 MB of HTML, four of them half a MiniLM atlas); the table keeps every value.
        step = -(-len(cos) // MAP_POSITIONS)
        cos = cos.iloc[::step, ::step]
        every = f", every {step} positions" if step > 1 else ""
        figs.append(go.Figure(go.Heatmap(z=cos.values.astype("float32"), x=cos.columns, y=cos.index,
                                         colorscale="RdBu", zmid=0))
                    .update_layout(title=f"Cosine similarity between positions ({tag}{every})", xaxis_title="position",
                                   yaxis_title="position", yaxis_autorange="reversed"))
        nm = g[g.metric == "norm"]
        figs.append(go.Figure(go.Scatter(x=nm.pos, y=nm.value, mode="lines")).update_layout(
            title=f"Norm by position ({tag})", xaxis_title="position", yaxis_title="L2 norm"))
        for fig in figs[start:]:
            style(fig, caption=cap)
    return figs


def atlas_paragraph(result: Any, n: Any) -> str:
    """The atlas's geometry section in words: the position table's first component, and the add-or-concatenate
    overlap with the token embeddings."""
    pc1 = n("wpos_pc1_explained")
    sentence = overlap_text(result.parts["geometry"])
    extra = " " + sentence if sentence else ""
    return (f"The first principal component of the learned position table explains {pc1:.0%} of its variance; "
            "the report shows the trajectory of positions in the top components and their sinusoid fits."
            + extra if pc1 is not None else "Residual-stream position geometry (see the section report).")


# --- the atlas over many models: this analysis's models side by side -----------------------------------------

def compare_section(result: Any) -> Section | None:
    """The atlas over many models' geometry section: the position table's variance inside the tokens' top-k
    subspace, per model. None where no model measured it."""
    import plotly.graph_objects as go

    t = table(result, "pos_token_subspace")
    if not len(t):
        return None
    fig = go.Figure()
    sentences = []
    for i, (model, g) in enumerate(t.groupby("model", sort=False)):
        w = g.pivot_table(index="k", columns="metric", values="value").sort_index()
        fig.add_trace(go.Scatter(x=w.index, y=w["pos_share_in_token"], name=str(model), mode="lines+markers",
                                 line=dict(color=COLORS[i % len(COLORS)])))
        if i == 0:
            fig.add_trace(go.Scatter(x=w.index, y=w["random_share"], name="random subspace (k / d_model)",
                                     mode="lines", line=dict(color=REFERENCE_COLOR, dash="dot")))
        one = SimpleNamespace(tables={"pos_token_subspace": g})  # overlap_text reads a result's tables
        sentences.append(f"<b>{html.escape(str(model))}</b>: {html.escape(overlap_text(one))}")
    fig.update_layout(title="Add or concatenate? The position table's variance inside the tokens' top-k subspace",
                      xaxis_title="k (subspace dimension)", yaxis_title="share of the table's variance",
                      xaxis_type="log")
    fig = style(fig, caption=caption(result.meta, None, note="Below the random line: positions avoid the tokens' "
                                                             "main directions (a learned concatenation)."))
    return Section("Add or concatenate?", html="<p>" + " ".join(sentences) + refused_text(result, "geometry") + "</p>",
                   figures=[fig])
