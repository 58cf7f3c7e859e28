"""Generation and scoring of a decoder under a position plan (own loop over TL's KV cache).

A PositionPlan covers the prompt exactly; new tokens get positions from `plan.extended(total)`. A callable
`plan(n) -> PositionPlan` can be given instead for presets whose per-query views must cover the new tokens too
(Self-Extend, ReRoPE, StreamingLLM).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from jaxtyping import Float, Int

from posprobe.backend.model import context_length, device_of, forward, forward_cached, new_kv_cache
from posprobe.core.positions import PositionError, PositionPlan
from posprobe.core.surgery import apply_plan

PlanLike = Union[PositionPlan, Callable[[int], PositionPlan], None]


def plan_for(plan: PlanLike, n: int, *, given: int | None = None) -> PositionPlan | None:
    """The plan for `n` tokens: `plan(n)` for a builder; a PositionPlan must cover exactly the `given`
    tokens (default n) and is then extended to n with `plan.extended(n)`. None stays None."""
    if plan is None:
        return None
    if isinstance(plan, PositionPlan):
        given = n if given is None else given
        if len(plan) != given:
            raise PositionError(f"The position plan covers {len(plan)} tokens but the sequence has {given}")
        return plan.extended(n)
    out = plan(n)
    if len(out) != n:
        raise PositionError(f"The plan builder made a plan of {len(out)} tokens for a sequence of {n}")
    return out


def _context(model: Any, plan: PositionPlan | None):
    return nullcontext() if plan is None else apply_plan(model, plan)


def _as_batch(tokens: torch.Tensor) -> torch.Tensor:
    tokens = torch.as_tensor(tokens)
    return tokens[None] if tokens.dim() == 1 else tokens


def logits_under(model: Any, tokens: Int[torch.Tensor, "batch pos"], plan: PlanLike = None
                 ) -> Float[torch.Tensor, "batch pos d_vocab"]:
    """Logits of one full forward (no cache) with the plan applied (None: unmodified model)."""
    tokens = _as_batch(tokens)
    p = plan_for(plan, tokens.shape[-1])
    with _context(model, p):
        return forward(model, tokens)


def token_logprobs(logits: Float[torch.Tensor, "batch pos d_vocab"], tokens: Int[torch.Tensor, "batch pos"]
                   ) -> Float[torch.Tensor, "batch pos_minus_1"]:
    """log p(token t+1 | tokens <= t) in nats, for t = 0..pos-2."""
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return lp.gather(-1, tokens[:, 1:, None].to(lp.device))[..., 0]


def continuation_logprob(model: Any, prefix: Int[torch.Tensor, " pos"], continuation: Int[torch.Tensor, " pos"],
                         plan: PlanLike = None) -> Float[torch.Tensor, " pos"]:
    """log p (nats) of each continuation token given the prefix and the earlier continuation tokens.

    A PositionPlan must cover the prefix; the continuation continues it (`plan.extended`)."""
    prefix, continuation = torch.as_tensor(prefix).flatten(), torch.as_tensor(continuation).flatten()
    if continuation.numel() == 0:
        raise ValueError("empty continuation")
    seq = torch.cat([prefix, continuation])[None]
    # A PositionPlan describes the prefix; the continuation is placed as generation would place it.
    lp = token_logprobs(logits_under(model, seq, plan_for(plan, seq.shape[1], given=prefix.numel())), seq)
    return lp[0, prefix.numel() - 1:]


@dataclass(frozen=True)
class Generation:
    """Tokens [batch, prompt + new], the new tokens, and the logits each new token was chosen from."""

    tokens: Int[torch.Tensor, "batch pos"]
    new_tokens: Int[torch.Tensor, "batch new"]
    step_logits: Float[torch.Tensor, "batch new d_vocab"]
    plan: PositionPlan | None


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    # Sampled on the logits' device with a generator living there (a CPU copy of the softmax per token
    # was a device sync per token). On the CPU this is the same generator and the same draws as before.
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[..., 0]


@torch.no_grad()
def generate(model: Any, tokens: Int[torch.Tensor, "batch pos"], *, max_new_tokens: int, plan: PlanLike = None,
             temperature: float = 0.0, top_k: int | None = None, seed: int = 0, use_cache: bool = True,
             stop_token: int | None = None) -> Generation:
    """Greedy (temperature 0) or sampled (temperature, top-k, seeded) continuation under a plan.

    Args:
        model: a TransformerLens causal LM.
        tokens: the prompt's token ids, `[batch, pos]` (a single row may be given as `[pos]`); prompt +
            max_new_tokens must fit the model's context (else PositionError).
        max_new_tokens: the number of tokens to generate (>= 1).
        plan: the positions: a PositionPlan covering exactly the prompt (the new tokens continue after it,
            `plan.extended`), a builder `plan(n)` giving the plan for n tokens, or None (unmodified model).
        temperature: 0 (the default) picks the argmax; above 0 samples from softmax(logits / temperature).
        top_k: when sampling, draw only among the `top_k` most likely tokens (None: all).
        seed: the seed of the sampling generator (unused when greedy).
        use_cache: one forward over the prompt fills TL's KV cache and each new token is one single-token
            forward; the plan is extended to prompt + max_new_tokens before the first forward. False: a full
            forward over the sequence for every new token.
        stop_token: stop early once every row has produced this token (rows already stopped keep emitting
            it); None: always generate max_new_tokens.

    Returns:
        A Generation: `tokens` (`[batch, prompt + new]`), `new_tokens`, `step_logits` (`[batch, new, d_vocab]`,
            the logits each new token was chosen from) and the `plan` used (extended to the full length; None
            without one).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    tokens = _as_batch(tokens).to(device_of(model))
    batch, n = tokens.shape
    total = n + max_new_tokens
    if total > context_length(model):
        raise PositionError(
            f"prompt ({n}) + max_new_tokens ({max_new_tokens}) = {total} exceeds n_ctx {context_length(model)}"
        )
    # A PositionPlan describes the prompt; the new tokens continue after it.
    p = plan_for(plan, total, given=n)
    # Greedy decoding draws nothing: a generator only where sampling needs one, on the tokens' device.
    gen = torch.Generator(device=tokens.device).manual_seed(seed) if temperature > 0 else None
    seq, steps = tokens, []
    done = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    with _context(model, p):
        cache = new_kv_cache(model, batch) if use_cache else None
        feed = tokens
        for _ in range(max_new_tokens):
            logits = forward_cached(model, feed, cache)[:, -1] if use_cache else forward(model, seq)[:, -1]
            nxt = _pick(logits, temperature, top_k, gen)
            if stop_token is not None:
                nxt = torch.where(done, torch.full_like(nxt, stop_token), nxt)
                done |= nxt == stop_token
            steps.append(logits.detach())
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            feed = nxt[:, None]
            if stop_token is not None and bool(done.all()):
                break
    return Generation(seq, seq[:, n:], torch.stack(steps, dim=1), p)
