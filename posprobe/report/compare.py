"""The pieces every side-by-side section of the atlas over many models shares (`posprobe zoo atlas`): its tables, the
member order, a mean with the seeds' range, the refused models in words, one line per member with its seeds' range.
Each analysis's report module draws its own section from these (`compare_section`); `report.zoo_atlas` is the page.
Tables and meta only."""

from __future__ import annotations

import html
from typing import Any

import pandas as pd

from posprobe.report.style import COLORS, caption, style

__all__ = ["by_member", "compare_caption", "layer_name", "line_figure", "member_of", "member_order", "over_seeds",
           "pct", "refused_rows", "refused_text", "seeded", "spread", "table", "unit"]


def table(result: Any, name: str) -> pd.DataFrame:
    """The result's table `name`, or an empty frame."""
    return result.tables.get(name, pd.DataFrame())


def seeded(result: Any) -> bool:
    """Whether the models compared are a zoo's members with seeds (a zoo's words: members, seeds) rather than models
    a user named (models): meta "vocabulary" where the atlas recorded it, else a seed in the models table."""
    said = result.meta.get("vocabulary")
    if said is not None:
        return said == "zoo"
    for name in ("models", "perplexity"):  # the atlas's models; `zoo eval` has its perplexity rows only
        seeds = table(result, name).get("seed")
        if seeds is not None and seeds.notna().any():
            return True
    return False


def unit(result: Any, plural: bool = False) -> str:
    """"member(s)" for a zoo's members, "model(s)" for models a user named."""
    word = "member" if seeded(result) else "model"
    return word + ("s" if plural else "")


def over_seeds(result: Any, text: str = " (mean over seeds)") -> str:
    """`text` where the models have seeds, else an empty string."""
    return text if seeded(result) else ""


def member_order(result: Any) -> list[str]:
    """Members in the order of the models table (zoo members first, as listed, then other models)."""
    return list(dict.fromkeys(table(result, "models").get("member", pd.Series(dtype=str)).astype(str)))


def spread(values: pd.Series, fmt: str = "{:.2f}") -> str:
    """`mean [lowest–highest]` of `values` in `fmt` (one value: itself; none: n/a)."""
    v = values.dropna()
    if not len(v):
        return "n/a"
    if len(v) == 1:
        return fmt.format(v.iloc[0])
    return f"{fmt.format(v.mean())} [{fmt.format(v.min())}–{fmt.format(v.max())}]"


def by_member(df: pd.DataFrame, value: str, order: list[str]) -> pd.Series:
    """Mean of column `value` per member, in `order`."""
    s = df.groupby("member")[value].mean()
    return s.reindex([m for m in order if m in s.index])


def refused_rows(result: Any, section: str) -> pd.DataFrame:
    """The rows of table `refused` for `section`."""
    r = table(result, "refused")
    return r[r.section == section] if len(r) else r


def refused_text(result: Any, section: str) -> str:
    """The models `section` refused, in words (" Not measured — model: why; ...", HTML-escaped), or an empty
    string."""
    r = refused_rows(result, section)
    if not len(r):
        return ""
    parts = [f"{html.escape(', '.join(g.model))}: {html.escape(why)}" for why, g in r.groupby("why", sort=False)]
    return " Not measured — " + "; ".join(parts) + "."


def pct(v: Any) -> str:
    """A fraction as a whole percentage, or n/a."""
    return "n/a" if v is None or v != v else f"{v:.0%}"


def line_figure(df: pd.DataFrame, x: str, y: str, order: list[str], title: str, xlab: str, ylab: str, cap: str,
                 log_y: bool = False) -> Any:
    """One line per member (mean over its seeds) of `y` against `x`, its seeds' range as error bars."""
    import plotly.graph_objects as go

    fig = go.Figure()
    g = df.groupby(["member", x])[y].agg(["mean", "min", "max", "count"]).reset_index()
    for i, name in enumerate(m for m in order if m in set(g.member)):
        line = g[g.member == name].sort_values(x)
        fig.add_trace(go.Scatter(x=line[x], y=line["mean"], name=name, mode="lines+markers",
                                 line=dict(color=COLORS[i % len(COLORS)], dash="solid" if i < len(COLORS) else "dot"),
                                 error_y=dict(type="data", symmetric=False, array=line["max"] - line["mean"],
                                              arrayminus=line["mean"] - line["min"],
                                              visible=bool((line["count"] > 1).any()))))
    fig.update_layout(title=title, xaxis_title=xlab, yaxis_title=ylab)
    if log_y:
        fig.update_yaxes(type="log")
    return style(fig, caption=cap)


def compare_caption(result: Any, note: str, *, meta: dict | None = None, **options: Any) -> str:
    """The caption of a side-by-side figure: the result's (or `meta`'s) data and options, `note`, and how the seeds
    are drawn."""
    # `meta`: the record the caption names in place of the result's own (the training figure's training text).
    seeds = over_seeds(result, " Lines: mean over seeds; bars: lowest and highest seed.")
    return caption(meta or result.meta, options, note=note + seeds)


def layer_name(layer: int) -> str:
    """"at the embedding" for layer -1, else "after layer l"."""
    return "at the embedding" if layer < 0 else f"after layer {layer}"


def member_of(result: Any, model: str) -> str:
    """The member of the model labelled `model` (its label outside a zoo)."""
    m = table(result, "models")
    got = m[m.model == model].member
    return str(got.iloc[0]) if len(got) else model
