"""The atlas over many models (`posprobe zoo atlas`, `posprobe zoo eval`): every positional analysis run on every
member of a zoo (and any other models named), side by side.

Each section is an existing analysis with the same data and bounds on every model; its tables are concatenated with
the member's family, block and seed, so one figure compares the families. A model an analysis refuses (a family it
does not apply to, a model posprobe has not proven) is a row of table `refused` with posprobe's own reason, never
dropped silently. Sections:

- training: the zoo's loss curves (read from `<zoo>/training`);
- extrapolation: perplexity from L to 8L, both of Press et al.'s protocols (`run_extrapolation`);
- shift: minimal-pair accuracy and text perplexity vs start position k (`run_shift_test`; Sinha et al. 2022);
- probes: absolute position recovered from the residual stream after each layer (`run_probes`; Haviv et al. 2022);
- heads: head signatures and classes (`run_heads`), with each head's attention window (the distance holding 90% of
  its attention);
- similarity: for each head of model A the nearest head of model B in the same layer by Jensen-Shannon divergence
  of attention patterns on the same inputs, averaged per layer (Kazemnejad et al. 2023, Fig. 4);
- sinks: Gu et al.'s sink share on random tokens and text, the position-vs-token control, massive activations by
  Sun et al.'s definition (`run_sinks`);
- geometry: add or concatenate? the position table's top-k subspace against the token embeddings' (`run_geometry`);
- decomposition: the exact / data-driven split of layer-0 scores into terms (`run_decompose`);
- frequency: per-band RoPE usage (`run_frequency`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from posprobe.analyses.configs import PROTOCOLS, ZOO_ATLAS_SECTIONS, ExtrapolationConfig, ZooAtlasConfig
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.zoo.folder import MEMBER_COLUMNS, member_info, resolve_text, training_tables, zoo_models

__all__ = ["ZOO_ATLAS_SECTIONS", "ZooAtlasConfig", "attention_window", "evaluate_zoo", "ratio_summary",
           "run_zoo_atlas"]

#: Share of a head's attention (mean over queries) that its attention window holds.
WINDOW_MASS = 0.9


@dataclass
class _Model:
    label: str
    spec: str
    record: dict | None
    model: Any = None
    facts: Any = None
    why: str | None = None  # why it could not be loaded


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


def run_zoo_atlas(paths: list[str], config: ZooAtlasConfig | None = None, *, text: str | None = None,
                  source: str | None = None, device: str = "cpu") -> Result:
    """Every section of `config` on every model of `paths` (zoo folders stand for their members; member folders and
    other model specs for themselves) over `text` (default: the zoo's held-out eval.txt). Returns a Result
    (analysis "zoo-atlas") whose tables are the sections' own tables concatenated over models with columns member,
    family, block, seed (NaN outside a zoo), plus `models` (one row per model) and `refused` (model, section, why).
    Progress goes to stderr by model and section."""
    from posprobe.backend.facts import model_facts
    from posprobe.backend.loading import load_model
    from posprobe.backend.sources import ModelLoadError

    cfg = config or ZooAtlasConfig()
    specs = zoo_models(paths)
    text, source = resolve_text(paths, text, source)
    source = source or "text"
    wanted = cfg.wanted()
    models = []
    for spec, rec in specs:
        m = _Model(Path(spec).name if rec is not None else spec, spec, rec)
        try:
            m.model = load_model(spec, device=device)
            m.facts = model_facts(m.model)
        except (ValueError, NotImplementedError, ModelLoadError) as e:
            m.why = str(e)
        models.append(m)
    frames: dict[str, list[pd.DataFrame]] = {}
    refused: list[dict] = []
    headline: dict[str, dict] = {}
    training_data = None
    timings: dict[str, float] = {}

    def add(name: str, df: pd.DataFrame, m: _Model) -> None:
        if df is not None and len(df):
            frames.setdefault(name, []).append(_tag(df, m))

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if cfg.progress else (lambda msg: None)
    for section in wanted:
        t0 = time.perf_counter()
        if section == "training":
            found, training_data = training_tables(paths)
            for tab, df in found.items():
                frames.setdefault(tab, []).append(df)
        elif section == "similarity":
            say(f"zoo atlas: similarity of {sum(m.model is not None for m in models)} models' heads ...")
            tabs, why = _similarity(models, text, cfg)
            for tab, df in tabs.items():
                frames.setdefault(tab, []).append(df)
            refused += [dict(model=lab, section=section, why=w) for lab, w in why.items()]
        else:
            run = _RUNS[section]
            for i, m in enumerate(models):
                if m.model is None:
                    refused.append(dict(model=m.label, section=section, why=m.why))
                    continue
                say(f"zoo atlas: {section} [{i + 1}/{len(models)}] {m.label} ...")
                try:
                    got = run(m, text, cfg)
                except (ValueError, NotImplementedError) as e:
                    refused.append(dict(model=m.label, section=section, why=str(e).splitlines()[0]))
                    continue
                if isinstance(got, str):  # the analysis does not apply: posprobe's own reason
                    refused.append(dict(model=m.label, section=section, why=got))
                    continue
                tables, head = got
                for tab, df in tables.items():
                    add(tab, df, m)
                if head:
                    headline.setdefault(section, {})[m.label] = head
        timings[section] = round(time.perf_counter() - t0, 2)
    tables = {name: pd.concat(parts, ignore_index=True) for name, parts in frames.items()}
    if "perplexity" in tables:  # ppl(xL) / ppl(L) per member over its seeds, as `zoo eval` gives it
        tables["ratios"] = ratio_summary(tables["perplexity"])
    tables["models"] = pd.DataFrame([_model_row(m) for m in models])
    tables["refused"] = pd.DataFrame(refused, columns=["model", "section", "why"])
    for name, df in tables.items():
        tables[name] = df.reset_index(drop=True)
    meta = make_meta("zoo-atlas", model={"name": "zoo", "positional_kind": "several",
                                         "models": [m.spec for m in models]},
                     data=data_meta(source, n_items=len(text), unit="characters", sha256=text_sha256(text)),
                     config=cfg, sections=wanted, seconds=timings, headline=headline, training_data=training_data,
                     extrapolation=dict(factors=list(cfg.factors), protocols=list(PROTOCOLS),
                                        max_tokens=cfg.extrapolation_tokens))
    return Result(tables, meta)


def _tag(df: pd.DataFrame, m: _Model) -> pd.DataFrame:
    return df.assign(model=m.label, **member_info(m.label, m.record))


def _model_row(m: _Model) -> dict:
    row = {"model": m.label, "spec": m.spec, **member_info(m.label, m.record)}
    if m.facts is not None:
        row.update(positional_kind=m.facts.positional_kind, n_ctx=m.facts.n_ctx, n_layers=m.facts.n_layers,
                   n_heads=m.facts.n_heads, layers="; ".join(m.facts.layer_positions), status="loaded", why="")
    else:
        row.update(status="refused", why=m.why)
    return row


def _skip(m: _Model, section: str) -> str | None:
    from posprobe.analyses.atlas import skip_reasons

    return skip_reasons(m.facts).get(section)


def _rows(m: _Model, text: str, window: int, n: int) -> list[list[int]]:
    from posprobe.analyses.probes import text_rows

    return text_rows(m.model, text, min(window, m.facts.n_ctx), n)


def _run_extrapolation(m: _Model, text: str, cfg: ZooAtlasConfig) -> Any:
    from posprobe.analyses.extrapolation import run_extrapolation

    length = int(m.record["widths"]["length"]) if m.record is not None else None
    ex = ExtrapolationConfig(train_length=length, factors=cfg.factors, max_tokens=cfg.extrapolation_tokens,
                             progress=False)
    got = run_extrapolation(m.model, text, ex, label=m.label)
    return {"perplexity": got.tables["perplexity"]}, None


def _run_shift(m: _Model, text: str, cfg: ZooAtlasConfig) -> Any:
    from posprobe.analyses.configs import ShiftConfig
    from posprobe.analyses.shift import hf_scorable, run_shift_test
    from posprobe.backend.model import device_of, dtype_of
    from posprobe.data import builtin_pairs

    if (why := _skip(m, "shift")) is not None:
        return why
    # The text window and its prefix token must fit at the largest k; the built-in pairs are shorter than it.
    fit = tuple(k for k in cfg.ks if k + cfg.shift_window + 1 <= m.facts.n_ctx)
    if m.facts.is_encoder:
        return ("an encoder: its shift test measures representation drift (posprobe shift-test), not the perplexity "
                "and pair accuracy compared here")
    if len(fit) < 2:
        return (f"no shift k > 0 of {list(cfg.ks)} fits a {cfg.shift_window}-token window in the model's "
                f"{m.facts.n_ctx} positions")
    got = run_shift_test(m.model, builtin_pairs(max_pairs=cfg.max_pairs, seed=cfg.seed), text=text,
                         config=ShiftConfig(ks=fit, window=cfg.shift_window, max_windows=cfg.max_windows,
                                            n_bootstrap=200, seed=cfg.seed, progress=False),
                         backend="hf" if hf_scorable(m.model) else "auto", device=str(device_of(m.model)),
                         dtype=str(dtype_of(m.model)).replace("torch.", ""))
    summary = got.summary
    overall = summary[summary.level == "overall"].drop(columns=["level", "group"]) if len(summary) else summary
    ppl = pd.DataFrame(got.meta.get("perplexity") or [])  # an encoder's text is not scored as perplexity
    return {"shift_summary": overall, "shift_perplexity": ppl}, {"ks": list(fit)}


def _run_probes(m: _Model, text: str, cfg: ZooAtlasConfig) -> Any:
    from posprobe.analyses.configs import ProbeConfig
    from posprobe.analyses.probes import run_probes

    window = min(cfg.window, m.facts.n_ctx)
    # Enough windows to hold the sampled tokens (a probe of 128 dims on 512 tokens sat at chance on every relative
    # member of the CPU zoo; on 2,048 the NoPE member's error falls layer by layer).
    windows = max(cfg.max_windows, -(-cfg.probe_tokens // window))
    got = run_probes(m.model, text, ProbeConfig(points=("resid_pre", "resid_post"), n_splits=3, window=window,
                                                max_windows=windows, max_tokens=cfg.probe_tokens, seed=cfg.seed,
                                                progress=False))
    p = got.tables["probes"]
    # The residual stream before layer 0 is the embedding (layer -1); after layer l, resid_post of l.
    p = pd.concat([p[(p.point == "resid_pre") & (p.layer == 0)].assign(layer=-1), p[p.point == "resid_post"]])
    per_layer = p.groupby(["layer", "condition", "metric"], as_index=False).value.mean()
    return {"probes": per_layer}, None


def _run_heads(m: _Model, text: str, cfg: ZooAtlasConfig) -> Any:
    from posprobe.analyses.configs import HeadsConfig
    from posprobe.analyses.heads import run_heads

    if (why := _skip(m, "heads")) is not None:
        return why
    got = run_heads(m.model, text, HeadsConfig(window=min(cfg.window, m.facts.n_ctx), max_windows=cfg.max_windows,
                                               induction_len=min(24, (m.facts.n_ctx - 1) // 2), seed=cfg.seed,
                                               progress=False))
    heads = pd.concat([got.tables["heads"], attention_window(got.tables["offsets"]).drop(columns=["measured_to",
                                                                                                  "covered"])],
                      ignore_index=True)
    return {"heads": heads, "head_classes": got.tables["head_classes"], "offsets": got.tables["offsets"]}, None


def _run_sinks(m: _Model, text: str, cfg: ZooAtlasConfig) -> Any:
    from posprobe.analyses.atlas import SINK_LENGTH
    from posprobe.analyses.configs import SinksConfig
    from posprobe.analyses.sinks import run_sinks

    if (why := _skip(m, "sinks")) is not None:
        return why
    got = run_sinks(m.model, text, SinksConfig(length=min(SINK_LENGTH, cfg.window, m.facts.n_ctx), random_samples=8,
                                               max_windows=cfg.max_windows, ablate_heads=0, seed=cfg.seed,
                                               progress=False))
    keep = ("sink_share", "sink_control", "massive_activations", "massive_intervention")
    share = pd.DataFrame([dict(condition=c, value=float(v)) for c, v in got.meta["sink_share"].items()])
    return ({"sink_overall": share, **{k: got.tables[k] for k in keep if k in got.tables}},
            {"massive": got.meta.get("massive"), "control": got.meta.get("control")})


def _run_geometry(m: _Model, text: str, cfg: ZooAtlasConfig) -> Any:
    from posprobe.analyses.configs import GeometryConfig
    from posprobe.analyses.geometry import run_geometry

    if (why := _skip(m, "geometry")) is not None:
        return why
    got = run_geometry(m.model, text, GeometryConfig(window=min(cfg.window, m.facts.n_ctx),
                                                     max_windows=cfg.max_windows, progress=False))
    g = got.tables["geometry"]
    ev = g[(g.source == "W_pos") & (g.metric == "explained_variance")]
    return {"pos_token_subspace": got.tables.get("pos_token_subspace"), "wpos_variance": ev}, None


def _run_decomposition(m: _Model, text: str, cfg: ZooAtlasConfig) -> Any:
    from posprobe.analyses.configs import DecomposeConfig
    from posprobe.analyses.decompose import run_decompose
    from posprobe.backend.model import tokenizer_of

    if m.facts.unsupported is not None:
        return m.facts.unsupported
    # The sentence decomposed: the text's first window, so it fits every model's context.
    sentence = tokenizer_of(m.model).decode(_rows(m, text, min(cfg.window, m.facts.n_ctx - 2), 1)[0][1:])
    got = run_decompose(m.model, DecomposeConfig(text=text, sentence=sentence, max_windows=cfg.max_windows,
                                                 progress=False))
    d = got.tables["decompose"]
    summary = d[d.metric != "score"].drop(columns=["query_pos", "key_pos", "rel_pos"])
    return {"decomposition": summary}, {"method": got.meta.get("method"), "terms": got.meta.get("terms")}


def _run_frequency(m: _Model, text: str, cfg: ZooAtlasConfig) -> Any:
    from posprobe.analyses.configs import FrequencyConfig
    from posprobe.analyses.frequency import run_frequency

    if (why := _skip(m, "frequency")) is not None:
        return why
    got = run_frequency(m.model, text, FrequencyConfig(window=min(cfg.window, m.facts.n_ctx),
                                                       max_windows=cfg.max_windows, queries=32, ablate=False,
                                                       progress=False))
    b = got.tables["bands"]
    return {"bands": b[(b.metric == "abs_share") & (b.band >= 0)], "frequency_heads": got.tables["heads"]}, None


def _similarity(models: list[_Model], text: str, cfg: ZooAtlasConfig) -> tuple[dict[str, pd.DataFrame],
                                                                                dict[str, str]]:
    # Every pair of models that read the same token ids with the same depth, on the same windows of the text; the
    # first loaded model's tokenizer cuts them.
    import torch

    from posprobe.analyses.head_similarity import pairwise_jsd_sums, similarity_frames
    from posprobe.backend.facts import require_attention_supported

    why: dict[str, str] = {}
    ok: list[_Model] = []
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
    rows = torch.tensor(_rows(ok[0], text, window, cfg.similarity_windows), dtype=torch.long)
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


_RUNS: dict[str, Callable[[_Model, str, ZooAtlasConfig], Any]] = {
    "extrapolation": _run_extrapolation,
    "shift": _run_shift,
    "probes": _run_probes,
    "heads": _run_heads,
    "sinks": _run_sinks,
    "geometry": _run_geometry,
    "decomposition": _run_decomposition,
    "frequency": _run_frequency,
}


def evaluate_zoo(paths: list[str], config: ExtrapolationConfig | None = None, *, text: str | None = None,
                 source: str | None = None, device: str = "cpu") -> Result:
    """Perplexity vs evaluation length for every model in `paths` (zoo folders, member folders, other model
    specs) on `text` (default: the zoo's held-out eval.txt). Each zoo member is evaluated at its own training
    length L. Returns a Result with tables `perplexity` (every model x protocol x length, with the member's family,
    block and seed) and `ratios` (ppl(xL) / ppl(L) per member, protocol and factor: mean, min and max over seeds)."""
    from posprobe.analyses.extrapolation import run_extrapolation
    from posprobe.backend.loading import load_model
    from posprobe.backend.sources import ModelLoadError

    config = config or ExtrapolationConfig()
    models = zoo_models(paths)
    text, source = resolve_text(paths, text, source)
    frames = []
    for spec, rec in models:
        label = Path(spec).name if rec is not None else spec
        cfg = config
        if rec is not None and config.train_length is None:
            cfg = replace(config, train_length=int(rec["widths"]["length"]))
        info = member_info(label, rec)
        try:
            model = load_model(spec, device=device)
            df = run_extrapolation(model, text, cfg, source=source, label=label).tables["perplexity"]
        except (ValueError, NotImplementedError, ModelLoadError) as e:
            df = pd.DataFrame([{"model": label, "status": "refused", "why": str(e)}])
        frames.append(df.assign(**info))
    table = pd.concat(frames, ignore_index=True)
    meta = make_meta("zoo-eval", model={"name": "zoo", "positional_kind": "several", "models": [s for s, _ in models]},
                     data=data_meta(source, n_items=len(text), unit="characters", sha256=text_sha256(text)),
                     config=config)
    return Result({"perplexity": table, "ratios": ratio_summary(table)}, meta)


def ratio_summary(table: pd.DataFrame) -> pd.DataFrame:
    """ppl(xL) / ppl(L) per member, protocol and factor: mean over seeds, min and max, seeds counted; rows that
    cannot run keep their status; a member none of whose models ran is one row with status "refused" and its why."""
    if "ppl_ratio" not in table:
        table = table.assign(ppl_ratio=float("nan"), protocol=None, factor=float("nan"))
    ok = table[table["status"].isin(["ok", "cannot run"])]
    keys = ["member", "family", "block", "protocol", "factor"]
    g = ok.groupby(keys, sort=False, dropna=False)
    out = g.agg(ppl_ratio=("ppl_ratio", "mean"), ratio_low=("ppl_ratio", "min"), ratio_high=("ppl_ratio", "max"),
                n_seeds=("model", "nunique"), status=("status", "first")).reset_index()
    # A member none of whose models ran stays a row (status refused, with the first reason), so every table that
    # lists members lists it.
    gone = table[~table["member"].isin(ok["member"])].drop_duplicates("member")
    if len(gone):
        why = gone["why"] if "why" in gone else ""
        out = pd.concat([out, gone[["member", "family", "block"]].assign(status="refused", why=why)],
                        ignore_index=True)
    return out
