"""The zoo's training loop (`posprobe.zoo.train.train_member`) on one tiny member for a few steps: the record it
returns and the zoo.json it writes, read against what was asked (steps, tokens, parameters counted here from the
saved weights), the looks at checkpoints (in eval mode, their time kept apart, not repeated), the progress line's zoo
ETA by its formula, and the label shift for classes whose loss does not shift. Seconds.

Plants seen failing (one at a time): tokens/s from all steps instead of the steps run (a resumed run); a look
repeated after a resume; the checkpoint's time counted
as training; the model left in training mode for a look; the ETA leaving out the later members' tokens; the last
label kept instead of ignored; zoo.json's final loss from the first logged step; the passkey share recorded when 0; the
look one step late; a retrained folder not replaced; windows past the text's end; an old state without looks refused."""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import load_file

from posprobe.zoo.config import ZooConfig
from posprobe.zoo.job import Job
from posprobe.zoo.members import MEMBERS
from posprobe.zoo.tokenizer import train_tokenizer
from posprobe.zoo.train import TrainState, _postfix, batch_ids, next_token_labels, train_member

TEXT = "".join(f"the {i % 7} cat and the {i % 5} dog sat on mat {i % 3}.\n" for i in range(300))
CFG = dict(d_model=16, n_layers=1, n_heads=2, length=16, vocab_size=270, batch_size=2, steps=6, warmup=1,
           checkpoint_every=100, progress=False)
NO_STATE = (lambda: None, lambda state: None)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXT, 270)


def test_the_record_and_zoo_json_say_what_was_trained(tok, tmp_path):
    ids = torch.tensor(tok(TEXT)["input_ids"])
    cfg = ZooConfig(**CFG, members=("rope-llama",))
    modes, calls = [], []

    def look(step, model):
        modes.append(model.training)
        calls.append(step)
        return step * 10

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "stale.txt").write_text("an earlier run's file")  # a folder trained again is replaced
    job = Job.text("rope-llama", 3, cfg, tok, ids, log_every=4, checkpoints=(0, 4, 6), record={"note": "extra"})
    rec = train_member(job, tmp_path / "m", NO_STATE, on_checkpoint=look)
    assert calls == [0, 4, 6] and modes == [False] * 3 and rec["checkpoints"] == [(0, 0), (4, 40), (6, 60)]
    assert not (tmp_path / "m" / "stale.txt").exists()
    assert [s for s, _, _ in rec["log"]] == [4, 6] and rec["steps_run"] == 6
    assert rec["tokens_per_s"] == pytest.approx(6 * 2 * 16 / rec["seconds"])
    weights = load_file(tmp_path / "m" / "model.safetensors")
    assert rec["params"] == sum(t.numel() for t in weights.values())  # tied head saved once
    z = json.loads((tmp_path / "m" / "zoo.json").read_text())
    assert (z["member"], z["seed"], z["steps"], z["batch_size"], z["warmup"], z["note"]) == (
        "rope-llama", 3, 6, 2, 1, "extra")
    assert z["final_loss"] == rec["log"][-1][1] and z["widths"]["length"] == 16 and "passkey" not in z
    assert z["positions"] == MEMBERS["rope-llama"].positions and z["family"] == "rotary"


def test_a_looks_time_is_not_training_time(tok, tmp_path, monkeypatch):
    import posprobe.zoo.train as T

    ids = torch.tensor(tok(TEXT)["input_ids"])
    cfg = ZooConfig(**{**CFG, "length": 72}, members=("nope",), passkey=0.5)  # a passkey prompt needs >= 55 tokens
    now = [0.0]
    monkeypatch.setattr(T.time, "perf_counter", lambda: now[0])

    def slow_look(step, model):
        now[0] += 100.0  # the look takes 100 s; training takes no time on this clock
        return None

    rec = train_member(Job.text("nope", 0, cfg, tok, ids, checkpoints=(0, 3)), tmp_path / "m", NO_STATE,
                       on_checkpoint=slow_look)
    assert rec["checkpoint_seconds"] == 200.0 and rec["seconds"] == 0.0
    assert json.loads((tmp_path / "m" / "zoo.json").read_text())["passkey"] == 0.5


def test_a_resumed_run_counts_its_own_steps_and_does_not_look_again(tok, tmp_path):
    import copy

    ids = torch.tensor(tok(TEXT)["input_ids"])
    cfg = ZooConfig(**{**CFG, "checkpoint_every": 3}, members=("rope-llama",))
    saved, calls = [], []

    def look(step, model):
        calls.append(step)
        return step + 1

    job = Job.text("rope-llama", 0, cfg, tok, ids, checkpoints=(0,))
    train_member(job, tmp_path / "a", (lambda: None, lambda st: saved.append(copy.deepcopy(st))), on_checkpoint=look)
    assert [st["step"] for st in saved] == [0, 3] and calls == [0]  # saved after the look, then every 3 steps
    rec = train_member(job, tmp_path / "b", (lambda: saved[0], lambda st: None), on_checkpoint=look)
    assert calls == [0] and rec["checkpoints"] == [(0, 1)]  # resumed at step 0: the look is not taken again
    rec = train_member(Job.text("rope-llama", 0, cfg, tok, ids), tmp_path / "c", (lambda: saved[1], lambda st: None))
    assert rec["steps_run"] == 3 and rec["tokens_per_s"] == pytest.approx(3 * 2 * 16 / rec["seconds"])


def test_the_zoo_eta_counts_this_members_tokens_left_and_the_later_members():
    fake = types.SimpleNamespace(format_dict={"rate": 100.0}, total=1000, n=400, postfix=None,
                                 format_interval=lambda s: f"{s:.0f}s")
    fake.set_postfix_str = lambda text, refresh=False: setattr(fake, "postfix", text)
    _postfix(fake, 4, 10, 2.5, 2000)
    assert fake.postfix == "step 4/10, loss 2.500, zoo ETA 26s"  # (1000 - 400 + 2000) / 100
    _postfix(fake, 4, 10, None, 0)
    assert fake.postfix == "step 4/10"  # the last member: no zoo ETA
    fake.format_dict = {"rate": None}
    _postfix(fake, 1, 10, 1.0, 5)
    assert fake.postfix.endswith("zoo ETA ?")


def test_next_token_labels_move_left_and_ignore_the_last():
    got = next_token_labels(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    assert got.tolist() == [[6, 7, -100], [9, 10, -100]]


def test_every_window_is_full_and_every_start_can_be_drawn():
    ids = torch.arange(17)  # L + 1 tokens: two possible windows, starting at 0 and 1
    cfg = ZooConfig(**{**CFG, "batch_size": 8})
    starts = set()
    for step in range(20):
        x = batch_ids(ids, step, cfg, seed=0)
        assert x.shape == (8, 16)
        assert all(torch.equal(row, torch.arange(row[0], row[0] + 16)) for row in x)
        starts |= {int(row[0]) for row in x}
    assert starts == {0, 1}


def test_a_state_saved_before_checkpoint_looks_existed_still_loads():
    lin = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(lin.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    st = TrainState(lin, opt, sched, torch.zeros(()))
    old = {k: v for k, v in st.state_dict().items() if k not in ("checkpoints", "running")}
    st.checkpoints = [(1, "stale")]
    st.load_state_dict({**old, "step": 5})
    assert st.step == 5 and st.checkpoints == []


def test_weights_every_k_steps_are_the_models_the_loop_held_then(tok, tmp_path):
    """`save_every`: a Hugging Face folder per K steps (and step 0) under the member's checkpoints/, each holding the
    weights the loop's model had after that step (read by the loop's own look, not by the saver), with step and
    tokens in its zoo.json; saving changes nothing in the training (same final weights as without it), and a run
    resumed past a saved step keeps it."""
    import copy

    from transformers import AutoModelForCausalLM

    ids = torch.tensor(tok(TEXT)["input_ids"])
    seen = {}

    def look(step, model):
        seen[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    cfg = ZooConfig(**{**CFG, "checkpoint_every": 3}, members=("rope-llama",), save_every=2)
    states = []
    job = Job.text("rope-llama", 0, cfg, tok, ids, checkpoints=(0, 2, 4))
    train_member(job, tmp_path / "m", (lambda: None, lambda st: states.append(copy.deepcopy(st))), on_checkpoint=look)
    steps = tmp_path / "m" / "checkpoints"
    assert sorted(p.name for p in steps.iterdir()) == ["step0", "step2", "step4"]  # the final weights: the member
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # nothing staged is left beside it
    for step in (0, 2, 4):
        hf = AutoModelForCausalLM.from_pretrained(steps / f"step{step}")
        for k, v in hf.state_dict().items():
            assert torch.equal(v, seen[step][k]), (step, k)
        z = json.loads((steps / f"step{step}" / "zoo.json").read_text())
        assert (z["step"], z["tokens"], z["member"], z["seed"]) == (step, step * 2 * 16, "rope-llama", 0)
    plain = Job.text("rope-llama", 0, ZooConfig(**{**CFG, "checkpoint_every": 3}, members=("rope-llama",)), tok, ids)
    train_member(plain, tmp_path / "plain", NO_STATE)
    assert load_file(tmp_path / "plain" / "model.safetensors").keys() == load_file(
        tmp_path / "m" / "model.safetensors").keys()
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "m" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "plain" / "checkpoints").exists()
    # Killed after step 3 and resumed: step 0 and 2 (saved before the kill) stay, step 4 is written by the resume.
    import shutil

    (tmp_path / "r").mkdir()
    first = tmp_path / "r" / "m"
    shutil.copytree(steps, tmp_path / "r" / ".m.checkpoints", ignore=lambda d, names: {"step4"} & set(names))
    at3 = next(st for st in states if st["step"] == 3)
    train_member(Job.text("rope-llama", 0, cfg, tok, ids), first, (lambda: at3, lambda st: None))
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["step0", "step2", "step4"]
    b4 = load_file(first / "checkpoints" / "step4" / "model.safetensors")
    a4 = load_file(steps / "step4" / "model.safetensors")
    assert all(torch.equal(a4[k], b4[k]) for k in a4)


def test_save_every_must_not_be_negative():
    with pytest.raises(ValueError, match="save_every must be >= 0"):
        ZooConfig(**CFG, save_every=-1)


def test_a_bf16_member_trains_through_the_loop_and_says_so(tok, tmp_path):
    ids = torch.tensor(tok(TEXT)["input_ids"])
    cfg = ZooConfig(**CFG, members=("rope-llama",), precision="bf16")
    rec = train_member(Job.text("rope-llama", 0, cfg, tok, ids), tmp_path / "m", NO_STATE)
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss, _ in rec["log"])
    assert json.loads((tmp_path / "m" / "zoo.json").read_text())["precision"] == "bf16"
    assert all(t.dtype == torch.float32 for t in load_file(tmp_path / "m" / "model.safetensors").values())
