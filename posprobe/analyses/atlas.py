"""The atlas: every positional analysis that applies to a model, run with bounded defaults, in one report.

Sections: positional facts; head signatures; attention sinks (Gu et al.'s share, the position-vs-token
control, massive activations); per-frequency RoPE usage (RoPE models); W_pos and
residual geometry (learned positions); a position-probe summary; the shift test, which is the
invariance control for RoPE models (a common shift of queries and keys cannot change anything) and
the effect itself for learned positions; retrieval heads (Wu et al.: which heads copy a needle, and the
answers with them masked vs random heads; RoPE decoders the long-context engine runs). Where sinks and retrieval
both run, the sinks section also zeroes its strongest sink heads one at a time, and the atlas flags any head whose
zeroing barely moves the text loss (low-effect) although it is a retrieval head (table `ablation_retrieval`). Each
section is a full Result of its own analysis, saved in a subfolder; the atlas's own table holds the headline numbers
its report turns into words.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from posprobe.analyses.configs import (
    ATLAS_SECTIONS,
    AtlasConfig,
    FrequencyConfig,
    GeometryConfig,
    HeadsConfig,
    ProbeConfig,
    RetrievalConfig,
    ShiftConfig,
    SinksConfig,
)
from posprobe.backend import hf as HF
from posprobe.backend.facts import ModelFacts, model_facts
from posprobe.backend.families import nope as nope_family
from posprobe.backend.families import not_applicable
from posprobe.backend.model import device_of, dtype_of
from posprobe.data import BUILTIN_CORPUS_SOURCE, BUILTIN_SOURCE, builtin_corpus, builtin_pairs
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256

SECTIONS = ATLAS_SECTIONS


class AtlasResult(Result):
    """The atlas's `atlas` table (section, metric, value) plus each section's own Result in `parts`,
    saved by `save` into subfolders named after the sections."""

    parts: dict[str, Result]

    def __init__(self, tables: dict[str, pd.DataFrame], meta: dict, parts: dict[str, Result]):
        super().__init__(tables, meta)
        self.parts = parts

    def save(self, out_dir: Any, *, figure_formats: Any = (), csv: str = "auto") -> dict[str, Path]:
        """Each section's outputs in `<out_dir>/<section>/`, then the atlas's own files and report
        (keys `<section>/<key>` for the sections, the usual keys for the atlas's own files). Every report of the
        folder loads one local `plotly.min.js` at its top (offline still; one copy instead of one per report)."""
        from posprobe.report.export import parse_formats
        from posprobe.report.html import PLOTLY_JS, write_plotlyjs
        from posprobe.report.result import csv_tables

        formats = parse_formats(figure_formats)  # a bad format fails before anything is written
        csv_tables({}, csv)  # a bad value too
        Path(out_dir).mkdir(exist_ok=True)
        paths: dict[str, Path] = {}
        for name, part in self.parts.items():
            saved = part.save(Path(out_dir) / name, figure_formats=formats, csv=csv, plotly_src="../" + PLOTLY_JS)
            paths.update({f"{name}/{k}": v for k, v in saved.items()})
        paths.update(super().save(out_dir, figure_formats=formats, csv=csv, plotly_src=PLOTLY_JS,
                                  extra={PLOTLY_JS: write_plotlyjs}))
        return paths


#: Sequence length of the sinks section: Gu et al.'s protocol measures Sink_1^0.3 on 64-token sequences.
SINK_LENGTH = 64

#: Windows (and their length, tokens) of the exact layer-0 decomposition that the atlas compares with the pattern
#: view on learned-position models: float64 pair terms grow with windows x heads x length^2.
RELATIVE_VIEW_WINDOWS = 4
RELATIVE_VIEW_TOKENS = 128

#: The shortest context the retrieval section runs in: a needle prompt's fixed parts and a haystack around it.
RETRIEVAL_MIN_CTX = 512


def applicable(facts: ModelFacts, wanted: tuple[str, ...] | None, engine_runs: bool = False) -> list[str]:
    """The sections that apply to this model, restricted to `wanted` when given: see `skip_reasons`."""
    skip = skip_reasons(facts, engine_runs)
    return [s for s in SECTIONS if s not in skip and (wanted is None or s in wanted)]


def skip_reasons(facts: ModelFacts, engine_runs: bool = False) -> dict[str, str]:
    """Section -> why it does not run on this model: its positional family's own reasons (backend.families: e.g.
    frequency needs RoPE, geometry a learned table), then what posprobe has not proven for the model (position
    analyses: `facts.unsupported`; patterns: `facts.attention_unsupported`; rotated q/k the model rotates where no
    hook fires), then retrieval's needs (the long-context engine runs the model, context >= RETRIEVAL_MIN_CTX)."""
    why: dict[str, str] = {}
    for s in SECTIONS:
        if (reason := not_applicable(facts.positional_kind, s)) is not None:
            why[s] = reason
    # Sinks read a RoPE model's rotated q/k: proven rotation, read where a hook fires.
    rotary_unsupported = facts.unsupported if facts.is_rotary else None
    for s, blocked in (("heads", facts.attention_unsupported), ("sinks", facts.attention_unsupported),
                       ("sinks", facts.rotation_unhooked), ("sinks", rotary_unsupported),
                       ("frequency", facts.unsupported), ("frequency", facts.rotation_unhooked),
                       ("frequency", facts.attention_unsupported),
                       ("geometry", facts.unsupported),
                       ("geometry", None if facts.has_w_pos else "the model exposes no position table"),
                       ("shift", facts.unsupported),
                       ("retrieval", facts.unsupported)):
        if blocked is not None:
            why.setdefault(s, blocked)
    if facts.n_ctx < RETRIEVAL_MIN_CTX:
        why.setdefault("retrieval", f"a {facts.n_ctx}-token context is shorter than the {RETRIEVAL_MIN_CTX} "
                                    "tokens a needle prompt needs")
    if not engine_runs:
        why.setdefault("retrieval", "the long-context engine does not run this model")
    return why


def run_atlas(model: Any, text: str | None = None, config: AtlasConfig | None = None, *,
              source: str | None = None) -> AtlasResult:
    """Run every applicable section on `model` over `text` (default: the built-in text) and return the
    atlas with its parts. The shift test scores a decoder bridge through the Hugging Face model it wraps
    (native position ids, pair packing; the same weights, not reloaded). Progress goes to stderr by stage."""
    import sys
    import time

    from posprobe.analyses.frequency import run_frequency
    from posprobe.analyses.geometry import run_geometry
    from posprobe.analyses.heads import run_heads
    from posprobe.analyses.probes import run_probes
    from posprobe.analyses.retrieval import run_retrieval
    from posprobe.analyses.shift import hf_scorable, run_shift_test
    from posprobe.analyses.sinks import run_sinks

    cfg = config or AtlasConfig()
    facts = model_facts(model)
    body = builtin_corpus() if text is None else text
    src = source or (BUILTIN_CORPUS_SOURCE if text is None else "text")
    quiet = not cfg.progress
    w, nw = cfg.window_for(facts.n_ctx), cfg.max_windows
    # Built-in sentences are < 64 tokens: a k that would push them past the context is lowered to fit.
    ks = tuple(sorted({min(k, max(facts.n_ctx - 64, 0)) for k in cfg.ks}))
    runs = {
        "heads": lambda: run_heads(
            model,
            body,
            HeadsConfig(
                window=w,
                max_windows=nw,
                induction_len=min(cfg.induction_len, (facts.n_ctx - 1) // 2),
                seed=cfg.seed,
                progress=cfg.progress,
            ),
            source=src,
        ),
        # Bounded: 8 random sequences, the text windows, the control and massive activations; the heads are zeroed
        # one at a time (one pass each) only when retrieval runs too, to cross-check the two views of a head.
        "sinks": lambda: run_sinks(
            model,
            body,
            SinksConfig(length=min(SINK_LENGTH, w), random_samples=8, max_windows=nw,
                        ablate_heads=cfg.ablate_heads if "retrieval" in sections else 0, seed=cfg.seed,
                        progress=cfg.progress),
            source=src,
        ),
        "frequency": lambda: run_frequency(
            model,
            body,
            FrequencyConfig(window=w, max_windows=nw, queries=32, ablate=False, progress=cfg.progress),
            source=src,
        ),
        "geometry": lambda: run_geometry(
            model, body, GeometryConfig(window=w, max_windows=nw, progress=cfg.progress), source=src
        ),
        "probes": lambda: run_probes(
            model,
            body,
            ProbeConfig(
                points=("resid_post",),
                n_splits=3,
                window=w,
                max_windows=max(nw, 6),
                max_tokens=cfg.probe_tokens_used(),
                seed=cfg.seed,
                progress=cfg.progress,
            ),
            source=src,
        ),
        # Bounded: one task, three depths, the top 5 heads and one draw of 5 random heads masked (9 answers); fewer
        # on a model with under 10 heads, where the random control could not draw 5 heads outside the top 5.
        "retrieval": lambda: run_retrieval(
            model,
            body,
            RetrievalConfig(lengths=(min(cfg.needle_length, facts.n_ctx),), depths=(0.25, 0.5, 0.75),
                            tasks=("niah_single_2",), mask_k=(min(5, facts.n_layers * facts.n_heads // 2),),
                            random_draws=1, seed=cfg.seed, progress=cfg.progress),
            source=src,
        ),
        "shift": lambda: run_shift_test(
            model,
            builtin_pairs(max_pairs=cfg.max_pairs, seed=cfg.seed),
            config=ShiftConfig(
                ks=ks, seed=cfg.seed, n_bootstrap=200, allow_beyond_context=False, progress=cfg.progress
            ),
            data_source=BUILTIN_SOURCE,
            # The loaded weights through HF's own forward, except ALiBi (HF takes no position ids there).
            backend="hf" if hf_scorable(model) and facts.positional_kind != "alibi" else "auto",
            device=str(device_of(model)),
            dtype=str(dtype_of(model)).replace("torch.", ""),
        ),
    }
    why_skipped = skip_reasons(facts, engine_runs=_engine_runs(model))
    sections = [s for s in SECTIONS if s not in why_skipped and (cfg.sections is None or s in cfg.sections)]
    skipped = [s for s in SECTIONS if s not in sections]
    left_out = []
    if cfg.quick and cfg.sections is None and "retrieval" in sections:  # the short tour leaves out the decoding
        sections, left_out = [s for s in sections if s != "retrieval"], ["retrieval"]
    parts: dict[str, Result] = {}
    timings: dict[str, float] = {}
    for i, name in enumerate(s for s in sections if s != "facts"):
        if not quiet:
            print(f"atlas [{i + 1}/{len(sections) - ('facts' in sections)}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        parts[name] = runs[name]()
        timings[name] = round(time.perf_counter() - t0, 2)
    rows = _headlines(facts, parts)
    tables = {"atlas": pd.DataFrame(rows, columns=["section", "metric", "value"])}
    extra: dict[str, Any] = {"nope_layers": nope_layers(facts)}
    if "frequency" in parts:  # the layers whose heads the frequency section measured (rotary layers only)
        extra["frequency_layers"] = sorted(int(l) for l in parts["frequency"].tables["heads"].layer.unique())
    ablation = parts["sinks"].tables.get("head_ablation") if "sinks" in parts else None
    if ablation is not None and "retrieval" in parts:
        cross, extra["ablation_retrieval"] = ablation_vs_retrieval(ablation, parts["retrieval"],
                                                                   parts["sinks"].meta["ablation"])
        tables["ablation_retrieval"] = cross.assign(model=facts.name)
    if "heads" in parts and facts.positional_kind == "learned_absolute" and facts.unsupported is None:
        # Learned positions: the heads section reads relative position from the pattern, the exact layer-0 score
        # split from the position x position term; the two views side by side, per layer-0 head.
        from posprobe.analyses.decompose import corpus_rows
        from posprobe.analyses.relative_views import TERM_POSITIONAL, TERM_RELATIVE, disagreements, relative_views

        t0 = time.perf_counter()
        threshold = parts["heads"].meta["config"]["relative_r2"]
        windows = corpus_rows(model, body, min(w, RELATIVE_VIEW_TOKENS), RELATIVE_VIEW_WINDOWS)
        views = relative_views(model, windows, parts["heads"].tables["heads"])
        tables["relative_views"] = views
        extra["relative_views"] = {"pattern_threshold": threshold, "term_relative": TERM_RELATIVE,
                                   "term_positional": TERM_POSITIONAL, **disagreements(views, threshold)}
        timings["relative_views"] = round(time.perf_counter() - t0, 2)
    meta = make_meta("atlas", model=facts.summary(), data=data_meta(src, n_items=nw, unit="windows",
                                                                    sha256=text_sha256(body)),
                     config=cfg, sections=sections, skipped=skipped,
                     skipped_why={s: why_skipped[s] for s in skipped if s in why_skipped}, left_out=left_out,
                     shift_ks=list(ks), seconds=timings, window=w, sink_length=min(SINK_LENGTH, w),
                     probe_tokens=cfg.probe_tokens_used(), **extra)
    return AtlasResult(tables, meta, parts)


def nope_layers(facts: ModelFacts) -> list[int]:
    """The layers of a rotary model that apply no rotation (NoPE, e.g. SmolLM3's `no_rope_layers`); [] for other
    models. Read from the per-layer phrases of the facts, which name NoPE layers even where `facts.rotary` is None
    (a rotation posprobe does not reproduce)."""
    if not facts.is_rotary:
        return []
    return [l for l, p in enumerate(facts.layer_positions) if p.startswith(nope_family.FAMILY.phrase)]


def ablation_vs_retrieval(ablation: pd.DataFrame, retrieval: Result, ablation_meta: dict) -> tuple[pd.DataFrame,
                                                                                                      dict]:
    """Each zeroed sink head (`head_ablation` of the sinks section) beside its retrieval score and class (first preset
    of the retrieval section): table (layer, head, kind = the ablation label, delta_loss, metric "retrieval_score",
    value, classes = ablation label and retrieval class) and meta (rule, flagged = [layer, head] of the heads labelled
    low-effect that are retrieval heads)."""
    from posprobe.analyses.dormant import LOW_EFFECT

    cls = retrieval.tables["head_classes"]
    score = retrieval.tables["retrieval_heads"]
    preset = cls.preset.iloc[0]
    cls = cls[cls.preset == preset].set_index(["layer", "head"]).kind
    score = score[(score.preset == preset) & (score.metric == "retrieval_score")].set_index(["layer", "head"]).value
    rows = []
    for r in ablation.itertuples():
        key = (int(r.layer), int(r.head))
        rows.append(dict(layer=key[0], head=key[1], kind=r.kind, delta_loss=float(r.delta_loss),
                         metric="retrieval_score", value=float(score.get(key, float("nan"))),
                         classes=f"{r.kind},{cls.get(key, 'unmeasured')}"))
    table = pd.DataFrame(rows)
    flagged = [[int(r.layer), int(r.head)] for r in table.itertuples()
               if r.kind == LOW_EFFECT and r.classes.split(",")[1] == "retrieval"]
    meta = {"rule": f"a head labelled {LOW_EFFECT} ({ablation_meta['labels'][LOW_EFFECT]}) that the retrieval section "
                    f"classes as a retrieval head ({retrieval.meta['classes']['retrieval']}, preset {preset})",
            "preset": str(preset), "flagged": flagged}
    return table, meta


def _engine_runs(model: Any) -> bool:
    # Whether the long-context engine can run this model: a TransformerBridge over a Hugging Face decoder of a type it
    # supports, with separate q/k/v/o projections (the HF attention modules it plugs into).
    from posprobe.backend.kind import is_bridge
    from posprobe.core import long_engine as LA

    if not is_bridge(model):
        return False
    try:
        LA.require_supported(model.original_model)
    except (NotImplementedError, ValueError):
        return False
    mods = HF.attention_modules(model.original_model)
    return bool(mods) and all(hasattr(m, "q_proj") and hasattr(m, "o_proj") for m in mods)


def _headlines(facts: ModelFacts, parts: dict[str, Result]) -> list[tuple[str, str, float]]:
    rows: list[tuple[str, str, float]] = [("facts", "n_layers", facts.n_layers), ("facts", "n_heads", facts.n_heads),
                                          ("facts", "n_ctx", facts.n_ctx)]
    if "heads" in parts:
        w = parts["heads"].tables["heads"].pivot_table(index=["layer", "head"], columns="metric", values="value")
        kinds = parts["heads"].tables["head_classes"].kind.value_counts()
        rows += [("heads", "max_prev_mass", float(w.prev_mass.max())),
                 ("heads", "mean_first_mass", float(w.first_mass.mean())),
                 ("heads", "sink_fraction", parts["heads"].meta["sink_fraction"])]
        rows += [("heads", f"n_{k}", float(v)) for k, v in kinds.items()]
    if "sinks" in parts:
        share = parts["sinks"].meta["sink_share"]
        rows += [("sinks", f"sink_share_{c}", float(v)) for c, v in share.items()]
        ctl = parts["sinks"].tables.get("sink_control")
        if ctl is not None and len(ctl):
            by = ctl[ctl.metric == "sink_share"].set_index("variant").value
            rows += [("sinks", "sink_share_the_first", float(by.get("'the' first", float("nan"))))]
    if "frequency" in parts:
        b = parts["frequency"].tables["bands"]
        share = b[(b.metric == "abs_share") & (b.band >= 0)]
        n_bands = int(share.band.max()) + 1
        q = n_bands // 4 or 1
        rows += [
            (
                "frequency",
                "abs_share_fastest_quarter",
                float(share[share.band < q].groupby(["layer", "head"]).value.sum().mean()),
            ),
            (
                "frequency",
                "abs_share_slowest_quarter",
                float(share[share.band >= n_bands - q].groupby(["layer", "head"]).value.sum().mean()),
            ),
        ]
        heads = parts["frequency"].tables["heads"]
        rows += [("frequency", f"n_{k}", float(v)) for k, v in heads.kind.value_counts().items()]
    if "geometry" in parts:
        g = parts["geometry"].tables["geometry"]
        ev = g[(g.source == "W_pos") & (g.metric == "explained_variance")].sort_values("k")
        if len(ev):
            rows.append(("geometry", "wpos_pc1_explained", float(ev.value.iloc[0])))
    if "probes" in parts:
        p = parts["probes"].tables["probes"]
        mae = p[p.metric == "mae"].groupby(["layer", "condition"]).value.mean().unstack()
        rows += [("probes", "mae_first_layer", float(mae["probe"].iloc[0])),
                 ("probes", "mae_last_layer", float(mae["probe"].iloc[-1])),
                 ("probes", "mae_control", float(mae["control"].mean())),
                 ("probes", "mae_chance", float(mae["chance"].mean()))]
    if "shift" in parts:
        s = parts["shift"].tables.get("shift_summary", pd.DataFrame())
        if len(s):
            o = s[s.level == "overall"].sort_values("k")
            rows += [("shift", f"accuracy_k{int(r.k)}", float(r.accuracy)) for r in o.itertuples()]
        d = parts["shift"].tables.get("shift_drift", pd.DataFrame())
        if len(d):
            pooled = d[d.layer == "pooled"].sort_values("k")
            rows += [("shift", f"pooled_cosine_k{int(r.k)}", float(r.cosine_to_k0)) for r in pooled.itertuples()]
        dev = parts["shift"].meta.get("max_abs_logp_change_vs_k0")
        if dev:
            rows.append(("shift", "max_abs_logp_change", float(max(dev.values()))))
    if "retrieval" in parts:
        m = parts["retrieval"].tables["retrieval_masking"]
        acc = m[m.metric == "string_match_all"].groupby("masked").value.mean()
        kinds = parts["retrieval"].tables["head_classes"].kind.value_counts()
        rows += [("retrieval", "needle_accuracy", float(acc.get("none", float("nan")))),
                 ("retrieval", "needle_accuracy_top_masked", float(acc.get("top", float("nan")))),
                 ("retrieval", "needle_accuracy_random_masked", float(acc.get("random", float("nan")))),
                 ("retrieval", "n_retrieval", float(kinds.get("retrieval", 0)))]
    return rows
