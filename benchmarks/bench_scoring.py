"""Scoring speed and agreement on BLiMP minimal pairs (run by hand, not in tests).

SmolLM2-135M fp32 on CPU, the first N pairs of the first P BLiMP paradigms (both sentences), with the
shift test's prefix (<|endoftext|>) before each sentence, k = 0. Methods, timed in interleaved rounds
(the machine is shared, so read medians and ratios, never single timings):

  bare        Hugging Face forward of the same weights, sorted by length, right-padded with an
              attention mask, full logits + log_softmax + gather (the reference, 1.00)
  shift       posprobe.analyses.shift.score_pairs with HFScorer (the path `posprobe shift-test` uses today)
  pairs       HFScorer.pair_logprobs (shared prefix of a pair computed once)
  minicons    minicons IncrementalLMScorer.sequence_score on the already-loaded HF model (if importable)
  tl          posprobe.analyses.shift.score_pairs with TLScorer on the TransformerLens model

CPU time (this process, one torch thread by default) is reported beside wall time, and the load
average before and after each round, so a quiet run can be told from a loaded one.

Usage: python benchmarks/bench_scoring.py [--rounds 3] [--pairs 50] [--paradigms 8] [--methods ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import Timed, loadavg  # noqa: E402

BLIMP = Path(__file__).resolve().parents[2] / "shared" / "data" / "blimp"
ALL = ("bare", "shift", "pairs", "minicons", "tl")


def load_pairs(blimp: Path, n_paradigms: int, n_pairs: int):
    from posprobe.data import load_blimp

    names = sorted(p.stem for p in blimp.glob("*.jsonl"))[:n_paradigms]
    out = []
    for name in names:
        out += load_blimp(blimp, paradigms=[name])[:n_pairs]
    return out


def bare_forward(model, tok, prefix: list[int], sents: list[str], batch_size: int) -> dict[str, float]:
    """Plain HF: padded batches sorted by length, full logits, log_softmax, gather; sentence tokens summed."""
    ids = [prefix + tok(s, add_special_tokens=False).input_ids for s in sents]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out = {}
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            n = max(len(ids[i]) for i in idx)
            x = torch.full((len(idx), n), tok.pad_token_id or 0, dtype=torch.long)
            att = torch.zeros((len(idx), n), dtype=torch.long)
            for r, i in enumerate(idx):
                x[r, :len(ids[i])] = torch.tensor(ids[i])
                att[r, :len(ids[i])] = 1
            lp = model(input_ids=x, attention_mask=att).logits.log_softmax(-1)
            tok_lp = lp[:, :-1].gather(-1, x[:, 1:, None])[..., 0] * att[:, 1:]
            # Only sentence tokens count: the prefix (first len(prefix)-1 predictions) is context.
            totals = tok_lp[:, len(prefix) - 1:].double().sum(1)
            for r, i in enumerate(idx):
                out[sents[i]] = float(totals[r])
    return out


def via_score_pairs(scorer, tok, pairs, prefix, batch_size) -> dict[str, float]:
    from posprobe.analyses.shift import ShiftConfig, score_pairs

    df = score_pairs(scorer, tok, pairs, ShiftConfig(ks=(0,), batch_size=batch_size, progress=False), prefix, [0])
    return {**dict(zip((p.good for p in pairs), df.logp_good)), **dict(zip((p.bad for p in pairs), df.logp_bad))}


def via_pair_logprobs(scorer, tok, pairs, prefix, batch_size) -> dict[str, float]:
    from posprobe.analyses.shift import place

    cache: dict[str, list[int]] = {}
    enc = lambda s: cache.setdefault(s, tok(s, add_special_tokens=False).input_ids)  # noqa: E731
    items = [(place(prefix, enc(p.good), 0, "with-sentence"), place(prefix, enc(p.bad), 0, "with-sentence"))
             for p in pairs]
    lps = scorer.pair_logprobs(items, batch_size=batch_size)
    out = {}
    for p, (lg, lb) in zip(pairs, lps):
        out[p.good] = float(lg[len(prefix) - 1:].sum())
        out[p.bad] = float(lb[len(prefix) - 1:].sum())
    return out


def make_minicons(model, tok, prefix_token: str):
    try:
        from minicons import scorer as mscorer
    except Exception as e:  # noqa: BLE001 - report any import failure and carry on
        return None, f"{type(e).__name__}: {e}"
    lm = mscorer.IncrementalLMScorer(model, tokenizer=tok, device="cpu")

    def run(sents: list[str], batch_size: int) -> dict[str, float]:
        out = {}
        # minicons prepends BOS itself when bos_token=True; give it our prefix as the text start instead.
        for b in range(0, len(sents), batch_size):
            chunk = sents[b:b + batch_size]
            scores = lm.sequence_score([prefix_token + s for s in chunk], reduction=lambda x: x.sum(0).item(),
                                       bos_token=False)
            out.update(zip(chunk, scores))
        return out

    return run, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=50, help="pairs per paradigm")
    ap.add_argument("--paradigms", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", nargs="+", default=list(ALL), choices=ALL)
    ap.add_argument("--blimp", type=Path, default=BLIMP)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from posprobe.analyses.shift import default_prefix
    from posprobe.backend.loading import load_hf_model
    from posprobe.core.scoring import HFScorer, TLScorer

    pairs = load_pairs(a.blimp, a.paradigms, a.pairs)
    sents = [s for p in pairs for s in (p.good, p.bad)]
    hf, tok = load_hf_model("smollm2")
    kind, prefix = default_prefix(tok)
    prefix_token = tok.convert_ids_to_tokens(prefix[0])
    print(f"{len(pairs)} pairs, {len(sents)} sentences ({len(set(sents))} distinct), prefix {kind} {prefix}, "
          f"batch {a.batch_size}, threads {torch.get_num_threads()}, torch {torch.__version__}")

    hf_scorer = HFScorer(hf, tok)
    runs = {
        "bare": lambda: bare_forward(hf, tok, prefix, sents, a.batch_size),
        "shift": lambda: via_score_pairs(hf_scorer, tok, pairs, prefix, a.batch_size),
        "pairs": lambda: via_pair_logprobs(hf_scorer, tok, pairs, prefix, a.batch_size),
    }
    if "minicons" in a.methods:
        fn, why = make_minicons(hf, tok, prefix_token)
        if fn is None:
            print(f"minicons skipped: not importable ({why})")
        else:
            runs["minicons"] = lambda: fn(sents, a.batch_size)
    if "tl" in a.methods:
        from posprobe.backend.loading import load_model

        tl_scorer = TLScorer(load_model("smollm2"))
        runs["tl"] = lambda: via_score_pairs(tl_scorer, tok, pairs, prefix, a.batch_size)
    methods = [m for m in ALL if m in runs and (m in a.methods or m == "bare")]

    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    results: dict[str, dict[str, float]] = {}
    for r in range(a.rounds):
        before = loadavg()
        # Rotate the order each round so no method always runs right after the same neighbour.
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for m in order:
            with Timed(rss=False) as t:
                results[m] = runs[m]()
            times[m].append(t.wall)
            cpu[m].append(t.cpu)
        print(f"round {r + 1}: " + ", ".join(f"{m} cpu {cpu[m][-1]:.1f}s wall {times[m][-1]:.1f}s" for m in methods)
              + f"  ({before} -> {loadavg()})", flush=True)
        print("CPU time:")
        table(methods, cpu, results, pairs, sents)
        print("wall time:")
        table(methods, times, results, pairs, sents)
    return 0


def table(methods, times, results, pairs, sents) -> None:
    """Speed ratios (bare median time / method median time) and agreement with the bare forward."""
    ref = results["bare"]
    base = statistics.median(times["bare"])
    print(f"{'method':10} {'speed vs bare':>14} {'paired-ratio median':>20} {'max |dlogp| vs bare':>20} "
          f"{'pair decisions':>16}")
    for m in methods:
        med = statistics.median(times[m])
        paired = statistics.median(tb / tm for tb, tm in zip(times["bare"], times[m]))
        diff = max(abs(results[m][s] - ref[s]) for s in sents)
        same = sum((results[m][p.good] > results[m][p.bad]) == (ref[p.good] > ref[p.bad]) for p in pairs)
        acc = statistics.mean(results[m][p.good] > results[m][p.bad] for p in pairs)
        print(f"{m:10} {base / med:13.2f}x {paired:19.2f}x {diff:20.2e} {same:>7}/{len(pairs)} same"
              f"  (accuracy {acc:.4f}, {len(sents) / med:.1f} sent/s median)", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
