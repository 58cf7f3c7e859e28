"""The zoo's numbers against their definitions written out here (plain torch, math and Hugging Face classes), each
test naming the one-line bug it was seen to catch: the learning-rate schedule, gradient clipping, the loss the loop
optimises, the batch order per seed, the initialisation, the sinusoidal member's embedding scale, and how `zoo eval`
combines seeds into a member's ratio."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from zoo_util import token_reads

from posprobe.zoo.config import ZooConfig
from posprobe.zoo.members import MEMBERS

TINY = dict(d_model=32, n_layers=2, n_heads=2, length=32, vocab_size=300, batch_size=4, checkpoint_every=100,
            progress=False)
NO_STATE = (lambda: None, lambda state: None)


@pytest.fixture(scope="module")
def text() -> str:
    from posprobe.data import builtin_corpus

    return builtin_corpus()


@pytest.fixture(scope="module")
def tok(text):
    from posprobe.zoo.tokenizer import train_tokenizer

    return train_tokenizer(text, TINY["vocab_size"])


@pytest.fixture(scope="module")
def ids(tok, text) -> torch.Tensor:
    return torch.tensor(tok(text[:20000])["input_ids"])


def _windows(ids: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    return torch.stack([ids[s:s + length] for s in starts])


def _plain_hf(folder: Path):
    # The saved folder read back by the class its config names (no posprobe loading code).
    import transformers

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(folder, attn_implementation="eager")


def _train(name: str, cfg: ZooConfig, ids, tok, folder: Path, *, seed: int = 0, batch=None) -> dict:
    from posprobe.zoo.job import Job
    from posprobe.zoo.train import text_windows, train_member

    batches = text_windows(ids, tok, cfg, seed) if batch is None else (lambda step: (batch, batch))
    return train_member(Job(name, seed, cfg, tok, batches, log_every=1), folder, NO_STATE)


def _next_token_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # Next-token cross-entropy written out: position t predicts token t + 1.
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


def test_lr_at_every_step_is_the_cosine_schedule_with_warmup(ids, tok, tmp_path):
    """The lr AdamW applies at each step (read from the optimiser just before it steps) equals transformers'
    `get_cosine_schedule_with_warmup` written out: lr * s / w during warmup, then lr * (1 + cos(pi * (s - w) /
    (T - w))) / 2, in both parameter groups.

    Catches: warmup ignored (lr at its peak or on the cosine from step 0); a linear instead of a cosine decay."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    cfg = ZooConfig(members=("rope",), **{**TINY, "steps": 12, "warmup": 4, "lr": 1e-2})
    seen = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: seen.append([g["lr"] for g in opt.param_groups]))
    try:
        _train("rope", cfg, ids, tok, tmp_path / "m")
    finally:
        handle.remove()
    T, w = cfg.steps, cfg.warmup
    want = [cfg.lr * (s / w if s < w else 0.5 * (1 + math.cos(math.pi * (s - w) / (T - w)))) for s in range(T)]
    assert len(seen) == T and all(len(g) == 2 for g in seen)
    for s, (got, expect) in enumerate(zip(seen, want)):
        assert all(math.isclose(v, expect, rel_tol=1e-12, abs_tol=1e-15) for v in got), (s, got, expect)


def _adamw_first_step(p: torch.Tensor, g: torch.Tensor, lr: float, wd: float) -> torch.Tensor:
    # torch's AdamW at its first step, bias corrections applied: m_hat = g, v_hat = g^2 (betas drop out).
    return p * (1 - lr * wd) - lr * g / (g.abs() + 1e-8)


def test_a_huge_gradient_is_clipped_to_the_configured_norm(ids, tok, tmp_path):
    """One step on a gradient whose norm is ~10^6 times the configured max-norm: every parameter moves exactly as
    AdamW's first step on the gradient scaled by max_norm / (norm + 1e-6) (clip_grad_norm_'s rule; norm computed
    here over every parameter), from the same starting weights and the loss written out by hand.

    Catches: gradient clipping removed; clipping at a hard-coded 1.0 instead of the configured max-norm.

    One torch thread, pinned here (#64): the loop's loss (HF's) and the one written out below reduce in different
    orders, and with several threads the order also follows the thread split; clipped to a norm of 1e-6, the norm
    layers' gradients sit below AdamW's eps (1e-8), where its first step lr g / (|g| + eps) carries g's rounding
    into the weights (2 threads: 1e-7 off on gpt_neox.layers.0.input_layernorm.weight)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _clipped_step_equals_adamw_on_the_clipped_gradient(ids, tok, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _clipped_step_equals_adamw_on_the_clipped_gradient(ids, tok, tmp_path) -> None:
    from posprobe.zoo.train import build_model

    cfg = ZooConfig(members=("rope",), **{**TINY, "steps": 1, "warmup": 0, "lr": 1e-2, "grad_clip": 1e-6})
    x = _windows(ids, [0, 500, 1000, 1500], cfg.length)
    _train("rope", cfg, ids, tok, tmp_path / "m", batch=x)
    got = dict(_plain_hf(tmp_path / "m").named_parameters())
    ref = build_model(MEMBERS["rope"], cfg, tok, seed=0)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    with torch.enable_grad():  # an earlier load in this process may have switched grad off globally
        _next_token_loss(ref(input_ids=x).logits, x).backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
    assert norm > 1e4 * cfg.grad_clip  # huge next to the max-norm: clipping must act
    scale = min(1.0, cfg.grad_clip / (norm + 1e-6))
    moved_otherwise = 0.0
    for n, p in before.items():
        wd = cfg.weight_decay if p.ndim >= 2 else 0.0
        want = _adamw_first_step(p, scale * grads[n], cfg.lr, wd)
        assert torch.allclose(got[n].detach(), want, rtol=0, atol=1e-7), n
        moved_otherwise = max(moved_otherwise, float((_adamw_first_step(p, grads[n], cfg.lr, wd) - want).abs().max()))
    assert moved_otherwise > 1e-3  # unclipped, the step would differ: the comparison is not vacuous


@pytest.mark.parametrize("name", ["t5", "rope-llama"])
def test_the_loss_the_loop_optimises_is_next_token_cross_entropy(name, ids, tok, tmp_path):
    """The loss logged (and back-propagated) at step 1 equals cross-entropy of logits[:, :-1] against ids[:, 1:]
    written out from the freshly built member's logits — for T5's class, which does not shift labels itself, and a
    class that does.

    Catches: the T5 member trained on unshifted labels (scoring token t from position t, a copy task); labels
    shifted twice for the classes that shift them."""
    from posprobe.zoo.train import build_model

    cfg = ZooConfig(members=(name,), **{**TINY, "steps": 1, "warmup": 0})
    x = _windows(ids, [0, 300, 600, 900], cfg.length)
    rec = _train(name, cfg, ids, tok, tmp_path / "m", batch=x)
    with torch.no_grad():
        want = float(_next_token_loss(build_model(MEMBERS[name], cfg, tok, seed=0)(input_ids=x).logits, x))
    assert rec["log"][0][0] == 1 and abs(rec["log"][0][1] - want) < 1e-5, (rec["log"][0], want)


def _training_reads(vocab_size: int, run) -> list[torch.Tensor]:
    with token_reads(vocab_size) as reads:
        run()
    return [x for training, x in reads if training]


def test_seeds_draw_different_batches_and_a_seed_repeats_its_own(ids, tok, tmp_path):
    """The token ids each training step feeds the model (observed at its embedding): windows of the text, the same
    for the same seed in two runs, different at every step for another seed; likewise for the task zoo's rows.

    Catches: every seed sharing seed 0's batch order, in the text loop and (separately) in the task zoo."""
    from posprobe.zoo.config import TaskConfig
    from posprobe.zoo.task_zoo import train_task_zoo
    from posprobe.zoo.tasks import task_tokenizer

    cfg = ZooConfig(members=("rope",), **{**TINY, "steps": 3, "warmup": 0})
    runs = {(seed, k): _training_reads(cfg.vocab_size, lambda s=seed, k=k: _train(
        "rope", cfg, ids, tok, tmp_path / f"t{s}{k}", seed=s)) for seed, k in ((0, "a"), (0, "b"), (1, "a"))}
    text_windows = ids.unfold(0, cfg.length, 1)
    for x in runs[(0, "a")] + runs[(1, "a")]:
        assert all(bool((text_windows == row).all(1).any()) for row in x)  # each row a window of the text
    assert all(torch.equal(a, b) for a, b in zip(runs[(0, "a")], runs[(0, "b")], strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(runs[(0, "a")], runs[(1, "a")], strict=True))

    tasks = TaskConfig(tasks=("copy",), train_max=3, test_factor=1, test_count=2, steps=3, batch_size=4)
    vocab = len(task_tokenizer().get_vocab())
    both = _training_reads(vocab, lambda: train_task_zoo(ZooConfig(**{**TINY, "members": ("rope",), "seeds": (0, 1)}),
                                                         tasks, tmp_path / "tz01"))
    alone = _training_reads(vocab, lambda: train_task_zoo(ZooConfig(**{**TINY, "members": ("rope",), "seeds": (0,)}),
                                                          tasks, tmp_path / "tz0"))
    assert len(both) == 6 and len(alone) == 3  # seed 0's three steps, then seed 1's
    assert all(torch.equal(a, b) for a, b in zip(both[:3], alone, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(both[:3], both[3:], strict=True))


@pytest.mark.parametrize("name", list(MEMBERS))
def test_every_table_and_matrix_starts_at_the_documented_init(name, tok):
    """Each matrix and table of every member, one by one (position table, T5's bucket-bias table, embeddings,
    projections): mean ~0 and std 0.02 within 4 standard errors of a sample of its size; biases 0; norm scales 1.

    Catches: one member's table initialised at half the std (GPT-2's position table; T5's bias table); HF's own
    init left in place for GPT-2's residual projections (c_proj, shrunk by HF)."""
    from posprobe.zoo.train import build_model

    model = build_model(MEMBERS[name], ZooConfig(**TINY), tok, seed=0)
    for pname, p in model.named_parameters():
        v = p.detach().double().flatten()
        if p.ndim >= 2:
            n = v.numel()
            assert abs(float(v.mean())) < 4 * 0.02 / math.sqrt(n), (name, pname)
            assert abs(float(v.std()) / 0.02 - 1) < 4 / math.sqrt(2 * n), (name, pname, float(v.std()))
        elif pname.endswith("bias"):
            assert torch.all(v == 0), (name, pname)
        else:
            assert torch.all(v == 1), (name, pname)


def test_the_sinusoidal_member_scales_its_token_embeddings_by_sqrt_d(tok):
    """What enters XGLM's first block equals sqrt(d_model) x the token embedding plus the sinusoid table written out
    (tensor2tensor's layout: sin of the first d/2 frequencies, then cos; positions start at 2, XGLM's offset).

    Catches: the embedding scale off (scale_embedding=False in the member's config)."""
    from posprobe.zoo.train import build_model

    cfg = ZooConfig(**TINY)
    model = build_model(MEMBERS["sinusoidal"], cfg, tok, seed=0).eval()
    x = torch.randint(2, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    seen = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=x)
    finally:
        handle.remove()
    d, half = cfg.d_model, cfg.d_model // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000) / (half - 1)))
    angle = torch.arange(2, 2 + x.shape[1], dtype=torch.float64)[:, None] * freq[None]
    table = torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)
    emb = model.get_input_embeddings().weight.detach().double()
    want = math.sqrt(d) * emb[x] + table[None]
    assert torch.allclose(seen[0].double(), want, atol=1e-5)


# ---- zoo eval: seeds combined into a member's ratio ----

@pytest.fixture(scope="module")
def two_seed_eval(text, tmp_path_factory):
    from posprobe.analyses.atlas_many import evaluate_zoo
    from posprobe.analyses.configs import ExtrapolationConfig
    from posprobe.zoo.run import train_zoo

    out = tmp_path_factory.mktemp("zoo2") / "zoo"
    cfg = ZooConfig(**{**TINY, "members": ("rope", "learned"), "seeds": (0, 1), "length": 16, "steps": 10,
                       "warmup": 1})
    train_zoo(cfg, text, out)
    return evaluate_zoo([str(out)], ExtrapolationConfig(factors=(1, 2, 4), max_tokens=64, stride=8, progress=False))


def test_a_members_ratio_is_the_mean_over_seeds_of_each_seeds_ratio(two_seed_eval):
    """`zoo eval`'s ratio per member, protocol and factor: the mean over seeds of exp(nll(xL) - nll(L)), each seed's
    from its own perplexity rows, with the lowest and highest seed — computed here from the per-seed nll rows —
    and the printed table shows that mean with the seeds' range.

    Catches: the first seed only; the lowest and highest seed swapped."""
    from posprobe.report.extrapolation import ratio_table

    ppl, ratios = two_seed_eval.tables["perplexity"], two_seed_eval.tables["ratios"]
    per_seed: dict = {}
    for model, rows in ppl[ppl.status == "ok"].groupby("model"):
        for protocol, part in rows.groupby("protocol"):
            nll = dict(zip(part.length, part.nll))
            L = min(nll)
            for length, v in nll.items():
                key = (rows.member.iloc[0], protocol, length / L)
                per_seed.setdefault(key, {})[int(rows.seed.iloc[0])] = math.exp(v - nll[L])
    got = ratios.set_index(["member", "protocol", "factor"])
    printed = ratio_table(two_seed_eval).set_index("member")
    for (member, protocol, factor), seeds in per_seed.items():
        assert sorted(seeds) == [0, 1], (member, protocol, factor)
        row = got.loc[(member, protocol, factor)]
        mean, low, high = sum(seeds.values()) / 2, min(seeds.values()), max(seeds.values())
        assert math.isclose(row.ppl_ratio, mean, rel_tol=1e-9) and row.n_seeds == 2
        assert math.isclose(row.ratio_low, low, rel_tol=1e-9) and math.isclose(row.ratio_high, high, rel_tol=1e-9)
        if factor > 1:
            assert printed.loc[member, f"{protocol} {factor:g}L"] == f"{mean:.2f} [{low:.2f}–{high:.2f}]"
    # the seeds differ, so "first seed only" or a mean of perplexities cannot pass unseen
    assert abs(per_seed[("rope", "chunks", 4.0)][0] - per_seed[("rope", "chunks", 4.0)][1]) > 1e-4
    assert (got.loc[("learned", "chunks", 2.0), "status"] == "cannot run"
            and printed.loc["learned", "chunks 2L"] == "cannot run")
