"""Benchmark: the squish study's batched generation vs Hugging Face `generate` on the same batch of prompts.

One batch of the study's prompts (SmolLM2's chat template, the instruction as system message, `--batch` built-in
questions, `--distance` filler turns); interleaved rounds (order rotated), every row generating exactly `--new`
tokens greedily:
  generate   `model.generate(left-padded batch, attention_mask, max_new_tokens=n, min_new_tokens=n)`: the model's
             own SDPA attention and KV cache
  normal     `decode_batch(prefix, rows)`: the shared prefix through the long-context engine once, rows on the
             model's own KV cache (the study's normal condition)
  squished   the same under `key_squish(to=0, variant=cache)` (the study's squish:0 condition)
  moved      keys at 0 and later queries moved out by 1000 positions, keys variant (the prefix's plan needs the
             engine's per-pair views)
Generated tokens per second (batch x new tokens / wall time) is the headline, CPU time beside it; ratios are paired
within a round. Target: normal / generate >= 0.9 (tokens/s).

    python benchmarks/bench_squish_study.py --model smollm2 --batch 16 --new 32 --rounds 3
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
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--distance", type=int, default=0, help="filler turns between instruction and question")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    import torch

    from posprobe.analyses.squish_study import render_study_prompt
    from posprobe.backend.loading import load_hf_model
    from posprobe.core.batch_decode import decode_batch
    from posprobe.core.surgery import key_squish
    from posprobe.data.instructions import builtin_instructions
    from posprobe.data.questions import builtin_questions

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_hf_model(args.model, device=args.device)
    inst = builtin_instructions(["french"])[0]
    prompts = [render_study_prompt(tok, "system", args.distance, inst.text, q.text)
               for q in builtin_questions(args.batch)]
    c = 0
    while all(p.tokens[c] == prompts[0].tokens[c] for p in prompts):
        c += 1
    span = prompts[0].span
    prefix = torch.tensor(prompts[0].tokens[:c])
    rests = [torch.tensor(p.tokens[c:]) for p in prompts]
    width = max(len(p.tokens) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF's generate expects for decoders
        ids[i, width - len(p.tokens):] = torch.tensor(p.tokens)
        mask[i, width - len(p.tokens):] = 1
    ids, mask = ids.to(args.device), mask.to(args.device)
    plans = {"squished": key_squish(c, span, to=0.0, variant="cache"),
             "moved": key_squish(c, span, to=0.0, variant="keys", query_start=span[1] + 1000.0)}

    def generate() -> None:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                                 do_sample=False, pad_token_id=pad)
        assert out.shape[1] == width + args.new

    def ours(plan=None):
        def run() -> None:
            out = decode_batch(model, prefix, rests, plan=plan, max_new_tokens=args.new, batch_size=args.batch)
            assert all(len(t) == args.new for t in out.tokens)
        return run

    runs = {"generate": generate, "normal": ours(), "squished": ours(plans["squished"]), "moved": ours(plans["moved"])}
    for fn in runs.values():  # warm-up
        fn()
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    print(f"model={args.model} batch={args.batch} new={args.new} prompt tokens {min(len(p.tokens) for p in prompts)}"
          f"-{width} (shared prefix {c}) rounds={args.rounds} threads={torch.get_num_threads()} "
          f"device={args.device} torch={torch.__version__}", flush=True)
    print(f"before: {loadavg()}", file=sys.stderr, flush=True)
    for r in range(args.rounds):
        for k in rotate(list(runs), r):
            with Timed(rss=False) as t:
                runs[k]()
            wall[k].append(t.wall)
            cpu[k].append(t.cpu)
    print(f"after: {loadavg()}", file=sys.stderr, flush=True)
    tokens = args.batch * args.new
    print("| run | tokens/s (wall, median) | CPU s (median) | tokens/s ratio to generate (wall) [min-max] |")
    print("| --- | --- | --- | --- |")
    for k in runs:
        m, lo, hi = ratio_summary(wall["generate"], wall[k])  # speed ratio = generate's time / ours
        print(f"| {k} | {tokens / statistics.median(wall[k]):.1f} | {statistics.median(cpu[k]):.2f} | "
              f"{m:.2f} [{lo:.2f}-{hi:.2f}] |", flush=True)


if __name__ == "__main__":
    main()
