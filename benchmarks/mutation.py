"""Mutation testing of posprobe's identity-critical modules with mutmut (issue #36, "Trust the check marks").

A green check mark is only as good as the test behind it: mutmut changes the code one small edit at a time
(`+` to `-`, `<` to `<=`, a constant, a dropped argument, ...) and re-runs the tests that reach the edited
function; a mutant the tests do not notice ("survived") is either a gap in the tests or an edit that cannot change
behaviour ("equivalent"). This script runs mutmut on one module at a time, each in its own scratch copy of the
repository, with a targeted selection of fast tests (tiny random models, no real weights, browsers or notebooks),
and prints the score per module. Not part of CI: a benchmark-like script (`pip install mutmut==3.8.1` into the
venv first; `--sample 10` tests a systematic tenth of the mutants).

    python benchmarks/mutation.py                       # every module, one after another (2 workers each)
    python benchmarks/mutation.py --module families     # one module
    python benchmarks/mutation.py --module rope --keep --list-survivors
    python benchmarks/mutation.py --json /tmp/mutation.json     # results + survivors' names (default in $TMPDIR)

Each module's run: copy the working tree's posprobe/, tests/ and pyproject.toml (tracked and untracked-but-not-
ignored files, so uncommitted work is measured as it stands) into a temporary directory, append a
`[tool.mutmut]` section to that copy's pyproject.toml (`source_paths = ["posprobe"]`, `only_mutate` = the
module's files, the module's tests as `pytest_add_cli_args_test_selection`, `-m "not slow"`), and run
`mutmut run --max-children 2` there under one torch / BLAS thread per worker. The repository's own pyproject.toml
is never touched. mutmut 3 mutates function bodies only (module-level constants such as a family's FAMILY table are
left alone) and runs, per mutant, only the selected tests that reached the mutated function in its stats run.

Score = (killed + timeout) / (mutants - skipped), mutmut's own badge formula: a "no tests" mutant (a function no
selected test reaches) or a "suspicious" one counts against the score. The JSON output lists every mutant that was
not killed, by mutmut's name; `mutmut show NAME` inside a --keep scratch directory prints its diff.

Progress goes to stderr, the table to stdout. Run from the repo root with the venv's python.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Tests every module's selection carries: the mutant-killing tests written for this script (tests/test_mutants*.py,
#: all fast: hand-built cases and tiny models).
_MUTANT_TESTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_mutants*.py"))

#: module name -> (files mutmut mutates, relative to the repo root; the fast tests that check them). Every test file
#: here runs on tiny random models (tests/families.py, tiny-ape / tiny-rope); `-m "not slow"` drops the rest.
MODULES: dict[str, tuple[list[str], list[str]]] = {
    "families": (["posprobe/backend/families/*.py"],
                 ["tests/test_families.py", "tests/test_family_adapters.py"]),
    "massive": (["posprobe/analyses/massive.py"],
                ["tests/test_sinks.py"]),
    "rope": (["posprobe/rope.py"],
             ["tests/test_rope_types.py", "tests/test_rope_positions.py", "tests/test_frequency.py"]),
    "sinks": (["posprobe/analyses/sinks.py"],
              ["tests/test_sinks.py"]),
    "positions": (["posprobe/core/positions.py"],
                  ["tests/test_rope_positions.py", "tests/test_surgery.py", "tests/test_rope_types.py",
                   "tests/test_families.py", "tests/test_t5_decoder.py"]),  # GPT-J's pre-rotation control, ALiBi
    # and T5 bucket positions live there
    "long_engine": (["posprobe/core/long_engine.py"],
                    ["tests/test_long_context.py", "tests/test_retrieval.py"]),
    "surgery": (["posprobe/core/surgery.py"],
                ["tests/test_surgery.py", "tests/test_rope_types.py", "tests/test_presets.py"]),
    "decompose": (["posprobe/analyses/decompose.py"],
                  ["tests/test_decompose.py"]),
    "t5_decoder": (["posprobe/backend/t5_decoder.py"],
                   ["tests/test_t5_decoder.py"]),
    # Brought in by issue 53 (numbers computed around the forward pass): the theory formulas, head similarity, the
    # add-or-concatenate geometry, batched cached decoding, the squish study and the zoo's factory.
    "rope_theory": (["posprobe/rope_theory.py", "posprobe/analyses/rope_tables.py"],
                    ["tests/test_rope_theory.py"]),
    "head_similarity": (["posprobe/analyses/head_similarity.py"],
                        ["tests/test_head_similarity.py"]),
    "geometry": (["posprobe/analyses/geometry.py"],
                 ["tests/test_probes.py"]),
    "batch_decode": (["posprobe/core/batch_decode.py"],
                     ["tests/test_batch_decode.py", "tests/test_squish_study.py", "tests/test_squish_variants.py"]),
    "squish_study": (["posprobe/analyses/squish_study.py"],
                     ["tests/test_squish_study.py", "tests/test_squish_study_numbers.py",
                      "tests/test_squish_variants.py"]),
    # The zoo's factory, split so that each part runs only the tests that reach it (the training tests train ten
    # tiny members per module fixture): the synthetic tasks; the members, their training loop and the zoo folder;
    # the zoo folder format (read by evaluation across a zoo); the atlas over many models; context extension.
    "zoo_tasks": (["posprobe/zoo/tasks.py", "posprobe/zoo/task_zoo.py"],
                  ["tests/test_zoo_tasks.py"]),
    "zoo_train": (["posprobe/zoo/members.py", "posprobe/zoo/train.py", "posprobe/zoo/config.py",
                   "posprobe/zoo/tokenizer.py", "posprobe/zoo/run.py", "posprobe/zoo/job.py",
                   "posprobe/zoo/__init__.py"],
                  ["tests/test_zoo_config.py", "tests/test_zoo_members.py", "tests/test_zoo_tokenizer.py",
                   "tests/test_zoo_run.py", "tests/test_zoo_train_loop.py", "tests/test_zoo.py",
                   "tests/test_zoo_numbers.py"]),
    "zoo_eval": (["posprobe/zoo/folder.py"],
                 ["tests/test_zoo_folder.py", "tests/test_zoo_numbers.py", "tests/test_bad_input.py",
                  "tests/test_zoo.py"]),
    # atlas_many.py also holds `zoo eval` (evaluate_zoo, ratio_summary): its tests are the zoo eval ones too.
    "zoo_atlas": (["posprobe/analyses/atlas_many.py"],
                  ["tests/test_zoo_atlas_loop.py", "tests/test_zoo_atlas.py", "tests/test_zoo_numbers.py",
                   "tests/test_bad_input.py", "tests/test_zoo.py"]),
    # Context extension by fine-tuning (#49, after #53's split) and the passkey mixture the zoo trains with.
    "zoo_extend": (["posprobe/zoo/extend.py", "posprobe/zoo/methods.py", "posprobe/zoo/passkey.py"],
                   ["tests/test_zoo_extend_plan.py", "tests/test_extend_methods.py", "tests/test_zoo_extend.py",
                    "tests/test_passkey.py"]),
}

#: Lines mutmut leaves alone in every module: message text only (an edited error message or log line changes no
#: number posprobe reports). Regexes matched per source line (mutmut's do_not_mutate_patterns).
DO_NOT_MUTATE_PATTERNS: list[str] = [
    r"^\s*raise \w+(Error|Exception)\(",  # raise SomeError(f"message ..."): the whole call, continuation lines too
    r"^\s*warnings\.warn\(",
]

#: Functions whose whole job is message text (a refusal naming the model, a phrase for a log line): excluded from
#: mutation in the scratch copy with mutmut's `# pragma: no mutate block` on their `def` line. Per file, by name.
MESSAGE_FUNCTIONS: dict[str, list[str]] = {
    "posprobe/backend/families/rotary.py": ["no_rotary_module", "kv_shared"],
    "posprobe/backend/families/relative.py": ["unsupported", "encoder_decoder"],
    "posprobe/backend/families/sinusoidal.py": ["unsupported"],
}

#: mutmut's exit-code vocabulary (mutmut.stats.status_by_exit_code), folded into the table's columns.
_STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 35: "suspicious",
           36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", 37: "type check",
           -11: "segfault", -9: "segfault", None: "not checked", 2: "interrupted"}
_COLUMNS = ("killed", "survived", "timeout", "suspicious", "no tests", "skipped", "not checked", "other")


#: Appended to the scratch copy's tests/conftest.py. mutmut forks each mutant's test run from its main process, which
#: has already run the clean tests: a module-level cache filled there by unmutated code would hand the mutant its
#: results, and every mutant behind the cache would survive unseen. rope's per-(spec, dtype, device) frequency
#: tables are the one such cache in the modules tested here; each pytest session (one per mutant) starts without
#: them. (mutmut's `process_isolation = "forkserver"` avoids the inheritance too, but each mutant's process then
#: re-imports everything posprobe loads lazily: about 5x fewer mutants per second on sinks.py in a trial.)
_FRESH_CACHES = """

@pytest.fixture(scope="session", autouse=True)
def _mutation_fresh_caches():  # added by benchmarks/mutation.py to its scratch copy only
    import posprobe.rope

    posprobe.rope._TABLES.clear()
    yield
"""


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def _repo_files() -> list[str]:
    """posprobe/, tests/ and pyproject.toml as the working tree has them (tracked, plus untracked files git does
    not ignore), without caches."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "posprobe",
                          "tests", "pyproject.toml"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return sorted({f for f in out.splitlines() if f and (ROOT / f).is_file()})


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def _selection(name: str) -> list[str]:
    """The test files module `name` runs: its own fast tests and every tests/test_mutants*.py file."""
    own = MODULES[name][1]
    return own + [t for t in _MUTANT_TESTS if t not in own]


def make_scratch(name: str) -> Path:
    """A temporary copy of the repo with a [tool.mutmut] section for module `name`."""
    mutate, tests = MODULES[name][0], _selection(name)
    scratch = Path(tempfile.mkdtemp(prefix=f"posprobe-mutation-{name}-"))
    for f in _repo_files():
        dst = scratch / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dst)
    for rel, names in MESSAGE_FUNCTIONS.items():
        if any(fnmatch.fnmatch(rel, pat) for pat in mutate):
            _exclude_functions(scratch / rel, names)
    section = "\n".join([
        "",
        "[tool.mutmut]",
        'source_paths = ["posprobe"]',
        f"only_mutate = {_toml_list(mutate)}",
        f"do_not_mutate_patterns = {_toml_list(DO_NOT_MUTATE_PATTERNS)}",
        f"pytest_add_cli_args_test_selection = {_toml_list(tests)}",
        'pytest_add_cli_args = ["-m", "not slow", "-p", "no:cacheprovider", "-W", "ignore"]',
        "use_git_change_detection = false",
        "",
    ])
    with open(scratch / "pyproject.toml", "a") as fh:
        fh.write(section)
    with open(scratch / "tests" / "conftest.py", "a") as fh:
        fh.write(_FRESH_CACHES)
    return scratch


def _exclude_functions(path: Path, names: list[str]) -> None:
    """Mark the top-level functions `names` of `path` `# pragma: no mutate block` (on the line ending their
    signature), so mutmut generates no mutant inside them."""
    lines = path.read_text().splitlines(keepends=True)
    found = {}
    for node in ast.parse("".join(lines)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            header = next(i for i in range(node.lineno - 1, node.body[0].lineno)
                          if lines[i].split("#")[0].rstrip().endswith(":"))
            found[node.name] = header
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"{path}: no top-level function {sorted(missing)} (MESSAGE_FUNCTIONS is stale)")
    for i in found.values():
        lines[i] = lines[i].rstrip("\n") + "  # pragma: no mutate block\n"
    path.write_text("".join(lines))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    env.pop("POSPROBE_CI", None)  # a ../shared-dependent test skips in the scratch copy instead of failing
    return env


def collect(scratch: Path) -> dict[str, int | None]:
    """Every mutant's exit code, from mutmut's per-file .meta records."""
    codes: dict[str, int | None] = {}
    for meta in sorted((scratch / "mutants").rglob("*.py.meta")):
        codes.update(json.loads(meta.read_text())["exit_code_by_key"])
    return codes


def summarise(codes: dict[str, int | None]) -> dict[str, object]:
    counts = dict.fromkeys(_COLUMNS, 0)
    not_killed: dict[str, str] = {}
    for key, code in codes.items():
        status = _STATUS.get(code, "suspicious")
        col = status if status in counts else "other"
        counts[col] += 1
        if status not in ("killed", "timeout", "not checked"):
            not_killed[key] = status
    n = len(codes)
    tested = n - counts["skipped"] - counts["not checked"]  # not checked: outside a --sample
    score = 100.0 * (counts["killed"] + counts["timeout"]) / tested if tested else float("nan")
    return dict(mutants=n, **counts, score=round(score, 1), not_killed=dict(sorted(not_killed.items())))


#: --sample K: mutmut tests only the mutants whose number ends in these digits (a systematic 1-in-K sample of every
#: function's mutants; the rest stay "not checked" and out of the score).
_SAMPLES = {2: "*[02468]", 5: "*[05]", 10: "*0"}


def run_module(name: str, *, keep: bool, children: int, sample: int | None = None) -> dict[str, object]:
    t0 = time.monotonic()
    scratch = make_scratch(name)
    log(f"[{name}] scratch copy {scratch}")
    mutmut = Path(sys.executable).with_name("mutmut")
    cmd = [str(mutmut) if mutmut.exists() else "mutmut", "run", "--max-children", str(children)]
    if sample:
        cmd.append(_SAMPLES[sample])
    log(f"[{name}] {' '.join(cmd)}  (only_mutate={MODULES[name][0]})")
    out_path = scratch / "mutmut-run.log"
    with open(out_path, "w") as out:
        proc = subprocess.run(cmd, cwd=scratch, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    codes = collect(scratch)
    res = summarise(codes)
    res.update(module=name, files=MODULES[name][0], tests=_selection(name), wall_s=round(wall, 1),
               mutmut_rc=proc.returncode, sample=f"1/{sample}" if sample else "all")
    if proc.returncode != 0 or not codes:
        log(f"[{name}] mutmut exited {proc.returncode}; last lines of {out_path}:")
        log("\n".join(out_path.read_text(errors="replace").replace("\r", "\n").splitlines()[-25:]))
    log(f"[{name}] {res['mutants']} mutants, {res['killed']} killed, {res['survived']} survived, "
        f"score {res['score']}%, {wall / 60:.1f} min")
    if keep:
        res["scratch"] = str(scratch)
        log(f"[{name}] kept {scratch}  (cd there; .venv/bin/mutmut show NAME)")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def rerun(scratch: Path, *, children: int) -> dict[str, object]:
    """Re-run the mutants a kept scratch copy (--keep) did not kill, against the working tree's tests as they are
    now (the copy's tests/ is refreshed; mutmut re-tests mutants named on its command line and collects stats for
    new tests). The killed ones keep their verdict: a new test cannot revive a mutant."""
    name = scratch.name.removeprefix("posprobe-mutation-").rsplit("-", 1)[0]
    if name not in MODULES:
        raise SystemExit(f"{scratch}: not a scratch copy of this script (posprobe-mutation-<module>-...)")
    t0 = time.monotonic()
    for f in _repo_files():
        if f.startswith("tests/"):
            (scratch / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, scratch / f)
    with open(scratch / "tests" / "conftest.py", "a") as fh:  # the refreshed copy lost it
        fh.write(_FRESH_CACHES)
    # A tests/test_mutants*.py file added since the copy was made joins the selection.
    toml = scratch / "pyproject.toml"
    toml.write_text(re.sub(r"(?m)^pytest_add_cli_args_test_selection = .*$",
                           lambda m: f"pytest_add_cli_args_test_selection = {_toml_list(_selection(name))}",
                           toml.read_text()))
    before = collect(scratch)
    todo = sorted(summarise(before)["not_killed"])
    log(f"[{name}] re-running {len(todo)} mutants in {scratch}")
    mutmut = Path(sys.executable).with_name("mutmut")
    with open(scratch / "mutmut-rerun.log", "w") as out:
        proc = subprocess.run([str(mutmut) if mutmut.exists() else "mutmut", "run", "--max-children", str(children),
                               *todo], cwd=scratch, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    # mutmut forgets every verdict when the test selection changes (a new tests/test_mutants*.py file); a mutant
    # killed before stays killed (the tests only grew), so its earlier verdict stands where it was not re-run.
    after = collect(scratch)
    merged = {k: after[k] if after.get(k) is not None else before.get(k) for k in before.keys() | after.keys()}
    for meta in sorted((scratch / "mutants").rglob("*.py.meta")):  # kept for the next re-run of this copy
        record = json.loads(meta.read_text())
        record["exit_code_by_key"] = {k: merged.get(k, v) for k, v in record["exit_code_by_key"].items()}
        meta.write_text(json.dumps(record))
    res = summarise(merged)
    res.update(module=name, files=MODULES[name][0], tests=_selection(name),
               wall_s=round(time.monotonic() - t0, 1), mutmut_rc=proc.returncode, rerun_of=len(todo),
               scratch=str(scratch))
    log(f"[{name}] after the re-run: {res['killed']} killed, {res['survived']} survived, score {res['score']}%")
    return res


def table(results: list[dict]) -> str:
    head = ("module", "mutants", "tested", "killed", "survived", "timeout", "suspicious", "no tests", "score %", "wall")
    rows = [head] + [(r["module"], r["mutants"], r["mutants"] - r["not checked"] - r["skipped"], r["killed"],
                      r["survived"], r["timeout"], r["suspicious"], r["no tests"], f"{r['score']:.1f}",
                      f"{r['wall_s'] / 60:.1f} min") for r in results]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--module", action="append", choices=sorted(MODULES),
                    help="run this module only (repeatable); default: all, in order of size")
    ap.add_argument("--keep", action="store_true", help="keep each scratch copy (mutmut show / browse there)")
    ap.add_argument("--list-survivors", action="store_true", help="print every mutant that was not killed")
    ap.add_argument("--children", type=int, default=2, help="mutmut --max-children (default 2: a 2-core machine)")
    ap.add_argument("--json", type=Path, default=Path(tempfile.gettempdir()) / "posprobe-mutation.json",
                    help="where to write the results with the survivors' names (default: %(default)s)")
    ap.add_argument("--sample", type=int, choices=sorted(_SAMPLES),
                    help="test a systematic 1-in-K sample of the mutants (those numbered ...0 for K=10): an estimate")
    ap.add_argument("--rerun", type=Path, action="append", metavar="SCRATCH",
                    help="re-run only the mutants a kept scratch copy did not kill, against the current tests")
    args = ap.parse_args(argv)
    results = []
    for scratch in args.rerun or []:
        results.append(rerun(scratch, children=args.children))
        args.json.write_text(json.dumps(dict(results=results, loadavg=os.getloadavg(), cpus=os.cpu_count()),
                                        indent=1) + "\n")
    names = args.module or ([] if args.rerun else list(MODULES))
    for name in names:
        results.append(run_module(name, keep=args.keep, children=args.children, sample=args.sample))
        args.json.write_text(json.dumps(dict(results=results, loadavg=os.getloadavg(), cpus=os.cpu_count()),
                                        indent=1) + "\n")
    print(table(results))
    if args.list_survivors:
        for r in results:
            for key, status in r["not_killed"].items():
                print(f"{r['module']}: {key}  [{status}]")
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
