"""The sink positive control (`posprobe zoo sink-control`, issue #63; Guo et al. 2024's Bigram-Backcopy task).

The generator is checked against the task's definition written out here from the corpus itself (plain Python
counting, not the module's matrix): every token after a trigger copies the token before the trigger, the other
transitions follow the corpus's character bigrams within binomial noise, a seed gives one stream. A member trained
on the task through the zoo's loop has a sink that posprobe's Sink_1^0.3 finds, and plain Hugging Face attention
weights (eager, `output_attentions=True`) give the same shares, computed here on position 0; the untrained model
(step 0) has none, so the test cannot pass vacuously."""

from __future__ import annotations

import math
import re
from collections import Counter

import pandas as pd
import pytest
import torch

from posprobe.zoo.backcopy import (
    BackcopyConfig,
    backcopy_batch,
    backcopy_rows,
    backcopy_tokenizer,
    backcopy_vocab,
    loss_floor,
    trigger_ids,
)


def _text() -> str:
    # The task's corpus as its docstring states it: the built-in corpus, letters and single spaces.
    from posprobe.data import builtin_corpus

    return re.sub(" +", " ", "".join(c for c in builtin_corpus().replace("\n", " ") if c.isascii() and
                                     (c.isalpha() or c == " ")))


def _law() -> tuple[dict[str, Counter], set[str]]:
    text = _text()
    follow: dict[str, Counter] = {}
    for a, b in zip(text, text[1:]):
        follow.setdefault(a, Counter())[b] += 1
    return follow, {c for c, _ in Counter(text).most_common(3)}


def _chars(x: torch.Tensor) -> list[str]:
    inv = {i: t for t, i in backcopy_vocab().items()}
    return [inv[i] for i in x.tolist()]


def test_triggers_and_vocabulary_are_the_corpus_own():
    _, triggers = _law()
    assert {_chars(torch.tensor(trigger_ids()))[i] for i in range(3)} == triggers == {" ", "e", "t"}
    tok = backcopy_tokenizer()
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<pad>"]) == [0, 1]
    assert set(backcopy_vocab()) - {"<|endoftext|>", "<pad>", "<unk>"} == set(_text())


def test_every_token_after_a_trigger_copies_the_one_before_it():
    _, triggers = _law()
    x, labels = backcopy_batch(64, 64, step=3, seed=5)
    assert torch.equal(x, labels)
    copied = 0
    for row in x:
        s = _chars(row)
        assert s[0] == "<|endoftext|>" and s[1] not in triggers  # BOS, then no trigger (nothing before it to copy)
        assert "<|endoftext|>" not in s[1:] and "<pad>" not in s and "<unk>" not in s
        for t in range(2, len(s)):
            if s[t - 1] in triggers:
                assert s[t] == s[t - 2], (t, "".join(s[1:]))
                copied += 1
    assert copied > 500  # the rule was exercised


def test_other_transitions_follow_the_corpus_bigrams():
    follow, triggers = _law()
    x, _ = backcopy_batch(512, 64, step=0, seed=1)
    seen: dict[str, Counter] = {}
    for row in x:
        s = _chars(row)
        for a, b in zip(s[1:], s[2:]):
            if a not in triggers:
                seen.setdefault(a, Counter())[b] += 1
    checked = 0
    for a in sorted(seen, key=lambda c: -sum(seen[c].values()))[:6]:
        n, total = sum(seen[a].values()), sum(follow[a].values())
        assert set(seen[a]) <= set(follow[a]), a  # never a pair the corpus lacks
        for b, c in follow[a].items():
            p = c / total
            if p > 0.01:
                assert abs(seen[a][b] - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1, (a, b, seen[a][b], n * p)
                checked += 1
    assert checked > 30


def test_a_seed_gives_one_stream():
    a = backcopy_batch(8, 32, step=7, seed=2)[0]
    assert torch.equal(a, backcopy_batch(8, 32, step=7, seed=2)[0])
    assert not torch.equal(a, backcopy_batch(8, 32, step=7, seed=3)[0])
    assert not torch.equal(a, backcopy_batch(8, 32, step=8, seed=2)[0])
    held = backcopy_rows(8, 32, seed=2)
    assert torch.equal(held, backcopy_rows(8, 32, seed=2)) and not torch.equal(held, a)


def test_loss_floor_is_the_law_written_out():
    follow, triggers = _law()
    rows = backcopy_rows(16, 32)
    nll = []
    for row in rows:
        s = _chars(row)
        for t in range(1, len(s)):
            if s[t - 1] in triggers:
                nll.append(0.0)
            elif t == 1:  # after BOS: the unigram frequencies without the triggers
                uni = Counter(_text()[1:])
                nll.append(-math.log(uni[s[1]] / sum(v for k, v in uni.items() if k not in triggers)))
            else:
                nll.append(-math.log(follow[s[t - 1]][s[t]] / sum(follow[s[t - 1]].values())))
    assert loss_floor(rows) == pytest.approx(sum(nll) / len(nll), rel=1e-9)


def test_bad_config_is_refused():
    with pytest.raises(ValueError):
        BackcopyConfig(length=2)
    with pytest.raises(ValueError):
        BackcopyConfig(triggers=60)
    assert BackcopyConfig(steps=100, looks=3).look_steps == (0, 25, 50, 75)


def _hf_shares(folder, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer and head, from plain HF eager attention: Gu et al.'s alpha_1 (the attention on position 0 averaged
    over every query, query 0 included) averaged over rows, and the share of rows where it exceeds 0.3."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        att = hf(rows, output_attentions=True).attentions  # per layer [batch, head, query, key]
    alpha = torch.stack([a[..., :, 0].mean(-1) for a in att])  # [layer, batch, head]
    return alpha.mean(1), (alpha > 0.3).double().mean(1)


def _at(df: pd.DataFrame, step: int, metric: str) -> torch.Tensor:
    d = df[(df.step == step) & (df.metric == metric)].sort_values(["layer", "head"])
    return torch.tensor(d.value.to_numpy())


@pytest.mark.slow
def test_trained_control_has_a_sink_posprobe_and_hf_agree(tmp_path):
    from posprobe.analyses.sink_control import run_sink_control
    from posprobe.zoo.config import ZooConfig
    from posprobe.zoo.members import Widths, member
    from posprobe.zoo.train import build_model

    cfg = BackcopyConfig(members=("learned",), n_layers=1, steps=400, looks=0, eval_sequences=32, progress=False)
    result = run_sink_control(cfg, tmp_path / "zoo")
    heads, share = result.tables["sink_heads"], result.tables["sink_share"]
    rows = backcopy_rows(32, cfg.length)
    folder = tmp_path / "zoo" / "learned-s0"
    alpha, hf_share = _hf_shares(folder, rows)
    assert torch.allclose(_at(heads, 400, "first_attention"), alpha.flatten().double(), atol=1e-5)
    assert torch.equal(_at(heads, 400, "sink_rate"), hf_share.flatten())
    got = share[share.step == 400].sort_values("layer").value.to_numpy()
    assert got[0] == pytest.approx(float(hf_share[0].mean())) and got[0] >= 0.5  # a sink in layer 0, as Guo et al.
    # Guo et al.'s active-dormant head: non-trigger queries on BOS, trigger queries on the token they copy, and a
    # value-state drain on BOS.
    assert _at(heads, 400, "dormant_first_attention")[0] > 0.5 and _at(heads, 400, "active_previous_attention")[0] > 0.5
    assert _at(heads, 400, "first_value_norm_ratio")[0] < 0.5
    # Step 0: no sink, by posprobe's look inside the loop and by HF on the same untrained weights built anew.
    assert share[share.step == 0].value.max() == 0
    untrained = build_model(member("learned"), ZooConfig(members=("learned",), d_model=cfg.d_model, n_layers=1,
                                                         n_heads=1, progress=False), backcopy_tokenizer(), 0,
                            Widths(d_model=cfg.d_model, n_layers=1, n_heads=1, length=cfg.length,
                                   vocab_size=len(backcopy_vocab())))
    untrained.save_pretrained(tmp_path / "untrained")
    alpha0, share0 = _hf_shares(tmp_path / "untrained", rows)
    assert share0.max() == 0 and torch.allclose(_at(heads, 0, "first_attention"), alpha0.flatten().double(),
                                                atol=1e-5)
    assert set(result.tables["members"].loss) and result.meta["sink_share"]["learned-s0"][0] == got[0]
