"""Checkpoint and resume (#27): the work folder's units, refusal of a changed run, and fault tests — a
long-context run killed with SIGKILL at random points and resumed equals the uninterrupted run bit for bit;
SIGINT exits 130 with no partial --out; a full disk gives one clear error and leaves the previous --out intact.

Equality here is exact (`check_exact`, NaN == NaN): a resumed run reads back the very tensors and rows an
uninterrupted run computes, on the same device and dtype (both are part of the run's key).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from posprobe.report.checkpoint import (
    Checkpoint,
    CheckpointMismatch,
    discard_work_folder,
    run_key,
    work_folder_for,
)

ROOT = Path(__file__).resolve().parents[1]


def _key(**over):
    base = {"analysis": "x", "model": {"name": "m", "weights": [1.0, 2.0]}, "config": {"lengths": [8, 16]}}
    base.update(over)
    return base


def test_units_round_trip_and_survive_a_new_process_object(tmp_path):
    work = tmp_path / "r.work"
    ck = Checkpoint(work, _key())
    t = torch.randn(3, 5, dtype=torch.float64)
    ck.put("a", t)
    ck.put("b", {"x": 1.5, "y": "s", "ok": True, "nan": float("nan"), "n": 3})
    again = Checkpoint(work, _key())
    assert again.has("a") and again.has("b") and not again.has("c")
    assert torch.equal(again.get("a"), t) and again.get("a").dtype == torch.float64
    b = again.get("b")
    assert b["x"] == 1.5 and b["y"] == "s" and b["ok"] is True and b["n"] == 3 and b["nan"] != b["nan"]
    calls = []
    out = again.map(["a", "c"], lambda u: calls.append(u) or torch.zeros(1), name=str, desc="t", progress=False)
    assert calls == ["c"] and torch.equal(out[0], t) and again.resumed == 1


def test_a_changed_run_is_refused_naming_what_differs_and_fresh_starts_over(tmp_path):
    work = tmp_path / "r.work"
    Checkpoint(work, _key()).put("a", 1)
    with pytest.raises(CheckpointMismatch, match=r"differs in: config\.lengths.*--fresh"):
        Checkpoint(work, _key(config={"lengths": [8, 32]}))
    with pytest.raises(CheckpointMismatch, match=r"model\.weights"):
        Checkpoint(work, _key(model={"name": "m", "weights": [1.0, 2.5]}))
    fresh = Checkpoint(work, _key(config={"lengths": [8, 32]}), fresh=True)
    assert not fresh.has("a") and Checkpoint(work, _key(config={"lengths": [8, 32]})).count(["a"]) == 0


def test_a_folder_that_is_not_a_work_folder_is_never_used_or_deleted(tmp_path):
    other = tmp_path / "mine.work"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    for fresh in (False, True):
        with pytest.raises(CheckpointMismatch, match="not a posprobe work folder"):
            Checkpoint(other, _key(), fresh=fresh)
    with pytest.raises(CheckpointMismatch):
        discard_work_folder(other)
    assert (other / "notes.txt").read_text() == "keep me"
    assert work_folder_for(tmp_path / "out") == tmp_path / "out.work"


def test_a_write_killed_before_its_rename_leaves_no_unit(tmp_path, monkeypatch):
    work = tmp_path / "r.work"
    ck = Checkpoint(work, _key())

    def boom(src, dst):
        raise KeyboardInterrupt  # the process dies between writing the temp file and renaming it

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        ck.put("a", torch.ones(2))
    monkeypatch.undo()
    assert any(p.name.startswith(".") for p in (work / "units").iterdir())  # the orphan temp file
    again = Checkpoint(work, _key())
    assert not again.has("a") and not any(p.name.startswith(".") for p in (work / "units").iterdir())


def test_no_folder_keeps_nothing(tmp_path):
    ck = Checkpoint(None, _key())
    assert not ck.enabled and ck.put("a", 1) == 1 and not ck.has("a")


def test_run_key_drops_the_progress_switch_and_names_versions():
    from posprobe.analyses.configs import LongContextConfig

    a = run_key("long-context", model={}, data={}, config=LongContextConfig(progress=True))
    b = run_key("long-context", model={}, data={}, config=LongContextConfig(progress=False))
    assert a == b and "progress" not in a["config"] and a["versions"]["torch"] == torch.__version__
    c = run_key("long-context", model={}, data={}, config=LongContextConfig(lengths=(64,), progress=False))
    assert c != a


def test_edited_code_is_another_run(tmp_path):
    # A checkout edited between the interrupted run and the rerun keeps its version number; the source digest in
    # the run key tells them apart, so the rerun is refused instead of mixing the two codes' numbers.
    import posprobe.report.checkpoint as C

    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    before = C.source_digest(pkg)
    C._SOURCE_DIGESTS.clear()
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert C.source_digest(pkg) != before
    C._SOURCE_DIGESTS.clear()
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    assert C.source_digest(pkg) == before
    assert run_key("x", model={}, data={}, config={})["versions"]["posprobe_code"] == C.source_digest()
    old = Checkpoint(tmp_path / "w", run_key("x", model={}, data={}, config={}))
    old.put("u", 1)
    edited = run_key("x", model={}, data={}, config={})
    edited["versions"]["posprobe_code"] = before
    with pytest.raises(CheckpointMismatch, match="versions.posprobe_code"):
        Checkpoint(tmp_path / "w", edited)


# ---- long-context through the Python API ---------------------------------------------------------------------

TEXT = "The quick brown fox jumps over the lazy dog while the river runs past the mill. " * 120


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    from posprobe.backend.tiny import byte_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000.0, bos_token_id=256,
                      eos_token_id=257)
    return LlamaForCausalLM(cfg).eval(), byte_tokenizer()


def _cfg(**over):
    from posprobe.analyses.configs import LongContextConfig

    base = dict(lengths=(80, 128), presets=("none", "rerope:window=16"), max_windows=3, bin_size=16, warmup=16,
                passkey_lengths=(260,), depths=(0.0, 1.0), trials=2, new_tokens=4, chunk=32, progress=False)
    base.update(over)
    return LongContextConfig(**base)


def _assert_same_tables(a, b):
    assert set(a.tables) == set(b.tables)
    for name in a.tables:
        pd.testing.assert_frame_equal(a.tables[name], b.tables[name], check_exact=True)


def test_an_interrupted_api_run_resumes_to_the_uninterrupted_tables(tmp_path, monkeypatch):
    from posprobe.analyses.long_context import run_long_context
    from posprobe.core import long_engine as LA

    model, tok = _tiny()
    clean = run_long_context(model, TEXT, _cfg(), tokenizer=tok)
    work = tmp_path / "lc.work"
    real_nll, real_decode = LA.token_nll, LA.greedy_decode
    calls = {"nll": 0, "decode": 0}

    def nll(*a, **k):
        calls["nll"] += 1
        if calls["nll"] == 5:
            raise KeyboardInterrupt
        return real_nll(*a, **k)

    def decode(*a, **k):
        calls["decode"] += 1
        if calls["decode"] == 3:
            raise KeyboardInterrupt
        return real_decode(*a, **k)

    monkeypatch.setattr(LA, "token_nll", nll)
    monkeypatch.setattr(LA, "greedy_decode", decode)
    with pytest.raises(KeyboardInterrupt):  # dies at the 5th of 12 windows
        run_long_context(model, TEXT, _cfg(), tokenizer=tok, work=work)
    with pytest.raises(KeyboardInterrupt):  # resumes the windows, dies at the 3rd passkey trial (of 8)
        run_long_context(model, TEXT, _cfg(), tokenizer=tok, work=work)
    assert calls == {"nll": 5 + 8, "decode": 3}
    resumed = run_long_context(model, TEXT, _cfg(), tokenizer=tok, work=work)
    assert calls == {"nll": 13, "decode": 3 + 6}  # nothing done twice
    assert resumed.meta["checkpoint"]["resumed_units"] == 12 + 2
    _assert_same_tables(clean, resumed)
    # The same folder with a changed config is refused before any forward pass; a changed model as well.
    with pytest.raises(CheckpointMismatch, match="config.trials"):
        run_long_context(model, TEXT, _cfg(trials=3), tokenizer=tok, work=work)
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    with pytest.raises(CheckpointMismatch, match="model.weights"):
        run_long_context(model, TEXT, _cfg(), tokenizer=tok, work=work)
    assert calls == {"nll": 13, "decode": 9}


# ---- the CLI in a subprocess: SIGKILL, SIGINT, disk full -----------------------------------------------------

@pytest.fixture(scope="module")
def cli_case(tmp_path_factory):
    base = tmp_path_factory.mktemp("ck")
    model, tok = _tiny()
    model.save_pretrained(base / "model")
    tok.save_pretrained(base / "model")
    (base / "t.txt").write_text(TEXT * 4)
    return base


N_UNITS = 54 + 72


def _argv(base: Path, out: Path) -> list[str]:
    # Enough units (54 windows, 72 passkey trials; ~4 s of work after ~4 s of start-up on 2 CPU cores) that random
    # kill times land inside the work as well as in the final save.
    return [sys.executable, "-m", "posprobe", "long-context", str(base / "model"), "--text", str(base / "t.txt"),
            "--length", "96", "--length", "256", "--length", "384", "--preset", "none", "--preset",
            "rerope:window=16", "--preset", "pi:scale=2", "--max-windows", "6", "--passkey-length", "300",
            "--depth", "0", "--depth", "0.5", "--depth", "1", "--trials", "8", "--new-tokens", "6", "--chunk", "32",
            "--bin-size", "16", "--warmup", "16", "--no-progress", "--out", str(out)]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("POSPROBE_DEBUG", None)
    return env


def _tables(out: Path) -> dict[str, pd.DataFrame]:
    return {p.stem: pd.read_parquet(p) for p in sorted(out.glob("*.parquet"))}


def _units(work: Path) -> int:
    d = work / "units"
    return len([p for p in d.iterdir() if p.suffix == ".pt"]) if d.is_dir() else 0


def test_sigkill_at_random_points_then_resume_equals_the_clean_run(cli_case):
    base = cli_case
    clean_out = base / "clean"
    done = subprocess.run(_argv(base, clean_out), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert not work_folder_for(clean_out).exists()  # removed once the results are written
    clean = _tables(clean_out)
    assert {"long_context", "long_context_summary", "passkey", "passkey_accuracy"} <= set(clean)

    out, work = base / "killed", work_folder_for(base / "killed")
    rng = random.Random(27)
    kills, mid_run, trials = 0, 0, 0
    while kills < 10 and trials < 30:
        trials += 1
        # A random point a little further into the run, read off its progress (not the clock, which a loaded
        # machine stretches): once `target` units exist, plus a random fraction of a unit. Steps of 0-25 units give
        # kills at start-up, all through the work and, once every unit exists, in the final save.
        target = min(N_UNITS, _units(work) + rng.randint(0, 25))
        proc = subprocess.Popen(_argv(base, out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        start = time.monotonic()
        while proc.poll() is None and _units(work) < target and time.monotonic() - start < 300:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.1))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            mid_run += 0 < _units(work) < N_UNITS  # killed inside the work, with some of it done
        err = proc.stderr.read().decode()
        proc.stderr.close()
        assert proc.returncode in (0, -signal.SIGKILL), err  # finished first: the next trial starts a new run
    final = subprocess.run(_argv(base, out), env=_env(), capture_output=True, text=True, timeout=600)
    assert final.returncode == 0, final.stderr
    print(f"{trials} runs, {kills} killed, {mid_run} of them inside the work", file=sys.stderr)
    assert kills >= 10 and mid_run >= 3, (kills, mid_run)
    assert not work.exists()
    got = _tables(out)
    assert set(got) == set(clean)
    for name in clean:
        pd.testing.assert_frame_equal(got[name], clean[name], check_exact=True)


def test_sigint_exits_130_and_leaves_no_partial_out_then_resumes(cli_case):
    base = cli_case
    out, work = base / "sigint", work_folder_for(base / "sigint")
    proc = subprocess.Popen(_argv(base, out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    start = time.monotonic()
    while _units(work) < 3 and proc.poll() is None and time.monotonic() - start < 300:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == 130 and "interrupted" in err, err
    # On a line of its own (not glued to a progress line), naming the folder a rerun resumes from.
    assert "\nposprobe long-context: interrupted; " in err and str(work) in err and "rerun the same command" in err, err
    assert not out.exists() and _units(work) >= 3
    again = subprocess.run(_argv(base, out), env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "resuming long-context loss" in again.stderr, again.stderr
    assert (out / "meta.json").is_file() and not work.exists()


def _mount_tmpfs(path: Path, size: str) -> str | None:
    """None when mounted, else why not."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "mounting a tmpfs needs root on Linux"
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    return None if r.returncode == 0 else f"mount -t tmpfs failed: {r.stderr.strip()}"


def test_disk_full_gives_one_clear_error_and_keeps_the_previous_out(cli_case, tmp_path):
    base = cli_case
    disk = tmp_path / "disk"
    why = _mount_tmpfs(disk, "16m")  # the report alone is ~5 MB (plotly inline)
    if why:
        pytest.skip(why)
    try:
        out = disk / "out"
        argv = _argv(base, out)
        # A small run fits; its --out is the "previous result" a failing rerun must not damage.
        small = argv[:argv.index("--passkey-length")] + ["--no-progress", "--csv", "none", "--out", str(out)]
        ok = subprocess.run(small, env=_env(), capture_output=True, text=True, timeout=600)
        assert ok.returncode == 0, ok.stderr
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        filler = disk / "filler"
        # Room for a unit or two, not for the run (fails saving a checkpoint), then room for every unit but not
        # for the report (fails writing --out): each gives one clear error and leaves the previous --out as it was.
        for room, where in ((8 << 10, "while saving a checkpoint"), (1 << 20, "while writing the results")):
            filler.unlink(missing_ok=True)
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            filler.write_bytes(b"\0" * max(free - room, 0))
            full = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=600)
            assert full.returncode == 2, full.stderr
            lines = [ln for ln in full.stderr.splitlines() if "error" in ln]
            assert len(lines) == 1 and "no space left" in lines[0] and where in lines[0], full.stderr
            assert "Traceback" not in full.stderr
            assert {p.name: p.read_bytes() for p in out.iterdir()} == before
        assert _units(work_folder_for(out)) == N_UNITS  # every unit kept for the rerun once space is freed
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# ---- the shift test: blocks of scored pairs and text windows --------------------------------------------------

def test_an_interrupted_shift_test_resumes_to_the_uninterrupted_tables(tmp_path, monkeypatch, tiny_ape):
    from posprobe.analyses import shift as SH
    from posprobe.analyses.configs import ShiftConfig
    from posprobe.core.scoring import _Scorer as Scorer
    from posprobe.data import builtin_pairs

    monkeypatch.setattr(SH, "UNIT_ITEMS", 16)  # many blocks from a few pairs
    pairs = builtin_pairs(max_pairs=8)
    cfg = ShiftConfig(ks=(0, 40), n_bootstrap=50, window=24, max_windows=20, progress=False)
    text = TEXT
    clean = SH.run_shift_test(tiny_ape, pairs, text=text, config=cfg)
    n_pair_blocks = -(-2 * len(pairs) // 16)
    assert n_pair_blocks >= 3
    calls = {"pairs": 0, "text": 0}
    real_pairs, real_text = Scorer.pair_logprobs, Scorer.token_logprobs

    def pair_lps(self, *a, **k):
        calls["pairs"] += 1
        if calls["pairs"] == 3:
            raise KeyboardInterrupt
        return real_pairs(self, *a, **k)

    def text_lps(self, *a, **k):
        calls["text"] += 1
        if calls["text"] == 2:
            raise KeyboardInterrupt
        return real_text(self, *a, **k)

    monkeypatch.setattr(Scorer, "pair_logprobs", pair_lps)
    monkeypatch.setattr(Scorer, "token_logprobs", text_lps)
    work = tmp_path / "shift.work"
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            SH.run_shift_test(tiny_ape, pairs, text=text, config=cfg, work=work)
    resumed = SH.run_shift_test(tiny_ape, pairs, text=text, config=cfg, work=work)
    n_text_blocks = -(-2 * 20 // 16)
    assert calls == {"pairs": n_pair_blocks + 1, "text": n_text_blocks + 1}  # each failed call once, nothing twice
    _assert_same_tables(clean, resumed)
    with pytest.raises(CheckpointMismatch, match="data.pairs"):
        SH.run_shift_test(tiny_ape, pairs[:-1], text=text, config=cfg, work=work)


# ---- corpus passes: the reducers' sums after n batches ---------------------------------------------------------

@pytest.mark.parametrize("analysis", ["heads", "frequency"])
def test_an_interrupted_corpus_pass_resumes_to_the_uninterrupted_tables(analysis, tmp_path, monkeypatch, tiny_rope):
    from posprobe.analyses.configs import FrequencyConfig, HeadsConfig
    from posprobe.analyses.frequency import run_frequency
    from posprobe.analyses.heads import run_heads
    from posprobe.core import capture
    from posprobe.report.checkpoint import StreamResume

    if analysis == "heads":
        cfg = HeadsConfig(window=24, max_windows=12, batch_size=2, induction_len=8, progress=False)
        run = lambda **k: run_heads(tiny_rope, TEXT, cfg, **k)  # noqa: E731
    else:
        cfg = FrequencyConfig(window=24, max_windows=12, batch_size=2, queries=8, ablate=False, progress=False)
        run = lambda **k: run_frequency(tiny_rope, TEXT, cfg, **k)  # noqa: E731
    clean = run()
    monkeypatch.setattr(StreamResume, "__init__", _every_batch(StreamResume.__init__))
    real = capture._run_through
    calls = {"n": 0}

    def forward(*a, **k):
        calls["n"] += 1
        if calls["n"] in (3, 7):  # two crashes: after 2 batches, then after 3 more
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(capture, "_run_through", forward)
    work = tmp_path / f"{analysis}.work"
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            run(work=work)
    resumed = run(work=work)
    induction = 1 if analysis == "heads" else 0  # the heads' induction pass: one forward after the corpus pass
    assert calls["n"] == 6 + 2 + induction  # 6 batches of 2 windows, each computed once, plus the two that crashed
    _assert_same_tables(clean, resumed)
    with pytest.raises(CheckpointMismatch, match="config.batch_size"):
        if analysis == "heads":
            run_heads(tiny_rope, TEXT, HeadsConfig(window=24, max_windows=12, batch_size=3, progress=False), work=work)
        else:
            run_frequency(tiny_rope, TEXT, FrequencyConfig(window=24, max_windows=12, batch_size=3, queries=8,
                                                           ablate=False, progress=False), work=work)


def _every_batch(init):
    def patched(self, *a, **k):
        init(self, *a, **k)
        self.every_s = 0.0  # save after every batch, so a crash at any batch resumes from the one before

    return patched


def test_interrupted_probes_resume_to_the_uninterrupted_table(tmp_path, monkeypatch, tiny_rope):
    from posprobe.analyses import probes as P
    from posprobe.analyses.configs import ProbeConfig

    cfg = ProbeConfig(window=16, max_windows=8, max_tokens=100, n_splits=2, inner_splits=2, progress=False)
    clean = P.run_probes(tiny_rope, TEXT, cfg)
    real = P.probe_scores
    calls = {"n": 0}

    def scores(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(P, "probe_scores", scores)
    work = tmp_path / "probes.work"
    with pytest.raises(KeyboardInterrupt):
        P.run_probes(tiny_rope, TEXT, cfg, work=work)
    resumed = P.run_probes(tiny_rope, TEXT, cfg, work=work)
    n_keys = len(cfg.points) * 2  # tiny-rope: 2 layers
    assert calls["n"] == n_keys + 1  # the two finished probes were read back
    _assert_same_tables(clean, resumed)


def test_the_interrupt_line_says_how_to_resume_only_where_a_rerun_resumes(tmp_path):
    from posprobe.cli.main import build_parser, interrupt_message

    resumable = build_parser().parse_args(["retrieval", "tiny-rope", "--out", str(tmp_path / "r")])
    line = interrupt_message(resumable)
    assert line.startswith("\nposprobe retrieval: interrupted; ") and str(work_folder_for(tmp_path / "r")) in line
    plain = interrupt_message(build_parser().parse_args(["info", "tiny-rope"]))
    assert plain.startswith("\nposprobe info: interrupted; ") and ".work" not in plain and "resume" not in plain
