"""Key-position brittleness by distance (issue #40, "Key squishing, measured").

The claim tested: in RoPE models the relative positions of adjacent and nearby tokens must stay intact, those of
distant tokens are less brittle. The measurement: language-model loss (nats/token) on text windows while the key
positions of only the (query, key) pairs in one distance bucket are jittered by Gaussian noise of standard deviation
sigma (tokens), one curve per bucket:

  * `near:K`: the K nearest earlier keys of every query, 1 <= i - j <= K (a query's own key, i == j, never moves);
  * `far:D`: every key farther than D tokens, i - j > D.

Every other pair keeps its exact relative position, and the query always stays at i. The run goes through the
chunked long-context engine (`posprobe.core.long_engine.token_nll`) on a plain Hugging Face RoPE model, with the
jitter written as a two-view `PairRule` (`jitter_pairs`).

The noise is per key, not per pair: key j moves to j + e_j for every query whose bucket holds it, e_j ~ N(0, sigma^2)
drawn once per window. A per-key displacement is what a noisy position of a stored key would be: each query still
sees one consistent set of key positions (the keys' spacings inside the bucket change by e_j - e_j', the query-key
offset by -e_j), and it is expressible as a position, which per-pair noise (an independent draw per (i, j)) is not.
The same standard-normal draws z_j, scaled by sigma, serve every sigma and every bucket of a window (common random
numbers): the curves differ only by sigma and by which pairs move, not by a new draw. Jittered offsets are not
clipped: a near key may land after its query (a negative offset), as unclipped Gaussian noise does.

Tables: `brittleness` (per bucket, sigma, window: mean NLL over the window's predicted tokens) and
`brittleness_summary` (per bucket and sigma: mean NLL over windows, the increase over sigma 0 with a percentile
bootstrap interval over windows). Sigma 0 is the model's own forward (one per window, shared by every bucket).

The Config and the bucket grammar live in `posprobe.analyses.configs` (torch-free: the CLI checks them before any
weights load), the report page in `posprobe.report.brittleness`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from posprobe.analyses.configs import BRITTLENESS_BUCKETS as DEFAULT_BUCKETS
from posprobe.analyses.configs import BRITTLENESS_SEED_STRIDE as SEED_STRIDE
from posprobe.analyses.configs import BRITTLENESS_SIGMAS as DEFAULT_SIGMAS
from posprobe.analyses.configs import (  # noqa: F401  (re-exported: the analysis's own names)
    BrittlenessConfig,
    Bucket,
    check_length,
    check_sigma,
    min_length,
    parse_bucket,
)
from posprobe.report.brittleness import figure_brittleness, figures, sections, title
from posprobe.report.schema import COLUMNS

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from posprobe.core.surgery import PairRule
    from posprobe.report.result import Result

__all__ = ["Bucket", "BrittlenessConfig", "parse_bucket", "min_length", "check_length", "jitter_pairs",
           "pairs_in_bucket", "run_brittleness", "summarize_brittleness", "figure_brittleness", "COLUMNS",
           "DEFAULT_BUCKETS", "DEFAULT_SIGMAS", "SEED_STRIDE", "title", "figures", "sections"]

def _noise(sigma: float, seed: int, n: int) -> torch.Tensor:
    # One call draws all n values, and n is part of the rule: the first m values of an n-value call need not equal an
    # m-value call (torch 2.13 CPU: they differ for 8 of 32 and 300 of 512). The rule is stated in `jitter_pairs`.
    import torch

    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(n, generator=g, dtype=torch.float64) * sigma


def jitter_pairs(sigma: float, bucket: str | Bucket, *, seed: int = 0, n_max: int) -> PairRule:
    """The PairRule that moves key j to j + e_j for the (query i, key j) pairs in `bucket`, every other pair (and
    every query) at its own position.

    e = torch.randn(n_max, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * sigma, one value per
    key index 0..n_max-1 (tokens), drawn once: per key, not per pair (see the module docstring). View 0 is the model's
    own positions, view 1 (query i, key j + e_j); the selector picks view 1 for near:K (1 <= i - j <= K) or far:D
    (i - j > D). Sigma 0 is the unmodified model (to float rounding: the engine's rotation is HF's). A sequence
    longer than n_max is refused when the engine asks for a key past it."""
    from posprobe.core.surgery import PairRule

    s = check_sigma(sigma)
    b = bucket if isinstance(bucket, Bucket) else parse_bucket(bucket)
    if n_max < 1:
        raise ValueError(f"n_max must be >= 1; got {n_max}")
    e = _noise(s, seed, n_max)

    def keys(j: torch.Tensor) -> torch.Tensor:
        idx = j.long()
        if idx.numel() and int(idx.max()) >= n_max:
            raise ValueError(f"jitter rule drawn for {n_max} keys asked for key {int(idx.max())}: build it with "
                             "n_max >= the sequence length")
        return j + e[idx].to(j.device)

    def select(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        d = i[:, None] - j[None, :]
        inside = (d >= 1) & (d <= b.distance) if b.kind == "near" else d > b.distance
        return inside.long()

    def same(p: torch.Tensor) -> torch.Tensor:
        return p

    return PairRule(f"jitter:{b.spec},sigma={s:g},seed={seed}", ((same, same), (same, keys)), select=select,
                    meta={"preset": "jitter", "bucket": b.spec, "sigma": s, "seed": int(seed), "n_max": int(n_max)})


def pairs_in_bucket(bucket: str | Bucket, length: int) -> float:
    """Mean over the scored queries i = 0..length-2 of the keys j <= i with (i, j) in `bucket` (pairs per query)."""
    b = bucket if isinstance(bucket, Bucket) else parse_bucket(bucket)
    if length < 2:
        raise ValueError(f"length must be >= 2; got {length}")
    per = [min(b.distance, i) if b.kind == "near" else max(0, i - b.distance) for i in range(length - 1)]
    return sum(per) / len(per)


def _bos(tokenizer: Any) -> list[int]:
    # The BOS the tokenizer adds by itself (none for SmolLM2), as the long-context harness frames its windows.
    return list(tokenizer("", add_special_tokens=True)["input_ids"])


def _windows(data: str | Sequence[Sequence[int]] | None, tokenizer: Any, cfg: BrittlenessConfig,
             source: str | None) -> tuple[list[list[int]], dict, str]:
    """(windows, data meta, how they were made) from a text, given token windows, or the built-in corpus."""
    from posprobe.data import BUILTIN_CORPUS_SOURCE, builtin_corpus, framed_windows
    from posprobe.report.schema import data_meta, text_sha256

    if data is None or isinstance(data, str):
        text = builtin_corpus() if data is None else data
        if not text.strip():
            raise ValueError("the text is empty")
        if tokenizer is None:
            raise ValueError("give the tokenizer to cut a text into windows (run_brittleness(model, text, "
                             "tokenizer=...)), or pass token windows")
        bos = _bos(tokenizer)
        body = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(body) + len(bos) < cfg.window:
            raise ValueError(f"the text has {len(body) + len(bos)} tokens, fewer than one window of {cfg.window}: "
                             "give a longer text or a smaller window")
        windows = framed_windows(body, cfg.window, pre=bos, max_windows=cfg.max_windows)
        src = source or (BUILTIN_CORPUS_SOURCE if data is None else "text")
        return windows, data_meta(src, n_items=len(windows), unit="windows", sha256=text_sha256(text)), "text"
    windows = [[int(t) for t in w] for w in data]
    if not windows:
        raise ValueError("no token windows given")
    flat = ",".join(";".join(map(str, w)) for w in windows)
    return windows, data_meta(source or "token windows", n_items=len(windows), unit="windows",
                              sha256=text_sha256(flat)), "token windows"


def _check(hf: Any, windows: list[list[int]], cfg: BrittlenessConfig) -> None:
    """Every check that can fail, before the first forward."""
    from posprobe.backend.facts import hf_trained_context, hf_vocab_size
    from posprobe.core import long_engine as LA

    if not hasattr(hf, "get_decoder") or not hasattr(hf, "get_output_embeddings"):
        raise ValueError(f"key-position jitter needs a Hugging Face causal LM; got {type(hf).__name__}")
    LA.require_supported(hf, "Key-position jitter")
    check_length(min(len(w) for w in windows), cfg.buckets)
    buckets = [parse_bucket(b) for b in cfg.buckets]
    vocab = hf_vocab_size(hf)
    bad = [t for w in windows for t in w if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary of {vocab}")
    ctx = hf_trained_context(hf)
    longest = max(len(w) for w in windows)
    if ctx is not None and longest > ctx:
        raise ValueError(f"a window of {longest} tokens is past the model's trained context of {ctx}: the loss would "
                         "mix brittleness with extrapolation; use a smaller window")
    LA.check_memory(hf, longest, jitter_pairs(1.0, buckets[0], n_max=longest), chunk=cfg.chunk)


def run_brittleness(model: Any, data: str | Sequence[Sequence[int]] | None = None,
                    config: BrittlenessConfig | None = None, *, tokenizer: Any = None, name: str | None = None,
                    source: str | None = None, **options: Any) -> Result:
    """Loss (nats/token) vs Gaussian noise (tokens) on the key positions of the pairs in each distance bucket.

    Every check (buckets, sigmas, window lengths, rotary model, vocabulary, context, memory) runs before the first
    forward pass.

    Args:
        model: a plain Hugging Face RoPE causal LM with its `tokenizer` (`load_hf_model`), or a TransformerBridge
            (the HF model inside runs; the tokenizer defaults to the bridge's).
        data: a text (cut into `window`-token windows, the tokenizer's own BOS first where it adds one), a list
            of token-id windows (used whole: `window` and `max_windows` then do not apply), or None for
            posprobe's built-in corpus.
        config: the analysis's options (None: its Config's defaults).
        tokenizer: the tokenizer of a plain Hugging Face `model` (default for a bridge: the bridge's).
        name: the model's name in the tables (default: the model's own).
        source: what meta.json's data record names as the data (default: "posprobe built-in corpus (CC0)",
            "text" or "token windows").
        **options: override fields of `config`
            (`run_brittleness(m, text, tokenizer=tok, sigmas=(0, 4), buckets=("near:4",))`).

    Returns:
        A Result with tables `brittleness` (model, bucket, sigma, window, nll: mean over the window's predicted
            tokens, n_pairs_jittered, count: predicted tokens) and `brittleness_summary` (per bucket and sigma:
            nll mean over windows, delta_nll = mean increase over sigma 0 on the same windows with a 95%
            percentile-bootstrap interval over windows in ci_low / ci_high, NaN with fewer than two windows;
            count = windows).

    Examples:
        >>> import posprobe as pp
        >>> cfg = pp.BrittlenessConfig(window=32, max_windows=2, sigmas=(1.0,), buckets=("near:2",), n_bootstrap=50,
        ...                            progress=False)
        >>> result = pp.run_brittleness(pp.load_model("tiny-rope"), None, cfg)
        >>> sorted(result.tables)
        ['brittleness', 'brittleness_summary']
        >>> result.tables["brittleness_summary"][["bucket", "sigma"]].values.tolist()  # sigma 0: the clean reference
        [['near:2', 0.0], ['near:2', 1.0]]
    """
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from posprobe.backend.facts import hf_facts, hf_trained_context
    from posprobe.backend.kind import is_bridge
    from posprobe.backend.model import hf_model_name, model_name, tokenizer_of
    from posprobe.core import long_engine as LA
    from posprobe.core.surgery import identity_pairs
    from posprobe.report.result import Result
    from posprobe.report.schema import make_meta

    cfg = config or BrittlenessConfig()
    if options:
        cfg = replace(cfg, **options)
    if isinstance(data, str) and not data.strip():
        raise ValueError("the text is empty")
    if is_bridge(model):
        # A bridge re-implements attention, which the engine's attention function would never reach: run the HF model
        # it wraps with HF's own attention modules (as the long-context harness does).
        from posprobe.backend.fast_attention import hf_model_inside

        with hf_model_inside(model) as inner:
            return run_brittleness(inner, data, cfg, tokenizer=tokenizer or tokenizer_of(model),
                                   name=name or model_name(model), source=source)
    hf = model
    windows, data_info, made_from = _windows(data, tokenizer, cfg, source)
    _check(hf, windows, cfg)
    name = name or hf_model_name(hf)
    buckets = [parse_bucket(b) for b in cfg.buckets]
    moved = [s for s in cfg.sigmas if s > 0]
    seeds = [cfg.seed * SEED_STRIDE + w for w in range(len(windows))]
    nll: dict[tuple[str, float, int], float] = {}
    with tqdm(total=len(windows) * (1 + len(buckets) * len(moved)), desc="brittleness", unit="forward",
              disable=not cfg.progress) as bar:
        for w, ids in enumerate(windows):
            t = torch.tensor(ids)
            base = float(LA.token_nll(hf, t, identity_pairs()).double().mean())
            bar.update()
            for b in buckets:
                nll[(b.spec, 0.0, w)] = base
                for s in moved:
                    rule = jitter_pairs(s, b, seed=seeds[w], n_max=len(ids))
                    nll[(b.spec, s, w)] = float(LA.token_nll(hf, t, rule, chunk=cfg.chunk).double().mean())
                    bar.update()
    rows = [dict(model=name, bucket=b.spec, sigma=s, window=w, nll=nll[(b.spec, s, w)],
                 n_pairs_jittered=pairs_in_bucket(b, len(windows[w])), count=len(windows[w]) - 1)
            for b in buckets for s in cfg.sigmas for w in range(len(windows))]
    table = pd.DataFrame(rows)
    summary = summarize_brittleness(table, n_bootstrap=cfg.n_bootstrap, seed=cfg.seed)
    facts = hf_facts(hf, name).summary()
    meta = make_meta(
        "brittleness", model=facts, data=data_info, config=cfg, windows_from=made_from,
        window_lengths=sorted({len(w) for w in windows}), trained_ctx=hf_trained_context(hf),
        noise={"rule": "key j of a pair in the bucket moves to j + e_j, e_j = sigma * z_j, z = torch.randn(n, "
                       f"generator=torch.Generator().manual_seed(seed * {SEED_STRIDE} + window), dtype=float64), "
                       "n = the window's length; the query stays at i; pairs outside the bucket keep i - j",
               "per": "key", "seeds": seeds},
        baseline="sigma 0: the model's own forward (one per window, shared by every bucket)",
        columns=dict(COLUMNS),
    )
    return Result({"brittleness": table, "brittleness_summary": summary}, meta)


def summarize_brittleness(table: pd.DataFrame, *, n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per model, bucket and sigma of a `brittleness` table: nll (mean over windows, nats/token), delta_nll (mean
    over windows of nll minus the same window's sigma-0 nll), its 95% percentile-bootstrap interval over windows
    (ci_low, ci_high; NaN with fewer than two windows), n_pairs_jittered (mean), count (windows)."""
    import numpy as np
    import pandas as pd

    from posprobe.core.stats import bootstrap_ci

    out = []
    for (model, bucket), part in table.groupby(["model", "bucket"], sort=False):
        base = part[part.sigma == 0].set_index("window").nll
        if base.empty:
            raise ValueError(f"bucket {bucket}: the table has no sigma-0 rows to measure the increase from")
        for sigma, rows in part.groupby("sigma", sort=True):
            delta = (rows.set_index("window").nll - base).dropna().to_numpy()
            if sigma == 0:
                lo = hi = 0.0
            elif len(delta) >= 2:
                lo, hi = bootstrap_ci(delta, n_boot=n_bootstrap, seed=seed)
            else:
                lo = hi = float("nan")
            out.append(dict(model=model, bucket=bucket, sigma=float(sigma), nll=float(rows.nll.mean()),
                            delta_nll=float(np.mean(delta)), ci_low=lo, ci_high=hi,
                            n_pairs_jittered=float(rows.n_pairs_jittered.mean()), count=int(len(rows))))
    return pd.DataFrame(out)
