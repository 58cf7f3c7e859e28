"""Benchmark: the zoo's training loop against a bare torch loop over the same Hugging Face model.

Per member, interleaved rounds (order rotated), each from the same freshly initialised weights on the same batches:
  bare     forward with labels, backward, AdamW step, zero_grad — nothing else
  posprobe `posprobe.zoo.train.train_member`: the same plus gradient clipping, the cosine schedule, batch drawing,
           a loss log every 10 steps, checkpoints every `--checkpoint-every` steps (written atomically), progress
           and saving the member folder at the end
CPU time of this process is the headline (all torch threads; `--threads`, default 2, the CPU tier's setting),
wall time beside it; ratios are tokens/s of posprobe over bare, paired within a round (target >= 0.95).
Peak RSS above the level at the start of each call is printed too.

    python benchmarks/bench_zoo.py --members rope learned alibi --steps 200 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from _timing import Timed, loadavg, ratio_summary, rotate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", nargs="+", default=["rope", "learned", "alibi"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    args = ap.parse_args()

    import torch

    from posprobe.data import builtin_corpus
    from posprobe.zoo.config import ZooConfig
    from posprobe.zoo.members import member
    from posprobe.zoo.tokenizer import train_tokenizer
    from posprobe.zoo.train import batch_ids, build_model, next_token_labels, train_member

    torch.set_num_threads(args.threads)
    cfg = ZooConfig(steps=args.steps, checkpoint_every=args.checkpoint_every, progress=False)
    text = builtin_corpus()
    tok = train_tokenizer(text, cfg.vocab_size)
    ids = torch.tensor(tok(text)["input_ids"])
    batches = [batch_ids(ids, s, cfg, 0) for s in range(cfg.steps)]
    tokens = cfg.steps * cfg.tokens_per_step
    print(f"{loadavg()}; torch threads {args.threads}; {cfg.steps} steps of {cfg.batch_size} x {cfg.length} tokens",
          file=sys.stderr)

    def bare(name: str) -> None:
        m = member(name)
        model = build_model(m, cfg, tok, 0).train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        for x in batches:
            # The same loss posprobe's loop computes (a class that does not shift its labels gets them shifted).
            model(input_ids=x, labels=x if m.shifts_labels else next_token_labels(x)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def posprobe_loop(name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            from posprobe.report.checkpoint import Checkpoint

            ckpt = Checkpoint(os.path.join(tmp, "work"), {"bench": name})
            train_member(name, 0, cfg, ids, tok, Path(tmp) / "m",
                         (lambda: None, lambda s: ckpt.put("state", s)))

    print("member     | posprobe / bare tokens/s (CPU) [min-max] | wall | bare k tok/s CPU | peak RSS bare / posprobe")
    for name in args.members:
        cpu = {"bare": [], "posprobe": []}
        wall = {"bare": [], "posprobe": []}
        peak = {"bare": [], "posprobe": []}
        methods = {"bare": bare, "posprobe": posprobe_loop}
        for r in range(args.rounds):
            for key in rotate(list(methods), r):
                with Timed() as t:
                    methods[key](name)
                cpu[key].append(t.cpu)
                wall[key].append(t.wall)
                peak[key].append(t.peak)
        med, lo, hi = ratio_summary(cpu["bare"], cpu["posprobe"])  # time ratio bare/posprobe = tokens/s ratio
        wmed = statistics.median(a / b for a, b in zip(wall["bare"], wall["posprobe"]))
        print(f"{name:10s} | {med:.3f}x [{lo:.3f}-{hi:.3f}] | {wmed:.3f}x | "
              f"{tokens / statistics.median(cpu['bare']) / 1000:.1f} | "
              f"{max(peak['bare']) / 2**20:.0f} / {max(peak['posprobe']) / 2**20:.0f} MiB")
    print(loadavg(), file=sys.stderr)


if __name__ == "__main__":
    main()
