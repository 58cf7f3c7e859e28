"""Peak memory of loading a model: posprobe.backend.loading.load_model vs plain Hugging Face (run by hand).

Each load runs in a fresh subprocess, which reports its peak resident set size (ru_maxrss) and its
resident size right after the imports (so the import cost of TransformerLens is visible on its own).
The HF folder is the one posprobe caches (GGUF dequantised once), so both read the same fp32 weights.
posprobe's load includes the model's tokenizer (a bridge boots with one), so the plain-HF child loads the
tokenizer too, after its forward, and reports the peak with and without it (Gemma 3's is ~300 MB).
Rounds are interleaved; medians are printed. The load is also timed in CPU seconds of the child
(process time; one torch thread by default, `--threads`) beside wall seconds, and the load average is
printed before and after each round, so a quiet run can be told from a loaded one.

Usage: python benchmarks/bench_loading.py [--specs smollm2 gemma3-270m] [--n-ctx 2048] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import loadavg  # noqa: E402

CHILD = r"""
import json, os, resource, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
kind, spec, n_ctx, threads = sys.argv[1], sys.argv[2], (int(sys.argv[3]) or None), int(sys.argv[4])

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

import torch
torch.set_num_threads(threads)
from posprobe.backend.sources import resolve
from posprobe.backend.hf import hf_folder
folder = hf_folder(resolve(spec))  # cached by an earlier run; no conversion is timed here
if kind == "posprobe":
    import transformer_lens  # noqa: F401 - counted in the import baseline, not in the load
    from posprobe.backend.loading import load_model
else:
    from transformers import AutoModelForCausalLM
after_imports = rss_mb()
t0, c0 = time.perf_counter(), time.process_time()
if kind == "posprobe":
    m = load_model(spec, n_ctx=n_ctx)
else:
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
secs, cpu_secs = time.perf_counter() - t0, time.process_time() - c0
n_params = sum(p.numel() for p in m.parameters())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
# Memory-mapped safetensors pages count only once touched: one short forward touches every weight.
with torch.inference_mode():
    m(torch.tensor([[1, 2, 3, 4]])) if kind == "posprobe" else m(input_ids=torch.tensor([[1, 2, 3, 4]]))
peak_fwd = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if kind == "hf":  # the bridge holds the model's tokenizer (it cannot boot offline without one): count it here too
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
peak_tok = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(dict(peak_mb=peak, peak_fwd_mb=peak_fwd, peak_tok_mb=peak_tok, imports_mb=after_imports, seconds=secs,
                      cpu_seconds=cpu_secs, n_params=n_params)))
"""


def run_child(kind: str, spec: str, n_ctx: int | None, threads: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", CHILD, kind, spec, str(n_ctx or 0), str(threads)], capture_output=True,
                       text=True, env=env, cwd=ROOT)
    if p.returncode:
        raise RuntimeError(f"{kind} {spec} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", nargs="+", default=["smollm2"])
    ap.add_argument("--n-ctx", type=int, default=2048, help="n_ctx cap for posprobe on gemma3-270m (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each child")
    a = ap.parse_args(argv)
    rows = []
    for spec in a.specs:
        n_ctx = a.n_ctx if spec.startswith("gemma") else None
        res: dict[str, list[dict]] = {"hf": [], "posprobe": []}
        for r in range(a.rounds):
            print(f"{spec} round {r + 1} before: {loadavg()}", flush=True)
            for kind in (("hf", "posprobe") if r % 2 == 0 else ("posprobe", "hf")):
                res[kind].append(run_child(kind, spec, n_ctx, a.threads))
                print(f"{spec} round {r + 1} {kind}: {res[kind][-1]}", flush=True)
            print(f"{spec} round {r + 1} after: {loadavg()}", flush=True)
        med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in res.items()}
        rows.append((spec, n_ctx, med))
    print("\nPeak RSS in MB (median of rounds); 'load' = after from_pretrained/load_model, 'fwd' = after one "
          "4-token forward (touches every mmapped weight); 'tok' = 'fwd' with the model's tokenizer loaded too "
          "(posprobe loads it while booting; HF after the forward); '-imp' = minus the RSS right after imports")
    cols = ("load", "fwd", "tok", "fwd-imp", "tok-imp")
    print(f"{'model':13} {'n_ctx':>5} " + " ".join(f"{'HF ' + c:>12} {'pp ' + c:>12} {'ratio':>6}" for c in cols)
          + f" {'HF s':>6} {'pp s':>6} {'HF cpu':>6} {'pp cpu':>6}")
    for spec, n_ctx, m in rows:
        line = f"{spec:13} {str(n_ctx or '-'):>5} "
        for c in cols:
            key = {"load": "peak_mb", "fwd": "peak_fwd_mb", "tok": "peak_tok_mb"}[c.split("-")[0]]
            h, p = m["hf"][key], m["posprobe"][key]
            if c.endswith("-imp"):
                h, p = h - m["hf"]["imports_mb"], p - m["posprobe"]["imports_mb"]
            line += f"{h:12.0f} {p:12.0f} {p / h:5.2f}x "
        print(line + f"{m['hf']['seconds']:6.1f} {m['posprobe']['seconds']:6.1f} "
              f"{m['hf']['cpu_seconds']:6.1f} {m['posprobe']['cpu_seconds']:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
