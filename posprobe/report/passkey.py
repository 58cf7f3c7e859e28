"""The atlas over many models' passkey section (`posprobe zoo atlas --sections passkey`): per member trained with the
skill, Chen et al.'s effective window and passkey success by distance, side by side. Tables and meta only."""

from __future__ import annotations

from typing import Any

from posprobe.report.compare import compare_caption, line_figure, member_order, refused_text, spread, table
from posprobe.report.html import Section


def _rate(g: Any, side: str) -> str:
    # One seed: the rate with its 95 % Wilson interval over the trials pooled there; several: mean [lowest-highest].
    col = f"success_{side}_L"
    if len(g) == 1 and f"{col}_low" in g and g[f"{col}_low"].notna().all():
        r = g.iloc[0]
        return f"{r[col]:.2f} (95 % CI {r[col + '_low']:.2f}–{r[col + '_high']:.2f})"
    return spread(g[col])


def compare_section(result: Any) -> Section | None:
    """Per member (mean over seeds [lowest–highest]): the effective window in tokens and as a multiple of L, the mean
    success within and beyond L (one seed: with its 95 % Wilson interval), and success by distance as one line per
    member. None where no model measured it."""
    w = table(result, "passkey_window")
    if not len(w):
        refused = refused_text(result, "passkey")
        return Section("Passkey retrieval and the effective window", html=f"<p>{refused.strip()}</p>") \
            if refused else None
    order = member_order(result)
    parts = []
    for name in [m for m in order if m in set(w.member)]:
        g = w[w.member == name]
        parts.append(f"{name} {spread(g['effective_window'], '{:.0f}')} tokens "
                     f"({spread(g['window_over_L'])} L; success within L {_rate(g, 'within')}, "
                     f"beyond {_rate(g, 'beyond')})")
    text = ("Chen et al.'s effective window (the longest distance with at least 20 % exact greedy answers there and at "
            "every shorter distance), mean over seeds: " + "; ".join(parts) + "." + refused_text(result, "passkey"))
    pk = table(result, "passkey")
    pk = pk[pk.status == "ok"]
    fig = line_figure(pk, "distance", "success_rate", order, "Passkey success by distance",
                      "key-to-answer distance (tokens)", "exact greedy answers",
                      compare_caption(result, "The same prompts for every member: the key at the distance before the "
                                              "answer, the needle first."))
    return Section("Passkey retrieval and the effective window", html=f"<p>{text}</p>", figures=[fig])
