"""The positional zoo: members are ordinary Hugging Face folders of the family they claim, training is deterministic
for a seed and resumes bit for bit, bad input is refused before training, and the extrapolation numbers equal an
independent Hugging Face computation."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from zoo_util import Died, dying_state_io

from posprobe.zoo.config import ZooConfig, load_config_file
from posprobe.zoo.members import MEMBERS

# 64 tokens: the support matrix's identity cells need 54-token sentences; 100 steps: enough for
# positions to move the logits (the cells check that their comparison is not vacuous).
TINY = dict(d_model=32, n_layers=4, n_heads=2, length=64, vocab_size=300, batch_size=4, steps=100, warmup=5,
            checkpoint_every=10, progress=False)
L = TINY["length"]
ROOT = Path(__file__).resolve().parents[1]


def _text() -> str:
    from posprobe.data import builtin_corpus

    return builtin_corpus()


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory):
    from posprobe.zoo.run import train_zoo

    out = tmp_path_factory.mktemp("zoo") / "zoo"
    result = train_zoo(ZooConfig(**TINY), _text(), out)
    return out, result


def _plain_hf(folder):
    # A genuine Hugging Face model read from disk: independent of posprobe's loading and of any TL bridge. The class
    # the folder's config names (Pix2StructTextModel has no causal-LM auto class unless posprobe registers it).
    import transformers

    arch = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(folder, attn_implementation="eager").eval()


# What `posprobe info` must say per layer of each member (4 layers): the family comes from the HF config alone.
EXPECTED_LAYERS = {
    "learned": ["learned absolute"] * 4,
    "sinusoidal": ["fixed sinusoidal"] * 4,
    "alibi": ["ALiBi"] * 4,
    "rope": ["rotary 100% of head dim"] * 4,
    "partial": ["rotary 25% of head dim"] * 4,
    "rope-llama": ["rotary 100% of head dim"] * 4,
    "nope": ["NoPE"] * 4,
    "hybrid": ["rotary 100% of head dim"] * 3 + ["NoPE"],
    "p-rope": ["rotary 100% of head dim, half-split pairing, base 10000, 2 of 8 bands rotate"] * 4,  # d_head 16
    "t5": ["T5 relative buckets"] * 4,
}


def test_every_member_is_a_hugging_face_folder_of_its_family(tiny_zoo):
    from posprobe.backend.facts import model_facts
    from posprobe.backend.loading import load_model

    out, result = tiny_zoo
    assert set(EXPECTED_LAYERS) == set(MEMBERS)
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{m}-s0" for m in MEMBERS] + ["eval.txt", "training"])
    for name, member in MEMBERS.items():
        folder = out / f"{name}-s0"
        record = json.loads((folder / "zoo.json").read_text())
        assert (record["member"], record["family"], record["block"]) == (name, member.family, member.block)
        hf = _plain_hf(folder)
        assert hf.config.model_type == member.model_type
        facts = model_facts(load_model(str(folder)))
        assert facts.unsupported is None, (name, facts.unsupported)
        assert len(facts.layer_positions) == 4
        for got, want in zip(facts.layer_positions, EXPECTED_LAYERS[name]):
            assert got.startswith(want) or want in got, (name, got, want)


def test_members_differ_only_where_stated(tiny_zoo):
    # Same widths and (within a block) the same parameter count up to BLOOM's embedding LayerNorm and GPT-2's table.
    out, result = tiny_zoo
    members = result.tables["members"].set_index("member")
    d, v, L = TINY["d_model"], TINY["vocab_size"], TINY["length"]
    gpt = members[members["block"] == "gpt"]["params"]
    base = gpt["rope"]
    assert gpt["partial"] == base == gpt["sinusoidal"]
    assert gpt["alibi"] == base + 2 * d  # the embedding LayerNorm
    assert gpt["learned"] == base + L * d  # the position table
    llama = members[members["block"] == "llama"]["params"]
    # T5's bias table (32 buckets x heads) is the T5 member's only extra parameter; its unused cross-attention is
    # not counted.
    assert llama["t5"] == llama["rope-llama"] + 32 * TINY["n_heads"]
    llama = llama.drop("t5")
    assert llama.nunique() == 1
    # The MLPs hold the same number of weights in both blocks (SwiGLU at 8d/3 vs GELU at 4d), to rounding.
    assert abs(int(llama.iloc[0]) - int(base)) < 0.05 * int(base)
    assert v * d < int(base)


def test_training_is_deterministic_for_a_seed(tmp_path):
    from posprobe.zoo.job import Job
    from posprobe.zoo.tokenizer import train_tokenizer
    from posprobe.zoo.train import train_member

    cfg = ZooConfig(members=("rope", "learned"), **TINY)
    tok = train_tokenizer(_text(), cfg.vocab_size)
    ids = torch.tensor(tok(_text()[:20000])["input_ids"])
    no_state = (lambda: None, lambda s: None)

    def weights(name, seed, folder):
        train_member(Job.text(name, seed, cfg, tok, ids), tmp_path / folder, no_state)
        return _plain_hf(tmp_path / folder).state_dict()

    for name in ("rope", "learned"):
        a, b, c = weights(name, 0, f"{name}a"), weights(name, 0, f"{name}b"), weights(name, 1, f"{name}c")
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert not all(torch.equal(a[k], c[k]) for k in a), name  # the seed matters (a test that can fail)


def test_initialisation_ignores_the_classes_own_init(tmp_path):
    # Every parameter is set by posprobe's seeded init: a different global RNG state changes nothing, norms are 1,
    # biases 0, matrices N(0, 0.02).
    from posprobe.zoo.tokenizer import train_tokenizer
    from posprobe.zoo.train import build_model

    cfg = ZooConfig(**TINY)
    tok = train_tokenizer(_text(), cfg.vocab_size)
    for name, member in MEMBERS.items():
        torch.manual_seed(1)
        a = build_model(member, cfg, tok, seed=7).state_dict()
        torch.manual_seed(2)
        b = build_model(member, cfg, tok, seed=7).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
        mats = torch.cat([v.flatten() for k, v in a.items() if v.ndim == 2 and v.dtype.is_floating_point
                          and "inv_freq" not in k and "bias" not in k.split(".")[-1]])
        assert abs(float(mats.std()) - 0.02) < 0.002, name
        for k, v in a.items():
            if k.endswith(".bias") and v.ndim == 1:
                assert torch.all(v == 0), (name, k)


def test_batches_are_the_same_for_every_member_and_fill_the_window():
    from posprobe.zoo.train import batch_ids

    cfg = ZooConfig(**TINY)
    ids = torch.arange(1000)
    a, b = batch_ids(ids, 5, cfg, seed=0), batch_ids(ids, 5, cfg, seed=0)
    assert torch.equal(a, b) and a.shape == (cfg.batch_size, cfg.length)
    assert torch.all(a[:, 1:] - a[:, :-1] == 1)  # contiguous windows of the stream
    assert not torch.equal(a, batch_ids(ids, 6, cfg, seed=0)) and not torch.equal(a, batch_ids(ids, 5, cfg, seed=1))


def test_interrupted_training_resumes_to_the_same_weights(tmp_path):
    # In-process: a run that dies right after its second checkpoint, then the same call again, equals an
    # uninterrupted run bit for bit (model, optimiser and schedule restored; batches a function of the step).
    from posprobe.report.checkpoint import Checkpoint
    from posprobe.zoo.job import Job
    from posprobe.zoo.tokenizer import train_tokenizer
    from posprobe.zoo.train import train_member

    cfg = ZooConfig(**{**TINY, "steps": 10, "checkpoint_every": 3})
    tok = train_tokenizer(_text(), cfg.vocab_size)
    ids = torch.tensor(tok(_text()[:20000])["input_ids"])
    for name in ("alibi", "p-rope"):
        job = Job.text(name, 0, cfg, tok, ids)
        train_member(job, tmp_path / f"{name}-whole", (lambda: None, lambda s: None))
        io, saved = dying_state_io(Checkpoint(tmp_path / f"{name}.work", {"k": name}), after=2)
        with pytest.raises(Died):
            train_member(job, tmp_path / f"{name}-resumed", io)
        assert saved == [3, 6] and not (tmp_path / f"{name}-resumed").exists()
        rec = train_member(job, tmp_path / f"{name}-resumed", io)
        assert rec["steps_run"] == 4 and saved == [3, 6, 9]
        whole, resumed = _plain_hf(tmp_path / f"{name}-whole"), _plain_hf(tmp_path / f"{name}-resumed")
        ws, rs = whole.state_dict(), resumed.state_dict()
        assert all(torch.equal(ws[k], rs[k]) for k in ws), name


def _zoo_cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "posprobe", "zoo", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_sigkill_mid_training_then_rerun_gives_the_uninterrupted_weights(tmp_path):
    from safetensors.torch import load_file

    flags = ["train", "--member", "rope", "--d-model", "64", "--n-layers", "2", "--n-heads", "2", "--length", "64",
             "--vocab-size", "300", "--batch-size", "8", "--steps", "300", "--warmup", "10", "--checkpoint-every", "20",
             "--no-progress"]
    whole = _zoo_cli(*flags, "--out", str(tmp_path / "whole"))
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    proc = _zoo_cli(*flags, "--out", str(tmp_path / "killed"))
    units = tmp_path / "killed.work" / "units"
    deadline = time.time() + 120
    while time.time() < deadline and not (units.is_dir() and any(p.suffix == ".pt" for p in units.iterdir())):
        time.sleep(0.02)
    assert proc.poll() is None, "training ended before it could be killed: make the run longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed").exists()  # nothing partial where the zoo goes
    rerun = _zoo_cli(*flags, "--out", str(tmp_path / "killed"))
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err
    assert "resumed at" not in err  # --no-progress: silent; the resumed step count is checked through the weights
    a = load_file(tmp_path / "whole" / "rope-s0" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "rope-s0" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "killed.work").exists()


def test_bad_input_is_refused_before_training(tmp_path, capsys):
    from posprobe.cli import main
    from posprobe.zoo.run import train_zoo

    with pytest.raises(ValueError, match="unknown zoo member 'fire'; known: learned, "):
        ZooConfig(members=("fire",))
    with pytest.raises(ValueError, match="tier"):
        ZooConfig(tier="tpu")
    with pytest.raises(ValueError, match="too short for one window"):
        train_zoo(ZooConfig(**{**TINY, "length": 4096}), "a few words of text\n" * 20, tmp_path / "z")
    assert not (tmp_path / "z").exists() and not (tmp_path / "z.work").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        train_zoo(ZooConfig(**TINY), _text(), tmp_path / "full")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"steps": 5, "colour": "red"}))
    with pytest.raises(ValueError, match="unknown field.*colour"):
        load_config_file(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"members": ["rope"], "steps": 5, "d_model": 64, "weight_decay": 0.0}))
    cfg = load_config_file(good, steps=7)
    assert (cfg.members, cfg.steps, cfg.d_model, cfg.weight_decay, cfg.length) == (("rope",), 7, 64, 0.0, 128)
    if not torch.cuda.is_available():
        # The GPU tier on this CPU machine without --device: one line naming the fix, before any training.
        code = main(["zoo", "train", "--tier", "gpu", "--out", str(tmp_path / "g")])
        err = capsys.readouterr().err
        assert code == 2 and "--device cpu" in err and err.count("\n") == 1
        assert not (tmp_path / "g").exists() and not (tmp_path / "g.work").exists()
    # A config file's values survive the command line's unset flags.
    code = main(["zoo", "train", "--config", str(bad), "--out", str(tmp_path / "c")])
    assert code == 2 and "colour" in capsys.readouterr().err


def test_tokenizer_is_byte_level_deterministic_and_saved(tiny_zoo):
    from transformers import AutoTokenizer

    from posprobe.zoo.tokenizer import EOT, PAD, train_tokenizer

    out, _ = tiny_zoo
    tok = AutoTokenizer.from_pretrained(out / "rope-s0")
    assert tok.convert_ids_to_tokens([0, 1]) == [EOT, PAD] and tok.pad_token_id == 1 and tok.eos_token_id == 0
    odd = "Zoë's naïve café — 東京 🚀\n\ttabs"
    assert tok.decode(tok(odd)["input_ids"]) == odd  # bytes: nothing is unknown
    again = train_tokenizer(Path(out / "eval.txt").read_text() + _text(), 300)
    assert again.get_vocab() == train_tokenizer(Path(out / "eval.txt").read_text() + _text(), 300).get_vocab()


# ---- extrapolation: independent recomputation with plain Hugging Face ----

def _hf_losses(hf, rows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(input_ids=rows).logits.double()
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), rows[:, 1:], reduction="none")


@pytest.mark.parametrize("name", ["alibi", "rope", "sinusoidal", "nope", "t5"])
def test_extrapolation_equals_hugging_face(tiny_zoo, name):
    from posprobe.analyses.extrapolation import ExtrapolationConfig, run_extrapolation
    from posprobe.backend.loading import load_model

    out, _ = tiny_zoo
    folder = out / f"{name}-s0"
    text = (out / "eval.txt").read_text()
    cfg = ExtrapolationConfig(train_length=L, factors=(1, 2, 4), max_tokens=8 * L, stride=8, batch_size=3,
                              progress=False)
    df = run_extrapolation(load_model(str(folder)), text, cfg).tables["perplexity"].set_index(["protocol", "length"])
    hf = _plain_hf(folder)
    from transformers import AutoTokenizer

    ids = torch.tensor(AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"])
    for n in (L, 2 * L, 4 * L):
        chunks = ids[:8 * L // n * n].view(-1, n)
        want = float(_hf_losses(hf, chunks).mean())
        got = df.loc[("chunks", n)]
        assert got["status"] == "ok" and got["count"] == chunks.shape[0] * (n - 1)
        assert abs(got["nll"] - want) < 1e-5, (name, n, got["nll"], want)
        ends = [4 * L + 8 * j for j in range(L)]
        windows = torch.stack([ids[e - n:e] for e in ends])
        want = float(_hf_losses(hf, windows)[:, -8:].mean())
        assert abs(df.loc[("sliding", n), "nll"] - want) < 1e-5, (name, n)
    for protocol in ("chunks", "sliding"):
        base = df.loc[(protocol, L), "nll"]
        for n in (L, 2 * L, 4 * L):
            assert math.isclose(df.loc[(protocol, n), "ppl_ratio"], math.exp(df.loc[(protocol, n), "nll"] - base))


def test_learned_member_past_its_table_cannot_run(tiny_zoo):
    from posprobe.analyses.extrapolation import ExtrapolationConfig, run_extrapolation
    from posprobe.backend.loading import load_model

    out, _ = tiny_zoo
    text = (out / "eval.txt").read_text()
    cfg = ExtrapolationConfig(train_length=L, factors=(1, 2), max_tokens=4 * L, stride=8, progress=False)
    df = run_extrapolation(load_model(str(out / "learned-s0")), text, cfg).tables["perplexity"]
    past = df[df["length"] == 2 * L]
    assert list(past["status"]) == ["cannot run"] * 2 and past["ppl"].isna().all()
    assert f"{L} rows" in past["why"].iloc[0]
    assert (df[df["length"] == L]["status"] == "ok").all()
    with pytest.raises(ValueError, match="no evaluation length fits"):
        run_extrapolation(load_model(str(out / "learned-s0")), text, replace(cfg, factors=(2, 4), train_length=2 * L))


def test_extrapolation_refuses_a_rope_table_that_changes_with_length(tiny_zoo, tmp_path):
    # Dynamic NTK rebuilds its table from the input's length and HF keeps the largest one built: each length's
    # perplexity would depend on what was scored before it. Refused with the reason, before any forward.
    import shutil

    from posprobe.analyses.extrapolation import ExtrapolationConfig, run_extrapolation
    from posprobe.backend.loading import load_model

    out, _ = tiny_zoo
    folder = tmp_path / "dynamic"
    shutil.copytree(out / "p-rope-s0", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="changes with the input's length"):
        run_extrapolation(load_model(str(folder)), (out / "eval.txt").read_text(),
                          ExtrapolationConfig(train_length=L, factors=(1, 2), progress=False))


def test_zoo_eval_over_members_and_other_models(tiny_zoo, tmp_path):
    # A zoo folder stands for its members; a model outside the zoo is evaluated too; one the analysis refuses is
    # a row with the reason, not dropped.
    from posprobe.analyses.atlas_many import evaluate_zoo
    from posprobe.analyses.configs import ExtrapolationConfig

    out, _ = tiny_zoo
    cfg = ExtrapolationConfig(factors=(1, 2), max_tokens=4 * L, stride=8, progress=False)
    result = evaluate_zoo([str(out), "tiny-rope", "minilm"], cfg)
    df = result.tables["perplexity"]
    assert set(df["member"]) == set(MEMBERS) | {"tiny-rope", "minilm"}
    refused = df[df["model"] == "minilm"]
    assert list(refused["status"]) == ["refused"] and "LM head" in refused["why"].iloc[0]
    assert (df[df["member"] == "learned"].set_index(["protocol", "length"]).loc[("chunks", 2 * L), "status"]
            == "cannot run")
    ratios = result.tables["ratios"]
    assert set(ratios["factor"].dropna()) == {1.0, 2.0}
    gone = ratios[ratios["member"] == "minilm"]  # the refused model stays a row of the ratio table, with its reason
    assert list(gone["status"]) == ["refused"] and "LM head" in gone["why"].iloc[0]
    assert (ratios[ratios["factor"] == 1.0]["ppl_ratio"].dropna() == 1.0).all()
    paths = result.save(tmp_path / "ev")
    assert paths["report"].is_file() and "cannot run" in paths["report"].read_text()
    # Press et al.'s Figure 1 layout: log axes, L marked where L is (a label at the raw length stretched the log
    # axis to 10^L: plotly reads annotations there in log10 units, shapes in data units).
    fig = result.figures()[0]
    assert fig.layout.xaxis.type == "log" and sorted(s.x0 for s in fig.layout.shapes) == [L, 256]  # tiny-rope: 256
    assert sorted(a.x for a in fig.layout.annotations if a.text.startswith("L = ")) == [math.log10(L), math.log10(256)]
    assert {t.name for t in fig.data} == set(MEMBERS) | {"tiny-rope"}


def test_cli_train_then_eval(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(_text()[:40000])
    p = _zoo_cli("train", "--text", str(text), "--member", "rope", "--member", "learned", "--seed", "0", "--seed", "1",
                 "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--length", "16", "--vocab-size", "300",
                 "--steps", "4", "--warmup", "1", "--out", str(tmp_path / "zoo"))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert out.count("[zoo] ") == 4 and "tokens/s" in err and "ETA" in err
    assert sorted(x.name for x in (tmp_path / "zoo").iterdir()) == ["eval.txt", "learned-s0", "learned-s1",
                                                                  "rope-s0", "rope-s1", "training"]
    p = _zoo_cli("eval", str(tmp_path / "zoo"), "--factor", "1", "2", "--max-tokens", "128", "--out",
                 str(tmp_path / "ev"))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "cannot run" in out and "chunks 2L" in out
    assert (tmp_path / "ev" / "ratios.parquet").is_file()


@pytest.mark.parametrize("name", list(MEMBERS))
def test_trained_members_pass_their_familys_identities(tiny_zoo, name):
    # The support matrix's identity cells (facts, position control, shift test, decomposition: each against a
    # genuine Hugging Face computation) on the trained folder, not only on random weights.
    from matrix_cells import run_cell

    from posprobe.backend.loading import load_model

    out, _ = tiny_zoo
    bridge = load_model(str(out / f"{name}-s0"))
    got = {cell: run_cell(bridge, cell) for cell in ("facts", "position control", "shift-test", "decompose")}
    expected_na = {"position control", "shift-test"} if name == "nope" else set()
    for cell, status in got.items():
        if cell in expected_na:
            assert status.startswith("n/a"), (name, cell, status)
        else:
            assert status == "ok", (name, cell, status)


def test_zoo_notebook_runs(tmp_path, monkeypatch):
    from conftest import run_notebook

    # Every cell runs; the training itself is tested above, so the smoke zoo trains a few steps here.
    monkeypatch.setenv("POSPROBE_ZOO_STEPS", "20")
    monkeypatch.setenv("POSPROBE_ZOO_TASK_STEPS", "20")
    text, _ = run_notebook("positional_zoo", tmp_path, timeout=600)
    assert "nope" in text and "NoPE" in text and "ALiBi" in text


def test_info_names_the_members_family_and_zoo_record(tiny_zoo, capsys):
    from posprobe.cli import main

    out, _ = tiny_zoo
    assert main(["info", str(out / "hybrid-s0")]) == 0
    text = capsys.readouterr().out
    assert "layer 3: NoPE" in text and "zoo_member" in text and "hybrid (seed 0, block llama" in text
    assert main(["info", str(out / "nope-s0"), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["positional_kind"] == "nope" and facts["zoo_member"].startswith("nope")


def test_gpu_tier_runs_its_code_path_on_cpu_when_asked(tmp_path):
    # The GPU tier is the CPU tier's code with other sizes: on a machine without CUDA it runs where --device says,
    # here with its widths shrunk so that the test takes seconds.
    from posprobe.zoo.run import train_zoo

    cfg = ZooConfig(tier="gpu", device="cpu", members=("rope",), d_model=32, n_layers=2, n_heads=2, length=32,
                    vocab_size=300, batch_size=2, steps=3, progress=False)
    assert (cfg.lr, cfg.warmup) == (1e-3, 0)  # the tier's optimiser settings stay
    result = train_zoo(cfg, _text(), tmp_path / "z")
    record = json.loads((tmp_path / "z" / "rope-s0" / "zoo.json").read_text())
    assert record["widths"]["d_model"] == 32 and result.meta["config"]["tier"] == "gpu"


def test_the_t5_member_is_trained_on_the_next_token(tmp_path):
    # Pix2Struct's text decoder scores logits[t] against labels[t] (no shift inside): the zoo hands it labels moved
    # one token left, so its loss is the next-token cross-entropy every other member's class computes.
    from posprobe.zoo.tokenizer import train_tokenizer
    from posprobe.zoo.train import build_model, next_token_labels

    cfg = ZooConfig(**TINY)
    tok = train_tokenizer(_text(), cfg.vocab_size)
    model = build_model(MEMBERS["t5"], cfg, tok, seed=0)
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(input_ids=x, labels=next_token_labels(x)).loss
        logits = model(input_ids=x).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    assert torch.allclose(got, want, atol=1e-6)
    assert not MEMBERS["t5"].architecture.shifts_labels
    assert all(m.architecture.shifts_labels for n, m in MEMBERS.items() if n != "t5")
