"""The key-squish variants, each against an implementation that shares no code with posprobe's:

- "qk" (the instruction's queries and keys at the squished position): plain Hugging Face forward with
  `position_ids` set to that position on the instruction's tokens and the condition's positions elsewhere;
- "keys" (the instruction's keys squished for every query, its queries at their own positions): the same HF
  forward with its rotary function replaced by one written here, rotating queries at `position_ids` and keys at
  positions computed by hand.

Both through `decode_batch` (the study's generator: logits, greedy tokens, reference log-probs) and through
`run_squish_study` (the condition's name reaching the right plan). The old name `global` is refused everywhere.

Tolerances: float32 log-probs to 1e-4 (the reference rotates in its own order and runs without a KV cache); greedy
token ids exactly."""

from __future__ import annotations

import pytest
import torch

from posprobe.analyses import squish_study as S
from posprobe.analyses.configs import SquishConfig, SquishStudyConfig
from posprobe.core.batch_decode import decode_batch
from posprobe.core.surgery import key_squish
from posprobe.data.instructions import builtin_instructions
from posprobe.data.questions import Question

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
THETA = 1e5


@pytest.fixture(scope="module")
def tiny():
    """A seeded tiny Llama (rotary, GQA, biases and norm weights drawn at random) over bytes, with a chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posprobe.backend.tiny import byte_tokenizer, randomize_

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=259, max_position_embeddings=4096, bos_token_id=256,
                      eos_token_id=257, pad_token_id=258, attention_bias=True, rope_theta=THETA,
                      initializer_range=0.8 / 32**0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        model = LlamaForCausalLM(cfg).eval()
    randomize_(model, 11)
    assert sum(p.numel() for p in model.parameters()) < 40_000  # tiny: the test runs in seconds
    tok = byte_tokenizer()
    tok.chat_template = TEMPLATE
    model.posprobe_name = "tiny-variants"
    return model, tok


def _positions(n: int, span: tuple[int, int], moved: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions, key positions) of n tokens under the condition "instruction at 0, later tokens moved out
    by `moved`", written out: before the span i; the span 0; after it i + moved. Keys = queries here; the "keys"
    variant's queries of the span are overwritten by the caller."""
    a, b = span
    pos = torch.arange(n, dtype=torch.long)
    pos[b:] += int(moved)
    pos[a:b] = 0
    return pos.clone(), pos


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class _HandRotatedKeys:
    """Replaces modeling_llama.apply_rotary_pos_emb: queries rotated as HF does (cos/sin of `position_ids`), keys
    rotated here at `self.k_pos` from the rotary formula theta_j = THETA ** (-2j / d), in float64 (k_pos None: keys
    rotated as the queries, i.e. plain HF)."""

    def __init__(self, head_dim: int):
        self.inv = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.k_pos: torch.Tensor | None = None

    def __call__(self, q, k, cos, sin, unsqueeze_dim=1):
        q_rot = q * cos.unsqueeze(unsqueeze_dim) + _rotate_half(q) * sin.unsqueeze(unsqueeze_dim)
        if self.k_pos is None:
            return q_rot, k * cos.unsqueeze(unsqueeze_dim) + _rotate_half(k) * sin.unsqueeze(unsqueeze_dim)
        ang = self.k_pos.to(torch.float64)[:, None] * self.inv[None]
        emb = torch.cat([ang, ang], dim=-1)
        k_rot = k * emb.cos().to(k.dtype) + _rotate_half(k) * emb.sin().to(k.dtype)
        return q_rot, k_rot


def _reference(model, ids: torch.Tensor, span: tuple[int, int], moved: float, variant: str, new: int,
               hand: _HandRotatedKeys | None = None) -> tuple[torch.Tensor, list[int]]:
    """(log-softmax of the last prompt token's logits, `new` greedy tokens) from full HF forwards without a cache:
    "qk" with position_ids (span at 0), "keys" with position_ids (span queries at their own i) and keys at 0 by
    hand. New tokens continue after the last prompt token, q = k."""
    ids = ids.clone()
    q_pos, k_pos = _positions(ids.numel(), span, moved)
    if variant == "keys":
        q_pos[span[0]:span[1]] = torch.arange(span[0], span[1])
    first, out = None, []
    for _ in range(new):
        if hand is not None:
            hand.k_pos = k_pos if variant == "keys" else None
        logits = model(ids[None], position_ids=q_pos[None]).logits[0, -1].float()
        if first is None:
            first = torch.log_softmax(logits, -1)
        t = int(logits.argmax())
        out.append(t)
        ids = torch.cat([ids, torch.tensor([t])])
        q_pos = torch.cat([q_pos, q_pos[-1:] + 1])
        k_pos = torch.cat([k_pos, q_pos[-1:]])
    return first, out


def _hand_keys(monkeypatch, model) -> _HandRotatedKeys:
    from transformers.models.llama import modeling_llama

    hand = _HandRotatedKeys(model.config.hidden_size // model.config.num_attention_heads)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", hand)
    return hand


@pytest.mark.parametrize("variant", ["qk", "keys"])
@pytest.mark.parametrize("moved", [0.0, 40.0])
@torch.no_grad()
def test_decode_batch_equals_independent_reference(tiny, monkeypatch, variant, moved):
    """Catches: the variants swapped (qk built as keys-only or the reverse), the span's queries left at i under qk,
    the span's own queries not seeing squished keys under keys (the cache view), a moved start ignored."""
    model, _ = tiny
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(5, 250, (12,), generator=g)
    rests = [torch.randint(5, 250, (n,), generator=g) for n in (3, 6, 2)]
    refs = [torch.randint(5, 250, (n,), generator=g) for n in (2, 4, 3)]
    span = (3, 8)
    plan = key_squish(prefix.numel(), span, to=0.0, variant=variant, query_start=span[1] + moved)
    got = decode_batch(model, prefix, rests, plan=plan, max_new_tokens=5, references=refs, batch_size=2)
    hand = _hand_keys(monkeypatch, model) if variant == "keys" else None
    for i, (rest, ref) in enumerate(zip(rests, refs)):
        ids = torch.cat([prefix, rest])
        first, toks = _reference(model, ids, span, moved, variant, 5, hand)
        torch.testing.assert_close(got.first_logprobs[i], first, atol=1e-4, rtol=0)
        assert got.tokens[i] == toks
        # The reference answer's log-probs, teacher-forced: the same positions over prompt + reference.
        full = torch.cat([ids, ref])
        q_pos, k_pos = _positions(full.numel(), span, moved)
        if variant == "keys":
            q_pos[span[0]:span[1]] = torch.arange(span[0], span[1])
            hand.k_pos = k_pos
        lp = torch.log_softmax(model(full[None], position_ids=q_pos[None]).logits[0].float(), -1)
        want = lp[ids.numel() - 1:-1].gather(-1, ref[:, None])[:, 0]
        torch.testing.assert_close(got.reference_logprobs[i], want, atol=1e-4, rtol=0)


@torch.no_grad()
def test_variants_differ(tiny):
    """Not vacuous: on this model cache, keys and qk give different first-token distributions (so the reference
    tests above could tell a swapped variant)."""
    model, _ = tiny
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(5, 250, (12,), generator=g)
    rests = [torch.randint(5, 250, (4,), generator=g)]
    lp = {v: decode_batch(model, prefix, rests, plan=key_squish(12, (3, 8), variant=v), max_new_tokens=1
                          ).first_logprobs[0] for v in ("cache", "keys", "qk")}
    for a, b in (("cache", "keys"), ("keys", "qk"), ("cache", "qk")):
        assert (lp[a] - lp[b]).abs().max() > 1e-2, (a, b)


@torch.no_grad()
def test_study_conditions_equal_independent_reference(tiny, monkeypatch):
    """The study's condition names reach the plan they name: answers of `squish:0:qk`, `moved:30:qk` and
    `squish:0:keys` equal the HF references above on each rendered prompt (both placements, 0 and 1 filler turns).
    Catches: a condition parsed to the wrong variant, the moved distance dropped."""
    model, tok = tiny
    questions = [Question("Why is the sea salty?", "Salt."), Question("What do bees make?", "Honey.")]
    conds = {"squish:0:qk": ("qk", 0.0), "moved:30:qk": ("qk", 30.0), "squish:0:keys": ("keys", 0.0)}
    cfg = SquishStudyConfig(instructions=("french",), questions=2, placements=("system", "user"), distances=(0, 1),
                            max_new_tokens=4, progress=False, conditions=("normal", *conds))
    answers = S.run_squish_study(model, cfg, tokenizer=tok, questions=questions).tables["squish_answers"]
    inst = builtin_instructions(["french"])[0]
    hand = _hand_keys(monkeypatch, model)
    checked = 0
    for row in answers[answers.condition.isin(list(conds))].itertuples():
        variant, moved = conds[row.condition]
        p = S.render_study_prompt(tok, row.placement, row.distance, inst.text, questions[row.question].text)
        _, want = _reference(model, torch.tensor(p.tokens), p.span, moved, variant, 4, hand)
        if tok.eos_token_id in want:
            want = want[:want.index(tok.eos_token_id) + 1]
        assert row.answer == tok.decode(want, skip_special_tokens=True), (row.condition, row.placement)
        checked += 1
    assert checked == 3 * 2 * 2 * 2


def test_old_global_name_refused_naming_both_new_ones():
    """`global` meant keys-only while reading as "the instruction at position 0": refused, never silently mapped."""
    for bad in ("squish:0:global", "moved:120:global", "range:0:4:global"):
        with pytest.raises(ValueError, match="'keys'.*'qk'") as e:
            SquishStudyConfig(conditions=("normal", bad))
        stem = bad.rsplit(":", 1)[0]
        assert f"{stem}:keys" in str(e.value) and f"{stem}:qk" in str(e.value)
    with pytest.raises(ValueError, match="'global' was renamed"):
        key_squish(6, (1, 3), variant="global")
    with pytest.raises(ValueError, match="'global' was renamed"):
        SquishConfig(variant="global")
    assert [SquishStudyConfig(conditions=("normal", c)).conditions[1] for c in ("squish:0:keys", "squish:0:qk")]


def test_plans_by_hand():
    """The three variants' positions, written out: span (1, 3) of 6 tokens squished to 0, later tokens from 10."""
    cache = key_squish(6, (1, 3), to=0.0, query_start=10.0, variant="cache")
    keys = key_squish(6, (1, 3), to=0.0, query_start=10.0, variant="keys")
    qk = key_squish(6, (1, 3), to=0.0, query_start=10.0, variant="qk")
    later = [0, 0, 0, 10, 11, 12]
    assert keys.k_pos.tolist() == cache.k_pos.tolist() == qk.k_pos.tolist() == later
    assert keys.q_pos.tolist() == cache.q_pos.tolist() == [0, 1, 2, 10, 11, 12]
    assert qk.q_pos.tolist() == later
    assert len(cache.views) == 1 and keys.views == () and qk.views == ()
    assert qk.label == "squish-qk:to 0" and keys.label == "squish-keys:to 0"


def test_surgery_eval_names_a_whole_sequence_preset_for_what_it_moves():
    """surgery-eval's variant column said "global" for presets that move every query and key, the squish variants'
    old, refused name; it says "every-position" (planted back: fails)."""
    from posprobe import load_model
    from posprobe.analyses.squish import loss_by_position

    t = loss_by_position(load_model("tiny-rope"), [list(range(3, 19))], ["none", "pi:scale=2"])
    assert set(t.variant) == {"every-position"} and set(t.preset) == {"none", "pi:scale=2"}
