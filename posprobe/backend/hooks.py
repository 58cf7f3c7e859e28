"""Hook names, attaching hooks, and the attention internals position control needs, in one place.

Where the TransformerBridge and TL 3 differ, the adapter `dispatch.ops(model)` returns does the work
(`bridge_ops` / `legacy_ops`); hook names come from `vocab.POINTS`, one table for both backends.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from posprobe.backend import attach
from posprobe.backend.attach import live_hook_count  # noqa: F401 - re-exported for the layers above
from posprobe.backend.dispatch import ops
from posprobe.backend.vocab import POINTS, hook_name  # noqa: F401 - re-exported for the layers above
from posprobe.rope import RotarySpec


@contextmanager
def hooked(model: Any, fwd_hooks: Sequence[tuple[str, Callable]]) -> Iterator[Any]:
    """Attach `fwd_hooks` (TL-style `fn(tensor, hook=...)`) for the duration of the block, removed on exit, also on
    error; unknown names raise before anything is attached. Hook points TL's component skips for this
    architecture (the rotated q/k of joint-QKV rotary attention, or of GPT-J's own attention module) are made to
    fire for the block."""
    with ops(model).exposed(model, [name for name, _ in fwd_hooks]), attach.hooked(model, fwd_hooks):
        yield model


def encoder_layer_hooks(model: Any) -> list[str]:
    """Hook names of an encoder's per-layer token representations: the normalised embedding (before the
    LN's affine part), then each block's normalised output."""
    return ops(model).encoder_layer_hooks(model)


def pos_embed_hook(model: Any) -> str:
    """Name of the hook that outputs the learned position embedding added to the residual stream."""
    return "embed.hook_pos_embed" if "embed.hook_pos_embed" in model.hook_dict else "hook_pos_embed"


def embedding_positions(model: Any, position_ids: torch.Tensor) -> Any:
    """A context in which a model whose positions are added inside Hugging Face's own module (XGLM's fixed sinusoids)
    gives token t the position `position_ids[t]` (`[pos]` or `[batch, pos]`, long), as HF's `position_ids` would."""
    return ops(model).embedding_positions(model, position_ids)


def layer_rotary_spec(model: Any, layer: int, length: int | None = None) -> RotarySpec:
    """The rotation layer `layer` applies to an input of `length` tokens (None: the table it was loaded with; it
    differs only for dynamic / longrope RoPE past their threshold): on a TransformerBridge from the wrapped HF
    config and rotary table, on TL 3 from its config (per-layer base for local/global attention)."""
    return ops(model).layer_rotary_spec(model, layer, length)


def scaled_rotary_spec(model: Any, layer: int, params: dict, length: int | None = None) -> RotarySpec:
    """The rotation `layer` would apply to an input of `length` tokens had the model's config set the HF rope
    parameters `params` (`rope_type` and its keys) in place of its own: HF's own computation (TransformerBridge);
    NotImplementedError on TL 3, whose models carry no HF config."""
    return ops(model).scaled_rotary_spec(model, layer, params, length)


def table_length(model: Any, layer: int, length: int) -> int | None:
    """The key of the table `layer` rotates an input of `length` tokens with: None where it is the table the model
    was loaded with (every static rope type; dynamic / longrope within their threshold)."""
    return ops(model).table_length(model, layer, length)


def rotate_at(model: Any, layer: int, x: torch.Tensor, positions: torch.Tensor, spec: RotarySpec,
              length: int | None = None) -> torch.Tensor:
    """Rotate `x` (`batch pos head_index d_head`) to `positions` (`[pos]` or `[batch, pos]`) with `spec`.

    Where `spec` is the layer's own rotation, the result is bit-equal to the model's: TL 3's tables follow
    posprobe's `posprobe.rope` convention, and on a TransformerBridge HF's cos/sin recipe is replayed
    (angle = position * inv_freq, not position / freq: the one-ulp angle difference alone moved
    SmolLM2's logits by 4e-5). Other specs (new base, scaled or removed bands) use `posprobe.rope.rotate`.
    `length` (a `table_length` key) names the table the layer's own rotation is at.
    """
    return ops(model).rotate_at(model, layer, x, positions, spec, length)


def pre_rotation(model: Any, layer: int, x: torch.Tensor, which: str) -> torch.Tensor:
    """Turn a hook_q / hook_k output into the vector the layer actually rotates (applies QK-norm if any)."""
    return ops(model).pre_rotation(model, layer, x, which)


def attention_scores(model: Any, layer: int, q_rot: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor:
    """Scores exactly as the layer computes them from rotated q and k (scale, GQA, soft-cap)."""
    return ops(model).attention_scores(model, layer, q_rot, k_rot)


def score_edits_apply(model: Any) -> bool:
    """True where an edit of `hook_attn_scores` reaches the layer's output; False where TL hands the attention to
    Hugging Face's module and fires its hooks after the fact (GPT-J, GPT-Neo, OPT, BERT on TL 4)."""
    return ops(model).score_edits_apply(model)


def scores_hook_is_pattern(model: Any) -> bool:
    """True where the model's `hook_attn_scores` carries the softmax pattern instead of the pre-softmax
    scores: TransformerBridge BERT encoders (TL 3.9 and 4.3; measured: equal to hook_pattern, rows sum
    to 1). Callers then compute the scores from hook_q/hook_k with `attention_scores`."""
    return ops(model).scores_hook_is_pattern(model)


def kept_pairs(model: Any, layer: int, n_q: int, n_k: int) -> torch.Tensor:
    """`[n_q, n_k]` bool: the (query, key) pairs `layer` attends to (causal, within its local window; all pairs in
    an encoder), queries being the last n_q of n_k positions. For scores rebuilt from q and k."""
    return ops(model).kept_pairs(model, layer, n_q, n_k)


def kept_scores(model: Any, scores: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the `hook_attn_scores` entries the layer did not mask out (causal, padding)."""
    return ops(model).kept_scores(model, scores)


def bucket_bias(model: Any, rel: torch.Tensor) -> torch.Tensor:
    """T5's learned bias at integer key-minus-query offsets `rel` `[..., query_pos, key_pos]`, as
    `[..., head, query_pos, key_pos]` in score units (the model's dtype and device), looked up through the model's
    own bucket function; NotImplementedError where the model carries no T5 buckets posprobe reads."""
    return ops(model).bucket_bias(model, rel)


def alibi_slopes(model: Any) -> tuple[tuple[float, ...], ...]:
    """Per layer and head, the ALiBi slope (score units per token of distance) the model applies, measured from its
    own scores; NotImplementedError where its bias is not ALiBi-linear or the backend cannot measure it."""
    return ops(model).alibi_slopes(model)


def score_bias(model: Any, family: Any, layer: int, scores: torch.Tensor, qk: torch.Tensor) -> torch.Tensor | None:
    """The score term positional `family` (a `families.Family`, or None) adds to q.k in `layer` (its `score_term`:
    ALiBi's distance bias, T5's bucket bias), float64 `[batch, head_index, query_pos, key_pos]` on the CPU, given
    the layer's captured `hook_attn_scores` and the q.k part of them already explained (float64, same shape); None
    where the family adds no term. The family computes it from what the backend reads off the model."""
    if family is None or family.score_bias is None:
        return None
    return family.score_bias(ops(model), model, layer, scores, qk)


def score_scale(model: Any, layer: int) -> float:
    """The divisor of q.k in the layer's pre-softmax score (sqrt(d_head) unless the model sets another)."""
    return ops(model).score_scale(model, layer)


def score_soft_cap(model: Any) -> float | None:
    """The attention-score soft-cap (Gemma 2 style tanh cap), or None when scores are not capped."""
    return ops(model).score_soft_cap(model)
