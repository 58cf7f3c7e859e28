"""Peak memory of one long forward vs length: posprobe's chunked long-context engine vs Hugging Face eager
attention (which builds the T x T pattern), on a small random Llama.

    python benchmarks/bench_long_context.py --lengths 2048 4096 8192 --preset rerope:window=512

Each (route, length) runs in a fresh subprocess and reports its peak RSS (ru_maxrss) above the RSS after the
model was built, and its wall/CPU seconds. Linear memory shows as a constant MiB per 1k tokens; the eager
route grows with T^2 (heads x T^2 x 4 bytes per layer for the scores alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHILD = r"""
import json, resource, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
from posprobe.core import long_engine as LA
from posprobe.core import surgery as S
from posprobe.core.presets import preset_pairs, preset_plan
route, length, preset, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=1024, attn_implementation="eager")
m = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 1000, (length,))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t, c = time.perf_counter(), time.process_time()
with torch.no_grad():
    if route == "engine":
        LA.token_nll(m, ids, preset_pairs(preset))
    else:  # HF eager at default positions: the T x T pattern per layer
        m.get_decoder()(input_ids=ids[None])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"route": route, "length": length, "peak_mib": (peak - base) / 1024,
                  "wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--preset", default="rerope:window=512", help="engine preset (a chunked one shows the chunking)")
    ap.add_argument("--routes", nargs="+", default=["engine", "eager"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()}", file=sys.stderr)
    print(f"{'route':<8} {'length':>7} {'peak MiB':>9} {'MiB/1k tok':>10} {'wall s':>7} {'cpu s':>7}")
    for route in args.routes:
        for n in args.lengths:
            out = subprocess.run([sys.executable, "-c", CHILD, route, str(n), args.preset, str(args.threads)],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{route:<8} {n:>7} {r['peak_mib']:>9.0f} {1000 * r['peak_mib'] / n:>10.1f} {r['wall_s']:>7.1f} "
                  f"{r['cpu_s']:>7.1f}", flush=True)
    print(f"load average {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"total {time.time() - t0:.0f} s", file=sys.stderr)
