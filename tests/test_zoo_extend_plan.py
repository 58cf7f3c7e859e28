"""`zoo extend`'s plan, without a trained zoo (seconds): each method's HF `rope_parameters` and the notes a folder
records, written out here from the papers' rules (`method_rope_parameters`); DroPE's removal in each class's own
config (`drope_config`); the config's edges; the fine-tuning schedule a job hands to the zoo's loop; and the plan of a
zoo written here by hand (member folders of HF configs, no weights).

Plants seen failing (mutmut's names from `benchmarks/mutation.py --module zoo_extend`, and by hand):
- ABF's base written under another key (`x_method_rope_parameters__mutmut_140`: the member kept its base, so abf
  silently became direct): test_each_method_gives_the_papers_rope_parameters_and_notes.
- The partial rotary factor ignored in the NTK exponent (`__mutmut_20`), PoSE's text window L / 5 (`__mutmut_60`), the
  NTK base or the YaRN ramp missing from the notes (`__mutmut_90`, `__mutmut_110`): the same test.
- A custom llama3 rope left without its original length (`__mutmut_170`), longrope accepted (`__mutmut_180`), drope
  sent to the unknown-method error (`__mutmut_190`): test_custom_rope_parameters_and_refusals.
- `_rope_of` missing a top-level rope_theta (`x__rope_of__mutmut_20`), `_inv_freq` reading no head_dim or a missing
  rope_type as "DEFAULT" (`x__inv_freq__mutmut_10/30`): test_a_members_rope_is_read_from_its_config_json.
- DroPE's no_rope_layers not found for SmolLM3 (`x_drope_config__mutmut_20`) or its notes' keys misspelt (30, 90,
  100): test_drope_removes_the_rotation_in_each_classs_own_config.
- Seeds not kept as ints in order (`__post_init____mutmut_50`), 0 passkey trials or a passkey step of 1 refused
  (70, 80), the sliding protocol scored at the wrong checkpoints (`protocols_at__mutmut_10`):
  test_config_edges_and_the_protocols_at_each_checkpoint.
- The job's lr, vocabulary or progress flag not handed to the loop (`train_config__mutmut_10/20/30`: a dropped lr
  fine-tunes at the loop's default pre-training lr): test_a_job_hands_its_schedule_to_the_zoo_loop.
- A member missing one seed stopping the member's other seeds (`x_plan_extension__mutmut_100`), the left-out rows'
  keys misspelt (90, 150): test_the_plan_of_a_hand_written_zoo.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posprobe.zoo.config import ZooConfig
from posprobe.zoo.extend import (
    ExtendConfig,
    ExtendJob,
    _rope_of,
    drope_config,
    method_rope_parameters,
    plan_extension,
)
from posprobe.zoo.folder import ZOO_FILE
from posprobe.zoo.members import Widths, member
from posprobe.zoo.methods import _inv_freq

W = Widths(d_model=32, n_layers=2, n_heads=2, length=16, vocab_size=64)
L, TARGET = 16, 64
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def tok():
    """The zoo's byte-level BPE trained on the built-in corpus (300 tokens): what the passkey rows are spelt in."""
    from posprobe.data import builtin_corpus
    from posprobe.zoo.tokenizer import train_tokenizer

    return train_tokenizer(builtin_corpus()[:30000], 300)


def _folder(zoo: Path, name: str, seed: int, **record) -> Path:
    """A member folder as `zoo train` writes it, less the weights: the member's HF config and its zoo.json."""
    folder = zoo / f"{name}-s{seed}"
    folder.mkdir(parents=True)
    member(name).hf_config(W, pad_id=0, bos_id=1).save_pretrained(folder)
    rec = {"member": name, "family": member(name).family, "seed": seed, "widths": W.__dict__, "batch_size": 8,
           "lr": 3e-3, **record}
    (folder / ZOO_FILE).write_text(json.dumps(rec), encoding="utf-8")
    return folder


def test_each_method_gives_the_papers_rope_parameters_and_notes():
    s = TARGET / L
    got = {m: method_rope_parameters(m, DEFAULT, 16, L, TARGET) for m in ("direct", "pi", "ntk", "yarn", "abf")}
    assert got["direct"] == (DEFAULT, {"scale": 4.0})
    assert got["pi"] == ({"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}, {"scale": 4.0})  # Chen et al.
    ntk = 1e4 * s ** (16 / 14)  # bloc97: b s^(d / (d - 2))
    assert got["ntk"][0] == {"rope_type": "default", "rope_theta": pytest.approx(ntk, rel=1e-12)}
    assert got["ntk"][1] == {"scale": 4.0, "ntk_base": pytest.approx(ntk, rel=1e-12), "exponent_dims": 16}
    assert got["yarn"] == ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                            "original_max_position_embeddings": L},
                           {"scale": 4.0, "temperature": pytest.approx(0.1 * math.log(4) + 1), "rotary_dims": 16,
                            "ramp": "paper"})
    abf = 1e4 * 50 ** (math.log(4) / math.log(8))  # Xiong et al.'s x50 per 8x, kept per doubling: 1.357e5
    assert got["abf"][0]["rope_theta"] == pytest.approx(abf, rel=1e-12) and abs(abf - 1.357e5) < 100
    assert got["abf"][1] == {"scale": 4.0, "abf_base": pytest.approx(abf, rel=1e-12)}
    assert method_rope_parameters("abf", DEFAULT, 16, L, TARGET, abf_base=5e5)[0]["rope_theta"] == 5e5
    # PoSE: the rope unchanged; its text window is 5L tokens (the released code reads up to 5L of a document).
    assert method_rope_parameters("pose", DEFAULT, 16, L, TARGET) == (
        DEFAULT, {"scale": 4.0, "chunks": 2, "text_window": 5 * L, "positions": "unscaled"})
    # Partial rotary: NTK's exponent runs over the rotated dims only (a half of 16 here).
    half = {**DEFAULT, "partial_rotary_factor": 0.5}
    assert method_rope_parameters("ntk", half, 16, L, TARGET)[0]["rope_theta"] == pytest.approx(1e4 * s ** (8 / 6))
    # p-RoPE (proportional): the exponent runs over the whole head; PI keeps the type and adds the factor.
    prop = {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    assert method_rope_parameters("ntk", prop, 16, L, TARGET)[0]["rope_theta"] == pytest.approx(1e4 * s ** (16 / 14))
    assert method_rope_parameters("pi", prop, 16, L, TARGET)[0] == {**prop, "factor": 4.0}
    # The scaled ramp: Peng et al.'s beta = 32 and alpha = 1 at L = 4,096 moved to L = 16 at base 1e4 (x L / 4096).
    rope, notes = method_rope_parameters("yarn", DEFAULT, 16, L, TARGET, yarn_ramp="scaled")
    assert (rope["beta_fast"], rope["beta_slow"]) == pytest.approx((32 * L / 4096, L / 4096))
    assert notes["ramp"] == "scaled" and (notes["beta_fast"], notes["beta_slow"]) == pytest.approx((0.125, 1 / 256))


def test_custom_rope_parameters_and_refusals():
    rope, _ = method_rope_parameters("custom", DEFAULT, 16, L, TARGET,
                                     custom={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0})
    assert rope["original_max_position_embeddings"] == L  # else HF would read L' from max_position_embeddings
    rope, _ = method_rope_parameters("custom", DEFAULT, 16, L, TARGET,
                                     custom={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    assert rope["original_max_position_embeddings"] == 8  # the user's own value is kept
    rope, _ = method_rope_parameters("custom", DEFAULT, 16, L, TARGET, custom={"rope_type": "linear", "factor": 2.0})
    assert "original_max_position_embeddings" not in rope and rope["factor"] == 2.0
    for kind in ("dynamic", "longrope"):
        with pytest.raises(ValueError, match="rebuilds its table from each input's length"):
            method_rope_parameters("custom", DEFAULT, 16, L, TARGET, custom={"rope_type": kind, "factor": 2.0})
    prop = {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    with pytest.raises(ValueError, match="would drop its removed bands"):
        method_rope_parameters("custom", prop, 16, L, TARGET, custom={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="has no YaRN ramp"):
        method_rope_parameters("yarn", prop, 16, L, TARGET)
    with pytest.raises(ValueError, match="use drope_config"):
        method_rope_parameters("drope", DEFAULT, 16, L, TARGET)
    with pytest.raises(ValueError, match="unknown method 'fire'"):
        method_rope_parameters("fire", DEFAULT, 16, L, TARGET)
    with pytest.raises(ValueError, match="neither default nor proportional"):
        method_rope_parameters("pi", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, 16, L, TARGET)


def test_a_members_rope_is_read_from_its_config_json(tmp_path):
    from types import SimpleNamespace

    (tmp_path / "config.json").write_text(json.dumps({"rope_theta": 5e4, "num_attention_heads": 2,
                                                      "hidden_size": 24}), encoding="utf-8")
    assert _rope_of(tmp_path) == ({"rope_theta": 5e4}, 12)  # an older config: the base at the top level
    (tmp_path / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 7.0}, "rope_theta": 5e4,
                                                      "num_attention_heads": 2, "hidden_size": 24, "head_dim": 6}))
    assert _rope_of(tmp_path) == ({"rope_theta": 7.0}, 6)  # rope_parameters win; an explicit head_dim wins
    # A default table's band count: (head dim x rotated share) / 2, the head dim from the width where none is set.
    cfg = SimpleNamespace(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}, head_dim=None,
                          hidden_size=32, num_attention_heads=2)
    assert _inv_freq(cfg, {}).shape == (4,)
    cfg.head_dim = 8
    assert _inv_freq(cfg, {}).shape == (2,)


@pytest.mark.parametrize("name,removed,was,overrides", [
    ("rope-llama", "no_rope_layers", [1, 1], {"no_rope_layers": [0, 0]}),
    ("rope", "rope_type proportional, partial_rotary_factor 0",
     {"rope_type": "default", "partial_rotary_factor": 1.0}, {}),
    ("p-rope", "rope_type proportional, partial_rotary_factor 0",
     {"rope_type": "proportional", "partial_rotary_factor": 0.25}, {}),
])
def test_drope_removes_the_rotation_in_each_classs_own_config(tmp_path, name, removed, was, overrides):
    folder = _folder(tmp_path, name, 0)
    rope, extra, notes = drope_config(folder, TARGET)
    assert extra == overrides and notes == {"removed": removed, "was": was}
    if overrides:  # SmolLM3: 1 = a rotary layer, so all 0 is NoPE everywhere; the rope itself unchanged
        assert rope["rope_type"] == "default"
    else:  # p-RoPE at p = 0: every band removed
        assert (rope["rope_type"], rope["partial_rotary_factor"]) == ("proportional", 0.0)


def test_config_edges_and_the_protocols_at_each_checkpoint():
    cfg = ExtendConfig(seeds=(1, 0, 1), passkey_trials=0, passkey_step=1, steps=10, checkpoints=(5,))
    assert cfg.seeds == (1, 0) and cfg.checkpoints == (5, 10) and cfg.passkey_trials_for(True) == 0
    for bad, says in ((dict(passkey_trials=-1), "passkey_trials must be >= 0"),
                      (dict(passkey_step=0), "passkey_step must be >= 1"), (dict(passkey=1.5), "passkey must be"),
                      (dict(warmup=10, steps=10, checkpoints=()), "warmup must be < steps")):
        with pytest.raises(ValueError, match=says):
            ExtendConfig(**bad)
    both, chunks = ("chunks", "sliding"), ("chunks",)
    last = ExtendConfig(steps=10, checkpoints=(), sliding="last")
    assert [last.protocols_at(s) for s in (None, 0, 5, 10)] == [both, chunks, chunks, both]
    every, never = (ExtendConfig(steps=10, checkpoints=(), sliding=s) for s in ("every", "never"))
    assert [every.protocols_at(s) for s in (None, 5)] == [both, both]
    assert [never.protocols_at(s) for s in (None, 10)] == [chunks, chunks]
    assert ExtendConfig(steps=100, checkpoints=()).default_warmup == 10
    assert ExtendConfig(steps=1000).default_warmup == 20


def test_a_job_hands_its_schedule_to_the_zoo_loop():
    widths = {"d_model": 48, "n_layers": 3, "n_heads": 3, "length": L, "vocab_size": 777}
    job = ExtendJob("rope", 2, "pi", Path("rope-s2"), {"widths": widths}, L, TARGET, None, 5, 1.5e-4, 3)
    cfg = ExtendConfig(steps=30, checkpoints=(), weight_decay=0.01, grad_clip=0.5, checkpoint_every=7, passkey=0.25,
                       device="cuda:1", progress=False)
    assert job.train_config(cfg) == ZooConfig(
        members=("rope",), seeds=(2,), d_model=48, n_layers=3, n_heads=3, length=TARGET, vocab_size=777, batch_size=5,
        steps=30, lr=1.5e-4, warmup=3, weight_decay=0.01, grad_clip=0.5, checkpoint_every=7, passkey=0.25,
        device="cuda:1", progress=False)
    assert (job.scale, job.train_length, job.folder_name) == (4.0, TARGET, "rope-s2-pi")


def test_the_plan_of_a_hand_written_zoo(tmp_path):
    zoo = tmp_path / "zoo"
    for name, seed in (("rope-llama", 0), ("rope-llama", 1), ("p-rope", 0), ("nope", 1), ("learned", 0),
                       ("learned", 1)):
        _folder(zoo, name, seed)
    jobs, left = plan_extension(zoo, ExtendConfig(methods=("pi", "yarn", "copy"), steps=200))
    got = [(j.member, j.seed, j.method) for j in jobs]
    # nope has no seed 0: its seed 1 still runs (the control, direct); p-rope has no YaRN in HF's config.
    assert got == [("learned", 0, "copy"), ("learned", 1, "copy"), ("nope", 1, "direct"), ("p-rope", 0, "pi"),
                   ("rope-llama", 0, "pi"), ("rope-llama", 1, "pi"), ("rope-llama", 0, "yarn"),
                   ("rope-llama", 1, "yarn")]
    assert [(r["member"], r["method"]) for r in left] == [("p-rope", "copy"), ("p-rope", "yarn"),
                                                          ("rope-llama", "copy")]
    assert all(r["why"].startswith(f"{r['member']} with {r['method']}: ") for r in left)
    by = {(j.member, j.seed, j.method): j for j in jobs}
    # The same tokens per step as pre-training (8 x L = 2 x 4L), a tenth of its lr, warmup min(20, steps / 10).
    pi = by[("rope-llama", 1, "pi")]
    assert (pi.batch_size, pi.lr, pi.warmup, pi.length, pi.target) == (2, pytest.approx(3e-4), 20, L, TARGET)
    assert pi.rope_parameters == {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}
    assert by[("learned", 0, "copy")].notes == {"rows": f"row t = row t mod {L}", "from_rows": L, "to_rows": TARGET}
    assert by[("nope", 1, "direct")].rope_parameters is None
    with pytest.raises(ValueError, match="NoPE has no use for"):
        plan_extension(zoo, ExtendConfig(members=("nope",), seeds=(1,), methods=("pose",)))
    with pytest.raises(ValueError, match="grown to L' = 64 by copying rows, as Longformer's was"):
        plan_extension(zoo, ExtendConfig(members=("learned",), methods=("direct",)))
    with pytest.raises(ValueError, match=r"has no member folder nope-s0"):
        plan_extension(zoo, ExtendConfig(members=("nope",)))


def test_every_config_rule_at_its_edge():
    """Each refusal of ExtendConfig one step either side of its edge (the rules in its docstring and --help)."""
    ok = [dict(lr=1e-9), dict(lr=2.0), dict(weight_decay=0.0), dict(grad_clip=1e-9), dict(abf_base=1.5),
          dict(length=2), dict(passkey=1.0), dict(passkey=0.0), dict(batch_size=1), dict(warmup=0),
          dict(rope_parameters={"factor": 2.0})]
    for kw in ok:
        ExtendConfig(**kw)
    bad = [(dict(lr=0.0), "lr and grad_clip must be > 0"), (dict(weight_decay=-0.1), "weight_decay >= 0"),
           (dict(grad_clip=0.0), "grad_clip must be > 0"), (dict(abf_base=1.0), "abf_base must be > 1"),
           (dict(length=1), "length must be >= 2"), (dict(batch_size=0), "batch_size must be >= 1"),
           (dict(warmup=-1), "warmup must be >= 0"), (dict(methods=("custom",)), "needs --rope-parameters"),
           (dict(methods=("pi", "fire")), r"unknown methods \['fire'\]"), (dict(methods=()), "unknown methods"),
           (dict(rope_parameters={}), "non-empty JSON object"), (dict(rope_parameters=[1]), "non-empty JSON object")]
    for kw, says in bad:
        with pytest.raises(ValueError, match=says):
            ExtendConfig(**kw)
    cfg = ExtendConfig(members=("rope", "rope", "alibi"), methods=("pi", "pi", "ntk"), rope_parameters={"factor": 2})
    assert cfg.members == ("rope", "alibi") and cfg.methods == ("pi", "ntk", "custom")
    assert ExtendConfig().passkey_trials_for(True) == 10 and ExtendConfig().passkey_trials_for(False) == 0
    assert ExtendConfig(passkey_trials=3).passkey_trials_for(False) == 3


def test_rope_parameters_without_a_type_are_the_default_type():
    """HF reads a rope_parameters dict without `rope_type` as the default type (and a custom dict without one keeps
    the member's): both are extended, not refused."""
    assert method_rope_parameters("pi", {"rope_theta": 1e4}, 16, L, TARGET)[0]["rope_type"] == "linear"
    rope, _ = method_rope_parameters("custom", {"rope_theta": 1e4}, 16, L, TARGET, custom={"rope_theta": 5e4})
    assert rope == {"rope_theta": 5e4}
    rope, _ = method_rope_parameters("custom", DEFAULT, 16, L, TARGET, custom={"rope_type": "yarn", "factor": 4.0})
    assert rope["original_max_position_embeddings"] == L
    prop = {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    assert method_rope_parameters("custom", prop, 16, L, TARGET, custom={"factor": 2.0})[0] == {**prop, "factor": 2.0}


def test_the_plans_numbers_follow_the_config(tmp_path):
    zoo = tmp_path / "zoo"
    _folder(zoo, "rope-llama", 0, batch_size=1)
    (job,), _ = plan_extension(zoo, ExtendConfig(methods=("abf",), abf_base=5e5, lr=7e-5, steps=10, checkpoints=()))
    assert job.rope_parameters["rope_theta"] == 5e5 and job.lr == 7e-5
    assert job.batch_size == 1  # 1 x L / 4L rounds to 0: at least one sequence
    (job,), _ = plan_extension(zoo, ExtendConfig(methods=("pose",), batch_size=3))
    assert (job.batch_size, job.train_length) == (3, L)
    other = tmp_path / "two-lengths"
    _folder(other, "rope", 0)
    long = _folder(other, "alibi", 0)
    rec = json.loads((long / ZOO_FILE).read_text())
    (long / ZOO_FILE).write_text(json.dumps({**rec, "widths": {**rec["widths"], "length": 32}}))
    with pytest.raises(ValueError, match=r"different training lengths \[16, 32\]"):
        plan_extension(other, ExtendConfig())
    # Each refusal names what it is about, and only that.
    with pytest.raises(ValueError) as e:
        plan_extension(zoo, ExtendConfig(members=("rope-llama",), methods=("copy",)))
    assert "has none (its positions are rotations)" in str(e.value)
    nope = tmp_path / "nope-zoo"
    _folder(nope, "nope", 0)
    with pytest.raises(ValueError) as e:
        plan_extension(nope, ExtendConfig(members=("nope",), methods=("pi",)))
    assert "pose included" not in str(e.value) and "Longformer" not in str(e.value)
    assert str(e.value).endswith("extended with --method direct only")


def test_copy_refuses_a_model_without_gpt2s_table():
    import torch
    from transformers import BloomConfig, BloomForCausalLM, LlamaConfig, LlamaForCausalLM

    from posprobe.zoo.extend import copy_rows

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32))
    bloom = BloomForCausalLM(BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2))  # .transformer, no wpe
    for model in (llama, bloom):
        with pytest.raises(ValueError, match="has none"):
            copy_rows(model, 64)
    assert isinstance(bloom.transformer.word_embeddings, torch.nn.Embedding)


def test_pose_and_drope_batches_are_at_L_with_the_skill_mixed_in(tok):
    """PoSE's and DroPE's batches are L tokens long (the others': the zoo's text windows at L'), with the
    passkey rows at the fine-tuning's share: the text rows are windows of the text, the last rows passkey prompts."""
    import torch

    from posprobe.data import builtin_corpus
    from posprobe.zoo.extend import job_batches, pose_batch

    ids = torch.tensor(tok(builtin_corpus()[:20000])["input_ids"])
    text = ids.tolist()
    n = 64
    widths = {"d_model": 32, "n_layers": 2, "n_heads": 2, "length": n, "vocab_size": 300}
    cfg = ExtendConfig(steps=4, checkpoints=(), passkey=0.5, progress=False)
    for method in ("drope", "pose", "pi"):
        job = ExtendJob("rope-llama", 3, method, Path("x"), {"widths": widths}, n, 4 * n, None, 4, 1e-4, 0)
        batches = job_batches(job, job.train_config(cfg), ids, tok)
        got = batches(2)
        x = got[0]
        assert x.shape == (4, 4 * n if method == "pi" else n) and got[1] is x
        for row in x[:2].tolist():  # text rows (PoSE's: two chunks of one window)
            head = row[:8]
            assert any(text[i:i + 8] == head for i in range(len(text) - 8))
        for row in x[2:]:
            assert "What is the pass key? The pass key is" in tok.decode(row)
        if method == "pose":
            assert torch.equal(got[2], pose_batch(ids, 2, 3, 4, n, 4 * n)[1])
        assert torch.equal(x, batches(2)[0]) and not torch.equal(x, batches(3)[0])  # a function of the step


def test_a_passkey_is_five_digits_and_a_share_gives_at_least_one_row(tok):
    import random

    from posprobe.zoo.passkey import passkey_rows, passkey_sequence

    class Ends(random.Random):  # draws each range's end: the smallest and largest key the rule allows
        def __init__(self, high: bool) -> None:
            super().__init__(0)
            self.high = high

        def randint(self, a: int, b: int) -> int:
            return b if self.high else a

    for high, key in ((False, "10000"), (True, "99999")):
        p = passkey_sequence(tok, 64, Ends(high))
        assert tok.decode(p.ids + list(p.answer)).endswith(f"The pass key is {key}")
    assert [passkey_rows(s, 8) for s in (0.0, 0.01, 0.25, 0.5, 1.0)] == [0, 1, 2, 4, 8]


def test_pose_reads_a_text_of_exactly_one_window_from_its_start():
    """A text of exactly W = 5L tokens is one window: every row's first chunk starts at token 0 (the window's start is
    uniform on {0, ..., len - W}), and each chunk is a run of consecutive tokens of it."""
    import torch

    from posprobe.zoo.extend import pose_batch

    ids = torch.arange(5 * L)
    for step in range(5):
        x, pos = pose_batch(ids, step, 0, 8, L, TARGET)
        assert x.shape == (8, L) and (x[:, 0] == 0).all()
        for row in x.tolist():  # two runs of consecutive tokens (one when the content skip is 0), the first from 0
            breaks = [i for i in range(1, L) if row[i] != row[i - 1] + 1]
            first = breaks[0] if breaks else L
            assert len(breaks) <= 1 and row[:first] == list(range(first))


def test_default_checkpoints_keep_those_within_the_steps():
    # issue #64: --steps 20 with the default checkpoints was refused; the defaults within the steps are kept, the last
    # step added, and checkpoints the user names past the steps are still refused.
    assert ExtendConfig(steps=20).checkpoints == (0, 20)
    assert ExtendConfig(steps=60).checkpoints == (0, 25, 50, 60)
    assert ExtendConfig().checkpoints == (0, 25, 50, 100, 200)
    with pytest.raises(ValueError, match="checkpoints must lie in 0..steps"):
        ExtendConfig(steps=20, checkpoints=(0, 50))


def test_the_fine_tuning_text_is_found_again_where_the_zoo_was_trained_on_a_file(tmp_path):
    import hashlib
    import json

    from posprobe.analyses.context_extension import training_text

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a\n" * 10, encoding="utf-8")
    part = "a\n" * 5  # zoo train's split at eval_fraction 0.5: the first half, cut at a line break
    zoo = tmp_path / "zoo"
    (zoo / "training").mkdir(parents=True)
    (zoo / "training" / "meta.json").write_text(json.dumps({
        "data": {"source": str(corpus), "sha256": hashlib.sha256(part.encode()).hexdigest()},
        "config": {"eval_fraction": 0.5}}), encoding="utf-8")
    assert training_text(zoo, None, None) == (part, str(corpus))
    corpus.write_text("b\n" * 10, encoding="utf-8")
    with pytest.raises(ValueError, match="has changed since"):
        training_text(zoo, None, None)
    corpus.unlink()
    with pytest.raises(ValueError, match="which is not here"):
        training_text(zoo, None, None)
    assert training_text(zoo, "given", "x.txt") == ("given", "x.txt")


def test_a_zoo_trained_from_python_on_its_own_text_is_not_called_the_built_in_corpus(tmp_path):
    """train_zoo(text) without `source` recorded "built-in corpus" for any text, and zoo extend then looked for the
    built-in corpus (review of #64). Planted (the old default back): the source reads "built-in corpus"."""
    import json

    from posprobe.analyses.context_extension import training_text
    from posprobe.data import builtin_corpus
    from posprobe.zoo import ZooConfig, train_zoo

    cfg = ZooConfig(members=("rope-llama",), d_model=16, n_layers=1, n_heads=2, length=16, vocab_size=280, steps=2,
                    progress=False)
    train_zoo(cfg, builtin_corpus()[:30_000], tmp_path / "own")
    meta = json.loads((tmp_path / "own" / "training" / "meta.json").read_text(encoding="utf-8"))
    assert meta["data"]["source"] == "text"
    with pytest.raises(ValueError, match="trained on a text given without a file name, that cannot be found again"):
        training_text(tmp_path / "own", None, None)
    train_zoo(cfg, builtin_corpus(), tmp_path / "builtin")
    assert training_text(tmp_path / "builtin", None, None)[1] == "built-in corpus"
