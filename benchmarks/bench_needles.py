"""Benchmark: the needle suite's cost per prompt vs a plain Hugging Face `generate` of the same prompt and answer
length, and its memory against the prompt's length.

Per prompt length, one seeded needle prompt (`niah_single_2`, depth 0.5); interleaved rounds (order rotated):
  generate  `model.generate(ids, max_new_tokens=n, min_new_tokens=n)`, greedy, the model's own SDPA attention and
            KV cache, n = the number of tokens posprobe's answer had (the reference)
  answer    `answer_heads(..., heads=False)` under preset none: the model's own forward with a KV cache, the answer
            decoded and scored (`posprobe long-context --task`)
  heads     `answer_heads(...)` with every answer step's attention weights recorded and the per-head retrieval
            score, needle mass and first-token mass computed (`posprobe retrieval`, unmasked)
  masked    `answer_heads(..., masked=5 heads, heads=False)`: the long-context engine with 5 heads zeroed (the
            masking runs of `posprobe retrieval`)
CPU time (this process, one torch thread by default) is the headline, wall time beside it; ratios are paired within
a round. Memory: peak RSS above the level at the start of each call, per 1k prompt tokens (the engine never builds a
T x T tensor; the KV cache and the activations grow linearly). Target: heads / generate <= 1.2 (CPU time).

    python benchmarks/bench_needles.py --model smollm2 --lengths 1024 2048 4096 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _timing import Timed, loadavg, ratio_summary, rotate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--task", default="niah_single_2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--text", default=None, help="haystack text file (default: the built-in text)")
    args = ap.parse_args()

    import torch

    from posprobe.analyses.retrieval import answer_heads
    from posprobe.backend.loading import load_hf_model
    from posprobe.core.presets import preset_pairs
    from posprobe.data import BUILTIN_TEXT
    from posprobe.data.needles import TASKS, needle_prompt

    torch.set_num_threads(args.threads)
    model, tok = load_hf_model(args.model)
    text = open(args.text, encoding="utf-8").read() if args.text else BUILTIN_TEXT
    none = preset_pairs("none")
    budget = TASKS[args.task].answer_tokens()
    masked = {18: (6, 7), 17: (3, 4), 23: (2,)}  # SmolLM2's top-5 retrieval heads (README); any 5 heads cost the same
    print(f"model={args.model} task={args.task} rounds={args.rounds} threads={torch.get_num_threads()} "
          f"torch={torch.__version__}", flush=True)
    print("| length | answer tokens | generate CPU s | answer CPU s | heads CPU s | masked CPU s | "
          "**heads / generate** (CPU) | answer / generate | masked / generate | heads / generate (wall) | "
          "peak MiB per 1k tokens: generate / heads / masked |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for length in args.lengths:
        p = needle_prompt(tok, args.task, length, 0.5, 0, text=text)
        ids = torch.tensor(p.ids)
        n = len(answer_heads(model, tok, p, none, budget, heads=False)["tokens"])

        def generate() -> None:
            with torch.no_grad():
                out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
            assert out.shape[1] == len(ids) + n

        runs = {
            "generate": generate,
            "answer": lambda: answer_heads(model, tok, p, none, budget, heads=False),
            "heads": lambda: answer_heads(model, tok, p, none, budget),
            "masked": lambda: answer_heads(model, tok, p, none, budget, masked=masked, heads=False),
        }
        generate()  # warm-up: generate's first call builds its caches and compiles nothing else
        cpu = {k: [] for k in runs}
        wall = {k: [] for k in runs}
        peak = {k: [] for k in runs}
        print(f"before {length}: {loadavg()}", flush=True, file=sys.stderr)
        for r in range(args.rounds):
            for k in rotate(list(runs), r):
                with Timed() as t:
                    runs[k]()
                cpu[k].append(t.cpu)
                wall[k].append(t.wall)
                peak[k].append(t.peak / 2**20)
        print(f"after {length}: {loadavg()}", flush=True, file=sys.stderr)
        med = {k: statistics.median(v) for k, v in cpu.items()}

        def ratio(k: str, times: dict = cpu) -> str:
            m, lo, hi = ratio_summary(times[k], times["generate"])
            return f"{m:.2f} [{lo:.2f}–{hi:.2f}]"

        per_k = {k: max(peak[k]) * 1000 / length for k in runs}
        print(f"| {length:,} | {n} | {med['generate']:.2f} | {med['answer']:.2f} | {med['heads']:.2f} | "
              f"{med['masked']:.2f} | **{ratio('heads')}** | {ratio('answer')} | {ratio('masked')} | "
              f"{ratio('heads', wall)} | {per_k['generate']:.0f} / {per_k['heads']:.0f} / {per_k['masked']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
