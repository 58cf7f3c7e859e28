"""Per-token log-probabilities of token sequences at chosen position ids, fast and exact.

Two backends compute the same numbers: `HFScorer` passes `position_ids` straight to a Hugging Face
model (no hooks, the fast path), `TLScorer` drives a TransformerLens model through posprobe's
position control. Sequences are sorted by length, right-padded (harmless for causal models: pads
sit after every scored token) and the vocabulary projection is applied only to real tokens.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from jaxtyping import Float
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Positioned:
    """Token ids and the position id of each token (same length)."""

    ids: tuple[int, ...]
    positions: tuple[int, ...]


def _length_batches(items: Sequence[Positioned], batch_size: int) -> Iterator[list[int]]:
    # Longest first: the first batch shows the peak memory at once, and padding stays minimal.
    order = sorted(range(len(items)), key=lambda i: (-len(items[i].ids), items[i].positions[:1]))
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) == batch_size or items[batch[0]].positions[:1] != items[i].positions[:1]):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _pad(items: Sequence[Positioned], idx: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(len(items[i].ids) for i in idx)
    ids = torch.full((len(idx), n), pad_id, dtype=torch.long)
    pos = torch.zeros((len(idx), n), dtype=torch.long)
    real = torch.zeros((len(idx), n), dtype=torch.bool)
    for r, i in enumerate(idx):
        m = len(items[i].ids)
        ids[r, :m] = torch.tensor(items[i].ids)
        pos[r, :m] = torch.tensor(items[i].positions)
        # Pads continue the row's positions so the position id stays within a valid range.
        if n > m:
            pos[r, m:] = pos[r, m - 1] + 1 + torch.arange(n - m) if m else torch.arange(n - m)
        real[r, :m] = True
    return ids, pos, real


class _Scorer:
    """Shared batching logic; subclasses implement `_hidden_and_head`."""

    pad_id: int = 0

    def _hidden_and_head(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        raise NotImplementedError

    @torch.inference_mode()
    def token_logprobs(self, items: Sequence[Positioned], *, batch_size: int = 32, progress: bool = False,
                       desc: str = "scoring") -> list[Float[torch.Tensor, "pos_minus_1"]]:
        """For each sequence, log p(token t+1 | tokens <= t) in nats for t = 0..len-2 (float64 tensors)."""
        if not items:
            raise ValueError("Empty input: nothing to score")
        out: list[torch.Tensor | None] = [None] * len(items)
        batches = list(_length_batches(items, batch_size))
        for idx in tqdm(batches, desc=desc, unit="batch", disable=not progress):
            ids, pos, real = _pad(items, idx, self.pad_id)
            hidden, head = self._hidden_and_head(ids.to(self.device), pos.to(self.device))
            scored = real[:, 1:].to(hidden.device)  # predict token t+1 from position t
            h = hidden[:, :-1][scored]
            logits = head(h).float()
            targets = ids[:, 1:].to(hidden.device)[scored]
            lp = (logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, -1)).double().cpu()
            lengths = real[:, 1:].sum(1).tolist()
            for i, chunk in zip(idx, torch.split(lp, lengths)):
                out[i] = chunk
        return out  # type: ignore[return-value]


class HFScorer(_Scorer):
    """Hugging Face causal LM; position ids passed natively (GPT-2, Llama, Gemma, Qwen, ...)."""

    def __init__(self, model: Any, tokenizer: Any):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.head = model.get_output_embeddings()
        self.softcap = getattr(model.config, "final_logit_softcapping", None)

    def _hidden_and_head(self, ids: torch.Tensor, pos: torch.Tensor):
        hidden = self.model.base_model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state

        def head(h: torch.Tensor) -> torch.Tensor:
            logits = self.head(h)
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return logits

        return hidden, head


class TLScorer(_Scorer):
    """TransformerLens model; positions applied with posprobe's learned / RoPE position control."""

    def __init__(self, model: Any):
        from posprobe.facts import model_facts

        self.model = model
        self.device = model.cfg.device
        self.facts = model_facts(model)
        tok = model.tokenizer
        self.pad_id = (tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0)
        if self.facts.positional_kind not in ("learned_absolute", "rotary"):
            raise NotImplementedError(f"Scoring at chosen positions needs learned or rotary positions, not {self.facts.positional_kind}")

    def _position_context(self, pos: torch.Tensor):
        from posprobe.positions import PositionPlan, learned_positions, rope_positions

        default = torch.arange(pos.shape[1], device=pos.device)[None].expand_as(pos)
        if torch.equal(pos, default):
            return nullcontext()  # unshifted: leave the model untouched
        if self.facts.positional_kind == "learned_absolute":
            return learned_positions(self.model, pos)
        p = pos.to(torch.float64)
        return rope_positions(self.model, PositionPlan(p, p.clone(), label="scoring"))

    def _hidden_and_head(self, ids: torch.Tensor, pos: torch.Tensor):
        with self._position_context(pos):
            # Stopping after the last block returns the residual stream, so the vocabulary
            # projection can be applied to real tokens only.
            resid = self.model(ids, stop_at_layer=self.model.cfg.n_layers)
        final = self.model.ln_final(resid)
        cap = getattr(self.model.cfg, "output_logits_soft_cap", -1.0)

        def head(h: torch.Tensor) -> torch.Tensor:
            logits = self.model.unembed(h[:, None, :])[:, 0]
            return torch.tanh(logits / cap) * cap if cap and cap > 0 else logits

        return final, head
