"""Per-token log-probabilities of token sequences at chosen position ids, fast and exact.

Two backends compute the same numbers: `HFScorer` passes `position_ids` straight to a Hugging Face
model (no hooks, the fast path), `TLScorer` drives a TransformerLens model through posprobe's
position control. Sequences are sorted by length, right-padded (harmless for causal models: pads
sit after every scored token) and the vocabulary projection is applied only to the rows that
predict a scored token.

`pair_logprobs` scores minimal pairs: the two sentences of a pair share their first tokens, and so do
many sentences across pairs (BLiMP's "The", "Who did ..."; the shift test's prefix). `HFScorer` packs
the distinct sequences into rows of a prefix tree (a trie, in lexicographic order of (id, position)):
each distinct prefix is one token of a row, and a custom attention mask lets every token see exactly its
own path (its ancestors and itself). Each shared token is computed, and projected to the vocabulary,
once; on 400 BLiMP pairs that is 5,301 tokens where the sentences hold 8,043 (pairs alone: 6,271).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch
from jaxtyping import Float
from tqdm.auto import tqdm

from posprobe.backend import hf
from posprobe.backend.families import control as position_control
from posprobe.backend.families import find as find_family
from posprobe.backend.model import device_of, dtype_of, forward, n_layers, residual_to_logits, tokenizer_of


@dataclass(frozen=True)
class Positioned:
    """Token ids and the position id of each token (same length)."""

    ids: tuple[int, ...]
    positions: tuple[int, ...]


@dataclass
class _Row:
    """One row of a batch: a single sequence, or several packed as a prefix tree (`tree`)."""

    ids: list[int]
    pos: list[int]
    members: list[tuple[int, list[int]]]  # (output index, row index of each of its tokens: its path)
    tree: bool = False  # needs the path mask; a single sequence is plain causal


def shared_prefix(a: Positioned, b: Positioned) -> int:
    """Number of leading tokens with equal id and position."""
    n = 0
    for x, y, px, py in zip(a.ids, b.ids, a.positions, b.positions):
        if x != y or px != py:
            break
        n += 1
    return n


def _single(i: int, item: Positioned) -> _Row:
    return _Row(list(item.ids), list(item.positions), [(i, list(range(len(item.ids))))])


def _trie_rows(items: Sequence[tuple[int, Positioned]], budget: int) -> list[_Row]:
    """Distinct sequences packed into prefix-tree rows of at most `budget` tokens (a longer sequence gets a row
    of its own). In lexicographic order the longest prefix a sequence shares with any earlier one is the one it
    shares with its predecessor, so each sequence adds only the tokens after that prefix."""
    order = sorted(items, key=lambda t: tuple(zip(t[1].ids, t[1].positions)))
    rows: list[_Row] = []
    row, prev, prev_path = None, None, []
    for o, it in order:
        p = shared_prefix(prev, it) if row is not None else 0
        if row is not None and len(row.ids) + len(it.ids) - p > budget:
            row, p = None, 0
        if row is None:
            row = _Row([], [], [], tree=True)
            rows.append(row)
        path = prev_path[:p] + list(range(len(row.ids), len(row.ids) + len(it.ids) - p))
        row.ids += it.ids[p:]
        row.pos += it.positions[p:]
        row.members.append((o, path))
        prev, prev_path = it, path
    for r in rows:  # a row that packed one sequence needs no tree mask
        r.tree = len(r.members) > 1
    return rows


def _length_batches(rows: Sequence[_Row], batch_size: int) -> Iterator[list[int]]:
    # Longest first: the first batch shows the peak memory at once, and padding stays minimal. A batch
    # holds one start position, so an unshifted batch stays unshifted (TL then runs without hooks), and tree
    # rows (custom mask) apart from plain ones (HF's own mask: a sliding window stays HF's). `batch_size` counts
    # sequences: a tree row holds several.
    order = sorted(range(len(rows)), key=lambda i: (rows[i].tree, rows[i].pos[0], -len(rows[i].ids)))
    batch: list[int] = []
    held = 0
    for i in order:
        n = len(rows[i].members)
        if batch and (held + n > batch_size or (rows[batch[0]].tree, rows[batch[0]].pos[0])
                      != (rows[i].tree, rows[i].pos[0])):
            yield batch
            batch, held = [], 0
        batch.append(i)
        held += n
    if batch:
        yield batch


def _pad(rows: Sequence[_Row], idx: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    n = max(len(rows[i].ids) for i in idx)
    ids = torch.full((len(idx), n), pad_id, dtype=torch.long)
    pos = torch.zeros((len(idx), n), dtype=torch.long)
    lengths = []
    for r, i in enumerate(idx):
        m = len(rows[i].ids)
        ids[r, :m] = torch.tensor(rows[i].ids)
        pos[r, :m] = torch.tensor(rows[i].pos)
        # Pads of a plain row continue its positions (valid: the batch's rows share their start and the longest
        # reaches as far; an unshifted batch stays arange, so TL runs without hooks). A tree row is longer than its
        # positions reach, so its pads repeat its last position (continuing ran off a learned member's table).
        if n > m:
            pos[r, m:] = rows[i].pos[-1] if rows[i].tree else max(rows[i].pos) + 1 + torch.arange(n - m)
        lengths.append(m)
    return ids, pos, lengths


def _tree_mask(rows: Sequence[_Row], idx: list[int], n: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [batch, 1, query_pos, key_pos] mask: each token of a tree row sees its own path (its ancestors and
    itself), a plain row is causal, a pad sees what precedes it (never an empty row of the softmax)."""
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None].repeat(len(idx), 1, 1)
    for r, i in enumerate(idx):
        row = rows[i]
        if not row.tree:
            continue
        m = len(row.ids)
        allowed[r, :m, :m] = False
        for _, path in row.members:
            t = torch.tensor(path)
            allowed[r, t[:, None], t[None, :]] |= torch.ones(len(path), len(path), dtype=torch.bool).tril()
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


#: Tokens per prefix-tree row: several short sentences share one row (their common prefixes once); a longer
#: sequence gets a row of its own length.
ROW_TOKENS = 64


class _Scorer:
    """Shared batching logic; subclasses implement `_hidden_and_head` (ids and mask on the model's device,
    positions on the CPU)."""

    pad_id: int = 0
    #: One row per forward: the model's rotation table depends on the forward's positions (HF's dynamic NTK /
    #: LongRoPE read max(position_ids) + 1 of the whole batch), so a row's numbers must not depend on its batch.
    one_row_per_forward: bool = False

    def _hidden_and_head(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None
                         ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        raise NotImplementedError

    @torch.inference_mode()
    def token_logprobs(self, items: Sequence[Positioned], *, batch_size: int = 32, progress: bool = False,
                       desc: str = "scoring") -> list[Float[torch.Tensor, " pos_minus_1"]]:
        """For each sequence, log p(token t+1 | tokens <= t) in nats for t = 0..len-2 (float64 tensors)."""
        if not items:
            raise ValueError("Empty input: nothing to score")
        _check(items)
        return self._score_rows([_single(i, it) for i, it in enumerate(items)], len(items), batch_size, progress, desc)

    @torch.inference_mode()
    def pair_logprobs(self, pairs: Sequence[tuple[Positioned, Positioned]], *, batch_size: int = 32,
                      progress: bool = False, desc: str = "pairs"
                      ) -> list[tuple[Float[torch.Tensor, " pos_minus_1"], Float[torch.Tensor, " pos_minus_1"]]]:
        """Per-token log-probs (nats, float64) of both sequences of each pair, as `token_logprobs` returns them.

        Equal to scoring the two sequences separately (to float noise); the shared prefix of a pair is
        computed once where the backend allows it. `batch_size` counts sequences.
        """
        if not pairs:
            raise ValueError("Empty input: nothing to score")
        flat = [it for pair in pairs for it in pair]
        if len(flat) != 2 * len(pairs):
            raise ValueError("Each pair must hold exactly two Positioned sequences")
        _check(flat)
        # Identical sequences (frequent across BLiMP pairs) are scored once.
        first: dict[Positioned, int] = {}
        for it in flat:
            first.setdefault(it, len(first))
        uniq = list(first)
        rows = self._tree_rows(uniq) or [_single(i, it) for i, it in enumerate(uniq)]
        lps = self._score_rows(rows, len(uniq), batch_size, progress, desc)
        return [(lps[first[a]], lps[first[b]]) for a, b in pairs]

    def _tree_rows(self, items: list[Positioned]) -> list[_Row] | None:
        """Prefix-tree rows for `items`, or None where this backend scores them one row each."""
        return None

    def _score_rows(
        self, rows: list[_Row], n_out: int, batch_size: int, progress: bool, desc: str
    ) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * n_out
        batches = list(_length_batches(rows, 1 if self.one_row_per_forward else batch_size))
        # Log-probs stay on the model's device until every batch is done, then cross to the CPU in one
        # copy: a copy per batch was a device sync per batch.
        parts: list[torch.Tensor] = []
        spans: list[tuple[int, int]] = []  # (output index, start in the concatenated log-probs)
        done = 0
        for idx in tqdm(batches, desc=desc, unit="batch", disable=not progress):
            ids, pos, lengths = _pad(rows, idx, self.pad_id)
            n = ids.shape[1]
            mask = _tree_mask(rows, idx, n, self.dtype) if rows[idx[0]].tree else None
            # Each scored token is predicted from the row index of the member's previous token;
            # shared prefix tokens give the same (source, target) twice and are projected once.
            src, tgt = [], []
            for r, i in enumerate(idx):
                for o, where in rows[i].members:
                    spans.append((o, done + len(src)))
                    src += [r * n + w for w in where[:-1]]
                    tgt += [rows[i].ids[w] for w in where[1:]]
            uniq_src, inverse = torch.unique(torch.tensor(src, dtype=torch.long), return_inverse=True)
            # Token ids and the three index vectors cross to the device in one copy (each host->device
            # copy from pageable memory is a stream sync on cuda), then are split there.
            sizes = [ids.numel(), uniq_src.numel(), inverse.numel(), len(tgt)]
            packed = torch.cat([ids.reshape(-1), uniq_src, inverse, torch.tensor(tgt, dtype=torch.long)]).to(
                self.device
            )
            ids_d, src_d, inv_d, tgt_d = packed.split(sizes)
            # Positions stay on the CPU: each backend decides there (no device read) and moves what it needs.
            hidden, head = self._hidden_and_head(ids_d.view(ids.shape), pos,
                                                 None if mask is None else mask.to(self.device))
            logits = head(hidden.reshape(-1, hidden.shape[-1])[src_d.to(hidden.device)])
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()  # log-softmax in at least single precision
            # log_softmax is one fused pass (logsumexp took ~1.4x its time on SmolLM2's 49k vocabulary).
            logp = logits.log_softmax(-1)
            parts.append(logp[inv_d.to(logp.device), tgt_d.to(logp.device)].double())
            done += len(src)
        lp = torch.cat(parts).cpu()
        ends = [s for _, s in spans[1:]] + [done]
        for (o, s), e in zip(spans, ends):
            out[o] = lp[s:e]
        return out  # type: ignore[return-value]


def _check(items: Sequence[Positioned]) -> None:
    for it in items:
        if len(it.ids) != len(it.positions) or not it.ids:
            raise ValueError(f"Each sequence needs >= 1 token and one position per token; got {len(it.ids)} ids, "
                             f"{len(it.positions)} positions")


class HFScorer(_Scorer):
    """Hugging Face causal LM; position ids passed natively (GPT-2, Llama, Gemma, Qwen, ...)."""

    def __init__(self, model: Any, tokenizer: Any):
        self.model, self.tokenizer = model, tokenizer
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # A custom mask replaces HF's sliding-window or local mask, which only equals it while a sequence fits the
        # narrowest window of any layer (Mistral's sliding window, GPT-Neo's local layers).
        cfg = hf.text_config(model)
        layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "num_layers", None) or 0
        windows = [w for layer in range(layers) if (w := hf.attention_window(model, layer))]
        windows += [hf.sliding_window(model)] if hf.sliding_window(model) else []
        self.window = min(windows) if windows else None
        self.one_row_per_forward = any(hf.length_rule(model, m.layer_idx) for m in hf.attention_modules(model))
        # A tree row puts a branch further from its shared prefix (in row indices) than it is in its sequence: only
        # positions read from position_ids survive that (ALiBi and T5-style biases read the indices).
        family = find_family(hf.positional_kind(model))
        self.trees = family is not None and family.hf_position_ids

    def _tree_rows(self, items: list[Positioned]) -> list[_Row] | None:
        if self.one_row_per_forward or not self.trees:
            return None  # a tree row's rotation table would follow its longest sequence, not each one's own
        longest = max(len(it.ids) for it in items)
        # The tree mask replaces HF's, so a sliding window holds only for sequences that fit in it: longer
        # ones keep rows of their own (plain causal, in batches without a tree, so HF builds their mask).
        fits = [(i, it) for i, it in enumerate(items) if not self.window or len(it.ids) <= self.window]
        long = [_single(i, it) for i, it in enumerate(items) if self.window and len(it.ids) > self.window]
        # Under a window a whole row fits in it: HF still applies its own window over the row's indices (GPT-Neo's
        # local layers), and a branch sits further from the prefix it shares in the row than in its sequence.
        return _trie_rows(fits, self.window if self.window else max(ROW_TOKENS, longest)) + long

    def _hidden_and_head(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None):
        if mask is None:
            # An all-ones mask rather than None: HF may read a jump in position ids (prefix at 0,
            # sentence at k) as the start of a packed sequence; all-ones still takes SDPA's is_causal path.
            mask = torch.ones(ids.shape, dtype=torch.long, device=ids.device)
        hf.fresh_rope_state(self.model)  # HF's dynamic NTK keeps the largest table it has built: not across rows
        hidden = self.model.base_model(input_ids=ids, position_ids=pos.to(ids.device), attention_mask=mask,
                                       use_cache=False).last_hidden_state

        def head(h: torch.Tensor) -> torch.Tensor:
            return hf.logits_from_hidden(self.model, h)

        return hidden, head


class TLScorer(_Scorer):
    """TransformerLens model; positions applied with posprobe's learned / RoPE position control."""

    def __init__(self, model: Any):
        from posprobe.backend.facts import model_facts, require_supported

        self.model = model
        self.device = device_of(model)
        self.dtype = dtype_of(model)
        self.facts = model_facts(model)
        tok = tokenizer_of(model)
        self.pad_id = (tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0)
        if position_control(self.facts.positional_kind) is None:
            raise NotImplementedError(
                "Scoring at chosen positions needs learned, sinusoidal, rotary or ALiBi positions, not "
                f"{self.facts.positional_kind}"
            )
        require_supported(self.facts, "Scoring at chosen positions")

    def _position_context(self, pos: torch.Tensor):
        # `pos` is the CPU copy: torch.equal on a device tensor would be a device sync per batch.
        from posprobe.core.positions import token_positions

        default = torch.arange(pos.shape[1], device=pos.device)[None].expand_as(pos)
        if torch.equal(pos, default):
            return nullcontext()  # unshifted: leave the model untouched
        return token_positions(self.model, pos, label="scoring")

    def _hidden_and_head(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None):
        assert mask is None, "TLScorer scores single sequences only"
        with self._position_context(pos):
            # Stopping after the last block returns the residual stream, so the vocabulary
            # projection can be applied to real tokens only.
            resid = forward(self.model, ids, stop_at_layer=n_layers(self.model))
        return resid, partial(residual_to_logits, self.model)
