"""The one `meta.json` schema and the one column vocabulary of every posprobe result.

meta.json (every analysis; extra analysis-specific keys are allowed beside these):

    analysis          str   which analysis made it ("shift-test", "frequency", "decompose", "probes",
                            "geometry", "squish", "surgery-eval", "long-context")
    posprobe_version  str
    created_utc       str   ISO 8601 time the result was made
    model             dict  the model's positional facts (`ModelFacts.summary()`): name, source,
                            positional_kind, n_ctx, n_layers, n_heads, rotary_* ...
    data              dict  source (str: file, folder, "built-in: ..."), sha256 (of the text or of the
                            pairs' content; None where no data is read), n_items (int) and unit
                            ("pairs", "windows", "tokens", "prompts", "rows")
    config            dict  the analysis config as given (a frozen dataclass turned into a dict)
    environment       dict  python, torch, transformers, transformer-lens, numpy, pandas, posprobe
                            versions, platform, timestamp_utc
    tables            list  names of the tables saved beside it (added by `Result.save`)

Tables are tidy (long): one row per measured value where that is natural, with the columns below.
A column that is not listed here is a defect: add it with its meaning and unit.
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from typing import Any

import pandas as pd

#: Column name -> meaning (and unit). One vocabulary for every analysis.
COLUMNS: dict[str, str] = {
    # key-position brittleness (analyses.brittleness)
    "bucket": "distance bucket of the jittered (query, key) pairs: near:K = 1 <= query_pos - key_pos <= K, "
              "far:D = query_pos - key_pos > D",
    "sigma": "standard deviation of the Gaussian noise on the jittered keys' positions (tokens)",
    "nll": "mean next-token loss (nats/token)",
    "delta_nll": "nll minus nll at sigma 0 on the same windows (nats/token)",
    "n_pairs_jittered": "(query, key) pairs in the bucket per scored query (mean over queries 0..length-2; their "
                        "keys move by the noise, by nothing at sigma 0)",
    # where
    "model": "model name",
    "layer": "block index (0-based); -1 or empty = not layer-specific",
    "head": "query head index (TL's head_index); -1 = all heads",
    "other": "the second model of a two-model comparison (head similarity)",
    "nearest_head": "the other model's head, in the same layer, with the smallest divergence from this head",
    "jsd_min": "Jensen-Shannon divergence (nats) to the other model's nearest head in the same layer",
    "jsd_mean": "Jensen-Shannon divergence (nats) to the other model's heads in the same layer, mean over them",
    "kv_head": "key/value head index (grouped-query attention)",
    "band": "RoPE frequency pair index: 0 = fastest rotation; -1 = unrotated dims",
    "bands": "comma-separated band indices",
    "n_bands": "number of bands",
    "pos": "token position inside a window/sequence (0-based)",
    "rank": "1 = the largest (massive activations: of the layer's |residual activations| over the corpus)",
    "token": "the token (as the tokenizer writes it) at `pos`",
    "dim": "residual-stream dimension (0-based)",
    "median_abs": "mean over sequences of the sequence's median |residual activation| at that layer",
    "ratio": "value / median_abs",
    "pos2": "second position of a position-by-position map (cosine between positions pos and pos2)",
    "query_pos": "query token position",
    "key_pos": "key token position",
    "rel_pos": "query_pos - key_pos (lower edge where binned)",
    "rel_pos_hi": "inclusive upper edge of a rel_pos bin",
    "k": "start position of a shifted sequence (shift test), or principal-component index / subspace dimension "
         "(geometry)",
    "window": "index of the text window",
    "point": "capture point (resid_pre, resid_mid, resid_post, ...)",
    "source": "what a row was computed from (W_pos, residual stream, ...)",
    # what
    "metric": "name of the measured quantity (see the analysis's docs)",
    "term": "component of a decomposition (ww, wp, pw, pp, bias, ...)",
    "value": "the measured value, in the metric's unit",
    "unit": "what a row aggregates (token, sentence)",
    "count": "number of entries averaged into the row",
    "condition": "experimental condition: probe / control / chance, or a band-ablation condition",
    # shift test
    "paradigm": "minimal-pair paradigm (BLiMP UID or posprobe_*)",
    "field": "BLiMP field (morphology, syntax, semantics, ...)",
    "phenomenon": "BLiMP linguistics term",
    "pair_id": "pair identifier inside its paradigm",
    "logp_good": "log-probability of the grammatical sentence (nats)",
    "logp_bad": "log-probability of the ungrammatical sentence (nats)",
    "n_tokens_good": "scored tokens of the grammatical sentence",
    "n_tokens_bad": "scored tokens of the ungrammatical sentence",
    "margin": "logp_good - logp_bad (nats)",
    "correct": "margin > 0",
    "level": "aggregation level (overall, field, paradigm)",
    "group": "the group at that level",
    "n_pairs": "pairs in the group",
    "accuracy": "fraction of pairs with margin > 0",
    "ci_low": "lower end of the 95% interval (percentile bootstrap, or Wilson score where every score is 0 or 1: "
              "meta['intervals'] names the method where both occur)",
    "ci_high": "upper end of the 95% interval (as ci_low)",
    "mean_margin": "mean margin (nats)",
    "delta_accuracy": "accuracy minus accuracy at k = 0",
    "flips": "pairs whose judgement changed vs k = 0",
    "flips_to_wrong": "correct at k = 0, wrong at k",
    "flips_to_correct": "wrong at k = 0, correct at k",
    "mcnemar_p": "two-sided exact McNemar p-value vs k = 0",
    "loss": "next-token loss (nats)",
    "cosine_to_k0": "cosine similarity to the representation at k = 0",
    # frequency usage
    "frequency": "angular frequency of the band (rad/token)",
    "wavelength": "2*pi/frequency (tokens)",
    "kind": "head class (rule in meta)",
    "classes": "every class a head meets, comma-separated (rules in meta)",
    "base": "RoPE base of the layer (theta)",
    "eta2": "share of score variance explained by rel_pos bin",
    "fast_share": "abs score share of bands with wavelength <= window",
    "prev_mass": "mean attention from i to i-1 (queries 1..n-1)",
    "self_mass": "mean attention from i to itself (decoders: queries 1..n-1; query 0 can only attend to itself)",
    "first_mass": "mean attention to the first token (decoders: queries 1..n-1; query 0 can only attend to itself)",
    # Chen et al.'s Theorem 2.1 per head (frequency report's `theory` table; a(s) = Re sum_j h_j e^{i s theta_j})
    "attention": "the layer's attention: local (sliding window: a(s) past the window is never used) or global",
    "h_max": "max_j |h_j| of the head's mean pair: h_j = q_j conj(k_j) / scale of the mean unrotated query and key "
             "(positions >= 1; score units)",
    "h_max_typical": "max_j of mean |q_j| x mean |k_j| / scale: one typical pair's |h_j| (score units)",
    "a_in_min": "min of the mean pair's a(s) over s = 0..L-1 (score units)",
    "a_in_max": "max of the mean pair's a(s) over s = 0..L-1 (score units)",
    "a_out_min": "min of the mean pair's a(s) over s = L..L'-1 (score units)",
    "a_out_max": "max of the mean pair's a(s) over s = L..L'-1 (score units)",
    "excess": "how far a(s) beyond L leaves its range inside L (0 if it stays inside; score units)",
    "interpolation_bound": "Chen et al.'s d max|h_j| / (32 ln b) with the typical pair (score units)",
    "extrapolation_bound": "Chen et al.'s 2 max|h_j| B(s), largest over s = L..L'-1, typical pair (score units)",
    "interpolation_safe": "interpolation_bound <= the tolerance in meta['theory'] (1 logit)",
    "extrapolation_leaves_range": "excess > the tolerance in meta['theory'] (1 logit)",
    "theory_context": "L: the trained length the theory refers to (tokens)",
    "theory_target": "L': a(s) beyond L is evaluated up to L'-1 (tokens)",
    "variant": "variant of a condition or plan",
    "mode": "ablation mode (unrotate, zero)",
    "fraction_kept": "fraction of bands kept rotating",
    "base_loss": "loss of the unablated model (nats/token)",
    "delta_loss": "value - base_loss (nats/token)",
    # probes / geometry / surgery
    "fold": "cross-validation fold",
    "alpha": "ridge penalty picked by the inner cross-validation (NaN where none applies)",
    "preset": "surgery preset spec",
    "section": "atlas section (facts, heads, frequency, geometry, probes, shift)",
    # long-context harness
    "length": "sequence length of the window or prompt (tokens)",
    "bin_start": "first query_pos of a bin of query positions",
    "bin_end": "end (exclusive) of a bin of query positions",
    "depth": "needle depth: fraction of the haystack placed before the (first asked) needle (0 = start, 1 = end; "
             "kv_retrieval: the gold pair's index / (pairs - 1))",
    "trial": "index of a repeated random trial",
    "target": "the passkey (digits) the model should return",
    "prediction": "first run of digits in the greedy answer ('' if none)",
    "exact_match": "prediction equals target exactly",
    "needle_pos": "token position where the (first asked) needle starts",
    "task": "needle task: RULER's NIAH names (niah_single_1 ...), niah_single_word, kv_retrieval",
    "targets": "the values the answer must contain, ' | '-separated",
    "answer": "the greedy answer's text (decoding stops once every target has appeared: the score cannot change)",
    "score": "RULER's string_match_all of one answer: fraction of the targets found in it, case-insensitive",
    "needles": "needles placed in the prompt (asked and distractors; a needle haystack's own not counted)",
    # retrieval heads
    "masked": "which heads were masked: none, top (the highest retrieval scores), random (seeded draw of others)",
    "n_masked": "number of heads masked",
    "draw": "index of a random draw (-1: not random)",
    # the atlas over many models (analyses.atlas_many): its models table and the columns every side-by-side table has
    "spec": "the model spec as given (a zoo member folder, a packaged name, a path)",
    "member": "the zoo member the model is a seed of (a model a user named: its own label)",
    "family": "the zoo member's positional family (empty outside a zoo)",
    "block": "the zoo member's block: the HF class its positions come with (empty outside a zoo)",
    "seed": "the zoo member's training seed (empty outside a zoo)",
    "positional_kind": "the model's positional kind (rotary, learned_absolute, sinusoidal, alibi, t5_relative, nope)",
    "n_ctx": "the model's context length (tokens)",
    "n_layers": "layers",
    "n_heads": "attention heads per layer",
    "layers": "the layers' positional encodings, collapsed by kind with their counts (×n)",
    "layers_per_layer": "each layer's positional encoding, one description per layer, '; '-separated",
    "status": "loaded, or refused (with why)",
    # passkey retrieval's intervals (analyses.passkey)
    "success_low": "lower end of the 95 % Wilson interval of the success rate (successes of trials)",
    "success_high": "upper end of the 95 % Wilson interval of the success rate",
    "success_within_L_low": "lower end of the 95 % Wilson interval of the trials pooled over distances <= L",
    "success_within_L_high": "upper end of the 95 % Wilson interval of the trials pooled over distances <= L",
    "success_beyond_L_low": "lower end of the 95 % Wilson interval of the trials pooled over distances > L",
    "success_beyond_L_high": "upper end of the 95 % Wilson interval of the trials pooled over distances > L",
    # an engine's positions against HF's (analyses.conform)
    "layer_type": "the layer type a rotation is for: all (one table), or HF's names (full_attention, "
                  "sliding_attention)",
    "verdict": "the check's verdict on this row (conforms / differs; position-flat / grows with position / differs "
               "everywhere; cache-consistent / cached differs past the switch / everywhere)",
    "bug_class": "the declared mismatch's class (ok, base off, scale off, attention factor missing / doubled / off, "
                 "rotated dims, layer types swapped, scaling on every layer type, ramp off, frequencies off)",
    "why": "one sentence with the numbers behind the verdict",
    "engine_bands": "rotary bands (pairs of dims) the engine rotates",
    "hf_bands": "rotary bands HF's rotary module rotates",
    "engine_base": "the engine's rope base for this layer type",
    "engine_freq_scale": "the engine's frequency scale (1 / linear or YaRN factor; 1: none)",
    "engine_ext_factor": "the engine's YaRN mix factor (0: YaRN off)",
    "engine_multiplier": "the engine's cos/sin multiplier (attention factor)",
    "hf_multiplier": "HF's cos/sin multiplier (attention_scaling)",
    "max_rel_diff": "largest relative difference of a band's inverse frequency or of the multiplier, engine vs HF",
    "engine_inv_freq": "the engine's inverse frequency of the band (rad/token)",
    "hf_inv_freq": "HF's inverse frequency of the band (rad/token)",
    "bin": "index of a position bin (equal bins of the input)",
    "first_position": "first position in the bin (tokens from the start)",
    "last_position": "last position in the bin",
    "kl": "mean KL divergence of next-token distributions (nats): KL(HF || engine) for behaviour, KL(uncached || "
          "cached) for cache",
    "top1_agreement": "fraction of positions whose top-1 next tokens agree (0..1)",
    "positions": "positions in the bin",
    "floor_kl": "KL where no position effect is expected (nats): behaviour, the first quarter's mean after 16 "
                "positions; cache, the largest before the switch",
    "late_kl": "KL past the expected effect (nats): behaviour, the last quarter's mean; cache, the largest at and past "
               "the switch",
    "growth": "late_kl / floor_kl",
    "top1_first": "top-1 agreement in the first quarter",
    "top1_last": "top-1 agreement in the last quarter",
    "side": "which side was scored through its cache: the HF reference, or the engine by name",
    "position": "position in the input (tokens from 0)",
    "offset": "position minus the switch position `at` (tokens)",
    "at": "the switch position checked around (HF's dynamic L, longrope's original context, or the user's)",
    "how": "how the uncached and the cached scores were made",
    "first_over": "first position whose cached KL passes the bar (empty: none)",
    "first_identical_position": "first position whose rotation equals its predecessor's in every band (empty: none "
                                "up to scanned_to)",
    "first_fast_neighbour_position": "first position at which the fastest band is off by half a token or more (empty: "
                                     "none up to scanned_to)",
    "fast_position_error_in_context": "the fastest band's largest position error within the context (tokens)",
    "max_phase_error_in_context": "largest phase error over bands within the context (rad, wrapped to [0, pi])",
    "max_phase_error": "largest phase error over bands up to scanned_to (rad; inf where the dtype overflows)",
    "context": "the model's context the errors are read within (tokens)",
    "scanned_to": "last position scanned",
    "phase_error": "largest phase error over bands at the position (rad, wrapped to [0, pi])",
    "fast_position_error": "the fastest band's position error at the position (tokens)",
}

#: The names that appear as values of a `metric` column, one definition each (same name, same number in every
#: command: `heads`, `freq-report`, the atlas and the notebooks read these). Shared with COLUMNS where a name is also
#: a column (the frequency report's per-head table).
METRICS: dict[str, str] = {
    "string_match_all": "mean of `score` over trials: RULER's needle accuracy (fraction of expected values found)",
    "retrieval_score": "Wu et al. 2025: distinct needle-value tokens a head copied while answering (its most-attended "
                       "key in the value and carrying the generated token) / value tokens, mean over prompts",
    "needle_mass": "mean attention on the asked needles' value tokens over the answer steps (last query, each step)",
    "answer_first_mass": "mean attention on the first token over the answer steps (last query, each step)",
    "retrieval_jaccard": "mean Jaccard overlap, over prompt pairs, of the sets of heads whose retrieval score on the "
                         "prompt exceeds the threshold",
    "retrieval_jaccard_tasks": "mean Jaccard overlap, over pairs of needle tasks, of the sets of heads whose mean "
                               "retrieval score over the task's prompts exceeds the threshold (NaN: one task)",
    "prev_mass": COLUMNS["prev_mass"],
    "self_mass": COLUMNS["self_mass"],
    "first_mass": COLUMNS["first_mass"],
    "first_k_mass": "mean attention on the first k tokens (HeadsConfig.first_k; decoders: queries 1..n-1)",
    "sink_score": "Gu et al. 2025 sink score: attention on the first token summed over every query that sees it "
                  "(query 0 included), divided by their number",
    "fixed_offset": "offset d >= 2 with the largest mean attention",
    "fixed_offset_mass": "mean attention at fixed_offset",
    "mean_distance": "mean over queries of the attention-weighted |i - j| (tokens)",
    "entropy": "mean attention entropy per query (nats)",
    "relative_entropy": "entropy / log(keys the query sees), queries that see more than one key",
    "relative_r2": "R² of the pattern explained by its offset i - j alone (per-diagonal means)",
    "prev_token_score": "TransformerLens head_detector 'mul' score of the previous-token pattern",
    "induction_score": "attention from a repeated token to the token after its first occurrence (repeated random "
                       "tokens; TL head_detector 'mul')",
    "duplicate_score": "attention from a repeated token to its first occurrence (TL head_detector 'mul')",
    "q_norm": "mean norm of a band's 2-d slice of the rotated query",
    "k_norm": "mean norm of a band's 2-d slice of the rotated key",
    "mean_contrib": "mean signed contribution of a band to the pre-softmax score (score units)",
    "mean_abs_contrib": "mean |contribution| of a band to the pre-softmax score (score units)",
    "h_re": "Re h_j: a band's product of the head's mean unrotated query and key, q_j conj(k_j) / scale (score units)",
    "h_im": "Im h_j (as h_re)",
    "h_typical": "mean |q_j| x mean |k_j| / scale: one typical pair's |h_j| in that band (score units)",
    "abs_share": "a band's share of the head's summed |contribution| (0-1)",
    "first_attention": "Gu et al. 2025 alpha_1: mean over all queries (query 0 included) of the attention on the "
                       "first token, averaged over sequences",
    "sink_rate": "share of sequences on which the head's alpha_1 exceeds epsilon (per-sample thresholding)",
    "sink_share": "Gu et al. 2025 Sink_1^epsilon: share of (sequence, head) pairs whose alpha_1 exceeds epsilon",
    "first_key_norm_ratio": "norm of the first token's key / mean norm of the other keys (the kv head's, as the "
                            "scores see it: after rotation and any QK-norm), averaged over sequences",
    "first_value_norm_ratio": "norm of the first token's value / mean norm of the other values, averaged over "
                              "sequences",
    "first_key_cos": "mean cosine of each query (positions 1..) with the first token's key",
    "other_key_cos": "mean cosine of each query (positions 1..) with the keys of positions 1.. it sees",
    "nll": "mean next-token loss (nats/token)",
    "delim_attention": "attention on the sequence's first delimiter (. , newline ; : ! ?) from the queries after it, "
                       "averaged over the sequences that have one",
    "delim_key_norm_ratio": "norm of the first delimiter's key / mean norm of the keys of positions 1..",
    "delim_value_norm_ratio": "norm of the first delimiter's value / mean norm of the values of positions 1..",
    "delim_key_cos": "mean cosine of the queries after the first delimiter with its key",
}

REQUIRED_META: dict[str, type | tuple[type, ...]] = {
    "analysis": str, "posprobe_version": str, "created_utc": str, "model": dict, "data": dict,
    "config": dict, "environment": dict,
}
DATA_KEYS = ("source", "sha256", "n_items", "unit")


def make_meta(analysis: str, *, model: dict, data: dict, config: Any, **extra: Any) -> dict:
    """A meta dict in the one schema: `model` = ModelFacts.summary(), `data` from `data_meta`,
    `config` a dataclass or dict; `extra` holds analysis-specific entries."""
    from posprobe import __version__
    from posprobe.report.result import environment_meta

    cfg = asdict(config) if is_dataclass(config) and not isinstance(config, type) else dict(config)
    return {
        "analysis": analysis, "posprobe_version": __version__,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": dict(model), "data": dict(data), "config": cfg, **extra, "environment": environment_meta(),
    }


def data_meta(source: str | None, *, n_items: int, unit: str, sha256: str | None = None) -> dict:
    """The `data` entry: where the data came from, its content hash, how many items of what."""
    return {"source": source, "sha256": sha256, "n_items": int(n_items), "unit": unit}


def text_sha256(text: str) -> str:
    """sha256 hex digest of a text's UTF-8 bytes."""
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def validate_meta(meta: dict) -> None:
    """Raise ValueError listing every way `meta` departs from the schema."""
    problems = [f"missing {k!r}" for k in REQUIRED_META if k not in meta]
    problems += [f"{k!r} should be {t.__name__ if isinstance(t, type) else t}, got {type(meta[k]).__name__}"
                 for k, t in REQUIRED_META.items() if k in meta and not isinstance(meta[k], t)]
    if isinstance(meta.get("model"), dict):
        problems += [f"model lacks {k!r}" for k in ("name", "positional_kind") if k not in meta["model"]]
    if isinstance(meta.get("data"), dict):
        problems += [f"data lacks {k!r}" for k in DATA_KEYS if k not in meta["data"]]
    if problems:
        raise ValueError(f"meta ({meta.get('analysis', '?')}) does not follow the schema: " + "; ".join(problems))


def unknown_columns(df: pd.DataFrame) -> list[str]:
    """Columns of `df` that are not in the vocabulary (`COLUMNS`)."""
    return [c for c in df.columns if c not in COLUMNS]
