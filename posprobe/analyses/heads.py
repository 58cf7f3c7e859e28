"""Head signatures: what every attention head does with position, read off its attention pattern.

Per layer and head, streamed over text windows with fixed-size float64 accumulators (memory does not
grow with the corpus): attention to itself (`self_mass`), to i-1 (`prev_mass`), to the first token
(`first_mass`) and the first few (`first_k_mass`), the mean attention at each offset d = i - j (the
offset profile) and the strongest offset >= 2, the mean attention distance, the attention entropy
(nats) and the entropy relative to uniform over the keys a query sees, the attention-sink score of
Gu et al. 2025 (the attention the first token receives, normalised by the number of queries that can
see it), and the R^2 of the pattern explained by offset alone (a Toeplitz fit: each entry predicted by
the mean of its diagonal over the corpus). A second pass on repeated random token sequences gives the
induction and duplicate-token scores with TransformerLens's `head_detector` definitions ("mul":
attention on the detection pattern / all attention, averaged over sequences); `prev_token_score` is
that definition for previous-token heads on the text windows.

Every statistic is a ratio of corpus-wide sums, so a chunked run equals a single full computation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import torch

from posprobe.analyses.configs import HeadsConfig
from posprobe.analyses.sections import AtlasRun, AtlasSection, CompareRun, ModelEntry, register, why_not
from posprobe.backend.facts import model_facts, require_attention_supported
from posprobe.backend.model import encode_text, first_token, tokenizer_of
from posprobe.core import distributed
from posprobe.core.capture import Reducer, capture, float64_device, stream, to_cpu_once
from posprobe.data import BUILTIN_TEXT, framed_windows, random_token_ids
from posprobe.report import heads as heads_report
from posprobe.report.checkpoint import stream_resume
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256

#: Signature metrics in the `heads` table, in report order.
METRICS = ("prev_mass", "self_mass", "first_mass", "first_k_mass", "sink_score", "fixed_offset",
           "fixed_offset_mass", "mean_distance", "entropy", "relative_entropy", "relative_r2",
           "prev_token_score", "induction_score", "duplicate_score")
#: Head classes, in the priority order that picks a head's `kind`.
CLASSES = ("sink", "previous-token", "current-token", "induction", "fixed-offset", "relative-position")


def class_rules(cfg: HeadsConfig) -> dict[str, str]:
    """Each class's rule in words, with the thresholds of `cfg` (written into meta and the report)."""
    return {
        "sink": f"sink_score > {cfg.sink_threshold} "
        "(Gu et al. 2025: attention on the first token per query that sees it)",
        "previous-token": f"prev_mass > {cfg.prev_threshold} (mean attention from i to i-1)",
        "current-token": f"self_mass > {cfg.self_threshold} (mean attention from i to itself)",
        "induction": f"induction_score > {cfg.induction_threshold} (repeated random tokens, TL head_detector 'mul')",
        "fixed-offset": f"fixed_offset_mass > {cfg.offset_threshold} (mean attention at one offset d >= 2)",
        "relative-position": f"relative_r2 > {cfg.relative_r2} (pattern explained by offset i-j alone)",
    }


def _reducer(layers: list[int], n: int, encoder: bool) -> Reducer:
    rel = (torch.arange(n)[:, None] - torch.arange(n)[None, :] + n - 1).reshape(-1)  # i - j, shifted to >= 0
    visible = torch.full((n,), n) if encoder else torch.arange(1, n + 1)
    keep = visible > 1  # a query that sees one key has no entropy to compare with uniform
    log_visible = torch.log(visible[keep].double())
    on: dict[
        torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ] = {}  # the index tables, copied once per device

    def fn(point: str, layer: int, x: torch.Tensor, state: dict) -> None:
        # [batch, head_index, query_pos, key_pos]; masked entries are exactly 0. float64 on the device
        # (the CPU for mps, which has no float64).
        p = x.to(float64_device(x.device), torch.float64)
        H = p.shape[1]
        if p.device not in on:
            # `keep` as indices, not a bool mask: masked indexing is data-dependent (a device sync).
            on[p.device] = (rel.to(p.device), keep.nonzero()[:, 0].to(p.device), log_visible.to(p.device))
        rel_d, keep_d, log_visible_d = on[p.device]
        s = state.get(layer)
        if s is None:
            z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=p.device)  # noqa: E731
            s = state[layer] = {"diag": z(H, 2 * n - 1), "col": z(H, n), "sq": z(H), "ent": z(H), "rel_ent": z(H),
                                "rows": 0}
        s["diag"].index_add_(1, rel_d, p.sum(0).reshape(H, n * n))
        s["col"] += p.sum((0, 2))
        s["sq"] += (p * p).sum((0, 2, 3))
        h = -torch.special.xlogy(p, p).sum(-1)  # [batch, head, query] entropy in nats
        s["ent"] += h.sum((0, 2))
        s["rel_ent"] += (h[..., keep_d] / log_visible_d).sum((0, 2))
        s["rows"] += p.shape[0]

    return Reducer(["pattern"], layers, fn)


def signature_frames(state: dict, n: int, encoder: bool, cfg: HeadsConfig) -> tuple[dict[int, dict], pd.DataFrame]:
    """Per-layer signature values ({layer: {metric: [head] tensor}}) and the offset-profile table
    (layer, head, rel_pos, value = mean attention at offset rel_pos) from the reducer's sums."""
    out, prof = {}, []
    d = torch.arange(-(n - 1), n)
    for layer, s in sorted(state.items()):
        if not isinstance(layer, int):
            continue
        diag, col, rows = s["diag"].cpu(), s["col"].cpu(), s["rows"]
        count = (rows * (n - d.abs())).double()  # entries on each diagonal
        if not encoder:
            count = torch.where(d >= 0, count, torch.zeros_like(count))
        queries = rows * n
        mean_at = diag / count.clamp_min(1)
        zero = n - 1
        allowed = count > 0
        total, n_entries = diag.sum(1), count[allowed].sum()
        fit = (diag[:, allowed] ** 2 / count[allowed]).sum(1)
        ss_tot = s["sq"].cpu() - total**2 / n_entries
        ss_res = s["sq"].cpu() - fit
        lo, hi = zero + 2, zero + min(cfg.max_offset, n - 1) + 1
        far = mean_at[:, lo:hi]
        best = far.argmax(1) if far.shape[1] else torch.zeros(diag.shape[0], dtype=torch.long)
        # A decoder's query 0 sees only itself (attention 1 on key 0 = itself): self_mass, first_mass and first_k_mass
        # average over the queries that can choose (1..n-1), as the frequency report does; encoders over all.
        forced = 0 if encoder else rows
        choosing = max(queries - forced, 1)
        out[layer] = {
            "self_mass": (diag[:, zero] - forced) / choosing,
            "prev_mass": mean_at[:, zero + 1] if n > 1 else torch.full_like(total, float("nan")),
            "first_mass": (col[:, 0] - forced) / choosing,
            "first_k_mass": (col[:, : cfg.first_k].sum(1) - forced) / choosing,
            # Gu et al. 2025: alpha_k = sum_i A[i, k] / (number of queries that can see key k); k = first token.
            "sink_score": col[:, 0] / queries,
            "fixed_offset": (best + 2).double() if far.shape[1] else torch.full_like(total, float("nan")),
            "fixed_offset_mass": far.gather(1, best[:, None])[:, 0] if far.shape[1] else torch.zeros_like(total),
            "mean_distance": (diag * d.abs().double()).sum(1) / queries,
            "entropy": s["ent"].cpu() / queries,
            "relative_entropy": s["rel_ent"].cpu() / (rows * (n if encoder else n - 1)),
            "relative_r2": 1 - ss_res / ss_tot.clamp_min(1e-300),
            # TL head_detector "mul" score of the previous-token pattern: attention on (i, i-1) / all attention.
            "prev_token_score": diag[:, zero + 1] / queries if n > 1 else torch.full_like(total, float("nan")),
        }
        lim = min(cfg.max_offset, n - 1)
        keep = (d.abs() <= lim) & (count > 0)
        for h in range(diag.shape[0]):
            prof.append(pd.DataFrame({"layer": layer, "head": h, "rel_pos": d[keep].numpy(),
                                      "value": mean_at[h, keep].numpy()}))
    return out, pd.concat(prof, ignore_index=True)


def detection_scores(patterns: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Induction and duplicate-token scores of each head, `[head]`, as TransformerLens's head_detector
    defines them with error_measure "mul" and no exclusions, averaged over the batch of sequences.

    patterns: `[batch, head_index, query_pos, key_pos]`; tokens: `[batch, pos]`.
    """
    p = patterns.to(float64_device(patterns.device), torch.float64)  # the CPU for mps (no float64 there)
    tokens = tokens.to(p.device)
    n = tokens.shape[1]
    same = tokens[:, :, None] == tokens[:, None, :]
    earlier = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril(-1)
    duplicate = (same & earlier).double()  # key j < i holds the query's token
    induction = torch.zeros_like(duplicate)
    induction[:, :, 1:] = duplicate[:, :, :-1]  # the token after that earlier occurrence
    induction = induction * earlier.logical_or(torch.eye(n, dtype=torch.bool, device=tokens.device)).double()
    total = p.sum((2, 3))  # [batch, head]
    return {"induction_score": ((p * induction[:, None]).sum((2, 3)) / total).mean(0),
            "duplicate_score": ((p * duplicate[:, None]).sum((2, 3)) / total).mean(0)}


def repeated_random_tokens(model: Any, length: int, batch: int, seed: int) -> torch.Tensor:
    """`[batch, 1 + 2*length]` (or without the leading BOS where the tokenizer has none): a random token
    sequence (no special tokens) followed by itself, seeded."""
    r = torch.tensor(random_token_ids(tokenizer_of(model), batch, length, seed))
    first = first_token(model)
    start = torch.full((batch, 1), first, dtype=torch.long) if first is not None else r[:, :0]
    return torch.cat([start, r, r], dim=1)


def _classes(values: dict[str, float], cfg: HeadsConfig) -> list[str]:
    tests = {
        "sink": values["sink_score"] > cfg.sink_threshold,
        "previous-token": values["prev_mass"] > cfg.prev_threshold,
        "current-token": values["self_mass"] > cfg.self_threshold,
        "induction": values["induction_score"] > cfg.induction_threshold,
        "fixed-offset": values["fixed_offset_mass"] > cfg.offset_threshold,
        "relative-position": values["relative_r2"] > cfg.relative_r2,
    }
    return [c for c in CLASSES if tests[c]]


@torch.no_grad()
def head_signatures(model: Any, token_rows: Any, config: HeadsConfig | None = None, *,
                    work: str | Path | None = None, fresh: bool = False) -> Result:
    """Head signatures over equal-length `token_rows` (plus the induction pass unless
    `config.induction_len` is 0). Returns a Result with tables `heads` (layer, head, metric, value),
    `head_classes` (layer, head, kind, classes) and `offsets` (mean attention by rel_pos, top heads).
    `work`: a folder where the corpus pass keeps its sums as it goes; the same call resumes from there to the
    same tables (another model, rows or config is refused; `fresh=True` discards it first)."""
    cfg = config or HeadsConfig()
    facts = model_facts(model)
    require_attention_supported(facts, "Head signatures")
    rows = torch.as_tensor(token_rows)
    if rows.dim() != 2 or rows.shape[0] == 0 or rows.shape[1] < 2:
        raise ValueError("token_rows must be a non-empty [batch, pos] set of equal-length rows with pos >= 2")
    n = rows.shape[1]
    if n > facts.n_ctx:
        raise ValueError(f"windows of {n} tokens exceed the model's context n_ctx={facts.n_ctx}")
    layers = list(range(facts.n_layers))
    red = _reducer(layers, n, facts.is_encoder)
    # Under torchrun each process streams its share of the batches; the sums are added over processes.
    spans = distributed.shard_batches(rows.shape[0], cfg.batch_size)
    resume = stream_resume(work, fresh=fresh, analysis="heads", model=model, rows=rows, config=cfg)
    stream(model, (rows[a:b] for a, b in spans), [red], total=len(spans), progress=cfg.progress,
           desc="head signatures", resume=resume)
    if distributed.active():
        sums = [red.state[l] for l in layers]
        distributed.all_reduce_sums([v for s in sums for v in s.values() if isinstance(v, torch.Tensor)])
        for s, r in zip(sums, distributed.all_reduce_ints([s["rows"] for s in sums])):
            s["rows"] = r
    values, offsets = signature_frames(to_cpu_once(red.state), n, facts.is_encoder, cfg)
    if cfg.induction_len and not facts.is_encoder:
        toks = repeated_random_tokens(model, cfg.induction_len, cfg.induction_batch, cfg.seed)
        if toks.shape[1] > facts.n_ctx:
            raise ValueError(f"induction sequences of {toks.shape[1]} tokens exceed n_ctx={facts.n_ctx}; "
                             "lower induction_len")
        got = capture(model, toks, ["pattern"], layers=layers)
        scores = to_cpu_once({l: detection_scores(got["pattern", l], toks) for l in layers})
        for l in layers:
            values[l].update(scores[l])
    nan = torch.full((facts.n_heads,), float("nan"), dtype=torch.float64)
    recs, kinds = [], []
    for l in layers:
        for m in METRICS:
            v = values[l].get(m, nan)
            recs.append(pd.DataFrame({"layer": l, "head": range(facts.n_heads), "metric": m, "value": v.numpy()}))
        for h in range(facts.n_heads):
            cls = _classes({m: float(values[l].get(m, nan)[h]) for m in METRICS}, cfg)
            kinds.append((l, h, cls[0] if cls else "other", ",".join(cls)))
    heads = pd.concat(recs, ignore_index=True)
    classes = pd.DataFrame(kinds, columns=["layer", "head", "kind", "classes"])
    for df in (heads, classes, offsets):
        df.insert(0, "model", facts.name)
    sinks = heads[heads.metric == "sink_score"]
    meta = make_meta(
        "heads", model=facts.summary(), data=data_meta("token rows", n_items=int(rows.shape[0]), unit="windows"),
        config=cfg, window=n, n_windows=int(rows.shape[0]), n_tokens=int(rows.numel()), class_rules=class_rules(cfg),
        class_order=list(CLASSES), sink_fraction=float((sinks.value > cfg.sink_threshold).mean()),
        induction="skipped (encoder)" if facts.is_encoder else
        ("skipped" if not cfg.induction_len else f"{cfg.induction_batch} random sequences of {cfg.induction_len} "
                                                  "tokens, each repeated once"),
    )
    return Result({"heads": heads, "head_classes": classes, "offsets": offsets}, meta)


def run_heads(model: Any, text: str | None = None, config: HeadsConfig | None = None, *,
              source: str | None = None, work: str | Path | None = None, fresh: bool = False) -> Result:
    """Head signatures over windows of `text`, each window framed the way the model expects (BOS, or
    CLS ... SEP for encoders).

    Args:
        model: a TransformerLens model (decoder or encoder).
        text: the text cut into windows (default: posprobe's built-in text).
        config: the analysis's options (None: its Config's defaults).
        source: what meta.json's data record names as the text (default: "built-in text" or "text").
        work: the corpus pass's checkpoint folder, as in `head_signatures` (None: no checkpoint).
        fresh: discard what `work` holds first, as in `head_signatures`.

    Returns:
        `head_signatures`'s Result: tables `heads` (layer, head, metric, value), `head_classes` (layer, head,
            kind, classes) and `offsets` (mean attention by rel_pos, top heads).

    Examples:
        >>> import posprobe as pp
        >>> result = pp.run_heads(pp.load_model("tiny-rope"), None, pp.HeadsConfig(max_windows=2, progress=False))
        >>> sorted(result.tables)
        ['head_classes', 'heads', 'offsets']
        >>> result.meta["analysis"]
        'heads'
    """
    from posprobe.backend.model import special_tokens

    cfg = config or HeadsConfig()
    body = BUILTIN_TEXT if text is None else text
    pre, post = special_tokens(model)
    if not pre:
        first = first_token(model)
        pre = [first] if first is not None else []
    rows = framed_windows(encode_text(model, body), cfg.window, pre=pre, post=post, max_windows=cfg.max_windows)
    result = head_signatures(model, rows, cfg, work=work, fresh=fresh)
    result.meta["data"] = data_meta(source or ("built-in text" if text is None else "text"), n_items=len(rows),
                                    unit="windows", sha256=text_sha256(body))
    return result


def _atlas_run(model: Any, r: AtlasRun) -> Result:
    return run_heads(model, r.text, HeadsConfig(window=r.window, max_windows=r.max_windows,
                                                 induction_len=min(r.config.induction_len, (r.facts.n_ctx - 1) // 2),
                                                 seed=r.config.seed, progress=r.config.progress), source=r.source)


def _atlas_headlines(part: Result) -> list[tuple[str, float]]:
    w = part.tables["heads"].pivot_table(index=["layer", "head"], columns="metric", values="value")
    kinds = part.tables["head_classes"].kind.value_counts()
    return [("max_prev_mass", float(w.prev_mass.max())), ("mean_first_mass", float(w.first_mass.mean())),
            ("sink_fraction", part.meta["sink_fraction"])] + [(f"n_{k}", float(v)) for k, v in kinds.items()]


#: Share of a head's attention (mean over queries) that its attention window holds.
WINDOW_MASS = 0.9


def attention_window(offsets: pd.DataFrame, mass: float = WINDOW_MASS) -> pd.DataFrame:
    """Per (model, layer, head) of a heads `offsets` table (mean attention by query - key distance `rel_pos`): the
    smallest distance d whose offsets 0..d hold `mass` of the attention measured there (tokens; NaN where even the
    largest measured distance holds less: the window is wider than what was measured, `covered` False)."""
    rows = []
    for (model, layer, head), g in offsets.groupby(["model", "layer", "head"], sort=False):
        g = g.sort_values("rel_pos")
        cum = g["value"].cumsum()
        inside = g["rel_pos"][cum >= mass - 1e-12]
        rows.append(dict(model=model, layer=int(layer), head=int(head), metric="window",
                         value=float(inside.iloc[0]) if len(inside) else float("nan"),
                         measured_to=int(g["rel_pos"].max()), covered=bool(len(inside))))
    return pd.DataFrame(rows)


def _compare(m: ModelEntry, run: CompareRun) -> Any:
    text, cfg = run.text, run.config
    if (why := why_not("heads", m.facts)) is not None:
        return why
    got = run_heads(m.model, text, HeadsConfig(window=min(cfg.window, m.facts.n_ctx), max_windows=cfg.max_windows,
                                               induction_len=min(24, (m.facts.n_ctx - 1) // 2), seed=cfg.seed,
                                               progress=False))
    heads = pd.concat([got.tables["heads"], attention_window(got.tables["offsets"]).drop(columns=["measured_to",
                                                                                                  "covered"])],
                      ignore_index=True)
    return {"heads": heads, "head_classes": got.tables["head_classes"], "offsets": got.tables["offsets"]}, None


ATLAS_SECTION = register(AtlasSection(
    "heads", "Head signatures", _atlas_run, _atlas_headlines, heads_report.atlas_paragraph,
    blocked=lambda facts, engine_runs: (facts.attention_unsupported,), key_figures=2,
    compare=_compare, compare_page=heads_report.compare_section))
