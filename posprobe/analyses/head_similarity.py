"""Head similarity across models (Kazemnejad et al. 2023, "The Impact of Positional Encoding on Length
Generalization in Transformers", Fig. 4): how alike are the attention patterns of two models' heads on the same
inputs?

For every head h of model A in layer l: the Jensen-Shannon divergence (nats, natural log; 0 for equal
distributions, at most ln 2) between h's attention distribution and that of each head h' of model B in the same layer,
averaged over query positions 1..n-1 (query 0 can only attend to itself, in every head) and over the inputs; then
the minimum over h' ("how close is the nearest head of B"), averaged per layer. Both models read the same token ids,
so they must share a tokenizer (the zoo's members do). Patterns are captured per batch and folded into a
`[heads_a, heads_b]` sum per layer, so memory stays flat in the number of inputs.
"""

from __future__ import annotations

from typing import Any, Sequence

import pandas as pd
import torch

from posprobe.analyses.sections import AtlasSection, CompareRun, ModelEntry, register
from posprobe.backend.facts import model_facts, require_attention_supported
from posprobe.core.capture import capture, check_rows
from posprobe.report import heads as heads_report
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta

__all__ = ["head_similarity", "jsd_sums", "pairwise_jsd_sums", "similarity_frames"]


def _xlogy_ratio(p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # p * log(p / m) with 0 * log 0 = 0; m >= p / 2 > 0 wherever p > 0, so the ratio is finite there.
    return torch.where(p > 0, p * (p.clamp_min(1e-300).log() - m.clamp_min(1e-300).log()), torch.zeros_like(p))


def jsd_sums(pa: torch.Tensor, pb: torch.Tensor) -> torch.Tensor:
    """`[heads_a, heads_b]` float64: the Jensen-Shannon divergence (nats) between every head of `pa` and every head
    of `pb` (`[batch, head, query_pos, key_pos]` attention patterns of the same inputs), summed over the batch and
    over query positions 1..n-1."""
    if pa.shape[0] != pb.shape[0] or pa.shape[2:] != pb.shape[2:]:
        raise ValueError(f"patterns of different inputs: {tuple(pa.shape)} vs {tuple(pb.shape)}")
    a, b = pa[:, :, 1:].double(), pb[:, :, 1:].double()
    out = torch.zeros(a.shape[1], b.shape[1], dtype=torch.float64)
    for i in range(a.shape[0]):  # one input at a time: [ha, hb, q, k] stays small
        p, r = a[i][:, None], b[i][None, :]
        m = (p + r) / 2
        out += (0.5 * (_xlogy_ratio(p, m) + _xlogy_ratio(r, m))).sum(-1).sum(-1).cpu()
    return out


def head_similarity(model_a: Any, model_b: Any, token_rows: Sequence[Sequence[int]] | torch.Tensor, *,
                    layers: Sequence[int] | None = None, batch_size: int = 4) -> Result:
    """Per layer and head of `model_a`, the nearest head of `model_b` by mean Jensen-Shannon divergence (nats) of
    their attention patterns on the same `token_rows`. Raises ValueError before any forward when the models differ
    in depth or vocabulary.

    Args:
        model_a: the TransformerLens model whose heads are matched.
        model_b: the model searched for the nearest head, in the same layer; same depth and vocabulary as
            `model_a`.
        token_rows: the inputs, `[batch, pos]` token ids of equal length (pos >= 2, within both contexts).
        layers: the layers compared (None: all; else a non-empty subset of 0..n_layers-1).
        batch_size: rows per forward pass.

    Returns:
        A Result with tables `head_similarity` (layer, head, nearest_head, jsd_min, jsd_mean: the mean over B's
            heads) and `head_similarity_layer` (layer, jsd_min averaged over A's heads: Kazemnejad et al.'s
            Fig. 4 number); divergences in nats, mean over query positions 1..n-1 and rows.
    """
    fa, fb = model_facts(model_a), model_facts(model_b)
    for f in (fa, fb):  # a pattern posprobe has not proven equal to HF's would give a divergence that means nothing
        require_attention_supported(f, "Head similarity")
    if fa.n_layers != fb.n_layers:
        raise ValueError(f"{fa.name} has {fa.n_layers} layers and {fb.name} {fb.n_layers}: heads are compared "
                         "layer by layer, so the depths must match")
    va, vb = model_a.tokenizer.get_vocab(), model_b.tokenizer.get_vocab()
    if va != vb:
        raise ValueError(f"{fa.name} and {fb.name} have different vocabularies: the same token ids would be "
                         "different inputs")
    rows = check_rows(model_a, token_rows)
    check_rows(model_b, rows)
    layers = list(range(fa.n_layers)) if layers is None else list(layers)
    if not layers or any(not 0 <= layer < fa.n_layers for layer in layers):
        raise ValueError(f"layers must be a non-empty subset of 0..{fa.n_layers - 1}, got {layers}")
    sums = pairwise_jsd_sums([model_a, model_b], rows, layers, pairs=[(0, 1)], batch_size=batch_size)[(0, 1)]
    heads, per_layer = similarity_frames(fa.name, fb.name, sums, rows.shape[0] * (rows.shape[1] - 1))
    meta = make_meta("head-similarity", model=fa.summary(), other=fb.summary(),
                     data=data_meta("token rows", n_items=int(rows.shape[0]), unit="sequences"),
                     config=dict(layers=layers, batch_size=batch_size, length=int(rows.shape[1])),
                     definition="Jensen-Shannon divergence (nats) of attention distributions, mean over query "
                                "positions 1..n-1 and inputs; minimum over the other model's heads in the same layer")
    return Result({"head_similarity": pd.DataFrame(heads), "head_similarity_layer": pd.DataFrame(per_layer)}, meta)



def pairwise_jsd_sums(models: Sequence[Any], rows: torch.Tensor, layers: Sequence[int], *,
                      pairs: Sequence[tuple[int, int]] | None = None, batch_size: int = 4,
                      ) -> dict[tuple[int, int], dict[int, torch.Tensor]]:
    """(i, j) -> layer -> `jsd_sums` of models[i] against models[j] on `rows`, for the ordered `pairs` (default:
    every i != j). Each model runs once per batch and only that batch's patterns are held, so memory stays flat in
    the number of inputs."""
    pairs = [(i, j) for i in range(len(models)) for j in range(len(models)) if i != j] if pairs is None else pairs
    sums: dict[tuple[int, int], dict[int, torch.Tensor]] = {p: {} for p in pairs}
    used = sorted({i for p in pairs for i in p})
    for start in range(0, rows.shape[0], batch_size):
        batch = rows[start:start + batch_size]
        pats = {i: capture(models[i], batch, ["pattern"], layers=list(layers)) for i in used}
        for i, j in pairs:
            for layer in layers:
                got = jsd_sums(pats[i][("pattern", layer)], pats[j][("pattern", layer)])
                sums[(i, j)][layer] = sums[(i, j)].get(layer, 0) + got
    return sums


def similarity_frames(name_a: str, name_b: str, sums: dict[int, torch.Tensor], count: int,
                      ) -> tuple[list[dict], list[dict]]:
    """The rows of `head_similarity` and `head_similarity_layer` (see `head_similarity`) from one pair's
    `pairwise_jsd_sums` over `count` (input, query) positions."""
    heads, per_layer = [], []
    for layer, total in sums.items():
        mean = total / count
        best = mean.min(dim=1)
        for h in range(mean.shape[0]):
            heads.append(dict(model=name_a, other=name_b, layer=layer, head=h, nearest_head=int(best.indices[h]),
                              jsd_min=float(best.values[h]), jsd_mean=float(mean[h].mean())))
        per_layer.append(dict(model=name_a, other=name_b, layer=layer, jsd_min=float(best.values.mean()),
                              count=mean.shape[0]))
    return heads, per_layer


def _across(models: list[ModelEntry], run: CompareRun) -> tuple[dict[str, pd.DataFrame], dict[str, str]]:
    # Every pair of models that read the same token ids with the same depth, on the same windows of the text; the
    # first loaded model's tokenizer cuts them.
    import torch

    from posprobe.analyses.probes import text_rows
    from posprobe.zoo.folder import MEMBER_COLUMNS, member_info

    text, cfg = run.text, run.config
    why: dict[str, str] = {}
    ok: list[ModelEntry] = []
    for m in models:
        if m.model is None:
            why[m.label] = m.why or "not loaded"
            continue
        try:
            require_attention_supported(m.facts, "Head similarity")
        except (ValueError, NotImplementedError) as e:
            why[m.label] = str(e).splitlines()[0]
            continue
        if ok and m.model.tokenizer.get_vocab() != ok[0].model.tokenizer.get_vocab():
            why[m.label] = f"a different vocabulary from {ok[0].label}'s: the same token ids would be different inputs"
            continue
        if ok and m.facts.n_layers != ok[0].facts.n_layers:
            why[m.label] = f"{m.facts.n_layers} layers, {ok[0].label} {ok[0].facts.n_layers}: heads are compared " \
                           "layer by layer"
            continue
        ok.append(m)
    if len(ok) < 2:
        if ok:
            why[ok[0].label] = "no other model to compare with"
        return {}, why
    window = min(cfg.window, *(m.facts.n_ctx for m in ok))
    rows = torch.tensor(text_rows(ok[0].model, text, window, cfg.similarity_windows), dtype=torch.long)
    layers = list(range(ok[0].facts.n_layers))
    sums = pairwise_jsd_sums([m.model for m in ok], rows, layers)
    heads, per_layer = [], []
    for (i, j), s in sums.items():
        h, p = similarity_frames(ok[i].label, ok[j].label, s, rows.shape[0] * (rows.shape[1] - 1))
        heads += h
        per_layer += p
    member = {m.label: member_info(m.label, m.record) for m in ok}
    layer_df = pd.DataFrame(per_layer)
    for col in MEMBER_COLUMNS:
        layer_df[col] = [member[x][col] for x in layer_df["model"]]
        layer_df[f"other_{col}"] = [member[x][col] for x in layer_df["other"]]
    return {"head_similarity": pd.DataFrame(heads), "head_similarity_layer": layer_df}, why


ATLAS_SECTION = register(AtlasSection("similarity", "Head similarity across members", None, None, None, across=_across,
                                      compare_page=heads_report.similarity_section))
