"""The task zoo (`posprobe zoo tasks`, Kazemnejad et al. 2023): instances are what their task says (checked with
plain Python arithmetic and sorting), seeded and apart from the training stream; training scores only answers;
accuracy by teacher forcing equals Hugging Face `generate`'s greedy answers instance by instance; members are
ordinary HF folders; bad input is refused before training."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posprobe.zoo.config import TaskConfig, ZooConfig
from posprobe.zoo.tasks import (
    TASKS,
    encode_instance,
    held_out_instances,
    instance,
    sequence_length,
    task_accuracy,
    task_batch,
    task_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(d_model=32, n_layers=2, n_heads=2, batch_size=16, warmup=5, checkpoint_every=50, progress=False)


@pytest.mark.parametrize("task", TASKS)
def held_out_instances_are_what_the_task_says(task):
    rng = random.Random(0)
    for n in (1, 2, 5, 17):
        for _ in range(20):
            inp, ans = instance(task, n, rng)
            if task == "addition":
                a, b = inp.split("+")
                assert len(a) == len(b) == n and int(a) + int(b) == int(ans)
                assert n == 1 or (a[0] != "0" and b[0] != "0")
            else:
                assert len(inp) == n and inp.isalpha() and inp.islower()
                assert ans == {"copy": inp, "reverse": inp[::-1], "sorting": "".join(sorted(inp))}[task]
            ids, start = encode_instance(task, inp, ans)
            assert len(ids) <= sequence_length(task, n) and len(ids) - start == len(ans) + 1


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
    return out, train_task_zoo(cfg, tasks, out)


def test_accuracy_equals_hugging_face_greedy_generation(task_zoo):
    from transformers import AutoModelForCausalLM

    out, _ = task_zoo
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

    from posprobe.report.zoo_tasks import accuracy_table, mean_reciprocal_rank

    out, result = task_zoo
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
    assert set(t.columns) >= {"member", "task", "in (n <= L)", "past L"}
    mrr = mean_reciprocal_rank(result)
    assert set(mrr.index) <= {"nope", "learned"} and ((mrr > 0) & (mrr <= 1)).all()
    paths = type(result).load(out / "tasks").save(tmp_path / "rep")
    page = paths["report"].read_text()
    assert "Mean reciprocal rank" in page and "copy: accuracy vs instance length" in page


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
