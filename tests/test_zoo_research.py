"""The zoo's research tier (issue #65, first step): its sizes and schedule are Gu et al.'s 60M LLaMA and GPT-2 small's
depth, its budget (N counted on the Hugging Face model, D, 6·N·D, hours from a timed warm-up of the real loop) is
printed before training and equals an independent count and a hand computation, and a real corpus read through
Hugging Face `datasets` (local files here: the hub is unreachable) becomes the same tokens as a by-hand reading,
resumes mid-stream bit for bit after a kill, and trains the zoo. Shrunk sizes; seconds on one thread.

Plants seen failing (one at a time): the 6 of 6·N·D as 2; N counted with the tied output matrix twice; the warm-up
timing from step 0 (the first step counted); hours as D x rate; the micro-batch losses not divided by their count;
a resumed corpus read that restarts the stream instead of loading its state; EOT not written after a document; the
text builder's lines joined without newlines; the research tier's warmup share 5%."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from zoo_util import Died

from posprobe.zoo.config import TIERS, ZooConfig
from posprobe.zoo.corpus import CorpusConfig

# The research tier shrunk: the gpt block deeper and with more heads than the llama block, as at full size.
SHRUNK = dict(tier="research", device="cpu", d_model=32, n_layers=1, n_heads=2, gpt_n_layers=2, gpt_n_heads=4,
              length=32, vocab_size=300, batch_size=4, micro_batch=2, steps=6, checkpoint_every=2, progress=False)


def _paragraphs() -> list[str]:
    from posprobe.data import builtin_corpus

    return [p.strip() for p in builtin_corpus().split("\n\n") if p.strip()]


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": p}) + "\n" for i, p in enumerate(_paragraphs())))
    return path


def _corpus(path: Path, **kw) -> CorpusConfig:
    return CorpusConfig(dataset="json", data_files=(str(path),), eval_chars=3000, tokenizer_chars=20000, **kw)


# ---- the tier ----------------------------------------------------------------------------------------------------

def test_research_tier_is_gu_et_als_60m_llama_and_gpt2_small():
    c = ZooConfig(tier="research")
    # sail-sg/Attention-Sink: lit_gpt/config.py "tinyllama_60M" and configs/tinyllama_60m.yaml
    assert (c.d_model, c.n_layers, c.n_heads, c.length, c.vocab_size) == (768, 10, 8, 2048, 50432)
    assert (c.batch_size, c.steps, c.lr, c.warmup, c.min_lr_share, c.weight_decay) == (512, 20000, 4e-4, 100, 1.0,
                                                                                         0.1)
    assert c.tokens_per_step * c.steps == 512 * 2048 * 20000 and c.micro_batch == 8 and c.device == "cuda"
    gpt, llama = c.widths_for("learned"), c.widths_for("rope-llama")
    assert (gpt.n_layers, gpt.n_heads, gpt.d_model) == (12, 12, 768)  # GPT-2 small
    assert (llama.n_layers, llama.n_heads) == (10, 8) and c.widths_for("sinusoidal") == gpt
    # Shrunk by flags, the gpt block follows --n-layers / --n-heads unless told otherwise.
    s = ZooConfig(tier="research", d_model=32, n_layers=2, n_heads=2)
    assert (s.gpt_n_layers, s.gpt_n_heads) == (2, 2)
    assert ZooConfig().micro_batch is None and ZooConfig().min_lr_share == 0.0  # the cpu tier as before
    assert "warmup_share" not in TIERS["cpu"]


def test_tokens_set_the_steps_and_cannot_be_given_with_them():
    c = ZooConfig(tier="research", tokens=5e9)
    assert c.steps == math.ceil(5e9 / (512 * 2048)) == 4769 and c.warmup == round(0.005 * 4769)
    assert ZooConfig(tokens=16 * 128 * 10).steps == 10
    assert ZooConfig(tokens=16 * 128 * 10 + 1).steps == 11
    with pytest.raises(ValueError, match="not both"):
        ZooConfig(steps=5, tokens=100)
    replace(c, batch_size=256)  # the budget became steps: a replaced config does not meet both
    with pytest.raises(ValueError, match="micro_batch 8 must divide batch_size 12"):
        ZooConfig(tier="research", batch_size=12)
    with pytest.raises(ValueError, match="into 16 heads"):  # the gpt block's heads are checked too
        ZooConfig(tier="research", d_model=64, n_heads=2, gpt_n_heads=16)
    ZooConfig(tier="research", d_model=64, n_heads=2, gpt_n_heads=8)


def test_the_research_schedule_holds_the_rate_after_warmup_and_the_others_are_unchanged():
    from transformers import get_cosine_schedule_with_warmup

    from posprobe.zoo.train import _optimizer

    model = torch.nn.Linear(2, 2)
    opt, sched = _optimizer(model, ZooConfig(**{**SHRUNK, "steps": 50, "warmup": 5}))
    lrs = []
    for _ in range(50):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == 0 and lrs[5:] == [4e-4] * 45  # Gu et al.: min_lr = lr
    opt, sched = _optimizer(model, ZooConfig(steps=50, warmup=5))
    opt2 = torch.optim.AdamW(model.parameters(), lr=ZooConfig().lr)
    ref = get_cosine_schedule_with_warmup(opt2, 5, 50)
    for _ in range(50):
        assert sched.get_last_lr()[0] == ref.get_last_lr()[0]
        opt.step(), sched.step(), opt2.step(), ref.step()


def test_micro_batches_give_the_whole_batchs_loss_and_gradient():
    from posprobe.zoo.members import Widths, member
    from posprobe.zoo.train import accumulate, init_weights

    hf = member("rope-llama").hf_config(Widths(32, 2, 2, 16, 300), pad_id=1, bos_id=0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager", dtype=torch.float32)
    init_weights(model, 0)
    x = torch.randint(2, 300, (8, 16), generator=torch.Generator().manual_seed(0))
    with torch.enable_grad():  # something imported earlier in a session may have turned it off
        whole = accumulate(model, x, x, [], None)
        g1 = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        parts = accumulate(model, x, x, [], 2)
    g2 = [p.grad.clone() for p in model.parameters()]
    assert abs(float(whole) - float(parts)) < 1e-6
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-5) for a, b in zip(g1, g2))


def test_bf16_runs_the_matmuls_in_bfloat16_and_keeps_fp32_weights_and_gradients():
    """Mixed precision as the field trains (the same code on CPU as on CUDA, where the research tier turns it on):
    every Linear computes in bfloat16 under autocast, the weights and their gradients stay float32, and the loss is
    the fp32 loss within bfloat16's precision. Planted: autocast left off (the Linear outputs stay fp32)."""
    from transformers import AutoModelForCausalLM

    from posprobe.zoo.members import Widths, member
    from posprobe.zoo.train import accumulate, init_weights

    hf = member("rope-llama").hf_config(Widths(32, 2, 2, 16, 300), pad_id=1, bos_id=0)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager", dtype=torch.float32)
    init_weights(model, 0)
    x = torch.randint(2, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.enable_grad():
            fp32 = float(accumulate(model, x, x, [], None))
            assert set(seen) == {torch.float32}
            model.zero_grad()
            seen.clear()
            bf16 = float(accumulate(model, x, x, [], 2, bf16=True))
    finally:
        for h in hooks:
            h.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    assert abs(bf16 - fp32) < 0.02 * fp32 and bf16 != fp32


def test_precision_defaults_to_bf16_only_on_a_gpu_tier_on_cuda():
    assert ZooConfig(tier="research").precision == "bf16" and ZooConfig(tier="gpu").precision == "bf16"
    assert ZooConfig(tier="research", device="cpu").precision == "fp32" and ZooConfig().precision == "fp32"
    assert ZooConfig(precision="bf16").precision == "bf16"
    with pytest.raises(ValueError, match="precision must be fp32 or bf16"):
        ZooConfig(precision="fp16")


# ---- the budget --------------------------------------------------------------------------------------------------

def _plain_count(name: str, widths) -> int:
    # An independent count: a plain Hugging Face model built (on the CPU, with its own init) from the member's config;
    # parameters() yields a tied matrix once. Pix2Struct's cross-attention, which a decoder-only forward never uses,
    # is taken out by its HF module name.
    from transformers import AutoModelForCausalLM

    from posprobe.backend import t5_decoder
    from posprobe.zoo.members import member

    t5_decoder.register_auto_class()
    model = AutoModelForCausalLM.from_config(member(name).hf_config(widths, pad_id=1, bos_id=0))
    return sum(p.numel() for n, p in model.named_parameters() if "encoder_decoder_attention" not in n)


@pytest.mark.parametrize("name", ["learned", "sinusoidal", "rope-llama", "t5", "alibi"])
def test_parameters_are_the_hugging_face_models_and_flops_are_6nd(name):
    from posprobe.zoo.budget import member_budget

    cfg = ZooConfig(**SHRUNK)
    b = member_budget(cfg, name)
    assert b.params == _plain_count(name, cfg.widths_for(name))
    assert b.tokens == 6 * 4 * 32 and b.flops == 6 * b.params * b.tokens and b.hours is None
    assert b.embedding_params == 300 * 32


def test_the_research_tiers_real_sizes_are_counted_on_the_real_models():
    from posprobe.zoo.budget import member_budget

    cfg = ZooConfig(tier="research")
    for name, n in (("learned", 125_360_640), ("rope-llama", 109_526_784)):
        b = member_budget(cfg, name)
        assert b.params == _plain_count(name, cfg.widths_for(name)) == n
        assert b.flops == 6 * n * 20000 * 512 * 2048


def test_hours_are_d_over_the_warm_up_rate_timed_after_the_first_step(monkeypatch, tmp_path):
    from posprobe.zoo import budget
    from posprobe.zoo.run import zoo_jobs
    from posprobe.zoo.tokenizer import train_tokenizer

    text = "\n\n".join(_paragraphs())
    tok = train_tokenizer(text, 300)
    ids = torch.tensor(tok(text)["input_ids"])
    ticks = iter([100.0, 102.5, 200.0, 201.0])  # (step 1, step 4) per member
    monkeypatch.setattr(budget, "_clock", lambda: next(ticks))
    cfg = ZooConfig(**{**SHRUNK, "members": ("learned", "nope")})
    rows = budget.zoo_budget(cfg, lambda w: zoo_jobs(w, tok, ids), warmup_steps=4)
    micro_tokens = 2 * 32  # a warm-up step is one micro-batch
    assert rows[0].tokens_per_s == 3 * micro_tokens / 2.5 and rows[1].tokens_per_s == 3 * micro_tokens / 1.0
    d = 6 * 4 * 32
    assert rows[0].hours == d / (3 * 64 / 2.5) / 3600 and rows[1].hours == d / 192 / 3600
    lines = budget.budget_lines(cfg, rows, "cpu")
    assert "D = 6 steps x 4 x 32 tokens = 7.680e+02" in lines[0] and "77 tokens/s" in lines[1]
    assert f"{d / 76.8:.1f} s" in lines[1]  # 10.0 s
    assert lines[-1].startswith("zoo budget: 2 members x 1 seeds:")


def test_the_command_prints_the_budget_before_training(jsonl, tmp_path, capsys):
    from posprobe.cli import main
    from posprobe.zoo.config import ZooConfig

    argv = ["zoo", "train", "--tier", "research", "--device", "cpu", "--member", "learned", "--member", "t5",
            "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--gpt-n-layers", "2", "--gpt-n-heads", "4",
            "--length", "32", "--vocab-size", "300", "--batch-size", "4", "--micro-batch", "2", "--tokens", "500",
            "--budget-steps", "2", "--dataset", "json", "--data-files", str(jsonl), "--eval-chars", "3000",
            "--tokenizer-chars", "20000", "--out", str(tmp_path / "z")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    budget = [line for line in err.splitlines() if line.startswith("zoo budget")]
    assert err.index("zoo budget") < err.index("zoo: learned seed 0")  # before training
    cfg = ZooConfig(**{**SHRUNK, "steps": 4})  # 500 tokens / (4 x 32) -> 4 steps
    for name, line in zip(("learned", "t5"), budget[1:3]):
        n = int(re.search(r"N = ([\d,]+) parameters", line).group(1).replace(",", ""))
        d = float(re.search(r"D = ([\d.e+]+),", line).group(1))
        flops = float(re.search(r"FLOPs = ([\d.e+]+)", line).group(1))
        assert n == _plain_count(name, cfg.widths_for(name)) and d == 4 * 4 * 32
        assert flops == pytest.approx(6 * n * d, rel=1e-3) and "tokens/s in warm-up" in line
    record = json.loads((tmp_path / "z" / "learned-s0" / "zoo.json").read_text())
    assert record["widths"]["n_layers"] == 2 and record["steps"] == 4


# ---- the corpus --------------------------------------------------------------------------------------------------

def _held_out(docs: list[str], chars: int) -> int:
    n = total = 0
    for d in docs:
        n, total = n + 1, total + len(d)
        if total >= chars:
            break
    return n


def test_local_jsonl_through_datasets_is_the_documents_tokenised_by_hand(jsonl, tmp_path):
    from transformers import AutoTokenizer

    from posprobe.zoo.corpus import prepare_corpus

    data = prepare_corpus(_corpus(jsonl), 300, 10**9, tmp_path / "cache")
    docs = [json.loads(line)["text"] for line in jsonl.read_text().splitlines()]  # read without datasets
    k = _held_out(docs, 3000)
    assert data.eval_text == "\n\n".join(docs[:k])
    tok = AutoTokenizer.from_pretrained(tmp_path / "cache" / "tokenizer")
    expected = [i for d in docs[k:] for i in [*tok(d)["input_ids"], 0]]  # EOT (id 0) after each document
    cache = np.fromfile(tmp_path / "cache" / "tokens.bin", dtype=np.uint16)
    assert cache.tolist() == expected and data.documents == len(docs) - k and len(data.ids) == len(expected)
    assert torch.equal(data.ids[5:9], torch.tensor(expected[5:9])) and data.ids[5:9].dtype == torch.long
    # The corpus_tokens limit cuts the same stream.
    short = prepare_corpus(_corpus(jsonl), 300, 1000, tmp_path / "short")
    assert np.fromfile(tmp_path / "short" / "tokens.bin", dtype=np.uint16).tolist() == expected[:1000]
    assert short.sha256 != data.sha256


def test_the_text_builder_reads_lines_joined_by_newlines(tmp_path):
    from transformers import AutoTokenizer

    from posprobe.zoo.corpus import prepare_corpus

    lines = [p.replace("\n", " ") for p in _paragraphs()]
    path = tmp_path / "a.txt"
    path.write_text("\n".join(lines) + "\n")
    prepare_corpus(CorpusConfig(dataset="text", data_files=(str(path),), eval_chars=3000, tokenizer_chars=20000),
                   300, 10**9, tmp_path / "cache")
    k = _held_out(lines, 3000)
    tok = AutoTokenizer.from_pretrained(tmp_path / "cache" / "tokenizer")
    expected = [i for line in lines[k:] for i in tok(line + "\n")["input_ids"]]
    assert np.fromfile(tmp_path / "cache" / "tokens.bin", dtype=np.uint16).tolist() == expected
    assert (tmp_path / "cache" / "eval.txt").read_text() == "\n".join(lines[:k])


def test_a_killed_corpus_read_resumes_mid_stream_bit_for_bit(jsonl, tmp_path, monkeypatch):
    from posprobe.zoo import corpus as mod

    monkeypatch.setattr(mod, "CHUNK_CHARS", 2000)
    whole = mod.prepare_corpus(_corpus(jsonl), 300, 10**9, tmp_path / "whole")
    read = {"n": 0}
    documents = mod._documents

    def counted(it, field):
        for d in documents(it, field):
            read["n"] += 1
            yield d

    monkeypatch.setattr(mod, "_documents", counted)
    calls = []
    write = mod._write_progress

    def write_then_die(folder, progress):  # a kill right after the third chunk is recorded
        write(folder, progress)
        calls.append(progress["documents"])
        if len(calls) == 3:
            raise Died

    monkeypatch.setattr(mod, "_write_progress", write_then_die)
    with pytest.raises(Died):
        mod.prepare_corpus(_corpus(jsonl), 300, 10**9, tmp_path / "killed")
    with open(tmp_path / "killed" / "tokens.bin", "ab") as f:
        f.write(b"\x07\x00" * 5)  # a chunk half-written when the kill came
    monkeypatch.setattr(mod, "_write_progress", write)
    read["n"] = 0
    resumed = mod.prepare_corpus(_corpus(jsonl), 300, 10**9, tmp_path / "killed")
    assert (tmp_path / "killed" / "tokens.bin").read_bytes() == (tmp_path / "whole" / "tokens.bin").read_bytes()
    assert resumed.sha256 == whole.sha256 and resumed.eval_text == whole.eval_text
    k = _held_out(_paragraphs(), 3000)
    assert read["n"] == len(_paragraphs()) - k - calls[-1]  # only the documents after the kill were read again
    read["n"] = 0
    mod.prepare_corpus(_corpus(jsonl), 300, 10**9, tmp_path / "killed")  # finished: the stream is not opened
    assert read["n"] == 0


def test_a_hub_name_offline_is_one_sentence_before_any_work(tmp_path, capsys, monkeypatch):
    from posprobe.cli import main
    from posprobe.zoo.run import train_zoo

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["zoo", "train", "--dataset", "HuggingFaceFW/fineweb-edu", "--dataset-config", "sample-10BT",
                 "--out", str(tmp_path / "z")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "hub cannot be reached" in err and "--data-files" in err
    assert "Traceback" not in err and not (tmp_path / "z").exists() and not (tmp_path / "z.work").exists()
    with pytest.raises(ValueError, match="hub cannot be reached"):
        train_zoo(ZooConfig(**SHRUNK), CorpusConfig(dataset="HuggingFaceFW/fineweb-edu"), tmp_path / "y")
    assert not (tmp_path / "y.work").exists()
    for argv, says in ((["--dataset", "json"], "--data-files PATH"),
                       (["--data-files", "x.jsonl"], "need --dataset"),
                       (["--dataset", "json", "--data-files", str(tmp_path / "none.jsonl")], "no such file"),
                       (["--text", "a.txt", "--dataset", "json", "--data-files", "x"], "not both"),
                       (["--budget-steps", "1"], "--budget-steps must be 0")):
        assert main(["zoo", "train", *argv, "--out", str(tmp_path / "w")]) == 2
        assert says in capsys.readouterr().err


def test_without_datasets_the_corpus_says_how_to_install_it(monkeypatch, jsonl):
    import importlib.util

    from posprobe.zoo.corpus import check_corpus

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'posprobe\[research\]'"):
        check_corpus(_corpus(jsonl))


def test_a_zoo_from_a_corpus_killed_mid_training_resumes_to_the_same_weights(jsonl, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from posprobe.zoo import corpus as corpus_mod
    from posprobe.zoo import train as zoo_train
    from posprobe.zoo.run import train_zoo

    cfg = ZooConfig(**{**SHRUNK, "members": ("learned", "p-rope")})
    whole = train_zoo(cfg, _corpus(jsonl), tmp_path / "whole")
    real = zoo_train.train_member

    def dying(job, folder, io, **kw):  # the second member dies after its first checkpoint
        if job.member != "p-rope":
            return real(job, folder, io, **kw)
        load, save = io

        def save_then_die(state):
            save(state)
            raise Died

        return real(job, folder, (load, save_then_die), **kw)

    monkeypatch.setattr(zoo_train, "train_member", dying)
    with pytest.raises(Died):
        train_zoo(cfg, _corpus(jsonl), tmp_path / "killed")
    monkeypatch.setattr(zoo_train, "train_member", real)
    opened = []
    monkeypatch.setattr(corpus_mod, "_open", lambda c: opened.append(c))
    resumed = train_zoo(cfg, _corpus(jsonl), tmp_path / "killed")
    assert opened == []  # the finished token cache is read, not the stream
    for name in ("learned-s0", "p-rope-s0"):
        a = load_file(tmp_path / "whole" / name / "model.safetensors")
        b = load_file(tmp_path / "killed" / name / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert resumed.meta["data"]["sha256"] == whole.meta["data"]["sha256"]
    assert resumed.meta["data"]["source"] == f"datasets json: {jsonl}"
    assert (tmp_path / "killed" / "eval.txt").read_text() == (tmp_path / "whole" / "eval.txt").read_text()
    assert not (tmp_path / "killed.work").exists()
