"""Add the `previous_token` table to `zoo extend` runs made before `zoo extend` measured it (issue #63's study).

`zoo extend` now measures, beside its mechanism, every head's mean attention from i to i - 1 on windows of L tokens
(`posprobe.analyses.extension_mechanism.previous_token_frame`). For a run made earlier this measures the same thing on
its saved folders (each method at its last checkpoint) and on the zoo's unextended members, and writes the run's
`extend/` result again with the table added (atomically, the other tables unchanged). A run that has the table
already is left alone. Run by hand, not in CI:

    python benchmarks/pi_study_previous.py --eval-text ../shared/data/wikitext-2/test.txt \
        pi-study/zoo-hd32-L64:pi-study/ext-hd32-L64-skill0 ...

Each argument is ZOO:RUN, the zoo folder a run was extended from and the run. Progress on stderr.

With `--step0` it writes nothing and prints, per run and seed, the strongest previous-token head of each method at
step 0, before any fine-tuning: the unextended member's weights under the method's saved rotation (its config.json),
as a share of the unextended member's. This separates what the rotation change does from what fine-tuning restores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd


def _models(zoo: Path, run: Path) -> tuple[object, int, dict[tuple[str, int, str], tuple[Path, str | None]]]:
    """`run`'s extend result, its L, and per (member, seed, method) the folder measured and, for an extended model,
    the folder of its saved config ("unextended": the zoo's member, None)."""
    from posprobe import Result

    res = Result.load(run / "extend")
    runs = res.tables["runs"]
    looked: dict[tuple[str, int, str], tuple[Path, str | None]] = {}
    for model, member, seed, method in runs[["model", "member", "seed", "method"]].itertuples(index=False):
        looked.setdefault((member, int(seed), "unextended"), (zoo / f"{member}-s{int(seed)}", None))
        looked[(member, int(seed), method)] = (run / str(model), str(model))
    for folder, _ in looked.values():
        if not (folder / "config.json").is_file():
            raise SystemExit(f"{folder}: no saved model (is {zoo} the zoo {run} was extended from?)")
    return res, int(res.meta["train_length"]), looked


def _strongest(folder: Path, text: str, L: int) -> pd.DataFrame:
    from posprobe.analyses.extension_mechanism import previous_token_frame
    from posprobe.backend.loading import load_model

    print(f"previous-token attention: {folder}", file=sys.stderr, flush=True)
    return previous_token_frame(load_model(str(folder)), folder, text, L)


def backfill(zoo: Path, run: Path, text: str) -> bool:
    """Measure and add `previous_token` to `run`'s extend result; False when it is there already."""
    res, L, looked = _models(zoo, run)
    if "previous_token" in res.tables:
        return False
    res.tables["previous_token"] = pd.concat(
        [_strongest(folder, text, L).assign(member=member, seed=seed, method=method)
         for (member, seed, method), (folder, _) in looked.items()], ignore_index=True)
    res.save(run / "extend")
    return True


def at_step_0(zoo: Path, run: Path, text: str, scratch: Path) -> list[dict]:
    """Per seed and method of `run`: the strongest head's mean attention from i to i - 1 on windows of L, with the
    member's weights under the method's config.json, and its share of the unextended member's."""
    import shutil

    _, L, looked = _models(zoo, run)
    rows, bases = [], {}
    for (member, seed, method), (folder, model) in looked.items():
        if model is None:
            continue
        source = looked[(member, seed, "unextended")][0]
        if source not in bases:  # one measurement of each member, shared by its methods
            bases[source] = _strongest(source, text, L)["prev_attention"].max()
        base = bases[source]
        mixed = scratch / f"{member}-s{seed}-{method}"
        shutil.rmtree(mixed, ignore_errors=True)
        shutil.copytree(source, mixed)
        shutil.copyfile(folder / "config.json", mixed / "config.json")
        got = _strongest(mixed, text, L)["prev_attention"].max()
        shutil.rmtree(mixed)
        rows.append({"run": str(run), "member": member, "seed": seed, "method": method, "step": 0,
                     "prev_token_attention": got, "unextended": base, "share": got / base})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pairs", nargs="+", metavar="ZOO:RUN")
    p.add_argument("--eval-text", required=True, metavar="PATH", help="the eval text the runs were scored on")
    p.add_argument("--step0", action="store_true", help="print each method's previous-token head before fine-tuning")
    args = p.parse_args()
    from posprobe.data import read_text

    text = read_text(args.eval_text)
    pairs = [tuple(map(Path, x.split(":", 1))) for x in args.pairs]
    bad = [f"{z}:{r}" for z, r in pairs if not (r / "extend" / "meta.json").is_file() or not z.is_dir()]
    if bad:
        raise SystemExit(f"not a zoo folder and a `zoo extend` run: {', '.join(bad)}")
    if args.step0:
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            rows = [r for zoo, run in pairs for r in at_step_0(zoo, run, text, Path(scratch))]
        print(pd.DataFrame(rows).round(6).to_string(index=False))
        return 0
    for zoo, run in pairs:
        print(f"{run}: {'added' if backfill(zoo, run, text) else 'has it already'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
