"""The extension study's table (`posprobe.analyses.extend_study`) against the raw passkey rows of a real `zoo extend`
run, recomputed here: pooled successes / trials within and beyond L with scipy's Wilson interval, the windows per
seed, the bands whose period fits in L and in L / s counted by brute force from the saved config.json, and the
fast-band share summed by hand from `band_usage`, the strongest previous-token head from `previous_token`. Planted,
each seen failing: `<` for `<=` at L, bands counted over L * s, the fast share taken over the slow bands, the mean
previous-token attention over heads for the largest. (The mean of per-distance rates equals the pooled rate here:
every distance has the same trials, so that swap is not a bug this table could show.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pandas as pd
import pytest
from scipy.stats import binomtest

from posprobe.zoo.config import ZooConfig

TINY = dict(d_model=32, n_layers=2, n_heads=2, length=64, vocab_size=300, batch_size=8, steps=4, warmup=1,
            checkpoint_every=10, progress=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from posprobe.analyses.context_extension import extend_zoo
    from posprobe.data import builtin_corpus
    from posprobe.zoo.extend import ExtendConfig
    from posprobe.zoo.run import train_zoo

    tmp = tmp_path_factory.mktemp("study")
    train_zoo(ZooConfig(**TINY, members=("rope-llama",), seeds=(0, 1), passkey=0.5), builtin_corpus(), tmp / "zoo")
    cfg = ExtendConfig(methods=("direct", "pi"), length=128, steps=2, checkpoints=(0, 2), eval_tokens=256,
                       sliding="never", passkey_step=16, passkey_trials=3, progress=False)
    extend_zoo(tmp / "zoo", cfg, tmp / "ext")
    return tmp / "ext"


def _wilson(k: int, n: int) -> tuple[float, float]:
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return ci.low, ci.high


def test_the_study_table_equals_the_raw_rows_recomputed(run):
    from posprobe.analyses.extend_study import extend_study_table

    df = extend_study_table([run], steps="all")
    pk = pd.read_parquet(run / "extend" / "passkey.parquet")
    ew = pd.read_parquet(run / "extend" / "effective_window.parquet")
    usage = pd.read_parquet(run / "extend" / "band_usage.parquet")
    mech = pd.read_parquet(run / "extend" / "mechanism.parquet")
    prev = pd.read_parquet(run / "extend" / "previous_token.parquet")
    cfg = json.loads((run / "rope-llama-s0-direct" / "config.json").read_text())
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    base = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    periods = [2 * math.pi * base ** (2 * j / d) for j in range(d // 2)]
    assert set(zip(df["method"], df["step"])) == {("unextended", 0), ("direct", 0), ("direct", 2), ("pi", 0),
                                                  ("pi", 2)}
    for _, row in df.iterrows():
        assert (row["head_dim"], row["L"], row["target"], row["scale"]) == (d, 64, 128, 2.0)
        assert row["fine_tuning"] == "text" and row["seeds"] == 2
        at = pk[(pk["method"] == row["method"]) & (pk["step"] == row["step"]) & (pk["status"] == "ok")]
        for side, part in (("within", at[at["distance"] <= 64]), ("beyond", at[at["distance"] > 64])):
            k, n = int(part["successes"].sum()), int(part["trials"].sum())
            assert n > 0 and row[f"trials_{side}_L"] == n
            assert row[f"success_{side}_L"] == pytest.approx(k / n, abs=1e-12)
            lo, hi = _wilson(k, n)
            assert (row[f"success_{side}_L_low"], row[f"success_{side}_L_high"]) == (pytest.approx(lo, abs=1e-9),
                                                                                     pytest.approx(hi, abs=1e-9))
        w = ew[(ew["method"] == row["method"]) & (ew["step"] == row["step"])].sort_values("seed")
        assert row["window_seeds"] == " ".join(str(int(x)) for x in w["effective_window"])
        assert row["window_mean"] == pytest.approx(w["effective_window"].mean())
        member = pk[(pk["method"] == "unextended") & (pk["distance"] <= 64)]
        sums = [member.loc[member["seed"] == s, ["successes", "trials"]].sum() for s in (0, 1)]
        assert row["member_skill_seeds"] == " ".join(f"{x['successes'] / x['trials']:.3f}" for x in sums)
        assert row["seeds_left_out"] == 0
        assert row["bands"] == d // 2
        assert row["bands_within_L"] == sum(p <= 64 for p in periods)
        assert row["bands_within_L_over_s"] == sum(p <= 32 for p in periods)
        if row["step"] == 2 or row["method"] == "unextended":
            shares = []
            for seed in (0, 1):
                u = usage[(usage["method"] == row["method"]) & (usage["seed"] == seed)]
                per_layer = [g.loc[g["band"] < row["bands_within_L"], "value"].sum() / g["value"].sum()
                             for _, g in u.groupby("layer")]
                shares.append(sum(per_layer) / len(per_layer))
            assert row["fast_share"] == pytest.approx(sum(shares) / 2, abs=1e-12)
            bounds = [mech[(mech["method"] == row["method"]) & (mech["seed"] == s)]["interpolation_bound"].max()
                      for s in (0, 1)]
            assert row["interpolation_bound"] == pytest.approx(sum(bounds) / 2, abs=1e-12)
            strongest = [prev[(prev["method"] == row["method"]) & (prev["seed"] == s)]["prev_attention"].max()
                         for s in (0, 1)]
            assert row["prev_token_attention"] == pytest.approx(sum(strongest) / 2, abs=1e-12)
        else:  # the mechanism is measured on the last checkpoint only
            assert math.isnan(row["fast_share"]) and math.isnan(row["interpolation_bound"])
            assert math.isnan(row["prev_token_attention"])
        first = [prev[(prev["method"] == "unextended") & (prev["seed"] == s)]["prev_attention"].max() for s in (0, 1)]
        assert row["prev_token_attention_unextended"] == pytest.approx(sum(first) / 2, abs=1e-12)
        before = [mech[(mech["method"] == "unextended") & (mech["seed"] == s)]["interpolation_bound"].max()
                  for s in (0, 1)]
        assert row["interpolation_bound_unextended"] == pytest.approx(sum(before) / 2, abs=1e-12)
        assert row["interpolation_bound_unextended"] > 0
    last = extend_study_table([run])
    assert set(zip(last["method"], last["step"])) == {("unextended", 0), ("direct", 2), ("pi", 2)}


def test_the_command_prints_the_table_and_refuses_a_folder_without_trials(run, tmp_path):
    out = subprocess.run([sys.executable, "-m", "posprobe", "zoo", "extend-study", str(run), "--out",
                          str(tmp_path / "study")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "bands within L" in out.stdout and "pi" in out.stdout
    assert (tmp_path / "study" / "study.parquet").is_file()
    page = (tmp_path / "study" / "report.html").read_text(encoding="utf-8")
    assert "Passkey success after extension, by head dim and trained length" in page
    assert "The previous-token head against the skill" in page
    bad = subprocess.run([sys.executable, "-m", "posprobe", "zoo", "extend-study", str(tmp_path), "--out",
                          str(tmp_path / "again")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a `zoo extend` output folder" in bad.stderr
    assert not (tmp_path / "again").exists()


@pytest.fixture(scope="module")
def split(run):
    """The run's two seeds extended again as two runs of one seed each (seeds added later, as separate runs)."""
    from posprobe.analyses.context_extension import extend_zoo
    from posprobe.zoo.extend import ExtendConfig

    cfg = dict(methods=("direct", "pi"), length=128, steps=2, checkpoints=(0, 2), eval_tokens=256, sliding="never",
               passkey_step=16, passkey_trials=3, progress=False)
    out = []
    for seed in (0, 1):
        extend_zoo(run.parent / "zoo", ExtendConfig(**cfg, seeds=(seed,)), run.parent / f"ext-s{seed}")
        out.append(run.parent / f"ext-s{seed}")
    return out


def test_runs_of_other_seeds_pool_into_one_row_as_one_run_of_both(run, split):
    """Two runs, seed 0 and seed 1, give the table of one run of both seeds: every count, rate, interval, window and
    mechanism column (the training is deterministic, so the trials are the same ones); the run column names both."""
    from posprobe.analyses.extend_study import extend_study_table

    one = extend_study_table([run], steps="all").drop(columns=["run"])
    two = extend_study_table(split, steps="all")
    assert set(two["run"]) == {f"{split[0]} {split[1]}"}
    pd.testing.assert_frame_equal(two.drop(columns=["run"]), one)
    with pytest.raises(ValueError, match="seed 0 of head dim 16, L = 64, text, .* is in two runs"):
        extend_study_table([run, split[0]])


def _synthetic_study() -> pd.DataFrame:
    """A study frame written by hand: two cells (head dim 16 and 32 at L = 64), two fine-tunings, steps 0 / 100 / 200
    for PI and the unextended member at 0 under each fine-tuning; successes / trials chosen per row."""
    from posprobe.analyses.extend_study import STUDY_COLUMNS

    rows, hits = [], iter(range(3, 1000, 7))
    for hd in (16, 32):
        for tuning in ("text", "text + passkey 0.5"):
            for method, step in (("unextended", 0), ("pi", 0), ("pi", 100), ("pi", 200)):
                r = dict.fromkeys(STUDY_COLUMNS)
                r.update(head_dim=hd, L=64, target=256, scale=4.0, fine_tuning=tuning, method=method, step=step,
                         seeds=3, bands=hd // 2, bands_within_L=3 if hd == 16 else 5, bands_within_L_over_s=1,
                         window_seeds="64 0 8", prev_token_attention=0.1 + 0.01 * len(rows) if step != 100 else None,
                         prev_token_attention_unextended=0.7 if hd == 16 else 0.5)
                for side, n in (("within", 60), ("beyond", 230)):
                    k = next(hits) % (n + 1)
                    r[f"trials_{side}_L"], r[f"success_{side}_L"] = n, k / n
                    r[f"success_{side}_L_low"], r[f"success_{side}_L_high"] = _wilson(k, n)
                rows.append(r)
    return pd.DataFrame(rows, columns=STUDY_COLUMNS)


def test_the_figure_draws_each_rate_at_its_last_step_with_its_wilson_interval():
    """Every point of the study figure is a row's pooled rate at that method's last step, its error bar spans scipy's
    Wilson interval for that row's successes / trials, and the unextended member (one model) is drawn once per panel.
    Planted, each seen failing: the bar's ends swapped, the first step drawn, the unextended member twice."""
    from posprobe import Result
    from posprobe.report.extend_study import figure

    df = _synthetic_study()
    fig = figure(Result({"study": df}, {"analysis": "zoo-extend-study"}))
    methods = ["unextended", "pi"]
    drawn = []
    for tr in fig.data:
        col = 1 if tr.xaxis in ("x", "x3") else 2  # row 1: x, x2; row 2: x3, x4
        side = "within" if tr.xaxis in ("x", "x2") else "beyond"
        hd = {1: 16, 2: 32}[col]
        for x, y, up, down in zip(tr.x, tr.y, tr.error_y.array, tr.error_y.arrayminus):
            method = methods[round(x)]
            tuning = None if method == "unextended" else tr.name.removeprefix("fine-tuned on ")
            drawn.append((hd, side, method, tuning))
            mine = df[(df["head_dim"] == hd) & (df["method"] == method)
                      & ((df["fine_tuning"] == tuning) if tuning else True)]
            r = mine[mine["step"] == mine["step"].max()].iloc[0]
            k, n = round(r[f"success_{side}_L"] * r[f"trials_{side}_L"]), r[f"trials_{side}_L"]
            lo, hi = _wilson(k, n)
            assert math.isclose(y, k / n, abs_tol=1e-12)
            assert math.isclose(y - down, lo, abs_tol=1e-12) and math.isclose(y + up, hi, abs_tol=1e-12)
    assert sorted(drawn, key=str) == sorted(
        [(hd, side, "unextended", None) for hd in (16, 32) for side in ("within", "beyond")]
        + [(hd, side, "pi", t) for hd in (16, 32) for side in ("within", "beyond")
           for t in ("text", "text + passkey 0.5")], key=str)
    steps = {int(c[0]) for tr in fig.data if tr.name != "unextended" for c in tr.customdata}
    assert steps == {200}


def test_the_backfill_script_adds_the_table_zoo_extend_measures(run, tmp_path):
    """benchmarks/pi_study_previous.py, on a copy of the run with its `previous_token` table removed (a run made before
    `zoo extend` measured it), writes back the table `zoo extend` measured, value for value; the other tables are
    unchanged, and a second call leaves the run alone."""
    import shutil

    from posprobe import Result

    copy = tmp_path / "old"
    shutil.copytree(run, copy)
    res = Result.load(copy / "extend")
    want = res.tables.pop("previous_token")
    res.save(copy / "extend")
    script = [sys.executable, "benchmarks/pi_study_previous.py", "--eval-text", str(run.parent / "zoo" / "eval.txt"),
              f"{run.parent / 'zoo'}:{copy}"]
    out = subprocess.run(script, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "added" in out.stdout
    got = Result.load(copy / "extend")
    key = ["member", "seed", "method", "layer", "head"]
    pd.testing.assert_frame_equal(got.tables["previous_token"].sort_values(key).reset_index(drop=True)[want.columns],
                                  want.sort_values(key).reset_index(drop=True), check_dtype=False, atol=1e-6)
    pd.testing.assert_frame_equal(got.tables["passkey"], res.tables["passkey"])
    again = subprocess.run(script, capture_output=True, text=True)
    assert again.returncode == 0 and "has it already" in again.stdout


def test_the_mechanism_figure_puts_each_rows_previous_token_share_against_its_success():
    """Each point: x = the row's strongest previous-token attention / the unextended member's (computed here), y = its
    success within L with scipy's Wilson interval, at each method's last step, the unextended member once per cell.
    Planted, each seen failing: x not divided by the unextended member's, beyond L drawn for within."""
    from posprobe import Result
    from posprobe.report.extend_study import mechanism_figure

    df = _synthetic_study()
    fig = mechanism_figure(Result({"study": df}, {"analysis": "zoo-extend-study"}))
    seen = []
    for tr in fig.data:
        for (hd, L, tuning, prev), x, y, up, down in zip(tr.customdata, tr.x, tr.y, tr.error_y.array,
                                                         tr.error_y.arrayminus):
            mine = df[(df["head_dim"] == hd) & (df["method"] == tr.name) & (df["fine_tuning"] == tuning)]
            r = mine[mine["step"] == mine["step"].max()].iloc[0]
            assert x == pytest.approx(r["prev_token_attention"] / (0.7 if hd == 16 else 0.5), abs=1e-12)
            k, n = round(r["success_within_L"] * r["trials_within_L"]), r["trials_within_L"]
            lo, hi = _wilson(k, n)
            assert y == pytest.approx(k / n) and y - down == pytest.approx(lo) and y + up == pytest.approx(hi)
            seen.append((hd, tr.name))
    assert sorted(seen) == sorted([(hd, "unextended") for hd in (16, 32)] + [(hd, "pi") for hd in (16, 32)] * 2)
    assert mechanism_figure(Result({"study": df.assign(prev_token_attention=None)},
                                   {"analysis": "zoo-extend-study"})) is None


def test_the_step_0_mode_puts_each_methods_rotation_on_the_members_weights(run):
    """`--step0` prints, per seed and method, the strongest head's attention to i - 1 with the member's weights under
    the method's config: recomputed here from HF's own eager attention with the member's weights loaded under PI's
    saved config (16 windows of L of the zoo's eval text); direct fine-tuning keeps L's rotation, so its share is
    exactly 1. Nothing is written. Planted, each seen failing: the method's config left out, the extended weights
    loaded in place of the member's."""
    import io

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    zoo = run.parent / "zoo"
    before = sorted(p.name for p in run.rglob("*"))
    out = subprocess.run([sys.executable, "benchmarks/pi_study_previous.py", "--step0", "--eval-text",
                          str(zoo / "eval.txt"), f"{zoo}:{run}"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got = pd.read_csv(io.StringIO(out.stdout), sep=r"\s+")
    assert sorted(p.name for p in run.rglob("*")) == before
    assert set(zip(got["seed"], got["method"])) == {(s, m) for s in (0, 1) for m in ("direct", "pi")}
    assert (got.loc[got["method"] == "direct", "share"] == 1.0).all()
    text = (zoo / "eval.txt").read_text()
    for seed in (0, 1):
        source = zoo / f"rope-llama-s{seed}"
        ids = AutoTokenizer.from_pretrained(source)(text, add_special_tokens=False)["input_ids"]
        k = min(16, len(ids) // 64)
        model = AutoModelForCausalLM.from_pretrained(
            source, config=AutoConfig.from_pretrained(run / f"rope-llama-s{seed}-pi"), attn_implementation="eager")
        with torch.no_grad():
            att = model.eval()(torch.tensor(ids[:k * 64]).view(k, 64), output_attentions=True).attentions
        i = torch.arange(1, 64)
        want = max(a[:, :, i, i - 1].double().mean((0, 2)).max().item() for a in att)
        row = got[(got["seed"] == seed) & (got["method"] == "pi")].iloc[0]
        assert row["prev_token_attention"] == pytest.approx(want, abs=2e-6)  # printed to 6 decimals


def _with_member_skill(run, dest, skill: dict[int, bool]):
    """A copy of the run whose unextended member succeeds on every trial within L (True) or on none (False), per seed:
    the other methods' trials are left as they were."""
    import shutil

    shutil.copytree(run, dest)
    path = dest / "extend" / "passkey.parquet"
    pk = pd.read_parquet(path)
    for seed, good in skill.items():
        rows = (pk["method"] == "unextended") & (pk["seed"] == seed) & (pk["distance"] <= 64)
        pk.loc[rows, "successes"] = pk.loc[rows, "trials"] if good else 0
    pk.to_parquet(path)
    return dest


def test_min_skill_leaves_out_the_seeds_whose_member_never_had_the_skill(run, split, tmp_path):
    """Seed 0's member made perfect and seed 1's made to fail: with min_skill 0.5 the table is the one of seed 0's run
    alone (every count, rate, window and mechanism column), says one seed was left out, and the command names it on
    stderr; min_skill 0 keeps both; a threshold no member reaches is refused before anything is written."""
    from posprobe.analyses.extend_study import extend_study_table

    both = _with_member_skill(run, tmp_path / "both", {0: True, 1: False})
    alone = _with_member_skill(split[0], tmp_path / "alone", {0: True})
    kept = extend_study_table([both], steps="all", min_skill=0.5)
    expected = extend_study_table([alone], steps="all")
    assert (kept["seeds_left_out"] == 1).all() and (expected["seeds_left_out"] == 0).all()
    assert (kept["member_skill_seeds"] == "1.000").all() and (kept["seeds"] == 1).all()
    pd.testing.assert_frame_equal(kept.drop(columns=["run", "seeds_left_out"]),
                                  expected.drop(columns=["run", "seeds_left_out"]))
    everyone = extend_study_table([both], min_skill=0)
    assert (everyone["member_skill_seeds"] == "1.000 0.000").all() and (everyone["seeds"] == 2).all()
    assert (everyone["seeds_left_out"] == 0).all()
    out = subprocess.run([sys.executable, "-m", "posprobe", "zoo", "extend-study", str(both), "--min-skill", "0.5",
                          "--out", str(tmp_path / "study")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "seed 1 (its member succeeds on 0.000 within L, under --min-skill 0.5)" in out.stderr
    assert "left out" not in out.stdout.split("\n", 1)[1]  # results on stdout, the note on stderr
    bad = subprocess.run([sys.executable, "-m", "posprobe", "zoo", "extend-study", str(alone), "--min-skill", "1.5",
                          "--out", str(tmp_path / "bad")], capture_output=True, text=True)
    assert bad.returncode == 2 and "min_skill is a share of trials" in bad.stderr
    # Only the trials at distance L itself succeed: L is within L (a `<` for `<=` would give 0).
    edge = _with_member_skill(split[0], tmp_path / "edge", {0: False})
    pk = pd.read_parquet(edge / "extend" / "passkey.parquet")
    at_l = (pk["method"] == "unextended") & (pk["distance"] == 64)
    assert at_l.any()
    pk.loc[at_l, "successes"] = pk.loc[at_l, "trials"]
    pk.to_parquet(edge / "extend" / "passkey.parquet")
    within = pk[(pk["method"] == "unextended") & (pk["distance"] <= 64)]
    expected_skill = pk.loc[at_l, "trials"].sum() / within["trials"].sum()
    assert 0 < expected_skill < 1
    assert set(extend_study_table([edge])["member_skill_seeds"]) == {f"{expected_skill:.3f}"}
    none = _with_member_skill(split[0], tmp_path / "none", {0: False})
    with pytest.raises(ValueError, match="no seed's member succeeds within L on at least 0.5"):
        extend_study_table([none], min_skill=0.5)
    assert not (tmp_path / "bad").exists()
