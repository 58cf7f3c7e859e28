"""TransformerBridge (posprobe's model type) vs the plain Hugging Face model it wraps: forward time, and the
start-up cost of the CLI (run by hand).

Forward: the same HF weights, once as `posprobe.load_model(spec)` (a bridge) and once as the bare
`AutoModelForCausalLM`, one `[batch, length]` forward each, rounds interleaved (order alternating), CPU and wall
seconds per round; the ratio is taken within a round. Start-up: seconds from process start to the end of
`import torch, transformers` vs to the end of `posprobe info tiny-rope --json` (argument parsing, validation,
TransformerLens import and a tiny model build included). Peak memory after loading is `bench_loading.py`.

Usage: python benchmarks/bench_bridge.py [--spec smollm2] [--length 512] [--batch 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _timing import Timed, loadavg, ratio_summary, rotate  # noqa: E402


def _startup(cmd: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env={"HF_HUB_OFFLINE": "1", "PATH": str(Path(sys.executable).parent)})
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="smollm2")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from posprobe.backend.loading import hf_folder, load_model
    from posprobe.backend.sources import resolve

    bridge = load_model(a.spec)
    hf = AutoModelForCausalLM.from_pretrained(hf_folder(resolve(a.spec)), dtype=torch.float32).eval()
    toks = torch.randint(0, 1000, (a.batch, a.length), generator=torch.Generator().manual_seed(0))
    runs = {"hf": lambda: hf(input_ids=toks).logits, "bridge": lambda: bridge(toks)}
    with torch.inference_mode():
        for f in runs.values():  # warm-up
            f()
        times: dict[str, list[float]] = {"hf": [], "bridge": []}
        walls: dict[str, list[float]] = {"hf": [], "bridge": []}
        print(f"before: {loadavg()}", file=sys.stderr)
        for r in range(a.rounds):
            for name in rotate(list(runs), r):
                with Timed(rss=False) as t:
                    runs[name]()
                times[name].append(t.cpu)
                walls[name].append(t.wall)
        print(f"after: {loadavg()}", file=sys.stderr)
    med, lo, hi = ratio_summary(times["bridge"], times["hf"])
    wmed, _, _ = ratio_summary(walls["bridge"], walls["hf"])
    print(f"forward {a.spec} batch {a.batch} x {a.length} tokens, {a.threads} thread(s), {a.rounds} rounds:")
    print(f"  bridge / plain HF: CPU time {med:.3f}x (range {lo:.3f}-{hi:.3f}), wall {wmed:.3f}x")
    exe = str(Path(sys.executable).parent / "posprobe")
    base = _startup([sys.executable, "-c", "import torch, transformers"], 3)
    cli = _startup([exe, "info", "tiny-rope", "--json"], 3)
    print(f"start-up: import torch+transformers {base:.2f} s; posprobe info tiny-rope --json {cli:.2f} s "
          f"({cli / base:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
