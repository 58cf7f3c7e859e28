"""One name, one number: the same model and windows give the same value for the same name in every command."""

from __future__ import annotations

import numpy as np

from posprobe.analyses.configs import AtlasConfig, FrequencyConfig, HeadsConfig
from posprobe.report.schema import COLUMNS

TEXT = "The harbour town woke slowly on winter mornings, and the boats came back before sunrise. " * 40
SHARED = ("self_mass", "prev_mass", "first_mass")


def _heads_wide(result):
    return result.tables["heads"].pivot_table(index=["layer", "head"], columns="metric", values="value")


def test_heads_frequency_and_atlas_agree_on_shared_names(tiny_rope):
    # `first_mass` averaged over every query in heads (query 0 always attends to itself: +1/n) and over queries 1..
    # in freq-report; frequency's `diag_mass` was heads' `self_mass`. Now one definition, one number, to 1e-12.
    from posprobe.analyses.atlas import run_atlas
    from posprobe.analyses.frequency import run_frequency
    from posprobe.analyses.heads import run_heads

    w, nw = 32, 3
    heads = _heads_wide(run_heads(tiny_rope, TEXT, HeadsConfig(window=w, max_windows=nw, induction_len=0,
                                                              progress=False)))
    freq = run_frequency(tiny_rope, TEXT, FrequencyConfig(window=w, max_windows=nw, queries=None, ablate=False,
                                                          progress=False)).tables["heads"].set_index(["layer", "head"])
    atlas = run_atlas(tiny_rope, TEXT, AtlasConfig(window=w, max_windows=nw, sections=("heads", "frequency"),
                                                   induction_len=0, progress=False))
    in_atlas = _heads_wide(atlas.parts["heads"])
    for name in SHARED:
        a, b = heads[name].sort_index().to_numpy(), freq[name].sort_index().to_numpy()
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(in_atlas[name].sort_index().to_numpy(), a, rtol=0, atol=1e-12, err_msg=name)
    assert (heads["first_mass"] < 1).all()  # query 0's forced self-attention is not in it


def test_every_metric_and_column_name_has_one_written_definition():
    from posprobe.analyses.heads import METRICS as HEAD_METRICS
    from posprobe.report.schema import METRICS

    assert not [m for m in HEAD_METRICS if m not in METRICS]
    for name in (*SHARED, "eta2", "fast_share", "kind"):  # the frequency report's per-head columns
        assert name in COLUMNS
    for name in set(METRICS) & set(COLUMNS):
        assert METRICS[name] == COLUMNS[name], f"{name} is defined twice, differently"
