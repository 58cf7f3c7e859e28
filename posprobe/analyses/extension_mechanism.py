"""The mechanism of context extension, per method (`zoo extend`): Chen et al.'s argument (Position Interpolation,
Theorem 2.1) is about the attention score as a function of query-key distance, a(s) = Re sum_j h_j e^{i s theta_j},
with h_j a head's mean per-band score contribution. For every member before extension (trained at L, looked at up to
L') and after each method (trained at L', looked at up to 2L'), the frequency pass measures each head's h_j on the
model's own rotation (a PI member's theta_j / s, an NTK or ABF member's new base, YaRN's ramp) and
`chen_bounds.head_bounds` turns them into a(s)'s range inside the trained length, how far it leaves that range
beyond it, and Chen's two bounds; the per-band usage (share of |q.k| per band) shows which bands the fine-tune
re-learned; `previous_token` holds each head's mean attention from position i to i - 1 on windows of the member's
trained length L (the heads analysis' `prev_mass`): the copy circuit behind passkey retrieval reads the token
before the key, and PI, which divides offset 1 by s, blurs it. A member the frequency pass does not apply to
(DroPE: no rotation left; the non-rotary controls) is a row of `mechanism_refused` with posprobe's reason. Beside
it, YaRN's temperature rationale: attention entropy against length (`entropy_table`), per layer at L, L' and 2L' for
every model, controls included. Units: scores in
pre-softmax logits, entropy in nats, lengths in tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from posprobe.analyses.configs import FrequencyConfig

__all__ = ["MECHANISM_COLUMNS", "PREVIOUS_TOKEN_WINDOWS", "Looked", "attention_entropy", "entropy_table", "looked_at",
           "mechanism_tables", "previous_token_frame", "uniform_entropy"]

#: The theory columns kept per head (`chen_bounds.head_bounds`).
MECHANISM_COLUMNS = ("layer", "head", "attention", "h_max", "h_max_typical", "a_in_min", "a_in_max", "a_out_min",
                     "a_out_max", "excess", "interpolation_bound", "extrapolation_bound", "interpolation_safe",
                     "extrapolation_leaves_range", "theory_context", "theory_target")
#: Windows of the eval text each frequency pass reads (the h_j are means over query-key pairs: a few windows do).
MECHANISM_WINDOWS = 4
#: Windows of L tokens the previous-token attention is averaged over (a mean over queries: cheap, so more windows).
PREVIOUS_TOKEN_WINDOWS = 16


@dataclass(frozen=True)
class Looked:
    """One model the mechanism looks at: its member, seed and method ("unextended" before extension), its folder, the
    length it was trained at (`context`) and how far a(s) is followed (`target`), in tokens."""

    member: str
    seed: int
    method: str
    folder: Path
    context: int
    target: int


def mechanism_tables(looked: list[Looked], text: str, *, device: str = "cpu", max_windows: int = MECHANISM_WINDOWS,
                     previous_length: int | None = None) -> dict[str, pd.DataFrame]:
    """Per model of `looked`: tables `mechanism` (one row per head: MECHANISM_COLUMNS with member, seed, method),
    `band_usage` (share of |q.k| per band, mean over heads, with the band's angular frequency in radians per token),
    `previous_token` (per head, `prev_attention`: mean attention from i to i - 1 over queries 1..n-1 of
    PREVIOUS_TOKEN_WINDOWS windows of `previous_length` tokens, the same length for every model so that the members
    before and after extension are compared on one footing; left out when None) and `mechanism_refused` (member,
    seed, method, why). Each model is scored on windows of its own trained length (at most what `text` holds) and
    released before the next loads."""
    from posprobe.analyses.frequency import run_frequency
    from posprobe.backend.loading import load_model

    heads, usage, previous, refused = [], [], [], []
    for m in looked:
        tag = dict(member=m.member, seed=m.seed, method=m.method)
        try:
            model = load_model(str(m.folder), device=device)
            got = run_frequency(model, text, FrequencyConfig(window=m.context, max_windows=max_windows, queries=32,
                                                             ablate=False, theory_context=m.context,
                                                             theory_target=m.target, progress=False))
        except (ValueError, NotImplementedError) as e:
            refused.append({**tag, "why": str(e).splitlines()[0]})
            continue
        if previous_length:
            previous.append(previous_token_frame(model, m.folder, text, previous_length).assign(**tag))
        theory = got.tables["theory"]
        heads.append(theory[[c for c in MECHANISM_COLUMNS if c in theory]].assign(**tag))
        b = got.tables["bands"]
        share = b[(b.metric == "abs_share") & (b.band >= 0)]
        per_band = share.groupby(["layer", "band"], as_index=False).agg(value=("value", "mean"),
                                                                        frequency=("frequency", "first"))
        usage.append(per_band.assign(**tag, metric="abs_share"))
    frame = (lambda parts, cols: pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=cols))
    return {"mechanism": frame(heads, [*MECHANISM_COLUMNS, "member", "seed", "method"]),
            "band_usage": frame(usage, ["layer", "band", "value", "frequency", "member", "seed", "method", "metric"]),
            **({"previous_token": frame(previous, ["layer", "head", "prev_attention", "length", "windows", "member",
                                                    "seed", "method"])} if previous_length else {}),
            "mechanism_refused": pd.DataFrame(refused, columns=["member", "seed", "method", "why"])}


def previous_token_frame(model: Any, folder: str | Path, text: str, length: int, *,
                         max_windows: int = PREVIOUS_TOKEN_WINDOWS) -> pd.DataFrame:
    """Per head of a loaded posprobe `model` (saved in `folder`, whose tokenizer cuts `text`): `prev_attention`, the
    mean attention from query i to key i - 1 over queries 1..length-1 of up to `max_windows` non-overlapping windows
    of `length` tokens (no special tokens), with the `length` and `windows` used. The heads analysis' `prev_mass`
    (`head_signatures`, no induction pass)."""
    import torch
    from transformers import AutoTokenizer

    from posprobe.analyses.configs import HeadsConfig
    from posprobe.analyses.heads import head_signatures

    ids = AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]
    k = min(max_windows, len(ids) // length)
    if k < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {length}")
    rows = torch.tensor(ids[:k * length]).view(k, length)
    h = head_signatures(model, rows, HeadsConfig(induction_len=0, progress=False)).tables["heads"]
    prev = h[h["metric"] == "prev_mass"]
    return pd.DataFrame({"layer": prev["layer"].astype(int).to_numpy(), "head": prev["head"].astype(int).to_numpy(),
                         "prev_attention": prev["value"].astype(float).to_numpy(), "length": length, "windows": k})


def looked_at(jobs: list[Any], folder_of: Any) -> list[Looked]:
    """The models of a `zoo extend` run the mechanism looks at: each member x seed before extension (its source
    folder, L, followed to L') and each extended run (`folder_of(job)`, L', followed to 2L')."""
    out: dict[tuple, Looked] = {}
    for j in jobs:
        out.setdefault((j.member, j.seed, "unextended"),
                       Looked(j.member, j.seed, "unextended", Path(j.source), j.length, j.target))
        out[(j.member, j.seed, j.method)] = Looked(j.member, j.seed, j.method, Path(folder_of(j)), j.target,
                                                   2 * j.target)
    return list(out.values())


def attention_entropy(model: Any, rows: Any) -> Any:
    """Per layer, the mean over rows, heads and query positions of the attention entropy -sum_j p_ij ln p_ij (nats)
    of a Hugging Face causal LM's own attention probabilities (`output_attentions`, eager) on token rows
    `[batch, n]`: a `[n_layers]` float64 tensor. Query i of a decoder sees i + 1 keys, so uniform attention gives
    mean_i ln(i + 1) (`uniform_entropy`)."""
    import torch

    with torch.no_grad():
        att = model(torch.as_tensor(rows), output_attentions=True).attentions
    return torch.stack([-torch.special.xlogy(a.double(), a.double()).sum(-1).mean() for a in att])


def uniform_entropy(n: int) -> float:
    """The entropy (nats) of causal attention spread evenly over the visible keys, mean over the n queries:
    mean_i ln(i + 1)."""
    return float(sum(math.log(i + 1) for i in range(n)) / n)


def entropy_table(looked: list[Looked], text: str, lengths: list[int], *, device: str = "cpu",
                  max_windows: int = MECHANISM_WINDOWS) -> pd.DataFrame:
    """Attention entropy against length, YaRN's temperature rationale (Peng et al. 2023: without a temperature,
    attention spreads as the context grows): per model of `looked` and length n of `lengths`, per layer
    the mean attention entropy (`attention_entropy`, nats) over `max_windows` non-overlapping windows of n tokens of
    `text` (the model's own tokenizer, no special tokens, as the perplexity chunks), `uniform` = `uniform_entropy(n)`
    and `relative` = entropy / uniform (1 = attention spread evenly, 0 = on one key). A length past a learned table's
    rows is a row with status "cannot run"."""
    import torch
    from transformers import AutoTokenizer

    from posprobe.analyses.passkey import table_rows
    from posprobe.backend.loading import load_causal_lm

    rows = []
    encoded: dict[bytes, Any] = {}  # a zoo's models share one tokenizer: the text is encoded once per tokenizer file
    for m in looked:
        tag = dict(member=m.member, seed=m.seed, method=m.method)
        model = load_causal_lm(m.folder).to(device)
        key = (Path(m.folder) / "tokenizer.json").read_bytes()
        if key not in encoded:
            encoded[key] = torch.tensor(AutoTokenizer.from_pretrained(m.folder)(text, add_special_tokens=False)[
                "input_ids"])
        ids = encoded[key]
        table = table_rows(model)
        for n in lengths:
            k = min(max_windows, len(ids) // n)
            if table is not None and n > table:
                rows.append({**tag, "length": n, "layer": None, "entropy": math.nan, "uniform": uniform_entropy(n),
                             "relative": math.nan, "windows": 0, "status": "cannot run",
                             "why": f"learned positions: the table has {table} rows, the windows {n} tokens"})
                continue
            if k < 1:
                raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {n}")
            ent = torch.stack([attention_entropy(model, ids[i * n:(i + 1) * n][None].to(device)) for i in range(k)])
            uni = uniform_entropy(n)
            for layer, e in enumerate(ent.mean(0).tolist()):
                rows.append({**tag, "length": n, "layer": layer, "entropy": e, "uniform": uni, "relative": e / uni,
                             "windows": k, "status": "ok", "why": ""})
        del model
    return pd.DataFrame(rows, columns=["member", "seed", "method", "length", "layer", "entropy", "uniform",
                                       "relative", "windows", "status", "why"])
