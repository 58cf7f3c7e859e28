"""Emergence over training (`posprobe zoo emergence`, issue 65): the atlas's positional measurements on the weights
a model had at several points of its training, against the training tokens it had seen then.

The models are the checkpoints of zoo members trained with `posprobe zoo train --save-every K` (each member's
`checkpoints/step<K>/` folders, step 0 included, then the member itself at its last step), or any models named as
`MODEL@REVISION` (a hub model's revisions, e.g. Pythia's `EleutherAI/pythia-160m@step1000` ... `@step143000`, whose
tokens are the step times `tokens_per_step`). Each is measured by the atlas over many models (`compare_models`, the
same loop and sections as `zoo atlas`, one model loaded at a time), and one number per section and metric is read
off its tables into the tidy table `emergence` (model, member, seed, step, tokens, section, metric, value):

- sinks: `sink_share_text` and `sink_share_random` (Gu et al. 2025's Sink_1^epsilon, epsilon 0.3: the share of
  (sequence, layer, head) whose mean attention on the first token exceeds epsilon, on `max_windows` text windows
  of T = 64 tokens, as Gu et al. measure it on 100 sequences of 64 training tokens, and on `sink_samples`
  random-token sequences); `massive_ratio` (Sun et al. 2024: the largest
  |residual activation| over the layers against its layer's median |activation|, on the random sequences; Sun et
  al. call activations massive at ratios of about 1,000 and above);
- heads: `heads_<class>` for each head class of `run_heads` (previous-token, induction, sink, ...): how many heads
  hold it (a head may hold several);
- shift: `shift_accuracy_k0` and `shift_drop_k<K>` (Sinha et al. 2022: minimal-pair accuracy with the sentences
  started at position 0, and how much it falls with them started at the largest k that fits, K).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Sequence

import pandas as pd

from posprobe.analyses.atlas_many import collect, compare_models, model_row
from posprobe.analyses.configs import EMERGENCE_SECTIONS, EmergenceConfig
from posprobe.analyses.heads import CLASSES
from posprobe.analyses.sections import CompareRun, section
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256
from posprobe.zoo.folder import STEPS_FOLDER, ZOO_FILE, member_info, resolve_text, zoo_models

__all__ = ["EMERGENCE_COLUMNS", "EMERGENCE_SECTIONS", "EmergenceConfig", "emergence_models", "printed_emergence",
           "run_emergence"]

#: The columns of table `emergence`.
EMERGENCE_COLUMNS = ["model", "member", "seed", "step", "tokens", "section", "metric", "value"]


_STEP = re.compile(r"^step(\d+)$")


def _step_of(revision: str) -> int | None:
    m = _STEP.match(revision)
    return int(m.group(1)) if m else None


def emergence_models(paths: Sequence[str], tokens_per_step: float | None = None) -> pd.DataFrame:
    """The models an emergence run measures, in order: one row per model with `spec` (what loads it), its zoo
    record (`record`, None outside a zoo), `member`, `seed`, `step` and `tokens` (NaN where unknown).

    Args:
        paths: zoo folders (their members), member folders (their checkpoints, then themselves) and other model
            specs, `MODEL@step<N>` read as step N.
        tokens_per_step: training tokens per step of the models given as `MODEL@step<N>` (None: tokens unknown).

    Returns:
        The DataFrame; ValueError (before any model loads) for a spec that is no model."""
    from posprobe.backend.sources import split_revision

    rows = []
    for spec, rec in zoo_models(list(paths)):
        if rec is None:
            base, revision = split_revision(spec)
            step = _step_of(revision) if revision else None
            tokens = step * tokens_per_step if step is not None and tokens_per_step else math.nan
            rows.append(dict(spec=spec, record=None, member=base, seed=None,
                             step=math.nan if step is None else step, tokens=tokens))
            continue
        folder = Path(spec)
        # A zoo.json without the batch (written by hand or by an older posprobe): tokens unknown, steps still known.
        per_step = rec.get("batch_size", math.nan) * rec.get("widths", {}).get("length", math.nan)
        last = rec.get("steps", math.nan)
        saved = sorted((int(m.group(1)), p) for p in (folder / STEPS_FOLDER).glob("step*")
                       if (m := _STEP.match(p.name)) and (p / ZOO_FILE).is_file()) \
            if (folder / STEPS_FOLDER).is_dir() else []
        for step, p in saved:
            r = json.loads((p / ZOO_FILE).read_text(encoding="utf-8"))
            rows.append(dict(spec=f"{folder}@step{step}", record=r, member=rec["member"], seed=rec.get("seed"),
                             step=step, tokens=r.get("tokens", step * per_step)))
        rows.append(dict(spec=str(folder), record=rec, member=rec["member"], seed=rec.get("seed"), step=last,
                         tokens=last * per_step))
    return pd.DataFrame(rows, columns=["spec", "record", "member", "seed", "step", "tokens"])


def _metrics(tables: dict[str, pd.DataFrame]) -> list[tuple[str, str, float]]:
    # (section, metric, value) of one model, read off its atlas tables.
    out: list[tuple[str, str, float]] = []
    share = tables.get("sink_overall")
    if share is not None and len(share):
        out += [("sinks", f"sink_share_{r.condition}", float(r.value)) for r in share.itertuples()]
    massive = tables.get("massive_activations")
    if massive is not None and len(massive):
        top = massive[(massive["rank"] == 1) & (massive["condition"] == "random")]
        if len(top):
            out.append(("sinks", "massive_ratio", float(top["ratio"].max())))
    classes = tables.get("head_classes")
    if classes is not None and len(classes):
        held = [c for cs in classes["classes"].fillna("") for c in cs.split(",") if c]
        out += [("heads", f"heads_{c.replace('-', '_')}", float(held.count(c))) for c in CLASSES]
    shift = tables.get("shift_summary")
    if shift is not None and len(shift):
        s = shift.set_index("k")["accuracy"].sort_index()
        if 0 in s.index:
            out.append(("shift", "shift_accuracy_k0", float(s.loc[0])))
            if len(s) > 1:
                out.append(("shift", f"shift_drop_k{int(s.index[-1])}", float(s.loc[0] - s.iloc[-1])))
    return out


def run_emergence(paths: Sequence[str], config: EmergenceConfig | None = None, *, text: str | None = None,
                  source: str | None = None, device: str = "cpu") -> Result:
    """The positional measurements of `config`'s sections on every checkpoint of `paths`, against training tokens.

    Args:
        paths: zoo folders, member folders (their checkpoints saved with `zoo train --save-every K`, then the
            member itself) and other model specs (`MODEL@step<N>` for a hub model's revisions).
        config: sections and their bounds (None: EmergenceConfig's defaults).
        text: the text the sections read (default: the zoo's held-out eval.txt; none and no zoo folder is a
            ValueError).
        source: what meta.json's data record names as the text (default: the eval.txt's path, or "text").
        device: where each model runs ("cpu", "cuda", ...).

    Returns:
        A Result (analysis "zoo-emergence"): table `emergence` (model, member, seed, step, tokens, section, metric,
            value; one row per model and number, tokens NaN where unknown), the sections' own tables over all
            models (tagged with model, member, family, block, seed), `models` (one row per model, with step and
            tokens) and `refused` (model, section, why).

    Examples:
        >>> import posprobe as pp
        >>> from posprobe.data import BUILTIN_TEXT
        >>> cfg = pp.EmergenceConfig(sections=("heads",), window=32, max_windows=2, progress=False)
        >>> r = pp.run_emergence(["tiny-rope"], cfg, text=BUILTIN_TEXT)
        >>> r.tables["emergence"][["model", "metric"]].head(2).values.tolist()
        [['tiny-rope', 'heads_sink'], ['tiny-rope', 'heads_previous_token']]
    """
    cfg = config or EmergenceConfig()
    plan = emergence_models(paths, cfg.tokens_per_step)  # every spec checked before any model loads
    text, source = resolve_text(list(paths), text, source)
    source = source or "text"
    wanted = cfg.wanted()
    declared = {name: section(name) for name in wanted}
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if cfg.progress else (lambda msg: None)
    say(f"emergence: {len(plan)} models x {len(wanted)} sections ({', '.join(wanted)})")
    specs = [(r.spec, r.record) for r in plan.itertuples()]
    models, outcomes, timings = compare_models(specs, declared, CompareRun(cfg, text, tuple(map(str, paths))),
                                               device=device, say=say)
    at = {m.label: (r.step, r.tokens) for m, r in zip(models, plan.itertuples())}
    tables, refused, _ = collect(outcomes)
    rows = []
    for o in outcomes:
        if o.why is None and o.model is not None:
            step, tokens = at[o.label]
            info = member_info(o.label, o.model.record)
            rows += [dict(model=o.label, member=info["member"], seed=info["seed"], step=step, tokens=tokens,
                          section=sec, metric=metric, value=value) for sec, metric, value in _metrics(o.tables)]
    tables["emergence"] = pd.DataFrame(rows, columns=EMERGENCE_COLUMNS)
    tables["models"] = pd.DataFrame([{**model_row(m), "step": at[m.label][0], "tokens": at[m.label][1]}
                                     for m in models])
    tables["refused"] = refused
    tables = {name: df.reset_index(drop=True) for name, df in tables.items()}
    meta = make_meta("zoo-emergence", model={"name": ", ".join(dict.fromkeys(map(str, plan["member"]))),
                                             "positional_kind": "several", "models": [m.spec for m in models]},
                     data=data_meta(source, n_items=len(text), unit="characters", sha256=text_sha256(text)),
                     config=cfg, sections=wanted, seconds=timings)
    return Result(tables, meta)


def printed_emergence(result: Result) -> pd.DataFrame:
    """The emergence table as printed: one row per member, seed and metric, one column per step (values rounded)."""
    df = result.tables["emergence"]
    if not len(df):
        return pd.DataFrame()
    wide = df.assign(seed=df["seed"].astype(str)).pivot_table(index=["member", "seed", "metric"], columns="step",
                                                              values="value", sort=False)
    wide.columns = [f"step {int(c)}" if c == c else "final" for c in wide.columns]
    return wide.round(3).reset_index()
