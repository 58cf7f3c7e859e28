"""The task zoo (`posprobe zoo tasks`, Kazemnejad et al. 2023): instances are what their task says (checked with
plain Python arithmetic and sorting), seeded and apart from the training stream; training scores only answers;
accuracy by teacher forcing equals Hugging Face `generate`'s greedy answers instance by instance; members are
ordinary HF folders; bad input is refused before training."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from zoo_util import spelled_instance, token_reads

from posprobe.zoo.config import TaskConfig, ZooConfig
from posprobe.zoo.tasks import (
    TASKS,
    encode_instance,
    held_out_instances,
    sequence_length,
    task_accuracy,
    task_batch,
    task_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(d_model=32, n_layers=2, n_heads=2, batch_size=16, warmup=5, checkpoint_every=50, progress=False)


def _by_hand(task: str, inp: str) -> str:
    # The tasks' definitions written out: plain Python arithmetic, slicing and a counting sort (duplicates kept).
    if task == "addition":
        a, b = inp.split("+")
        return str(int(a) + int(b))
    if task == "sorting":
        counts = Counter(inp)
        return "".join(c * counts[c] for c in sorted(counts))
    return {"copy": inp, "reverse": inp[::-1]}[task]


@pytest.mark.parametrize("task", TASKS)
def test_held_out_instances_are_what_the_task_says(task):
    """The held-out instances (what accuracy is measured on) have length n and the right answer.

    Catches: sorting dedups repeated symbols ("bab" -> "ab"); reverse answering the copy; addition operands with
    leading zeros; letter instances one symbol short."""
    repeats = 0
    for n in (1, 2, 5, 17, 30):
        pairs = held_out_instances(task, n, 20, seed=0)
        assert len(pairs) == 20 and len(set(pairs)) > 1
        for inp, ans in pairs:
            if task == "addition":
                a, b = inp.split("+")
                assert len(a) == len(b) == n and a.isdigit() and b.isdigit()
                assert n == 1 or (a[0] != "0" and b[0] != "0")
            else:
                assert len(inp) == n and inp.isalpha() and inp.islower()
                repeats += len(set(inp)) < n
            assert ans == _by_hand(task, inp), (task, inp, ans)
            ids, start = encode_instance(task, inp, ans)
            assert len(ids) <= sequence_length(task, n) and len(ids) - start == len(ans) + 1
    # 30 letters out of 26 always repeat one: sorting is checked on repeated symbols
    assert task == "addition" or repeats >= 20


def test_training_rows_have_every_length_1_to_L_and_no_other():
    """Training instances are drawn at lengths 1..L exactly, every task at every length (read back from the rows).

    Catches: lengths drawn from 1..L-1 (L never trained) or 1..L+1 (the first test length leaks into training)."""
    tok = task_tokenizer()
    seen: dict[str, set[int]] = {t: set() for t in TASKS}
    for step in range(40):
        x, _ = task_batch(TASKS, 5, 32, step=step, seed=2)
        for row in x.tolist():
            task, n, inp, ans = spelled_instance(tok.convert_ids_to_tokens(row))
            assert ans == _by_hand(task, inp)
            seen[task].add(n)
    assert seen == {t: set(range(1, 6)) for t in TASKS}


def test_tokenizer_reads_the_sequences_the_trainer_writes():
    tok = task_tokenizer()
    ids, _ = encode_instance("reverse", "abc", "cba")
    assert tok("<|endoftext|><reverse>abc=cba<|endoftext|>", add_special_tokens=False)["input_ids"] == ids
    assert tok.decode(ids) == "<|endoftext|><reverse>abc=cba<|endoftext|>"
    assert tok.convert_ids_to_tokens(tok("Z?", add_special_tokens=False)["input_ids"]) == ["<unk>", "<unk>"]


def test_batches_score_only_answers_and_depend_on_seed_and_step_alone():
    x, labels = task_batch(TASKS, 6, 32, step=3, seed=1)
    x2, labels2 = task_batch(TASKS, 6, 32, step=3, seed=1)
    assert torch.equal(x, x2) and torch.equal(labels, labels2)
    assert not torch.equal(task_batch(TASKS, 6, 32, step=4, seed=1)[0], x)
    tok = task_tokenizer()
    for row, lab in zip(x.tolist(), labels.tolist()):
        text = tok.decode([t for t in row if t != tok.pad_token_id])
        answer = text.split("=")[1]  # "<answer><|endoftext|>"
        scored = [t for t in lab if t != -100]
        assert tok.decode(scored) == answer and answer.endswith("<|endoftext|>")
    # the test stream is another stream: no test set equals the training rows drawn from the same seed
    assert held_out_instances("copy", 5, 4, seed=0) == held_out_instances("copy", 5, 4, seed=0)
    assert held_out_instances("copy", 5, 4, seed=0) != held_out_instances("copy", 5, 4, seed=1)


@pytest.fixture(scope="module")
def task_zoo(tmp_path_factory):
    from posprobe.zoo.task_zoo import train_task_zoo

    out = tmp_path_factory.mktemp("tz") / "zoo"
    cfg = ZooConfig(members=("nope", "learned"), seeds=(0,), steps=250, lr=3e-3, **TINY)
    tasks = TaskConfig(tasks=("copy", "sorting"), train_max=3, test_factor=2, test_count=24, steps=250,
                       batch_size=16)
    with token_reads(len(task_tokenizer().get_vocab())) as reads:
        result = train_task_zoo(cfg, tasks, out)
    return out, result, reads


def test_accuracy_equals_hugging_face_greedy_generation(task_zoo):
    from transformers import AutoModelForCausalLM

    out, _, _ = task_zoo
    model = AutoModelForCausalLM.from_pretrained(out / "nope-s0", attn_implementation="eager").eval()
    tok = task_tokenizer()
    verdicts = []
    for task in ("copy", "sorting"):
        for inp, ans in held_out_instances(task, 1, 12, seed=0) + held_out_instances(task, 4, 12, seed=0):
            ids, start = encode_instance(task, inp, ans)
            prompt = torch.tensor([ids[:start]])
            with torch.no_grad():
                gen = model.generate(prompt, max_new_tokens=len(ids) - start, do_sample=False,
                                     pad_token_id=tok.pad_token_id, eos_token_id=None)
            want = gen[0, start:].tolist() == ids[start:]
            assert task_accuracy(model, task, [(inp, ans)]) == float(want), (task, inp, ans)
            verdicts.append(want)
    assert any(verdicts) and not all(verdicts)  # both outcomes occur: the comparison is not vacuous


def test_task_zoo_folders_tables_and_report(task_zoo, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posprobe.report.zoo_tasks import accuracy_table

    out, result, _ = task_zoo
    assert sorted(p.name for p in out.iterdir()) == ["learned-s0", "nope-s0", "tasks"]
    hf = AutoModelForCausalLM.from_pretrained(out / "learned-s0")
    assert hf.config.n_positions == sequence_length("copy", 6)  # the longest test sequence
    assert AutoTokenizer.from_pretrained(out / "nope-s0").get_vocab() == task_tokenizer().get_vocab()
    acc = result.tables["accuracy"]
    assert len(acc) == 2 * 2 * 6 and set(acc.n) == set(range(1, 7)) and (acc["count"] == 24).all()
    assert list(acc[acc.n <= 3].in_training.unique()) == [True]
    # trained: the copy task at n = 1 is answered far above chance (1 / 26)
    assert acc[(acc.task == "copy") & (acc.n == 1)].accuracy.max() > 0.5
    t = accuracy_table(result)
    assert set(t.columns) >= {"member", "task", "in (n <= L)", "in seeds", "past L", "past L seeds"}
    _assert_mrr_by_hand(result, L=3)
    paths = type(result).load(out / "tasks").save(tmp_path / "rep")
    page = paths["report"].read_text()
    assert "Mean reciprocal rank" in page and "copy: accuracy vs instance length" in page
    assert "in seeds" in page and "past L seeds" in page  # the report's table is the printed one


def _crafted_accuracy(L: int = 2) -> SimpleNamespace:
    # An accuracy table with what the summaries must handle: two seeds that disagree (ALiBi's copy inside L: 0.35
    # and 0.98 per seed), ties between members, a length past L where every member scores 0, and inside-L cells
    # ordered unlike the past-L ones. Values are multiples of 1/20 drawn from a seeded generator.
    rng = random.Random(5)
    rows = []
    for member in ("nope", "alibi", "rope", "t5"):
        for seed in (0, 1):
            for task in ("copy", "sorting"):
                for n in range(1, 3 * L + 1):
                    acc = rng.choice([0.0, 0.05, 0.25, 0.5, 0.5, 0.75, 1.0])
                    if n == 3 * L:
                        acc = 0.0
                    if (member, task) == ("alibi", "copy") and n <= L:
                        acc = 0.35 if seed == 0 else 0.98
                    rows.append(dict(member=member, seed=seed, task=task, n=n, in_training=n <= L, accuracy=acc))
    return SimpleNamespace(tables={"accuracy": pd.DataFrame(rows)})


def _assert_mrr_by_hand(result, L: int) -> None:
    # Kazemnejad et al.'s summary as documented: per (task, length past L) cell, each member's accuracy averaged over
    # seeds, ranked among the members (1 = best; tied members share the mean of the ranks they span), cells where
    # every member scores the same left out; a member's MRR is the mean of 1 / rank over the remaining cells.
    from posprobe.report.zoo_tasks import mean_reciprocal_rank

    cells: dict = {}
    for r in result.tables["accuracy"].to_dict("records"):
        if r["n"] > L:
            cells.setdefault((r["task"], r["n"]), {}).setdefault(r["member"], []).append(r["accuracy"])
    rr: dict[str, list[float]] = {}
    for per_member in cells.values():
        means = {m: sum(v) / len(v) for m, v in per_member.items()}
        if max(means.values()) == min(means.values()):
            continue
        for m, mine in means.items():
            better = sum(v > mine for v in means.values())
            tied = sum(v == mine for v in means.values())  # itself included
            rr.setdefault(m, []).append(1 / (better + (tied + 1) / 2))
    want = {m: sum(v) / len(v) for m, v in rr.items()}
    got = mean_reciprocal_rank(result).to_dict()
    assert got.keys() == want.keys() and all(abs(got[m] - want[m]) < 1e-12 for m in want), (got, want)


def test_mean_reciprocal_rank_equals_the_definition_by_hand():
    """Catches: ranks ascending (worst = 1); ties ranked by "min" instead of sharing the mean rank; rank per seed
    instead of on the seed mean; lengths inside L counted; cells where every member ties kept."""
    result = _crafted_accuracy()
    acc = result.tables["accuracy"]
    past = acc[~acc.in_training].groupby(["task", "n", "member"]).accuracy.mean()
    # the crafted table has the cases the definition decides: ties inside a cell and an all-equal cell
    assert any(g.duplicated().any() and g.nunique() > 1 for _, g in past.groupby(level=[0, 1]))
    assert any(g.nunique() == 1 for _, g in past.groupby(level=[0, 1]))
    _assert_mrr_by_hand(result, L=2)


def test_accuracy_table_shows_each_seeds_range_beside_the_mean():
    """Each member and task: mean over seeds of the per-seed mean over lengths, and the lowest–highest of those per-seed
    means, inside and past L (computed here from the per-seed rows).

    Catches: the first seed only; the range taken over single lengths instead of per-seed means; the inside-L
    range read from the past-L rows (and the table before this change, which showed no inside-L range)."""
    from posprobe.report.zoo_tasks import accuracy_table

    result = _crafted_accuracy(L=2)
    per_seed: dict = {}
    for r in result.tables["accuracy"].to_dict("records"):
        key = (r["member"], r["task"], r["in_training"])
        per_seed.setdefault(key, {}).setdefault(r["seed"], []).append(r["accuracy"])
    table = accuracy_table(result).set_index(["member", "task"])
    for (member, task, inside), seeds in per_seed.items():
        means = [sum(v) / len(v) for v in seeds.values()]
        mean, low, high = sum(means) / len(means), min(means), max(means)
        row = table.loc[(member, task)]
        label, seeds_label = ("in (n <= L)", "in seeds") if inside else ("past L", "past L seeds")
        # printed to 3 and 2 decimals: equal to the rounding
        shown = [float(v) for v in row[seeds_label].split("–")]
        assert abs(row[label] - mean) <= 5e-4 + 1e-12, (member, task, inside)
        assert abs(shown[0] - low) <= 5e-3 + 1e-12 and abs(shown[1] - high) <= 5e-3 + 1e-12, (member, task, inside)
    assert table.loc[("alibi", "copy"), "in seeds"] == "0.35–0.98"
    printed = accuracy_table(result).to_string(index=False)  # what `posprobe zoo tasks` prints
    assert "0.35–0.98" in printed and "past L seeds" in printed


def test_rows_read_in_training_and_in_measuring_have_the_documented_lengths(task_zoo):
    """Read from the ids the models' embeddings actually received: training rows at lengths 1..L only, and for each
    task and length n = 1..test_factor x L exactly test_count held-out instances of length n, labelled in_training
    exactly when n <= L.

    Catches: held-out instances measured at a length other than their row's n (clipped to L); test lengths
    stopping at test_factor x L - 1; in_training marking n <= L + 1."""
    _, result, reads = task_zoo
    tok = task_tokenizer()
    trained, measured = set(), Counter()
    for training, ids in reads:
        for row in ids.tolist():
            task, n, inp, ans = spelled_instance(tok.convert_ids_to_tokens(row))
            assert ans == _by_hand(task, inp)
            (trained.add((task, n)) if training else measured.update([(task, n)]))
    assert trained == {(t, n) for t in ("copy", "sorting") for n in (1, 2, 3)}
    # two members, 24 instances each per task and length 1..2L (L = 3)
    assert measured == {(t, n): 2 * 24 for t in ("copy", "sorting") for n in range(1, 7)}
    acc = result.tables["accuracy"]
    assert sorted(set(acc.n)) == list(range(1, 7)) and (acc.in_training == (acc.n <= 3)).all()
    assert TaskConfig().test_lengths == list(range(1, 25)) and TaskConfig().train_max == 8  # README: L = 8, to 3L


class _Scripted(torch.nn.Module):
    """A causal stand-in for a trained member that answers by rule from the prefix it has read (never a later
    token): after "=" it writes `answer(task, input)` and then `closing`."""

    def __init__(self, answer, closing: str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # task_accuracy reads the device from a parameter
        self.answer, self.closing, self.tok = answer, closing, task_tokenizer()

    def forward(self, input_ids):
        vocab = self.tok.get_vocab()
        logits = torch.zeros(*input_ids.shape, len(vocab))
        for r, row in enumerate(input_ids.tolist()):
            tokens = self.tok.convert_ids_to_tokens(row)
            for t in range(len(row)):
                prefix, nxt = tokens[:t + 1], "<pad>"
                if "=" in prefix:
                    eq = prefix.index("=")
                    out = list(self.answer(prefix[1].strip("<>"), "".join(prefix[2:eq]))) + [self.closing]
                    written = prefix[eq + 1:]
                    nxt = out[len(written)] if len(written) < len(out) else "<pad>"
                logits[r, t, vocab[nxt]] = 1.0
        return SimpleNamespace(logits=logits)


def _greedy_by_hand(model, task: str, inp: str, ans: str) -> bool:
    # The rule written out: decode greedily from "<eot> <task> input =" for len(answer) + 1 tokens; correct when that
    # is the answer followed by the end token.
    ids, start = encode_instance(task, inp, ans)
    prompt = ids[:start]
    for _ in range(len(ids) - start):
        prompt.append(int(model(torch.tensor([prompt])).logits[0, -1].argmax()))
    return prompt[start:] == ids[start:]


@pytest.mark.parametrize("closing", ["<|endoftext|>", "a"])
def test_an_answer_counts_only_with_its_end_token(closing):
    """An answer counts when greedy decoding writes it and then <eot> (README: "reproduces it" and its closing <eot>,
    which training scores); right symbols without the end token do not count.

    Catches: the closing <eot> left out of the comparison (a model that never stops would score 1.0)."""
    for answer in (_by_hand, _third_symbol_wrong):
        model = _Scripted(answer, closing)
        for task in ("copy", "reverse", "sorting"):
            pairs = held_out_instances(task, 4, 6, seed=0)
            want = [_greedy_by_hand(model, task, inp, ans) for inp, ans in pairs]
            assert task_accuracy(model, task, pairs, batch_size=4) == sum(want) / len(pairs)
            # the stand-ins behave as built: the comparison above sees both verdicts across the cases
            assert all(want) if (answer is _by_hand and closing == "<|endoftext|>") else not any(want)


def _third_symbol_wrong(task: str, inp: str) -> str:
    right = _by_hand(task, inp)
    return right[:2] + ("b" if right[2] == "a" else "a") + right[3:]


def test_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    from posprobe.zoo.task_zoo import train_task_zoo

    cfg = ZooConfig(members=("rope",), seeds=(3,), steps=6, **TINY)
    tasks = TaskConfig(train_max=2, test_factor=1, test_count=2, steps=6, batch_size=4)
    a = train_task_zoo(cfg, tasks, tmp_path / "a")
    b = train_task_zoo(cfg, tasks, tmp_path / "b")
    wa = load_file(tmp_path / "a" / "rope-s3" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "rope-s3" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert a.tables["training"].loss.tolist() == b.tables["training"].loss.tolist()


def test_the_task_batch_and_steps_are_the_task_configs(tmp_path, monkeypatch):
    """Every optimiser step of a task zoo draws `TaskConfig.batch_size` instances for `TaskConfig.steps` steps, not the
    text tier's batch (16 in TINY) or steps. Catches (mutmut zoo_tasks): `train_task_zoo` dropping
    `batch_size=tasks.batch_size` or `steps=tasks.steps` from the config it trains with."""
    import posprobe.zoo.tasks as T
    from posprobe.zoo.task_zoo import train_task_zoo

    drawn, real = [], T.task_batch

    def counted(tasks, train_max, batch_size, step, seed):
        drawn.append((batch_size, step))
        return real(tasks, train_max, batch_size, step, seed)

    monkeypatch.setattr(T, "task_batch", counted)
    cfg = ZooConfig(members=("rope",), seeds=(0,), steps=9, **TINY)
    result = train_task_zoo(cfg, TaskConfig(train_max=2, test_factor=1, test_count=2, steps=3, batch_size=5),
                            tmp_path / "z")
    assert {b for b, _ in drawn} == {5} and sorted({s for _, s in drawn}) == [0, 1, 2]
    assert result.tables["members"]["steps"].tolist() == [3]


def test_tables_meta_and_tokenizer_say_what_was_trained(tmp_path):
    """The `members` and `training` tables and the Result's meta carry what the run did, read back from the saved
    folders (not from the code that wrote them): the last logged loss is the training table's last row, every
    member's steps are the task config's, meta names the test count per task and length, and the saved tokenizer
    opens and closes instances with the end token. Catches (mutmut zoo_tasks): a renamed column or meta key, the meta
    dropped from the Result, the tokenizer's bos token left unset."""
    from transformers import AutoTokenizer

    from posprobe.report.result import Result
    from posprobe.zoo.task_zoo import train_task_zoo

    cfg = ZooConfig(members=("rope", "nope"), seeds=(1,), steps=99, **TINY)
    tasks = TaskConfig(tasks=("copy",), train_max=2, test_factor=1, test_count=3, steps=4, batch_size=4)
    result = train_task_zoo(cfg, tasks, tmp_path / "z")
    saved = Result.load(tmp_path / "z" / "tasks")
    members, curve = saved.tables["members"], saved.tables["training"]
    assert members.model.tolist() == ["rope-s1", "nope-s1"] and (members.steps == 4).all()
    assert (members.seconds > 0).all() and (members.tokens_per_s > 0).all()
    # log every 10 steps and at the last one: one row per member, at step 4, its loss the members table's loss
    assert curve.groupby("model").step.apply(list).to_dict() == {"nope-s1": [4], "rope-s1": [4]}
    last = curve.set_index("model").loss
    assert all(members.set_index("model").loss[m] == last[m] for m in last.index)
    assert saved.meta["analysis"] == "zoo-tasks" and saved.meta["model"]["positional_kind"] == "several"
    assert saved.meta["data"]["n_items"] == 3 and saved.meta["context"] == sequence_length("copy", 2)
    assert result.meta["data"] == saved.meta["data"]
    tok = AutoTokenizer.from_pretrained(tmp_path / "z" / "rope-s1")
    assert tok.bos_token == tok.eos_token == "<|endoftext|>" and tok.pad_token != tok.eos_token


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "posprobe", "zoo", "tasks", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_cli_trains_and_measures_and_refuses_bad_input_first(tmp_path):
    p = _cli("--member", "alibi", "--seed", "0", "--steps", "8", "--batch-size", "4", "--d-model", "32",
             "--n-layers", "2", "--n-heads", "2", "--task", "copy", "--train-max", "2", "--test-count", "3",
             "--out", str(tmp_path / "tz"))
    assert p.returncode == 0, p.stderr
    assert "past L" in p.stdout and "alibi" in p.stdout and "tokens/s" in p.stderr
    assert (tmp_path / "tz" / "tasks" / "accuracy.parquet").is_file()
    for bad, says in ((["--task", "divide"], "divide"), (["--train-max", "0"], "train_max"),
                      (["--member", "fire"], "fire")):
        p = _cli(*bad, "--out", str(tmp_path / "bad"))
        assert p.returncode != 0 and says in p.stderr and "tokens/s" not in p.stderr, p.stderr
        assert not (tmp_path / "bad").exists()
