"""An extension method is one row (`posprobe.zoo.methods.ExtendMethod`): a planted row registered here, and nothing
else edited, is accepted by the config, planned for every rotary member with its rope_parameters checked against HF's
config, fine-tuned through the zoo's one loop, saved as a folder whose plain HF load rotates by the row's formula
(written out here, not read from posprobe), and listed in the Result's plan; a job of any command is one object run
by `run_jobs`.

Planted bugs seen failing (each by editing posprobe/zoo/, running this file, then reverting):
- `ExtendJob.train_length` ignoring the row's `at_train_length` (always L'): the planted row trains at L, so the
  batch length check fails.
- `ExtendMethod.carried` computing every method's rope_parameters by PI's row: the planted row's factor s/2 is
  missing from the plan and the plan table (two tests fail).
- `run_jobs` handing the loop the first job of the list for every run: one folder instead of three.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posprobe.zoo.config import ZooConfig
from posprobe.zoo.extend import METHOD_NAMES, ExtendConfig, plan_extension
from posprobe.zoo.folder import ZOO_FILE
from posprobe.zoo.methods import METHODS, ExtendMethod, RopeCase, register

L, TARGET = 16, 64
TINY = dict(d_model=32, n_layers=1, n_heads=2, length=L, vocab_size=300, batch_size=4, steps=2, warmup=0,
            progress=False)


def _half_pi(case: RopeCase) -> tuple[dict, dict]:
    # The planted method: Position Interpolation by s/2 (half of PI's factor), trained at L.
    return {**case.rope, "rope_type": "linear", "factor": case.scale / 2}, {"scale": case.scale}


@pytest.fixture
def half_pi():
    row = register(ExtendMethod("half-pi", "PI by s / 2 (a test's row)", rope=_half_pi, at_train_length=True))
    try:
        yield row
    finally:
        del METHODS["half-pi"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    from posprobe.data import builtin_corpus
    from posprobe.zoo.run import train_zoo

    out = tmp_path_factory.mktemp("methods") / "zoo"
    train_zoo(ZooConfig(members=("rope-llama", "alibi"), steps=1, **{k: v for k, v in TINY.items() if k != "steps"}),
              builtin_corpus()[:40000], out)
    return out


def test_the_registry_is_the_one_list_of_methods():
    # Every row says how it changes a rotary member (rope or config) or is a control of named families; the CLI's
    # --method choices and the config's validation read the registry.
    from posprobe.cli.main import build_parser

    assert METHOD_NAMES == tuple(METHODS) == ("direct", "pi", "ntk", "yarn", "abf", "pose", "drope", "custom", "copy")
    for row in METHODS.values():
        assert row.rope is not None or row.config is not None or (not row.rotary and row.controls), row.name
    parser = build_parser()
    extend = parser._subparsers._group_actions[0].choices["zoo"]._subparsers._group_actions[0].choices["extend"]
    choices = next(a for a in extend._actions if a.dest == "methods").type("pi,ntk")
    assert tuple(choices) == ("pi", "ntk")
    with pytest.raises(Exception, match="not one of"):
        next(a for a in extend._actions if a.dest == "methods").type("half-pi")
    with pytest.raises(ValueError, match="unknown methods"):
        ExtendConfig(methods=("half-pi",))
    with pytest.raises(ValueError, match="already registered"):
        register(ExtendMethod("pi", "again", rope=_half_pi))


def test_a_planted_row_is_planned_trained_and_loaded_by_its_formula(half_pi, zoo, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posprobe.zoo.job import open_work, run_jobs

    cfg = ExtendConfig(methods=("half-pi", "pi"), steps=2, checkpoints=(), progress=False)
    jobs, left = plan_extension(zoo, cfg)
    assert [(j.member, j.method) for j in jobs] == [("alibi", "direct"), ("rope-llama", "half-pi"),
                                                    ("rope-llama", "pi")] and not left
    job = jobs[1]
    assert job.rope_parameters["factor"] == TARGET / L / 2 and job.train_length == L  # the row's own settings
    tok = AutoTokenizer.from_pretrained(job.source)
    from posprobe.data import builtin_corpus

    ids = torch.tensor(tok(builtin_corpus()[:30000])["input_ids"])
    run = [j.job(cfg, ids, tok) for j in jobs]
    assert run[1].batches(0)[0].shape == (job.batch_size, L) and run[2].batches(0)[0].shape[1] == TARGET
    ckpt, staging, _ = open_work(tmp_path / "out", "key")
    records = run_jobs(run, ckpt, staging)
    assert [r["steps_run"] for r in records] == [2, 2, 2]
    assert sorted(p.name for p in staging.iterdir()) == ["alibi-s0-direct", "rope-llama-s0-half-pi",
                                                         "rope-llama-s0-pi"]
    folder = staging / "rope-llama-s0-half-pi"
    saved = json.loads((folder / ZOO_FILE).read_text())
    assert saved["method"] == "half-pi" and saved["extension"]["train_length"] == L
    # The plain HF load rotates by theta_j = b^(-2j/d) / (s/2): written out here.
    model = AutoModelForCausalLM.from_pretrained(folder)
    emb = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
    d = 32 // 2
    want = 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) / (TARGET / L / 2)
    assert torch.allclose(emb.inv_freq.double(), want, rtol=1e-6)


def test_the_plan_table_lists_a_planted_row(half_pi, zoo, tmp_path):
    from posprobe.analyses.context_extension import extend_zoo
    from posprobe.data import builtin_corpus

    text = (zoo / "eval.txt").read_text()
    cfg = ExtendConfig(members=("rope-llama",), methods=("half-pi",), steps=1, checkpoints=(), eval_tokens=256,
                       sliding="never", mechanism=False, progress=False)
    result = extend_zoo(zoo, cfg, tmp_path / "ext", text=builtin_corpus()[:40000], eval_text=text * 4)
    plan = result.tables["plan"]
    assert plan["method"].tolist() == ["half-pi"]
    assert json.loads(plan["rope_parameters"].iloc[0])["factor"] == TARGET / L / 2
    assert (Path(tmp_path / "ext") / "rope-llama-s0-half-pi" / "config.json").is_file()
