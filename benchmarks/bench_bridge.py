"""TransformerBridge (posprobe's model type) vs the plain Hugging Face model it wraps: forward time, and the
start-up cost of the CLI (run by hand).

Forward: the same HF weights, once as `posprobe.load_model(spec)` (a bridge) and twice as the bare
`AutoModelForCausalLM` -- with its default attention (SDPA) and with `attn_implementation="eager"`, which is what
the bridge computes (TransformerLens forces eager attention so `hook_attn_scores`/`hook_pattern` see the scores
and the pattern). One `[batch, length]` forward each, rounds interleaved (order rotating), CPU and wall seconds
per round; ratios are taken within a round. A fourth run is posprobe's own forward on the bridge with
`fused_attention=True` (what capture passes use: the wrapped HF attention modules with SDPA, since nothing inside
attention is hooked; `posprobe.backend.fast_attention`).

Start-up: seconds from process start to exit, best of 3, for
  `import torch, transformers` (the floor: nothing from transformers' modelling code is imported yet),
  the same tiny random Llama as plain HF (import, build, tokenizer, one forward; no TransformerLens), and
  `posprobe info tiny-rope --json` (argument parsing, validation, TransformerLens import, bridge boot, facts).
Peak memory after loading is `bench_loading.py`.

Usage: python benchmarks/bench_bridge.py [--spec smollm2] [--length 512] [--batch 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from _timing import interleaved, ratio_summary  # noqa: E402

# The model `posprobe info tiny-rope` builds, as plain transformers: no TransformerLens anywhere.
PLAIN_HF_TINY = ("import torch; from posprobe.backend.tiny import tiny_hf_model, byte_tokenizer; "
                 "m = tiny_hf_model('tiny-rope').eval(); tok = byte_tokenizer(); "
                 "m(input_ids=torch.tensor([tok.encode('hello')]))")


def _startup(cmd: list[str], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
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

    from posprobe.backend.hf import hf_folder
    from posprobe.backend.loading import load_model
    from posprobe.backend.model import forward
    from posprobe.backend.sources import resolve

    bridge = load_model(a.spec)
    folder = hf_folder(resolve(a.spec))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_eager = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    toks = torch.randint(0, 1000, (a.batch, a.length), generator=torch.Generator().manual_seed(0))
    runs = {"hf": lambda: hf(input_ids=toks).logits, "hf_eager": lambda: hf_eager(input_ids=toks).logits,
            "bridge": lambda: bridge(toks), "fused": lambda: forward(bridge, toks, fused_attention=True)}
    with torch.inference_mode():
        for f in runs.values():  # warm-up
            f()
        times, walls = interleaved(runs, a.rounds)
    print(f"forward {a.spec} batch {a.batch} x {a.length} tokens, {a.threads} thread(s), {a.rounds} rounds:")
    for num, den, label in (
        ("bridge", "hf", "bridge / plain HF (SDPA)"),
        ("bridge", "hf_eager", "bridge / plain HF eager"),
        ("hf_eager", "hf", "plain HF eager / SDPA"),
        ("fused", "hf", "posprobe forward(fused_attention=True) on the bridge / plain HF (SDPA)"),
    ):
        med, lo, hi = ratio_summary(times[num], times[den])
        wmed, _, _ = ratio_summary(walls[num], walls[den])
        print(f"  {label}: CPU time {med:.3f}x (range {lo:.3f}-{hi:.3f}), wall {wmed:.3f}x")
    exe = str(Path(sys.executable).parent / "posprobe")
    base = _startup([sys.executable, "-c", "import torch, transformers"], 3)
    plain = _startup([sys.executable, "-c", PLAIN_HF_TINY], 3)
    cli = _startup([exe, "info", "tiny-rope", "--json"], 3)
    print(f"start-up (best of 3): import torch+transformers {base:.2f} s; the tiny Llama as plain HF {plain:.2f} s; "
          f"posprobe info tiny-rope --json {cli:.2f} s ({cli / base:.2f}x the imports, {cli / plain:.2f}x plain HF)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
