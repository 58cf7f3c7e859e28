"""Key squishing of an instruction span (baseline vs squished generation) and loss-vs-position under presets.

Tidy outputs: columns model, variant (cache | keys | qk | baseline | no-instruction), metric, layer,
query_pos, value. Attention mass is a fraction of attention (0..1, mean over heads), losses in nats
per token, KL in nats.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Sequence

import pandas as pd
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from posprobe.analyses.configs import SquishConfig, SurgeryEvalConfig
from posprobe.backend.facts import model_facts, require_rotary
from posprobe.backend.model import encode_text, model_name, n_layers, tokenizer_of
from posprobe.core.capture import capture
from posprobe.core.generation import Generation, continuation_logprob, generate, logits_under, token_logprobs
from posprobe.core.positions import PositionPlan
from posprobe.core.presets import preset_plan
from posprobe.core.surgery import apply_plan, key_squish
from posprobe.report.result import Result
from posprobe.report.schema import data_meta, make_meta, text_sha256


@dataclass(frozen=True)
class Prompt:
    """Prompt tokens and the [start, end) token span of the instruction inside them."""

    tokens: Int[torch.Tensor, " pos"]
    span: tuple[int, int]
    text: str


def _render(model: Any, user: str, chat: bool | None) -> str:
    tok = tokenizer_of(model)
    if bool(getattr(tok, "chat_template", None)) if chat is None else chat:
        # The template already starts with the BOS-like token; never prepend another.
        return tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    bos = tok.bos_token if getattr(model.cfg, "default_prepend_bos", False) and tok.bos_token else ""
    return bos + user


def build_prompt(model: Any, instruction: str, prompt: str, *, chat: bool | None = None) -> Prompt:
    """Instruction + prompt as one user turn (chat template when the tokenizer has one), with the instruction span.

    Without a template: BOS (if the model prepends one) + instruction + newline + prompt.
    """
    if not instruction.strip():
        raise ValueError("empty instruction")
    user = f"{instruction}\n{prompt}"
    text = _render(model, user, chat)
    enc = tokenizer_of(model)(text, return_offsets_mapping=True, add_special_tokens=False)
    start = text.index(user)
    lo, hi = start, start + len(instruction)
    idx = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < hi and b > lo]
    if not idx:
        raise ValueError("could not locate the instruction's tokens in the prompt")
    return Prompt(torch.tensor(enc["input_ids"]), (idx[0], idx[-1] + 1), text)


def span_attention(model: Any, tokens: torch.Tensor, span: tuple[int, int], first_query: int,
                   plan: PositionPlan | None) -> list[float]:
    """Per layer: attention mass (mean over heads and over query rows >= first_query) onto keys in span."""
    layers = range(n_layers(model))
    with apply_plan(model, plan) if plan is not None else nullcontext():
        pats = capture(model, tokens[None], ["pattern"], layers=list(layers))
    # One host read for all layers, not one per layer.
    return torch.stack([pats[("pattern", l)][0, :, first_query:, span[0]:span[1]].sum(-1).mean()
                        for l in layers]).tolist()


def _decode(model: Any, ids: torch.Tensor) -> str:
    return tokenizer_of(model).decode(ids.tolist(), skip_special_tokens=True)


def run_squish(model: Any, instruction: str, prompt: str, config: SquishConfig | None = None) -> Result:
    """`squish_generate` with its options from a SquishConfig (what `posprobe squish` calls).

    Args:
        model: a TransformerLens causal LM with rotary layers.
        instruction: the text whose keys are squished.
        prompt: the text that follows the squished `instruction` in the same user turn (instruction, newline,
            prompt).
        config: the analysis's options (None: its Config's defaults); with neither `to` nor `range_` set the
            instruction's keys go to position 0.

    Returns:
        `squish_generate`'s Result: one `squish` table (metrics attn_mass, kl, and with a reference ref_nll,
            effect_kept) and meta with each run's continuation.

    Examples:
        >>> import posprobe as pp
        >>> cfg = pp.SquishConfig(max_new_tokens=3, variant="keys")  # the instruction's keys all at position 0
        >>> model = pp.load_model("tiny-rope")
        >>> result = pp.run_squish(model, "Answer in French.", "What is the capital of Italy?", cfg)
        >>> sorted(result.tables["squish"].metric.unique()), sorted(result.meta["continuations"])
        (['attn_mass', 'kl'], ['baseline', 'keys'])
    """
    cfg = config or SquishConfig()
    return squish_generate(model, instruction, prompt, to=0.0 if cfg.to is None and cfg.range_ is None else cfg.to,
                      range_=cfg.range_, query_start=cfg.query_start, variant=cfg.variant,
                      max_new_tokens=cfg.max_new_tokens, reference=cfg.reference, temperature=cfg.temperature,
                      top_k=cfg.top_k, seed=cfg.seed, chat=cfg.chat)


@torch.no_grad()
def squish_generate(model: Any, instruction: str, prompt: str, *, to: float | None = 0.0,
               range_: tuple[float, float] | None = None, query_start: float | None = None,
               variant: str | Sequence[str] = "cache", max_new_tokens: int = 16, reference: str | None = None,
               temperature: float = 0.0, top_k: int | None = None, seed: int = 0, chat: bool | None = None
               ) -> Result:
    """Generate with and without key squishing of the instruction span; return a Result (`squish` table + meta).

    Args:
        model: a TransformerLens causal LM with rotary layers.
        instruction: the text whose tokens' keys are squished (not empty).
        prompt: the text that follows the instruction in the same user turn (instruction, newline, prompt).
        to: the one position every instruction key gets (see `key_squish`).
        range_: (lo, hi): instruction keys spread linearly over [lo, hi] instead (wins over `to`).
        query_start: where the tokens after the instruction restart (None: unchanged).
        variant: "cache", "keys", "qk" (see `key_squish`) or several (the baseline is computed once).
        max_new_tokens: the number of tokens generated per run (each run stops early at the tokenizer's EOS).
        reference: a continuation to score under each condition (None: no reference metrics).
        temperature: 0 (greedy) or the sampling temperature, as in `generate`.
        top_k: when sampling, only the `top_k` most likely tokens (None: all).
        seed: the sampling seed.
        chat: wrap the user turn in the tokenizer's chat template (None: when the tokenizer has one).

    Returns:
        A Result with one `squish` table (model, variant, metric, layer, query_pos, value; -1 where not
            applicable) and meta (prompt text, span, plans, each run's decoded continuation). Metrics:
            "attn_mass" per layer (generated queries onto the span, each run on its own output); "kl" per
            query_pos: KL(baseline || squished) of next-token distributions, teacher-forced on the baseline's
            output; with `reference`: "ref_nll" (mean nats per token) for baseline, each variant and the prompt
            without the instruction, and "effect_kept" = (lp_variant - lp_none) / (lp_base - lp_none) on
            summed log-probs (1 = instruction's effect intact, 0 = as if absent).
    """
    require_rotary(model_facts(model), "Key squishing")
    variants = (variant,) if isinstance(variant, str) else tuple(variant)
    p = build_prompt(model, instruction, prompt, chat=chat)
    n = len(p.tokens)
    plans = {v: key_squish(n, p.span, to=to, range_=range_, query_start=query_start, variant=v) for v in variants}
    eos = getattr(tokenizer_of(model), "eos_token_id", None)
    runs: dict[str, Generation] = {}
    for v, pl in tqdm([("baseline", None), *plans.items()], desc="generate", leave=False):
        runs[v] = generate(model, p.tokens, max_new_tokens=max_new_tokens, plan=pl, temperature=temperature,
                           top_k=top_k, seed=seed, stop_token=eos)
    name = model_name(model)
    rows = []
    for v, g in runs.items():
        full = None if g.plan is None else g.plan.extended(g.tokens.shape[1])
        for l, mass in enumerate(span_attention(model, g.tokens[0], p.span, n, full)):
            rows.append(dict(model=name, variant=v, metric="attn_mass", layer=l, query_pos=-1, value=mass))
    seq = runs["baseline"].tokens
    lp_base = torch.log_softmax(logits_under(model, seq).float(), -1)
    for v, pl in plans.items():
        lp_sq = torch.log_softmax(logits_under(model, seq, pl.extended(seq.shape[1])).float(), -1)
        kl = (lp_base.exp() * (lp_base - lp_sq)).sum(-1)[0].tolist()  # one host read, not one per query
        for q in range(n - 1, seq.shape[1]):
            rows.append(dict(model=name, variant=v, metric="kl", layer=-1, query_pos=q, value=kl[q]))
    config = dict(to=to, range_=range_, query_start=query_start, variant=list(variants), max_new_tokens=max_new_tokens,
                  reference=reference, temperature=temperature, top_k=top_k, seed=seed, chat=chat)
    data = data_meta("instruction + prompt", n_items=1, unit="prompts", sha256=text_sha256(p.text))
    meta = make_meta(
        "squish", model=model_facts(model).summary(), data=data, config=config,
        variant=variants[0] if len(variants) == 1 else list(variants), instruction=instruction, prompt=prompt,
        prompt_text=p.text, span=list(p.span), n_prompt_tokens=n, plan={v: pl.label for v, pl in plans.items()},
        plan_meta={v: dict(pl.meta) for v, pl in plans.items()}, max_new_tokens=max_new_tokens,
        continuations={v: _decode(model, g.new_tokens[0]) for v, g in runs.items()},
    )
    if reference is not None:
        ref = torch.tensor(tokenizer_of(model)(reference, add_special_tokens=False)["input_ids"])
        lps = {"baseline": continuation_logprob(model, p.tokens, ref),
               "no-instruction": continuation_logprob(model, build_prompt_without(model, prompt, chat=chat), ref)}
        lps.update({v: continuation_logprob(model, p.tokens, ref, pl) for v, pl in plans.items()})
        for v, lp in lps.items():
            rows.append(dict(model=name, variant=v, metric="ref_nll", layer=-1, query_pos=-1, value=float(-lp.mean())))
        s = {v: float(lp.sum()) for v, lp in lps.items()}
        denom = s["baseline"] - s["no-instruction"]
        kept = {v: (s[v] - s["no-instruction"]) / denom if denom != 0 else float("nan") for v in variants}
        for v, k in kept.items():
            rows.append(dict(model=name, variant=v, metric="effect_kept", layer=-1, query_pos=-1, value=k))
        meta.update(reference=reference, ref_logprob_sum=s, effect_kept=kept)
    return Result({"squish": pd.DataFrame(rows)}, meta)


def build_prompt_without(model: Any, prompt: str, *, chat: bool | None = None) -> Int[torch.Tensor, " pos"]:
    """The same prompt with no instruction (the control for the instruction's effect)."""
    return torch.tensor(tokenizer_of(model)(_render(model, prompt, chat), add_special_tokens=False)["input_ids"])


@torch.no_grad()
def loss_by_position(model: Any, windows: Sequence[Sequence[int]], presets: Sequence[str]) -> pd.DataFrame:
    """NLL (nats) of token t+1 at every query_pos t of each window under each preset; tidy long table."""
    require_rotary(model_facts(model), "Surgery evaluation")
    rows = []
    name = model_name(model)
    todo = [(w, s) for w in range(len(windows)) for s in presets]
    for w, spec in tqdm(todo, desc="surgery-eval"):
        ids = torch.as_tensor(windows[w])[None]
        plan = preset_plan(spec, model, ids.shape[1])
        nll = -token_logprobs(logits_under(model, ids, plan), ids)[0]
        for t, v in enumerate(nll.tolist()):
            # A squish plan names its variant (cache | keys | qk); any other preset moves every query and key alike.
            rows.append(dict(model=name, preset=spec, variant=plan.meta.get("variant", "every-position"), window=w,
                             query_pos=t, metric="nll", value=v))
    return pd.DataFrame(rows)


def run_surgery_eval(model: Any, text: str, config: SurgeryEvalConfig | None = None, *,
                     source: str | None = None) -> Result:
    """Loss by position (nats/token) under each surgery preset on windows of `text`: one `surgery_eval` table.

    Args:
        model: a TransformerLens model with rotary layers.
        text: the text cut into windows (`config.window` tokens, at most the model's context).
        config: the analysis's options (None: its Config's defaults); every preset is checked before any forward.
        source: what meta.json's data record names as the text (default: "text").

    Returns:
        A Result with one `surgery_eval` table: model, preset, variant (the squish variant, else
            "every-position"), window, query_pos, metric ("nll": of token query_pos + 1, in nats), value.

    Examples:
        >>> import posprobe as pp
        >>> from posprobe.data import BUILTIN_TEXT
        >>> cfg = pp.SurgeryEvalConfig(window=32, max_windows=2, presets=("none", "pi:scale=2"))
        >>> table = pp.run_surgery_eval(pp.load_model("tiny-rope"), BUILTIN_TEXT, cfg).tables["surgery_eval"]
        >>> sorted(table.preset.unique()), sorted(table.metric.unique())
        (['none', 'pi:scale=2'], ['nll'])
    """
    from posprobe.data import token_windows

    cfg = config or SurgeryEvalConfig()
    presets, window, max_windows = cfg.presets, cfg.window, cfg.max_windows
    facts = model_facts(model)
    require_rotary(facts, "Surgery evaluation")
    if window > facts.n_ctx:
        raise ValueError(f"window {window} exceeds the model's context n_ctx={facts.n_ctx} (raise --n-ctx)")
    for spec in presets:  # every preset is checked before any forward pass
        preset_plan(spec, model, 2)
    windows = token_windows(encode_text(model, text), window, max_windows=max_windows)
    df = loss_by_position(model, windows, presets)
    data = data_meta(source or "text", n_items=len(windows), unit="windows", sha256=text_sha256(text))
    meta = make_meta("surgery-eval", model=facts.summary(), data=data, config=cfg)
    return Result({"surgery_eval": df}, meta)
