"""What checkpointing costs: a long-context run (loss windows + passkey trials) with and without a work folder,
a rerun that finds every unit done (reading back only), and a bare forward pass over the same windows.

    python benchmarks/bench_checkpoint.py --model smollm2 --rounds 3
    python benchmarks/bench_checkpoint.py --rounds 5            # a small random Llama

Within each round the methods run in a rotated order; the table gives medians and the paired ratios over rounds
(CPU time of this process; wall time beside it). "checkpoint vs plain" - 1 is the overhead of keeping every unit
(a torch.save + fsync + rename per window and per passkey trial); "resume vs plain" is what a rerun of a finished
run costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved, ratio_summary  # noqa: E402


def _model(name: str | None):
    import torch

    if name:
        from posprobe.backend.loading import load_hf_model

        return load_hf_model(name)
    from transformers import LlamaConfig, LlamaForCausalLM

    from posprobe.backend.tiny import byte_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=256,
                      eos_token_id=257)
    return LlamaForCausalLM(cfg).eval(), byte_tokenizer()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model name for load_hf_model (default: a small random Llama)")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--passkey-length", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from posprobe.analyses.configs import LongContextConfig
    from posprobe.analyses.long_context import run_long_context
    from posprobe.data import BUILTIN_TEXT

    torch.set_num_threads(args.threads)
    model, tok = _model(args.model)
    text = BUILTIN_TEXT * 8
    cfg = LongContextConfig(lengths=(args.length,), presets=("none",), max_windows=args.windows,
                            passkey_lengths=(args.passkey_length,), depths=(0.0, 1.0), trials=2, progress=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    windows = [torch.tensor(ids[i * args.length:(i + 1) * args.length])[None] for i in range(args.windows)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    done = tmp / "done.work"
    run_long_context(model, text, cfg, tokenizer=tok, work=done)  # warm-up, and the folder "resume" reads back

    def bare() -> None:
        with torch.no_grad():
            for w in windows:
                model(w)

    def plain() -> None:
        run_long_context(model, text, cfg, tokenizer=tok)

    def checkpoint() -> None:
        folder = tmp / "fresh.work"
        run_long_context(model, text, cfg, tokenizer=tok, work=folder, fresh=True)

    def resume() -> None:
        run_long_context(model, text, cfg, tokenizer=tok, work=done)

    methods = {"bare": bare, "plain": plain, "checkpoint": checkpoint, "resume": resume}
    cpu, wall = interleaved(methods, args.rounds)
    units = len(windows) + 2 * 2
    print(f"model {args.model or 'random Llama (4 layers, d=256)'}; {args.windows} windows of {args.length} tokens "
          f"+ 4 passkey trials of {args.passkey_length} = {units} units; {args.rounds} rounds, "
          f"{args.threads} thread(s)")
    print(f"{'method':<11} {'cpu s':>8} {'wall s':>8} {'vs plain (cpu)':>22} {'vs bare forward (cpu)':>22}")
    for m in methods:
        med, lo, hi = ratio_summary(cpu[m], cpu["plain"])
        bmed, _, _ = ratio_summary(cpu[m], cpu["bare"])
        print(f"{m:<11} {statistics.median(cpu[m]):8.2f} {statistics.median(wall[m]):8.2f} "
              f"{med:9.4f}x [{lo:.4f}-{hi:.4f}] {bmed:21.2f}x")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
