"""Attention sinks: how many heads dump their attention on the first token, and what sets that token apart.

The protocol of Gu et al. 2025 ("When Attention Sink Emerges in Language Models: An Empirical View", ICLR 2025;
arXiv 2024): on sequences of T tokens, a head's alpha_1 is the attention on the first token averaged over all T
queries (query 0 included, as in their formula); the head sinks on that sequence when alpha_1 > epsilon (0.3);
Sink_1^epsilon is the share of (sequence, head) pairs that sink, per layer and over all layers (per-sample
thresholding, then the average).
Two conditions: random-token sequences (seeded, no special tokens; the first token as the model expects or
random, `SinksConfig.first`) and windows of a text.

Why the first token, per head (the questions of Gu et al. 2025 and Sun et al. 2024): the norm of its key against the
other keys (as the scores see them: rotated, after any QK-norm), the cosine of queries with its key against their
cosine with the other keys they see, and the norm of its value against the others (sinks often carry small
values, so attending to them changes little). Everything is streamed with fixed-size float64 sums per layer.
"""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd
import torch

from posprobe.analyses.configs import SinksConfig
from posprobe.analyses.sections import AtlasRun, AtlasSection, CompareRun, ModelEntry, register, why_not
from posprobe.backend.facts import ModelFacts, model_facts, require_attention_supported
from posprobe.backend.model import encode_text, has_lm_head, special_tokens, tokenizer_of
from posprobe.core.capture import Reducer, check_rows, float64_device, stream, to_cpu_once
from posprobe.data import BUILTIN_TEXT, framed_windows, random_token_ids
from posprobe.report import sinks as sinks_report
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.report.sinks import control_meaning

__all__ = ["SinksConfig", "run_sinks", "sink_statistics", "HEAD_METRICS"]

#: Per-head metrics of the `sink_heads` table, in report order.
HEAD_METRICS = ("first_attention", "sink_rate", "first_key_norm_ratio", "first_value_norm_ratio", "first_key_cos",
                "other_key_cos", "delim_attention", "delim_key_norm_ratio", "delim_value_norm_ratio", "delim_key_cos")

#: Delimiters whose first occurrence (after position 0) gets the same questions as the first token.
DELIMITERS = (".", ",", "\n", ";", ":", "!", "?")


def _qk_points(facts: ModelFacts) -> dict[tuple[str, str], list[int]]:
    """{(q point, k point): layers}: the q and k whose dot product is the score — rotated ones on RoPE layers (read
    where the model rotates), plain q/k on layers without rotation (learned/ALiBi models, NoPE layers)."""
    if not facts.is_rotary:
        return {("q", "k"): list(range(facts.n_layers))}
    if facts.unsupported or facts.rotation_unhooked:
        raise NotImplementedError(f"Attention sinks are not available for {facts.name}: "
                                  f"{facts.unsupported or facts.rotation_unhooked}")
    rotary = list(facts.rotary_layers)
    nope = [l for l in range(facts.n_layers) if l not in rotary]
    return {k: v for k, v in ((("rot_q", "rot_k"), rotary), (("q", "k"), nope)) if v}


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # [batch, pos, head, d] x [batch, pos, head, d] -> [batch, head, q, k] cosines
    a = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    b = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    return torch.einsum("bqhd,bkhd->bhqk", a, b)


def _reducer(facts: ModelFacts, n: int, epsilon: float, qp: str, kp: str, layers: list[int], current: dict
             ) -> Reducer:
    group = facts.n_heads // facts.n_kv_heads
    causal = torch.ones(n, n, dtype=torch.bool) if facts.is_encoder else torch.ones(n, n, dtype=torch.bool).tril()
    others = causal.clone()
    others[:, 0] = False
    others[0] = False  # queries 1.. with keys 1.. they see
    n_others = others.sum().clamp_min(1)
    names = ("alpha", "above", "k_ratio", "v_ratio", "cos0", "cosj", "d_att", "d_k", "d_v", "d_cos")

    def fn(point: str, layer: int, x: torch.Tensor, state: dict) -> None:
        pending = state.setdefault(("pending", layer), {})
        pending[point] = x.to(float64_device(x.device), torch.float64)
        if len(pending) < 4:  # q, k, v and the pattern of this layer, in whatever order the hooks fire
            return
        del state[("pending", layer)]
        q, k, v, p = pending[qp], pending[kp], pending["v"], pending["pattern"]
        s = state.get(layer)
        if s is None:
            z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=p.device)  # noqa: E731
            s = state[layer] = {name: z(facts.n_heads) for name in names} | {"rows": 0, "delim_rows": 0}
        alpha = p[..., 0].mean(-1)  # [batch, head]: Gu et al.'s alpha_1, over every query
        s["alpha"] += alpha.sum(0)
        s["above"] += (alpha > epsilon).double().sum(0)
        kn, vn = k.norm(dim=-1), v.norm(dim=-1)  # [batch, pos, kv_head]
        k_rest, v_rest = kn[:, 1:].mean(1), vn[:, 1:].mean(1)  # [batch, kv_head]
        s["k_ratio"] += (kn[:, 0] / k_rest).repeat_interleave(group, -1).sum(0)
        s["v_ratio"] += (vn[:, 0] / v_rest).repeat_interleave(group, -1).sum(0)
        cos = _cos(q, k.repeat_interleave(group, dim=2))  # [batch, head, q, k]
        s["cos0"] += cos[:, :, 1:, 0].mean(-1).sum(0)
        s["cosj"] += (cos * others.to(cos.device)).sum((-2, -1)).div(n_others.to(cos.device)).sum(0)
        s["rows"] += p.shape[0]
        # The first delimiter of each sequence (rows without one, or with it last, are left out): the attention the
        # queries after it give it, its key/value norm ratios and the queries' cosine with its key.
        d = current["delim"].to(p.device)
        rows = ((d >= 1) & (d < n - 1)).nonzero()[:, 0]
        if len(rows):
            dr = d[rows]
            after = (torch.arange(n, device=p.device)[None] > dr[:, None]).double()  # [rows, query]
            col = p[rows, :, :, dr]  # [rows, head, query]: attention on the delimiter
            s["d_att"] += ((col * after[:, None]).sum(-1) / after.sum(-1)[:, None]).sum(0)
            s["d_k"] += (kn[rows, dr] / k_rest[rows]).repeat_interleave(group, -1).sum(0)
            s["d_v"] += (vn[rows, dr] / v_rest[rows]).repeat_interleave(group, -1).sum(0)
            dc = cos[rows, :, :, dr]
            s["d_cos"] += ((dc * after[:, None]).sum(-1) / after.sum(-1)[:, None]).sum(0)
            s["delim_rows"] += len(rows)

    return Reducer([qp, kp, "v", "pattern"], layers, fn)


def first_delimiters(model: Any, rows: torch.Tensor) -> torch.Tensor:
    """Per row, the position (>= 1) of its first delimiter token (`DELIMITERS`, alone or after a space, as the
    tokenizer writes them), -1 where it has none."""
    tok = tokenizer_of(model)
    ids = set()
    for d in DELIMITERS:
        for text in (d, " " + d):
            got = tok(text, add_special_tokens=False)["input_ids"]
            if len(got) == 1:
                ids.add(got[0])
    hit = torch.isin(rows, torch.tensor(sorted(ids), dtype=rows.dtype))
    hit[:, 0] = False
    first = hit.double().argmax(-1)
    return torch.where(hit.any(-1), first, torch.full_like(first, -1)).long()


@torch.no_grad()
def sink_statistics(model: Any, token_rows: Any, config: SinksConfig | None = None, *,
                    condition: str = "rows", context: Callable[[], Any] | None = None
                    ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per head (`sink_heads`: layer, head, metric, value) and per layer (`sink_share`: layer, metric
    "sink_share", value, count = sequences) over equal-length `token_rows`, labelled `condition`; `context`
    (e.g. a position plan) is entered around each forward."""
    cfg = config or SinksConfig()
    facts = model_facts(model)
    require_attention_supported(facts, "Attention sinks")
    rows = check_rows(model, token_rows)
    n = rows.shape[1]
    delims = first_delimiters(model, rows)
    current: dict = {}
    reds = [_reducer(facts, n, cfg.epsilon, qp, kp, layers, current)
            for (qp, kp), layers in _qk_points(facts).items()]

    def fed() -> Any:  # each batch with its rows' delimiter positions, for the reducers
        for a in range(0, rows.shape[0], cfg.batch_size):
            current["delim"] = delims[a:a + cfg.batch_size]
            yield rows[a:a + cfg.batch_size]

    stream(model, fed(), reds, total=-(-rows.shape[0] // cfg.batch_size), progress=cfg.progress,
           desc=f"sinks ({condition})", context=context)
    state = to_cpu_once({l: s for r in reds for l, s in r.state.items() if isinstance(l, int)})
    heads, layers = [], []
    for layer in range(facts.n_layers):
        s = state[layer]
        r = s["rows"]
        dr = s["delim_rows"] or float("nan")  # no sequence with a delimiter: NaN, not 0
        values = {"first_attention": s["alpha"] / r, "sink_rate": s["above"] / r, "first_key_norm_ratio":
                  s["k_ratio"] / r, "first_value_norm_ratio": s["v_ratio"] / r, "first_key_cos": s["cos0"] / r,
                  "other_key_cos": s["cosj"] / r, "delim_attention": s["d_att"] / dr,
                  "delim_key_norm_ratio": s["d_k"] / dr, "delim_value_norm_ratio": s["d_v"] / dr,
                  "delim_key_cos": s["d_cos"] / dr}
        for m in HEAD_METRICS:
            heads.append(pd.DataFrame({"condition": condition, "layer": layer, "head": range(facts.n_heads),
                                       "metric": m, "value": values[m].numpy()}))
        layers.append(dict(condition=condition, layer=layer, metric="sink_share",
                           value=float(s["above"].sum() / (r * facts.n_heads)), count=int(r)))
    return pd.concat(heads, ignore_index=True), pd.DataFrame(layers)


def control_variants(model: Any, rows: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """The position-vs-token control on `rows` (StreamingLLM's and Gu et al.'s question: does the sink follow
    position 0 or the token?): {variant: (token rows, positions or None = 0..n-1)} — as they are; the first token
    at position n // 2 (the others unchanged, so it is still seen first); the second token at position 0 and the
    first at 1 (another token holds position 0); the first token replaced by "the"; by a newline. Positions are set
    where posprobe controls them (learned, rotary, ALiBi; proven families). What the position variants can show
    depends on the family (`posprobe.report.sinks.control_meaning`): under ALiBi the distance bias alone gives the
    moved token, now nearer to every later query, more attention, sink or no sink."""
    n = rows.shape[1]
    tok = tokenizer_of(model)
    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {"as is": (rows, None)}
    facts = model_facts(model)
    if facts.family is not None and facts.family.control is not None and facts.unsupported is None:
        moved = torch.arange(n)
        moved[0] = n // 2
        out[f"first token at position {n // 2}"] = (rows, moved)
        swapped_pos = torch.arange(n)
        swapped_pos[0], swapped_pos[1] = 1, 0
        out["second token at position 0"] = (rows, swapped_pos)
    for label, text in (("'the' first", "the"), ("newline first", "\n")):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if ids:
            swapped = rows.clone()
            swapped[:, 0] = ids[0]
            out[label] = (swapped, None)
    return out


def _control(model: Any, rows: torch.Tensor, cfg: SinksConfig) -> pd.DataFrame:
    from posprobe.core.positions import token_positions

    out = []
    for variant, (toks, pos) in control_variants(model, rows).items():
        ctx = None if pos is None else (lambda pos=pos: token_positions(model, pos, label="sink control"))
        heads, share = sink_statistics(model, toks, cfg, condition=variant, context=ctx)
        first = heads[heads.metric == "first_attention"].value
        out += [dict(variant=variant, metric="sink_share", value=float(share.value.mean()), count=int(len(toks))),
                dict(variant=variant, metric="first_attention", value=float(first.mean()), count=int(len(toks)))]
    return pd.DataFrame(out)


def _random_rows(model: Any, cfg: SinksConfig) -> torch.Tensor:
    pre, post = special_tokens(model)
    if cfg.first == "random":
        pre = []
    body = cfg.length - len(pre) - len(post)
    if body < 1:
        raise ValueError(f"length {cfg.length} leaves no room for random tokens after the special tokens")
    r = random_token_ids(tokenizer_of(model), cfg.random_samples, body, cfg.seed)
    return torch.tensor([pre + x + post for x in r])


def run_sinks(model: Any, text: str | None = None, config: SinksConfig | None = None, *,
              source: str | None = None) -> Result:
    """Sink_1^epsilon per layer and per head on random-token sequences and on windows of `text`, with the first
    token's key/value norm ratios and query cosines.

    Args:
        model: a TransformerLens model.
        text: the text cut into windows (default: the built-in text).
        config: the analysis's options (None: its Config's defaults); its `massive_top`, `control` and
            `ablate_heads` add the tables below.
        source: what meta.json's data record names as the text (default: "built-in text" or "text").

    Returns:
        A Result with tables `sink_heads` (condition, layer, head, metric, value) and `sink_share` (condition,
            layer, metric, value, count); meta["sink_share"] holds the share over all layers per condition (Gu et
            al.'s headline number). With `massive_top`, also `massive_activations` (per condition and layer the
            largest |residual activations| with position, token, dimension and ratio to the median;
            `posprobe.analyses.massive`) and, where a layer has one above `massive_ratio` x median and
            `massive_abs` (Sun et al.'s definition), `massive_intervention` (loss and first-token attention with
            them zeroed or set to their mean; meta["massive"] says where and which dims). With `control`,
            `sink_control`: the share and the first token's attention on the text windows as they are, with the
            first token moved to position n // 2, and with it replaced by "the" or a newline (`control_variants`);
            meta["control"] says what the model's positional mechanism alone predicts for the position variants.
            With `ablate_heads`, `head_ablation`: the heads with the most attention on the first token, each
            zeroed alone and labelled by the change of the text loss (low-effect, loss-rises, loss-falls:
            `posprobe.analyses.dormant`; meta["ablation"] holds the definitions).

    Examples:
        >>> import posprobe as pp
        >>> cfg = pp.SinksConfig(length=16, random_samples=2, max_windows=2, progress=False)
        >>> result = pp.run_sinks(pp.load_model("tiny-rope"), None, cfg)
        >>> sorted(result.tables)
        ['massive_activations', 'sink_control', 'sink_heads', 'sink_share']
        >>> sorted(result.tables["sink_heads"].condition.unique())
        ['random', 'text']
    """
    cfg = config or SinksConfig()
    facts = model_facts(model)
    require_attention_supported(facts, "Attention sinks")
    _qk_points(facts)
    if cfg.length > facts.n_ctx:
        raise ValueError(f"length {cfg.length} exceeds the model's context n_ctx={facts.n_ctx}")
    conditions: dict[str, torch.Tensor] = {}
    if cfg.random_samples:
        conditions["random"] = _random_rows(model, cfg)
    body = BUILTIN_TEXT if text is None else text
    if cfg.max_windows:
        pre, post = special_tokens(model)
        windows = framed_windows(encode_text(model, body), cfg.length, pre=pre, post=post,
                                 max_windows=cfg.max_windows)
        if not windows:
            raise ValueError(f"the text is shorter than one window of {cfg.length} tokens")
        conditions["text"] = torch.tensor(windows)
    heads, shares = [], []
    for name, rows in conditions.items():
        h, s = sink_statistics(model, rows, cfg, condition=name)
        heads.append(h)
        shares.append(s)
    heads_df, share_df = pd.concat(heads, ignore_index=True), pd.concat(shares, ignore_index=True)
    tables = {"sink_heads": heads_df, "sink_share": share_df}
    control_meta: dict = {"skipped": "control is off or there are no text windows"}
    if cfg.control and "text" in conditions:
        tables["sink_control"] = _control(model, conditions["text"], cfg)
        control_meta = control_meaning(facts.positional_kind, conditions["text"].shape[1] // 2)
    ablation_meta: dict = {"skipped": "ablate_heads is 0, no text windows or no language-model head"}
    if cfg.ablate_heads and "text" in conditions and has_lm_head(model):
        from posprobe.analyses.dormant import head_ablation

        text_heads = heads_df[(heads_df.condition == "text") & (heads_df.metric == "first_attention")]
        found, ablation_meta = head_ablation(model, conditions["text"], text_heads, min_attention=cfg.ablate_attention,
                                             max_delta=cfg.ablate_delta, max_heads=cfg.ablate_heads,
                                             batch_size=cfg.batch_size)
        if len(found):
            tables["head_ablation"] = found
    massive_meta: dict = {"skipped": "massive_top is 0"}
    if cfg.massive_top:
        from posprobe.analyses.massive import intervene, massive_table

        tables["massive_activations"] = pd.concat(
            [massive_table(model, rows, top=cfg.massive_top, batch_size=cfg.batch_size, progress=cfg.progress,
                           condition=name) for name, rows in conditions.items()], ignore_index=True)
        massive_meta = {"skipped": "no text condition (max_windows 0)"}
        if "text" in conditions:
            text_rows = tables["massive_activations"]
            effect, massive_meta = intervene(model, conditions["text"], text_rows[text_rows.condition == "text"],
                                             ratio=cfg.massive_ratio, min_abs=cfg.massive_abs,
                                             batch_size=cfg.batch_size)
            if len(effect):
                tables["massive_intervention"] = effect
    for df in tables.values():
        df.insert(0, "model", facts.name)
    overall = {c: float(g.value.mean()) for c, g in share_df.groupby("condition", sort=False)}
    n_items = sum(len(r) for r in conditions.values())
    data = data_meta(source or ("built-in text" if text is None else "text"), n_items=n_items, unit="sequences",
                     sha256=text_sha256(body) if cfg.max_windows else None)
    meta = make_meta("sinks", model=facts.summary(), data=data, config=cfg, sink_share=overall, massive=massive_meta,
                     ablation=ablation_meta, control=control_meta,
                     qk_points={f"{qp}/{kp}": layers for (qp, kp), layers in _qk_points(facts).items()},
                     sequences={c: int(len(r)) for c, r in conditions.items()},
                     delimiter_sequences={c: int(((d >= 1) & (d < r.shape[1] - 1)).sum())
                                          for c, r in conditions.items() for d in [first_delimiters(model, r)]},
                     delimiters=list(DELIMITERS),
                     first_tokens={c: tokenizer_of(model).convert_ids_to_tokens(r[:3, 0].tolist())
                                   for c, r in conditions.items()})
    return Result(tables, meta)


#: Sequence length of the atlas's sinks section: Gu et al.'s protocol measures Sink_1^0.3 on 64-token sequences.
SINK_LENGTH = 64


def _atlas_run(model: Any, r: AtlasRun) -> Result:
    # Bounded: 8 random sequences, the text windows, the control and massive activations; the heads are zeroed one at
    # a time (one pass each) only when retrieval runs too, to cross-check the two views of a head.
    c = r.config
    return run_sinks(model, r.text, SinksConfig(
        length=min(SINK_LENGTH, r.window), random_samples=8, max_windows=r.max_windows,
        ablate_heads=c.ablate_heads if "retrieval" in r.sections else 0, seed=c.seed, progress=c.progress),
        source=r.source)


def _atlas_headlines(part: Result) -> list[tuple[str, float]]:
    rows = [(f"sink_share_{c}", float(v)) for c, v in part.meta["sink_share"].items()]
    ctl = part.tables.get("sink_control")
    if ctl is not None and len(ctl):
        by = ctl[ctl.metric == "sink_share"].set_index("variant").value
        rows.append(("sink_share_the_first", float(by.get("'the' first", float("nan")))))
    return rows


# Sinks read a RoPE model's rotated q/k: a proven rotation, read where a hook fires.
def _compare(m: ModelEntry, run: CompareRun) -> Any:
    text, cfg = run.text, run.config
    if (why := why_not("sinks", m.facts)) is not None:
        return why
    got = run_sinks(m.model, text, SinksConfig(length=min(SINK_LENGTH, cfg.window, m.facts.n_ctx),
                                               random_samples=cfg.sink_samples,
                                               max_windows=cfg.max_windows, ablate_heads=0, seed=cfg.seed,
                                               progress=False))
    keep = ("sink_share", "sink_control", "massive_activations", "massive_intervention")
    share = pd.DataFrame([dict(condition=c, value=float(v)) for c, v in got.meta["sink_share"].items()])
    return ({"sink_overall": share, **{k: got.tables[k] for k in keep if k in got.tables}},
            {"massive": got.meta.get("massive"), "control": got.meta.get("control")})


ATLAS_SECTION = register(AtlasSection(
    "sinks", "Attention sinks", _atlas_run, _atlas_headlines, sinks_report.atlas_paragraph,
    blocked=lambda facts, engine_runs: (facts.attention_unsupported, facts.rotation_unhooked,
                                        facts.unsupported if facts.is_rotary else None),
    compare=_compare, compare_page=sinks_report.compare_section))
