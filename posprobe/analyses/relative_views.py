"""Two views of relative position per head of a learned-position model's first layer, side by side.

The attention pattern's view (`heads`): `relative_r2`, the share of the pattern's variance explained by the offset
i - j alone. The score decomposition's view (`decompose`): the position x position term's share of variance
explained by the offset (`rel_pos_fraction`, term `pp`) and the share of the score's (row-centred) variance carried
by the terms with a position part (`var_share`, term `positional`). A head can be relative in its scores' position
term and not in its pattern (the word terms dominate the softmax), or the reverse (a pattern that follows the offset
through content); the table lets a reader see which.

Layer 0 only, where the split into word and position parts is exact (`decompose_layer0`). Later layers have only
the data-driven split, whose positional part is the corpus mean of the residual stream at each position: from the
atlas's few windows (a handful of tokens per position) that mean is mostly content, and the comparison would be
noise (`posprobe decompose --layer L` with a large corpus).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from posprobe.analyses.decompose import decompose_layer0, head_summary
from posprobe.backend.facts import model_facts

__all__ = ["relative_views", "disagreements", "TERM_RELATIVE", "TERM_POSITIONAL"]

#: A head's position x position score term counts as relative when the offset explains at least this share of it.
TERM_RELATIVE = 0.5
#: ... and as mattering when the position terms carry at least this share of the score's variance.
TERM_POSITIONAL = 0.3


def relative_views(model: Any, rows: torch.Tensor, heads: pd.DataFrame) -> pd.DataFrame:
    """Per layer-0 head: `relative_r2` of the pattern (from the `heads` table of `run_heads`, term `pattern`), the
    `pp` term's `rel_pos_fraction` and the position terms' `var_share` (term `positional`) from the exact layer-0
    decomposition of `rows` (`[batch, pos]` token ids). Tidy: model, layer, head, term, metric, value (shares)."""
    facts = model_facts(model)
    if facts.family is None or not facts.family.learned_table:
        raise ValueError(f"relative views compare a learned position table's two views; {facts.name} uses "
                         f"{facts.positional_kind} positions")
    s = head_summary(decompose_layer0(model, torch.as_tensor(rows)))
    terms = s[((s.term == "pp") & (s.metric == "rel_pos_fraction")) | ((s.term == "positional")
                                                                        & (s.metric == "var_share"))]
    pattern = heads[(heads.metric == "relative_r2") & (heads.layer == 0)].assign(term="pattern")
    cols = ["layer", "head", "term", "metric", "value"]
    table = pd.concat([pattern[cols], terms[cols]], ignore_index=True)
    table.insert(0, "model", facts.name)
    table = table.astype({"layer": int, "head": int, "value": float})
    return table.sort_values(["layer", "head", "term"], kind="stable").reset_index(drop=True)


def disagreements(table: pd.DataFrame, pattern_threshold: float) -> dict[str, list[tuple[int, int, float, float]]]:
    """Heads by view: `term` = position term relative (rel_pos_fraction >= TERM_RELATIVE) and mattering (var_share
    >= TERM_POSITIONAL); `pattern` = relative_r2 > `pattern_threshold`; `both`, `term_only`, `pattern_only`, each as
    (layer, head, pp rel_pos_fraction, pattern relative_r2), strongest term first."""
    w = table.pivot_table(index=["layer", "head"], columns=["term", "metric"], values="value")
    pp, share, pat = w[("pp", "rel_pos_fraction")], w[("positional", "var_share")], w[("pattern", "relative_r2")]
    term = (pp >= TERM_RELATIVE) & (share >= TERM_POSITIONAL)
    patt = pat > pattern_threshold

    def heads_where(mask: pd.Series) -> list[tuple[int, int, float, float]]:
        got = [(int(l), int(h), float(pp[(l, h)]), float(pat[(l, h)])) for l, h in mask[mask].index]
        return sorted(got, key=lambda x: (-x[2], x[0], x[1]))

    return {"term": heads_where(term), "pattern": heads_where(patt), "both": heads_where(term & patt),
            "term_only": heads_where(term & ~patt), "pattern_only": heads_where(patt & ~term)}
