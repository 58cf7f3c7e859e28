"""One command to check posprobe on whatever device is present: identities and speed ratios, one table.

    python benchmarks/gpu_check.py                       # --device auto (cuda > mps > cpu), tiny-rope
    python benchmarks/gpu_check.py --model smollm2 --dtypes float32 bfloat16
    python benchmarks/gpu_check.py --quick               # seconds on a CPU (what the test runs)

Identities (each against an independent computation, never posprobe against itself):
  default-plan   logits under the identity position plan vs the plain forward
  rope-shift     logits with queries and keys both shifted by 100 vs the plain forward
  bands=scores   per-band partial dot products + unrotated rest vs the model's own hook_attn_scores
  decompose      data-driven score decomposition terms summed vs the model's scores (where supported)
Errors are max |difference| / max |reference| (relative); each row states the tolerance for its device
and dtype and passes or fails against it.

The zoo's research tier (`--zoo`, on by default): two members (learned, rope-llama) trained a few steps through the
zoo's own loop at the tier's real widths (d 768, 10 / 12 layers, L 2,048, micro-batches of 8) on the device, in the
tier's precision (bf16 on CUDA), weights saved every few steps, then the emergence page over those checkpoints;
per member: its warm-up tokens/s and the hours the full tier's D would take at that rate, the loss finite, the saved
steps present. `--quick` shrinks it to a CPU smoke run (d 64, 2 layers, L 128).

Speed ratios (median wall time of `--repeats` interleaved rounds, divided by a bare forward of the same
tokens in the same round): the frequency pass (`--queries 32`) and the scoring path (TLScorer at k=0 and
k=100) at each `--batches` size. On cuda the clock waits for the device (torch.cuda.synchronize).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Relative tolerance per (device type, dtype) for each identity; measured values are printed beside it.
#: float32 on cuda: the default plan differs from the model by ~1e-6 (sin/cos kernels), not 0 as on CPU.
TOLERANCE = {
    "default-plan": {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3},
    "rope-shift": {"float64": 1e-9, "float32": 1e-4, "bfloat16": 1e-1, "float16": 2e-2},
    "bands=scores": {"float64": 1e-10, "float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3},
    "decompose": {"float64": 1e-10, "float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2},
}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def _rel(a, b) -> float:

    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def identities(model, device: str, dtype: str, n: int) -> list[dict]:
    """The four identity rows for one loaded model."""
    import torch

    from posprobe.backend.facts import model_facts
    from posprobe.backend.hooks import kept_scores, score_scale
    from posprobe.backend.model import forward
    from posprobe.core.capture import capture
    from posprobe.core.positions import PositionPlan, rope_positions, shifted_plan
    from posprobe.rope import band_contributions

    facts = model_facts(model)
    toks = torch.randint(3, 250, (2, n), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []

    def row(name: str, err: float | None, note: str = "") -> None:
        tol = TOLERANCE[name][dtype]
        rows.append(dict(check=name, device=device, dtype=dtype, value=err, tolerance=tol,
                         ok="n/a" if err is None else ("pass" if err <= tol else "FAIL"), note=note))

    plain = forward(model, toks)
    if facts.positional_kind == "rotary":
        with rope_positions(model, PositionPlan.default(n)):
            row("default-plan", _rel(forward(model, toks), plain))
        with rope_positions(model, shifted_plan(n, 100)):
            row("rope-shift", _rel(forward(model, toks), plain))
        got = capture(model, toks, ["rot_q", "rot_k", "scores"], layers=[0])
        bands, rest = band_contributions(got["rot_q", 0].double(), got["rot_k", 0].double(), facts.rotary[0],
                                         score_scale(model, 0))
        scores = got["scores", 0]
        ok = kept_scores(model, scores)
        row("bands=scores", _rel((bands.sum(2) + rest)[ok], scores[ok]))
    else:
        for name in ("default-plan", "rope-shift", "bands=scores"):
            row(name, None, f"{facts.positional_kind} positions")
    try:
        from posprobe.analyses.decompose import decompose_layer, positional_mean

        mean = positional_mean(model, toks, [0], batch_size=2, progress=False)[0]
        dec = decompose_layer(model, toks[:1], 0, mean)
        ok = dec.allowed
        row("decompose", _rel(dec.reconstructed()[ok], dec.scores.double()[ok]))
    except NotImplementedError as e:
        row("decompose", None, str(e).split(";")[0][:60])
    return rows


def _timed(fn, device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def speed(model, device: str, dtype: str, *, tokens: int, window: int, batches: list[int], repeats: int) -> list[dict]:
    """Speed ratio rows (frequency pass, scoring path) against a bare forward of the same tokens."""
    import torch

    from posprobe.analyses.frequency import frequency_usage
    from posprobe.backend.facts import model_facts
    from posprobe.backend.model import forward
    from posprobe.core.scoring import Positioned, TLScorer

    facts = model_facts(model)
    n_rows = max(1, tokens // window)
    rows = torch.randint(3, 250, (n_rows, window), generator=torch.Generator().manual_seed(1))
    out = []

    def bare(batch: int) -> None:
        with torch.inference_mode():
            for i in range(0, n_rows, batch):
                forward(model, rows[i:i + batch].to(device))

    for batch in batches:
        jobs = {"bare": lambda b=batch: bare(b)}
        if facts.positional_kind == "rotary":
            jobs["frequency pass (queries 32)"] = lambda b=batch: frequency_usage(
                model, rows, batch_size=b, queries=32, progress=False)
        scorer = TLScorer(model) if facts.has_lm_head and not facts.is_encoder else None
        if scorer is not None:
            for k in (0, 100):
                items = [Positioned(tuple(r.tolist()), tuple(range(k, k + window))) for r in rows]
                jobs[f"scoring k={k}"] = lambda b=batch, it=items: scorer.token_logprobs(it, batch_size=b)
        times: dict[str, list[float]] = {name: [] for name in jobs}
        for name, fn in jobs.items():  # warm-up (allocator, kernels, caches)
            fn()
        for _ in range(repeats):  # interleaved rounds: a neighbour's load hits every job alike
            for name, fn in jobs.items():
                times[name].append(_timed(fn, device))
        base = statistics.median(times["bare"])
        for name, ts in times.items():
            if name != "bare":
                out.append(dict(check=f"{name} / bare forward", device=device, dtype=dtype, batch=batch,
                                value=statistics.median(ts) / base, seconds=statistics.median(ts), bare_seconds=base))
    return out


def zoo_smoke(device: str, quick: bool) -> list[dict]:
    """Rows of the research tier's smoke run: train, save every few steps, emergence (see the module docstring)."""
    import math
    import tempfile

    from posprobe import EmergenceConfig, ZooConfig, run_emergence, train_zoo
    from posprobe.data import builtin_corpus
    from posprobe.zoo.budget import zoo_budget

    sizes = dict(d_model=64, n_layers=2, n_heads=2, gpt_n_layers=2, gpt_n_heads=2, length=128, vocab_size=1024,
                 batch_size=8, micro_batch=4) if quick else dict(vocab_size=8192)
    cfg = ZooConfig(tier="research", members=("learned", "rope-llama"), steps=6, save_every=3, device=device,
                    progress=False, **sizes)
    full = ZooConfig(tier="research", members=cfg.members, device=device, progress=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = train_zoo(cfg, builtin_corpus() * (1 if quick else 8), Path(tmp) / "zoo", budget_steps=3)
        seconds = time.perf_counter() - t0
        rates = {b["member"]: b["tokens_per_s"] for b in result.meta["budget"]}
        hours = {b.member: b.tokens / rates[b.member] / 3600 for b in zoo_budget(full)}
        for r in result.tables["members"].itertuples():
            saved = sorted(p.name for p in (Path(tmp) / "zoo" / r.model / "checkpoints").iterdir())
            ok = math.isfinite(r.loss) and saved == ["step0", "step3"]
            rows.append(dict(check=f"zoo research {r.member}", device=device, dtype=cfg.precision,
                             value=round(rates[r.member]), ok="ok" if ok else "FAIL", seconds=round(seconds, 1),
                             note=("warm-up tokens/s at the smoke run's shrunk sizes; " if quick else
                                   f"warm-up tokens/s; the full tier's D: {hours[r.member]:,.1f} h per member here; ")
                             + f"{r.params / 1e6:.1f}M params, loss {r.loss:.2f}, saved {', '.join(saved)}"))
        t0 = time.perf_counter()
        em = run_emergence([str(Path(tmp) / "zoo")], EmergenceConfig(sections=("sinks", "heads"), max_windows=4,
                                                                    sink_samples=4, progress=False), device=device)
        n = em.tables["emergence"]["model"].nunique()
        rows.append(dict(check="zoo emergence", device=device, dtype="float32", value=n,
                         ok="ok" if n == 6 and em.tables["refused"].empty else "FAIL",
                         seconds=round(time.perf_counter() - t0, 1), note="checkpoints measured (2 members x 3)"))
    return rows


def main(argv: list[str] | None = None) -> int:
    from posprobe.cli.args import resolve_device

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-rope")
    p.add_argument("--device", default="auto", type=resolve_device, help="auto (cuda > mps > cpu), cpu, cuda, mps")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float64", "float32", "bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=32768, help="tokens per timed pass")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds on a CPU")
    p.add_argument("--no-zoo", dest="zoo", action="store_false", help="skip the research tier's smoke run")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.window, a.batches, a.repeats = 256, 32, [4], 1
    import pandas as pd
    import torch

    from posprobe.backend.loading import load_model

    if a.device == "cpu":
        a.dtypes = [d for d in a.dtypes if d != "float16"]  # no fp16 matmul worth timing on a CPU
    rows = []
    for dtype in a.dtypes:
        model = load_model(a.model, device=a.device, dtype=dtype)
        with torch.no_grad():
            rows += identities(model, a.device, dtype, n=min(a.window, 64))
            rows += speed(model, a.device, dtype, tokens=a.tokens, window=a.window, batches=a.batches,
                          repeats=a.repeats)
        del model
    if a.zoo:
        rows += zoo_smoke(a.device, a.quick)
    df = pd.DataFrame(rows)
    cols = [c for c in ("check", "device", "dtype", "batch", "value", "tolerance", "ok", "seconds", "bare_seconds",
                        "note") if c in df.columns]
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    print(f"posprobe gpu_check: {a.model} on {name}, torch {torch.__version__}")
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.float_format", "{:.3g}".format):
        print(df[cols].astype(object).fillna("").to_string(index=False))
    return 1 if (df.get("ok") == "FAIL").any() else 0


if __name__ == "__main__":
    raise SystemExit(main())
