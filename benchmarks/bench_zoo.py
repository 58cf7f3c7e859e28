"""Benchmark: the zoo's training loop against a bare torch loop over the same Hugging Face model.

Per member, interleaved rounds (order rotated), each from the same freshly initialised weights on the same batches:
  bare     forward with labels, backward, AdamW step, zero_grad — nothing else
  posprobe `posprobe.zoo.train.train_member`: the same plus gradient clipping, the cosine schedule, batch drawing,
           a loss log every 10 steps, checkpoints every `--checkpoint-every` steps (written atomically), progress
           and saving the member folder at the end
CPU time of this process is the headline (all torch threads; `--threads`, default 2, the CPU tier's setting),
wall time beside it; ratios are tokens/s of posprobe over bare, paired within a round (target >= 0.95).
Peak RSS above the level at the start of each call is printed too.

With `--extend METHOD` it measures `zoo extend`'s fine-tuning instead: a member (trained for one step, the weights do
not matter for speed) continued from L to L' = 4L under METHOD, through `posprobe.zoo.train.train_member` on the
run's job (the zoo's loop started from the saved member with the method's config, no checkpoint scoring) against the
bare loop over
the same model, loaded by `ExtendJob.start`, on the same batches of L'-token windows.

    python benchmarks/bench_zoo.py --members rope learned alibi --steps 200 --rounds 3
    python benchmarks/bench_zoo.py --members rope-llama rope --extend pi --steps 200 --rounds 3
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

HEADER = "member     | posprobe / bare tokens/s (CPU) [min-max] | wall | bare k tok/s CPU | peak RSS bare / posprobe"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", nargs="+", default=["rope", "learned", "alibi"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--extend", metavar="METHOD", default=None,
                    help="measure zoo extend's fine-tuning at L' = 4L under this method (pi, ntk, yarn, abf, direct)")
    args = ap.parse_args()
    if args.extend is not None:
        return extend_main(args)

    import torch

    from posprobe.data import builtin_corpus
    from posprobe.zoo.config import ZooConfig
    from posprobe.zoo.job import Job
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
            model(input_ids=x, labels=x if m.architecture.shifts_labels else next_token_labels(x)).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def posprobe_loop(name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            from posprobe.report.checkpoint import Checkpoint

            ckpt = Checkpoint(os.path.join(tmp, "work"), {"bench": name})
            train_member(Job.text(name, 0, cfg, tok, ids), Path(tmp) / "m",
                         (lambda: None, lambda s: ckpt.put("state", s)))

    print(HEADER)
    for name in args.members:
        _report(name, {"bare": lambda name=name: bare(name), "posprobe": lambda name=name: posprobe_loop(name)},
                args.rounds, tokens)
    print(loadavg(), file=sys.stderr)


def extend_main(args: argparse.Namespace) -> None:
    """`--extend METHOD`: zoo extend's fine-tuning at L' through posprobe's loop against a bare loop (see the top)."""
    import torch

    from posprobe.data import builtin_corpus
    from posprobe.report.checkpoint import Checkpoint
    from posprobe.zoo.config import ZooConfig
    from posprobe.zoo.extend import ExtendConfig, plan_extension
    from posprobe.zoo.members import member
    from posprobe.zoo.run import train_zoo
    from posprobe.zoo.train import batch_ids, next_token_labels, train_member

    torch.set_num_threads(args.threads)
    text = builtin_corpus()
    with tempfile.TemporaryDirectory() as tmp:
        zoo = Path(tmp) / "zoo"
        train_zoo(ZooConfig(members=tuple(args.members), steps=1, progress=False), text, zoo)
        cfg = ExtendConfig(methods=(args.extend,), steps=args.steps, checkpoints=(),
                           checkpoint_every=args.checkpoint_every, progress=False)
        jobs, _ = plan_extension(zoo, cfg)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(jobs[0].source)
        ids = torch.tensor(tok(text)["input_ids"])
        print(f"{loadavg()}; torch threads {args.threads}; {args.extend}: {cfg.steps} steps of {jobs[0].batch_size} x "
              f"{jobs[0].target} tokens (L = {jobs[0].length})", file=sys.stderr)
        print(HEADER)
        for job in jobs:
            zc = job.train_config(cfg)
            batches = [batch_ids(ids, s, zc, job.seed) for s in range(cfg.steps)]
            shifts = member(job.member).architecture.shifts_labels

            def bare(job=job, batches=batches, zc=zc, shifts=shifts) -> None:
                model = job.start()
                opt = torch.optim.AdamW(model.parameters(), lr=zc.lr)
                for x in batches:
                    model(input_ids=x, labels=x if shifts else next_token_labels(x)).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

            def posprobe_loop(job=job) -> None:
                with tempfile.TemporaryDirectory() as run:
                    ckpt = Checkpoint(os.path.join(run, "work"), {"bench": job.folder_name})
                    train_member(job.job(cfg, ids, tok), Path(run) / "m",
                                 (lambda: None, lambda s: ckpt.put("state", s)))

            _report(job.folder_name, {"bare": bare, "posprobe": posprobe_loop}, args.rounds,
                    cfg.steps * job.batch_size * job.target)
    print(loadavg(), file=sys.stderr)


def _report(name: str, methods: dict, rounds: int, tokens: int) -> None:
    # Interleaved rounds (order rotated), CPU time as the headline: one table row.
    cpu = {k: [] for k in methods}
    wall = {k: [] for k in methods}
    peak = {k: [] for k in methods}
    for r in range(rounds):
        for key in rotate(list(methods), r):
            with Timed() as t:
                methods[key]()
            cpu[key].append(t.cpu)
            wall[key].append(t.wall)
            peak[key].append(t.peak)
    med, lo, hi = ratio_summary(cpu["bare"], cpu["posprobe"])  # time ratio bare/posprobe = tokens/s ratio
    wmed = statistics.median(a / b for a, b in zip(wall["bare"], wall["posprobe"]))
    print(f"{name:10s} | {med:.3f}x [{lo:.3f}-{hi:.3f}] | {wmed:.3f}x | "
          f"{tokens / statistics.median(cpu['bare']) / 1000:.1f} | "
          f"{max(peak['bare']) / 2**20:.0f} / {max(peak['posprobe']) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
