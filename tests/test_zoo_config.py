"""The zoo's options (`ZooConfig`, `TaskConfig`, `load_config_file`) at the edges of every documented rule: the last
valid value passes, the first invalid one is refused with a message naming the field, defaults come from the tier,
warmup is 5% of the steps, duplicates are dropped. Pure Python, milliseconds.

Plants seen failing (one at a time): `<` for `<=` at the vocab, length, warmup, passkey and test-factor edges; the
warmup share 0.5; the gpu tier's length read from the cpu tier; seeds not deduplicated; an override of None applied;
the test lengths stopping one short of test_factor x L; the head-split check dropped."""

from __future__ import annotations

import json

import pytest

from posprobe.zoo.config import TIERS, TaskConfig, ZooConfig, load_config_file

SMALL = dict(d_model=16, n_heads=2, n_layers=1, length=8, vocab_size=300, steps=10, warmup=1)


def test_tier_values_fill_what_is_not_given_and_warmup_is_five_percent_of_the_steps():
    for tier in ("cpu", "gpu"):
        c = ZooConfig(tier=tier)
        for k, v in TIERS[tier].items():
            assert getattr(c, k) == v, (tier, k)
        assert c.warmup == round(0.05 * c.steps)
    assert ZooConfig(tier="gpu").length == 512 and ZooConfig().length == 128
    assert ZooConfig(steps=100).warmup == 5 and ZooConfig(steps=30).warmup == 2  # round(1.5)
    assert ZooConfig(steps=100, warmup=0).warmup == 0
    c = ZooConfig(**{**SMALL, "batch_size": 3})
    assert c.tokens_per_step == 3 * 8
    assert (c.widths.d_model, c.widths.n_layers, c.widths.n_heads, c.widths.length, c.widths.vocab_size) == (
        16, 1, 2, 8, 300)


def test_members_and_seeds_are_deduplicated_in_order():
    c = ZooConfig(members=("rope", "nope", "rope"), seeds=(2, 0, 2))
    assert c.members == ("rope", "nope") and c.seeds == (2, 0)


# (field, last valid value, first invalid value, words the refusal must contain)
EDGES = [
    ("d_model", 8, 0, "d_model must be >= 1"),
    ("n_layers", 1, 0, "n_layers must be >= 1"),
    ("steps", 2, 0, "steps must be >= 1"),
    ("batch_size", 1, 0, "batch_size must be >= 1"),
    ("checkpoint_every", 1, 0, "checkpoint_every must be >= 1"),
    ("length", 2, 1, "length must be >= 2"),
    ("vocab_size", 258, 257, "vocab_size must be >= 258"),
    ("warmup", 9, 10, "warmup must be in [0, steps)"),
    ("warmup", 0, -1, "warmup must be in [0, steps)"),
    ("lr", 1e-9, 0.0, "lr and grad_clip must be > 0"),
    ("grad_clip", 1e-9, 0.0, "lr and grad_clip must be > 0"),
    ("weight_decay", 0.0, -1e-9, "weight_decay >= 0"),
    ("passkey", 1.0, 1.0001, "passkey must be a share in [0, 1]"),
    ("passkey", 0.0, -0.0001, "passkey must be a share in [0, 1]"),
    ("eval_fraction", 0.999, 1.0, "eval_fraction must be in (0, 1)"),
    ("eval_fraction", 0.001, 0.0, "eval_fraction must be in (0, 1)"),
]


@pytest.mark.parametrize("name, ok, bad, says", EDGES, ids=[f"{e[0]}={e[2]}" for e in EDGES])
def test_each_rule_refuses_its_first_invalid_value_and_keeps_the_last_valid(name, ok, bad, says):
    base = {**SMALL, "d_model": 8, "n_heads": 1} if name == "d_model" else SMALL
    assert getattr(ZooConfig(**{**base, name: ok}), name) == ok
    with pytest.raises(ValueError) as e:
        ZooConfig(**{**base, name: bad})
    assert says in str(e.value)


@pytest.mark.parametrize("kw, says", [
    (dict(tier="tpu"), "unknown tier 'tpu'"),
    (dict(members=()), "no zoo members"),
    (dict(members=("rope", "fire")), "unknown zoo member 'fire'"),
    (dict(seeds=()), "seeds must be >= 0"),
    (dict(seeds=(0, -1)), "seeds must be >= 0"),
    (dict(d_model=50, n_heads=6), "must split into 6 heads"),  # 50 // 6 = 8 dims, but 50 = 6 x 8 + 2
    (dict(d_model=48, n_heads=4), "heads of a multiple of 8 dims"),  # 12 dims per head
    (dict(n_heads=0), "n_heads must be >= 1"),
])
def test_shapes_and_names_that_cannot_train_are_refused(kw, says):
    with pytest.raises(ValueError) as e:
        ZooConfig(**{**SMALL, **kw})
    assert says in str(e.value)
    assert ZooConfig(**{**SMALL, "d_model": 64, "n_heads": 8}).n_heads == 8  # 8 dims per head: allowed


def test_task_config_edges_and_test_lengths():
    assert TaskConfig(train_max=8, test_factor=3).test_lengths == list(range(1, 25))
    assert TaskConfig(train_max=3, test_factor=1.5).test_lengths == [1, 2, 3, 4]  # 1 .. floor(4.5)
    assert TaskConfig(train_max=1, test_factor=1).test_lengths == [1]
    assert TaskConfig(tasks=("sorting", "copy", "sorting")).tasks == ("sorting", "copy")
    for kw, says in ((dict(tasks=("divide",)), "unknown tasks ['divide']"), (dict(tasks=()), "unknown tasks"),
                     (dict(test_factor=0.99), "test_factor must be >= 1"), (dict(train_max=0), "train_max"),
                     (dict(test_count=0), "test_count"), (dict(steps=0), "steps"), (dict(batch_size=0), "batch_size")):
        with pytest.raises(ValueError) as e:
            TaskConfig(**kw)
        assert says in str(e.value), kw


def test_config_files_are_read_with_overrides_and_refused_with_one_sentence(tmp_path):
    f = tmp_path / "zoo.json"
    f.write_text(json.dumps({"members": ["rope", "alibi"], "seeds": [3], "steps": 40, "length": 16}))
    c = load_config_file(f, steps=50, length=None)
    assert c.members == ("rope", "alibi") and c.seeds == (3,) and c.steps == 50
    assert c.length == 16  # an override of None (a flag not given) leaves the file's value
    for text, says in (("{", "not valid JSON"), ("[1, 2]", "expected a JSON object"),
                       ('{"stepz": 3}', "unknown field(s) stepz; known: "), ('{"progress": false}', "progress")):
        f.write_text(text)
        with pytest.raises(ValueError) as e:
            load_config_file(f)
        assert says in str(e.value) and str(f) in str(e.value)
    with pytest.raises(ValueError, match="no such file"):
        load_config_file(tmp_path / "none.json")
