"""The zoo's passkey skill and Chen et al.'s effective window (#49, "a task that needs the long context"): the
training sequences are exact, seeded per (seed, step), cover every distance the format allows within L, leave a zoo
without the skill unchanged and resume bit for bit; the effective window matches a hand-computed case; the scorer's
exact-greedy success equals HF's own `generate`.

Planted bugs seen failing (each by editing posprobe/, running this file, then reverting):
- `effective_window` with `>` for `>=` (20 % itself not a success): test_effective_window_by_hand fails (32, not 40).
- `effective_window` taking the largest passing distance without stopping at the first failure: the same test
  fails (56, not 40).
- `greedy_prefix` reading the logits one position late (`len(p)` for `len(p) - 1`): test_greedy_prefix_equals_generate
  fails (the generated continuation scores 0 tokens, not all).
- The passkey rows drawn from a generator seeded by the step alone (not the seed): test_passkey_rows_are_seeded...
  fails.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from zoo_util import Died, dying_state_io

from posprobe.analyses.passkey import effective_window
from posprobe.zoo.config import ZooConfig

TINY = dict(d_model=32, n_layers=2, n_heads=2, length=64, vocab_size=300, batch_size=8, steps=10, warmup=1,
            checkpoint_every=3, progress=False)


@pytest.fixture(scope="module")
def tok():
    from posprobe.data import builtin_corpus
    from posprobe.zoo.tokenizer import train_tokenizer

    return train_tokenizer(builtin_corpus()[:30000], 300)


@pytest.fixture(scope="module")
def ids(tok):
    from posprobe.data import builtin_corpus

    return torch.tensor(tok(builtin_corpus()[:20000])["input_ids"])


def test_effective_window_by_hand():
    # Success by distance; 20 % counts (>=), and the window stops at the first failure (48) although 56 passes again.
    rates = {25: 1.0, 32: 0.5, 40: 0.2, 48: 0.1, 56: 0.6}
    assert effective_window(rates) == 40
    assert effective_window(list(reversed(list(rates.items())))) == 40  # order of the input does not matter
    assert effective_window({25: 0.1, 32: 1.0}) == 0  # the shortest fails: no window
    assert effective_window({25: 1.0, 32: math.nan, 40: 1.0}) == 25  # not measured = failed
    assert effective_window({}) == 0
    assert effective_window({25: 0.3, 32: 0.3}, floor=0.5) == 0


def test_passkey_prompt_places_the_key_exactly(tok):
    from posprobe.analyses.passkey import distance_grid, passkey_trial, shortest_distance
    from posprobe.data.needles import SHORT_PASSKEY, passkey_at

    short = shortest_distance(tok)
    for d in (short, short + 1, 40, 100):
        p = passkey_trial(tok, d, "48213")
        assert p.distance == d and len(p.ids) == p.key_pos + d
        assert p.ids[p.key_pos:p.key_pos + len(p.answer)] == list(p.answer)
        assert tok.decode(p.answer) == " 48213" and tok.decode(p.ids).endswith("The pass key is")
    with pytest.raises(ValueError, match="shorter"):
        passkey_trial(tok, short - 1, "48213")
    grid = distance_grid(tok, 64, 256)
    assert grid[0] == short and all(d % 8 == 0 for d in grid[1:]) and grid == sorted(set(grid))
    assert len(passkey_trial(tok, grid[-1], "10000").ids) <= 256 < len(passkey_trial(tok, grid[-1] + 8, "10000").ids)
    # The filler is one stream cut at `before`: needle + filler = the whole filler with the needle spliced in.
    p = passkey_at(tok, 80, 7, "12345", SHORT_PASSKEY)
    assert len(p.ids) == 80 and p.needle_pos == 7


def test_passkey_rows_are_seeded_and_cover_the_distances(tok, ids):
    from posprobe.analyses.passkey import shortest_distance
    from posprobe.zoo.passkey import passkey_rows, with_passkey
    from posprobe.zoo.train import batch_ids

    cfg = ZooConfig(**TINY, passkey=0.25)
    text = batch_ids(ids, 3, cfg, 0)
    assert with_passkey(text, tok, 3, 0, 0.0) is text  # share 0: the batch as before
    a, b = with_passkey(text, tok, 3, 0, 0.25), with_passkey(text, tok, 3, 0, 0.25)
    assert torch.equal(a, b) and a.shape == text.shape and passkey_rows(0.25, 8) == 2
    assert torch.equal(a[:6], text[:6]) and not torch.equal(a[6:], text[6:])  # the last rows replaced
    assert not torch.equal(a, with_passkey(text, tok, 3, 1, 0.25))  # another seed, other keys
    assert not torch.equal(a, with_passkey(text, tok, 4, 0, 0.25))  # another step, other keys
    for row in a[6:]:
        s = tok.decode(row)
        key = s.rsplit("The pass key is ", 1)[1]
        assert len(key) == 5 and key.isdigit() and s.count(f"The pass key is {key}") == 2
    # The distance from key to answer covers every value the format allows within L.
    from posprobe.zoo.passkey import passkey_sequence

    rng = random.Random(0)
    seen = {passkey_sequence(tok, 64, rng).distance for _ in range(2000)}
    assert min(seen) == shortest_distance(tok) and seen == set(range(min(seen), max(seen) + 1))
    one = passkey_sequence(tok, 64, rng)
    assert max(seen) == 64 - len(one.answer) - (one.key_pos - one.needle_pos)  # the needle first, the answer last
    with pytest.raises(ValueError, match="passkey"):
        ZooConfig(**TINY, passkey=1.5)


def test_training_with_the_skill_resumes_bit_for_bit(tok, ids, tmp_path):
    import json

    from safetensors.torch import load_file

    from posprobe.report.checkpoint import Checkpoint
    from posprobe.zoo.job import Job
    from posprobe.zoo.train import train_member

    cfg = ZooConfig(**TINY, passkey=0.5)
    job = Job.text("rope-llama", 0, cfg, tok, ids)
    whole = train_member(job, tmp_path / "whole", (lambda: None, lambda s: None))
    io, saved = dying_state_io(Checkpoint(tmp_path / "work", {"k": 1}), after=2)
    with pytest.raises(Died):
        train_member(job, tmp_path / "resumed", io)
    resumed = train_member(job, tmp_path / "resumed", io)
    assert saved == [3, 6, 9] and resumed["log"] == whole["log"]
    a, b = (load_file(tmp_path / f / "model.safetensors") for f in ("whole", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "whole" / "zoo.json").read_text())["passkey"] == 0.5
    # The skill changes the training: the same run without it ends elsewhere.
    plain = train_member(Job.text("rope-llama", 0, ZooConfig(**TINY), tok, ids), tmp_path / "plain",
                         (lambda: None, lambda s: None))
    assert plain["log"] != whole["log"] and "passkey" not in json.loads((tmp_path / "plain" / "zoo.json").read_text())


def _tiny_lm(tok, name="rope-llama", seed=3):
    from posprobe.zoo.members import member
    from posprobe.zoo.train import build_model

    return build_model(member(name), ZooConfig(**TINY), tok, seed).eval()


@pytest.mark.parametrize("name", ["rope-llama", "alibi"])
def test_greedy_prefix_equals_generate(tok, name):
    """The scorer's exact-greedy success against HF's own `generate` (greedy, no cache shortcut of ours): on a tiny
    random model, the continuation `generate` gives scores all its tokens, one changed at position i scores i, and for
    the true key the scorer's prefix is the length of the key's agreement with `generate`'s output."""
    from posprobe.analyses.passkey import greedy_prefix, passkey_trial, shortest_distance

    model = _tiny_lm(tok, name)
    short = shortest_distance(tok)
    prompts = [passkey_trial(tok, short + d, k) for d, k in ((0, "48213"), (5, "10000"), (5, "99999"), (16, "55555"))]
    gen = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p.ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        gen.append(out[0, len(p.ids):].tolist())
    items = [(p.ids, g) for p, g in zip(prompts, gen)]
    assert greedy_prefix(model, items, batch_size=2) == [6] * 4
    changed = [(p, g[:i] + [(g[i] + 1) % 300] + g[i + 1:]) for (p, g), i in zip(items, (0, 2, 5, 3))]
    assert greedy_prefix(model, changed) == [0, 2, 5, 3]
    agree = [next((i for i, (a, b) in enumerate(zip(g, p.answer)) if a != b), len(p.answer))
             for p, g in zip(prompts, gen)]
    assert greedy_prefix(model, [(p.ids, p.answer) for p in prompts]) == agree


def test_passkey_table_and_a_learned_table(tok):
    from posprobe.analyses.passkey import passkey_table, shortest_distance

    model = _tiny_lm(tok, "learned")  # a learned table of L = 64 rows
    short = shortest_distance(tok)
    df = passkey_table(model, tok, [short, short + 8, 80], trials=3, max_length=64)
    assert df["distance"].tolist() == [short, short + 8, 80] and df["status"].tolist()[:2] == ["ok", "ok"]
    assert df["status"].iloc[2] == "beyond the position table" and math.isnan(df["success_rate"].iloc[2])
    assert (df["trials"].iloc[:2] == 3).all() and df["success_rate"].iloc[:2].between(0, 1).all()
    again = passkey_table(model, tok, [short, short + 8], trials=3)
    assert again[["successes", "prefix_tokens"]].equals(df[["successes", "prefix_tokens"]].iloc[:2])
    for r in df.iloc[:2].itertuples():  # each rate's 95 % Wilson interval, from its own successes of 3 trials
        assert (r.success_low, r.success_high) == pytest.approx(_wilson(r.successes, 3), abs=1e-12)
    assert math.isnan(df["success_low"].iloc[2])  # no trials beyond the table: no interval


def test_zoo_extend_measures_the_window_beside_perplexity(tmp_path):
    """`extend_zoo` on a zoo trained with the skill: the unextended member and every checkpoint get a success table
    by distance up to L' and an effective window (the pure function of that table), in the summary beside ppl; the
    numbers equal `passkey_table` run on the saved folders again."""
    from posprobe.analyses.context_extension import extend_zoo
    from posprobe.analyses.passkey import passkey_table
    from posprobe.backend.loading import load_causal_lm
    from posprobe.data import builtin_corpus
    from posprobe.zoo.extend import ExtendConfig
    from posprobe.zoo.run import train_zoo

    small = dict(TINY, length=64, steps=4, checkpoint_every=10)
    train_zoo(ZooConfig(**small, members=("rope-llama", "alibi"), passkey=0.5), builtin_corpus(), tmp_path / "zoo")
    cfg = ExtendConfig(methods=("pi",), length=128, steps=2, checkpoints=(0,), eval_tokens=256, sliding="never",
                       passkey_step=16, passkey_trials=3, progress=False)
    result = extend_zoo(tmp_path / "zoo", cfg, tmp_path / "out")
    pk, ew, summary = (result.tables[k] for k in ("passkey", "effective_window", "summary"))
    assert set(zip(pk["member"], pk["method"])) == {("rope-llama", "unextended"), ("rope-llama", "pi"),
                                                    ("alibi", "unextended"), ("alibi", "direct")}
    assert set(pk[pk["method"] == "pi"]["step"]) == {0, 2} and pk["length"].max() <= 128
    for (model, step), g in pk.groupby(["model", "step"]):
        row = ew[(ew["model"] == model) & (ew["step"] == step)]
        assert row["effective_window"].item() == effective_window(dict(zip(g["distance"], g["success_rate"])))
    assert {"ew_unextended", "ew_step0", "ew"} <= set(summary.columns)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tmp_path / "zoo" / "rope-llama-s0")
    for folder, method in ((tmp_path / "zoo" / "alibi-s0", "unextended"), (tmp_path / "out" / "alibi-s0-direct",
                                                                          "direct")):
        again = passkey_table(load_causal_lm(folder), tok, sorted(set(pk["distance"])), 3)
        step = 2 if method == "direct" else 0
        got = pk[(pk["member"] == "alibi") & (pk["method"] == method) & (pk["step"] == step)]
        assert got["prefix_tokens"].tolist() == again["prefix_tokens"].tolist()
    # Fine-tuning with the skill mixed in (--passkey of zoo extend): PoSE's rows keep their skip-wise position ids.
    from posprobe.zoo.extend import job_batches, plan_extension, pose_batch

    ids = torch.tensor(tok(builtin_corpus()[:20000])["input_ids"])
    with_skill = ExtendConfig(members=("rope-llama",), methods=("pose", "pi"), length=128, steps=2, checkpoints=(),
                              passkey=0.5)
    (pose, pi), _ = plan_extension(tmp_path / "zoo", with_skill)
    x, labels, pos = job_batches(pose, pose.train_config(with_skill), ids, tok)(1)
    text, text_pos = pose_batch(ids, 1, 0, pose.batch_size, 64, 128)
    half = pose.batch_size // 2
    assert torch.equal(pos, text_pos) and torch.equal(x[:half], text[:half]) and not torch.equal(x[half:], text[half:])
    assert "The pass key is" in tok.decode(x[-1]) and torch.equal(x, labels)
    # PI's batches are the zoo's text windows at L' with the same share of passkey rows.
    from posprobe.zoo.train import batch_ids

    pi_cfg = pi.train_config(with_skill)
    x = job_batches(pi, pi_cfg, ids, tok)(1)[0]
    assert pi_cfg.passkey == 0.5 and x.shape == (pi.batch_size, 128)
    assert torch.equal(x[:pi.batch_size // 2], batch_ids(ids, 1, pi_cfg, 0)[:pi.batch_size // 2])
    # ... and through the loop: the tokenizer reaches PoSE's batches (two steps, saved as an HF folder).
    from posprobe.zoo.train import train_member

    rec = train_member(pose.job(with_skill, ids, tok), tmp_path / "pose-skill", (lambda: None, lambda s: None))
    assert rec["steps_run"] == 2 and (tmp_path / "pose-skill" / "model.safetensors").is_file()


def test_the_zoo_atlas_measures_the_window_of_members_trained_with_the_skill(tmp_path):
    """`zoo atlas --sections passkey`: each member trained with the skill gets `passkey_table` on its HF folder (rerun
    here: same distances from the format's shortest to prompts of max(factors) x L, same keys) and the effective
    window of that table; the learned member's distances past its L rows say so; the page's section names every
    member with its window."""
    from transformers import AutoTokenizer

    from posprobe.analyses.atlas_many import run_zoo_atlas
    from posprobe.analyses.configs import ZooAtlasConfig
    from posprobe.analyses.passkey import distance_grid, passkey_table
    from posprobe.backend.loading import load_causal_lm
    from posprobe.data import builtin_corpus
    from posprobe.report.passkey import compare_section
    from posprobe.zoo.run import train_zoo

    small = dict(TINY, steps=4, checkpoint_every=10)
    train_zoo(ZooConfig(**small, members=("rope-llama", "learned"), passkey=0.5), builtin_corpus(), tmp_path / "zoo")
    cfg = ZooAtlasConfig(sections=("passkey",), factors=(1, 2), passkey_trials=3, progress=False)
    result = run_zoo_atlas([str(tmp_path / "zoo")], cfg)
    pk, w = result.tables["passkey"], result.tables["passkey_window"]
    assert set(pk.model) == set(w.model) == {"rope-llama-s0", "learned-s0"} and not len(result.tables["refused"])
    tok = AutoTokenizer.from_pretrained(tmp_path / "zoo" / "rope-llama-s0")
    distances = distance_grid(tok, 64, 128)
    again = passkey_table(load_causal_lm(tmp_path / "zoo" / "rope-llama-s0"), tok, distances, 3)
    got = pk[pk.model == "rope-llama-s0"]
    assert got["distance"].tolist() == distances and got["prefix_tokens"].tolist() == again["prefix_tokens"].tolist()
    for model, g in pk[pk.status == "ok"].groupby("model"):
        want = effective_window(dict(zip(g["distance"], g["success_rate"])))
        assert w[w.model == model]["effective_window"].item() == want
    learned = pk[pk.model == "learned-s0"]
    assert set(learned[learned["length"] > 64]["status"]) == {"beyond the position table"}
    assert set(learned[learned["length"] + 5 <= 64]["status"]) == {"ok"}
    text = compare_section(result).html
    assert "rope-llama" in text and "learned" in text and "effective window" in text


def _wilson(k: int, n: int) -> tuple[float, float]:
    # The Wilson score interval written out here, with scipy's normal quantile (independent of posprobe's code).
    from scipy.stats import norm

    z = norm.ppf(0.975)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    return max(0.0, centre - half), min(1.0, centre + half)


def test_success_rates_carry_wilson_intervals_per_distance_and_pooled_within_and_beyond_L():
    """#63: every success rate comes with its 95 % Wilson interval; inside and beyond L over the trials pooled there.
    Planted: the pooled interval taken from the mean rate with one distance's trials fails."""
    import pandas as pd

    from posprobe.analyses.passkey import window_table

    rows = [(8, 10, 10), (16, 9, 10), (32, 4, 10), (64, 1, 10)]  # distance, successes, trials; L = 16
    df = pd.DataFrame([{"model": "m", "distance": d, "successes": k, "trials": n, "success_rate": k / n,
                        "status": "ok"} for d, k, n in rows])
    w = window_table(df, 16).iloc[0]
    assert w["success_within_L"] == pytest.approx(0.95)
    assert (w["success_within_L_low"], w["success_within_L_high"]) == pytest.approx(_wilson(19, 20), abs=1e-12)
    assert (w["success_beyond_L_low"], w["success_beyond_L_high"]) == pytest.approx(_wilson(5, 20), abs=1e-12)
    assert w["success_within_L_low"] < 0.95 < w["success_within_L_high"] <= 1.0
