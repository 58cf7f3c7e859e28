"""The context-extension methods of `posprobe zoo extend`, one row each (`ExtendMethod`), as a zoo member is one
`Member` row and a preset one registry entry. A row says what the method does to a member: the HF `rope_parameters`
it carries (the numbers through `posprobe.rope_theory`, the papers' formulas), or the class-dependent config fields
(DroPE), whether it fine-tunes at L or L', its batches where they differ (PoSE), its change to the loaded model
(copy), its per-band table (YaRN) and which members it applies to. A new method is one `register(ExtendMethod(...))`
plus its test (docs/contributing.md).

s = L'/L, b the member's base, d the dims its frequency exponent runs over (the rotated dims; the whole head for
p-RoPE's `proportional` type, whose removed bands keep their place in the exponent). Torch-free at import."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from posprobe.backend.families import ALIBI, LEARNED, NOPE, RELATIVE, SINUSOIDAL

__all__ = ["ABF_REFERENCE", "METHODS", "POSE_TEXT_WINDOW", "YARN_REFERENCE", "ExtendMethod", "RopeCase",
           "abf_default_base", "check_hf_carries", "control_method", "copy_rows", "drope_config",
           "method_rope_parameters", "pose_batch", "register", "scaled_yarn_betas", "yarn_bands"]

#: PoSE's text window: the released code reads up to 5L tokens of a document and takes both chunks from them.
POSE_TEXT_WINDOW = 5
#: YaRN's reference setting (Peng et al. 2023, Llama 2): L = 4,096, base 1e4, beta = 32, alpha = 1 turns within L.
YARN_REFERENCE = (4096, 10000.0, 32.0, 1.0)
#: Xiong et al. 2023 (ABF): base 1e4 -> 5e5 for Llama 2 from 4,096 to 32,768 tokens (s = 8), a x50 base.
ABF_REFERENCE = (50.0, 8.0)


@dataclass(frozen=True)
class RopeCase:
    """A rotary member's own HF `rope_parameters` and head dim, extended from `length` to `target` tokens, with the
    user's choices (`abf_base`, `custom` rope_parameters, `yarn_ramp`)."""

    rope: dict
    head_dim: int
    length: int
    target: int
    abf_base: float | None = None
    custom: dict | None = None
    yarn_ramp: str = "paper"

    @property
    def scale(self) -> float:
        """s = L'/L."""
        return self.target / self.length

    @property
    def kind(self) -> str:
        """The member's rope type (default or proportional)."""
        return self.rope.get("rope_type", "default")

    @property
    def base(self) -> float:
        """The member's rope base b."""
        return float(self.rope["rope_theta"])

    @property
    def spec(self) -> Any:
        """The member's plain table (a `posprobe.rope.RotarySpec`) over the dims its frequency exponent 2j/d runs
        over: the rotated dims for default (partial rotary included), the whole head for proportional."""
        from posprobe.rope import RotarySpec  # torch: imported when a method is planned, not when the CLI parses

        prf = float(self.rope.get("partial_rotary_factor", 1.0))
        d = self.head_dim if self.kind == "proportional" else int(self.head_dim * prf)
        return RotarySpec(rotary_dim=d, base=self.base)


@dataclass(frozen=True)
class ExtendMethod:
    """One context-extension method. `rope(case) -> (rope_parameters, notes)` for a rotary member, or
    `config(folder, target) -> (rope_parameters, config fields, notes)` where what HF carries depends on the class;
    neither: a control that keeps the positions (non-rotary members fine-tuned at L'). `controls`: the non-rotary
    families it is the control method of; `rotary`: whether it applies to rotary members (else `why_not_rotary`).
    `at_train_length`: fine-tuned at L (else L'); `batches(ids, step, job) -> (ids, position ids)` replaces the
    text windows; `prepare(model, job)` edits the loaded member before fine-tuning; `notes(L, L')` for a control;
    `bands(job) -> DataFrame` a per-band table for the Result; `option`: the ExtendConfig field it reads (set: the
    method is added; unset: it is refused); `default`: in the default method list."""

    name: str
    help: str
    rope: Callable[[RopeCase], tuple[dict, dict]] | None = None
    config: Callable[[Path, int], tuple[dict, dict, dict]] | None = None
    rotary: bool = True
    why_not_rotary: str = ""
    controls: frozenset = frozenset()
    control_note: str = ""
    at_train_length: bool = False
    batches: Callable[[Any, int, Any], tuple[Any, Any]] | None = None
    prepare: Callable[[Any, Any], None] | None = None
    notes: Callable[[int, int], dict] | None = None
    bands: Callable[[Any], Any] | None = None
    option: str | None = None
    default: bool = False

    def carried(self, folder: Path, case: RopeCase) -> tuple[dict, dict, dict]:
        """(rope_parameters, further HF config fields, notes) of a rotary member at `folder` under this method,
        checked to be what its HF config can carry; ValueError with the reason otherwise."""
        if self.config is not None:
            return self.config(folder, case.target)
        rope, notes = _rope_by_row(self.name, case)
        check_hf_carries(folder, rope, case.target)
        return rope, {}, notes


#: The registry, in the order methods are listed and run.
METHODS: dict[str, ExtendMethod] = {}


def register(method: ExtendMethod) -> ExtendMethod:
    """Add `method` to the registry (its name must be new); returns it."""
    if method.name in METHODS:
        raise ValueError(f"extension method {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def control_method(family: str) -> str:
    """The method a non-rotary member of `family` is extended with (its control)."""
    return next(m.name for m in METHODS.values() if family in m.controls)


def method_rope_parameters(method: str, rope: dict, head_dim: int, length: int, target: int, *,
                           abf_base: float | None = None, custom: dict | None = None,
                           yarn_ramp: str = "paper") -> tuple[dict, dict]:
    """(the HF `rope_parameters` of a member whose own are `rope` (head dim `head_dim`) extended by `method` from
    `length` to `target` tokens, notes: the numbers chosen), by the method's row. ValueError with one sentence where
    HF's config cannot carry the method for this rope type (p-RoPE's `proportional` type has no YaRN), or for a type
    whose table changes with the input. `drope`'s removal depends on the class (`drope_config`), not on rope alone."""
    return _rope_by_row(method, RopeCase(rope, head_dim, length, target, abf_base, custom, yarn_ramp))


def _rope_by_row(method: str, case: RopeCase) -> tuple[dict, dict]:
    if case.kind not in ("default", "proportional"):
        raise ValueError(f"the member's rope type {case.kind!r} is neither default nor proportional: this step "
                         "extends plain and p-RoPE members only")
    row = METHODS.get(method)
    if row is None or (row.rope is None and row.config is None):
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if row.rope is None:
        raise ValueError(f"{method} removes the rotation through the member's HF class: use {method}_config")
    return row.rope(case)


# ---- each method's rope_parameters --------------------------------------------------------------------------------

def _unchanged(case: RopeCase) -> tuple[dict, dict]:
    return dict(case.rope), {"scale": case.scale}


def _pose(case: RopeCase) -> tuple[dict, dict]:
    return dict(case.rope), {"scale": case.scale, "chunks": 2, "text_window": POSE_TEXT_WINDOW * case.length,
                             "positions": "unscaled"}


def _pi(case: RopeCase) -> tuple[dict, dict]:
    out = dict(case.rope)
    if case.kind == "default":
        out["rope_type"] = "linear"  # p-RoPE's proportional type takes the same factor
    out["factor"] = case.scale
    return out, {"scale": case.scale}


def _ntk(case: RopeCase) -> tuple[dict, dict]:
    from posprobe.rope_theory import ntk_aware_base

    spec = case.spec
    base = ntk_aware_base(spec, case.scale)  # bloc97: b s^{d/(d-2)}
    return {**case.rope, "rope_theta": base}, {"scale": case.scale, "ntk_base": base,
                                               "exponent_dims": spec.rotary_dim}


def _yarn(case: RopeCase) -> tuple[dict, dict]:
    if case.kind == "proportional":
        raise ValueError("HF's proportional rope type (p-RoPE) takes a PI factor but has no YaRN ramp, and its "
                         "yarn type would rotate only a quarter-width table without p-RoPE's removed bands: "
                         "yarn cannot be carried for this member (use pi, ntk or abf)")
    from posprobe.rope_theory import yarn_temperature

    s = case.scale
    out = {**case.rope, "rope_type": "yarn", "factor": s, "original_max_position_embeddings": case.length}
    notes = {"scale": s, "temperature": yarn_temperature(s), "rotary_dims": case.spec.rotary_dim,
             "ramp": case.yarn_ramp}
    if case.yarn_ramp == "scaled":
        fast, slow = scaled_yarn_betas(case.length, case.base)
        out.update(beta_fast=fast, beta_slow=slow)
        notes.update(beta_fast=fast, beta_slow=slow)
    return out, notes


def _abf(case: RopeCase) -> tuple[dict, dict]:
    base = float(case.abf_base) if case.abf_base is not None else abf_default_base(case.base, case.scale)
    return {**case.rope, "rope_theta": base}, {"scale": case.scale, "abf_base": base}


def _custom(case: RopeCase) -> tuple[dict, dict]:
    out = {**case.rope, **(case.custom or {})}
    new = out.get("rope_type", "default")
    if new in ("yarn", "llama3"):
        # HF would take it from max_position_embeddings, which the extended config sets to L'.
        out.setdefault("original_max_position_embeddings", case.length)
    if new in ("dynamic", "longrope"):
        raise ValueError(f"rope type {new!r} rebuilds its table from each input's length, so one checkpoint's "
                         "perplexity would depend on the lengths scored before it: not a fixed extension")
    if case.kind == "proportional" and new != "proportional":
        raise ValueError(f"p-RoPE's rope type is 'proportional'; rope_type {new!r} would drop its removed bands")
    return out, {"scale": case.scale}


def abf_default_base(base: float, scale: float) -> float:
    """The default ABF base for an extension by `scale`: Xiong et al.'s x50 for s = 8 kept per doubling of the
    context, b * 50^(log s / log 8) (x13.6 for s = 4: 1e4 -> 1.36e5). Scaling the base by the slowest wavelength
    over L' (the other reading of "scaled for this L") changes nothing here: at L = 128 the zoo's base 1e4 already
    has its slowest band turn ~276x more slowly than L, against Llama 2's ~13x at 4,096."""
    mult, ref_s = ABF_REFERENCE
    return float(base * mult ** (math.log(scale) / math.log(ref_s)))


def scaled_yarn_betas(length: int, base: float) -> tuple[float, float]:
    """(beta_fast, beta_slow) of the scaled YaRN ramp for a member of training length `length` and rope base `base`:
    the turns within L at which the ramp starts and ends are moved so that each boundary falls at the same fraction
    of the member's bands as the paper's beta = 32 and alpha = 1 do for Llama 2 (L = 4,096, base 1e4).

    Band j (of n) turns r = L / (2 pi b^(j/n)) times within L, so the band that turns r times sits at the fraction
    j/n = ln(L / (2 pi r)) / ln b of the bands, whatever n is: keeping that fraction gives
    r' = L / (2 pi) * b^(-ln(L_ref / (2 pi r)) / ln b_ref), and for the reference base simply r' = r L / L_ref
    (beta 1 and alpha 1/32 at L = 128). The band count drops out: the same share of every head's bands is kept
    (about the fastest third), ramped and interpolated as in Llama 2."""
    ref_len, ref_base, beta, alpha = YARN_REFERENCE

    def moved(turns: float) -> float:
        frac = math.log(ref_len / (2 * math.pi * turns)) / math.log(ref_base)
        return float(length / (2 * math.pi) * base ** (-frac))

    return moved(beta), moved(alpha)


def yarn_bands(job: Any) -> Any:
    """Per rotary band of a yarn run (`posprobe.zoo.extend.ExtendJob`): its period (tokens), turns within L, HF's
    gamma (ramp by band index, what the member gets) and the paper's (ramp by turns), both with the run's alpha =
    beta_slow and beta = beta_fast (the paper's 1 and 32, or the scaled ramp's), and the factor on its frequency
    ((1 - gamma)/s + gamma)."""
    import numpy as np
    import pandas as pd

    from posprobe.rope import RotarySpec
    from posprobe.rope_theory import band_periods, yarn_gamma

    rp = job.rope_parameters or {}
    spec = RotarySpec(rotary_dim=int(job.notes["rotary_dims"]), base=float(rp["rope_theta"]))
    alpha, beta = float(rp.get("beta_slow") or 1), float(rp.get("beta_fast") or 32)
    gamma = yarn_gamma(spec, job.length, alpha=alpha, beta=beta, ramp="band")
    paper = yarn_gamma(spec, job.length, alpha=alpha, beta=beta, ramp="turns")
    period = band_periods(spec)
    s = job.scale
    return pd.DataFrame({"member": job.member, "band": np.arange(spec.n_bands), "period": period,
                         "turns_in_L": job.length / period, "gamma": gamma, "gamma_paper": paper,
                         "freq_factor": (1 - gamma) / s + gamma})


# ---- what HF's config carries ------------------------------------------------------------------------------------

def check_hf_carries(folder: Path, rope: dict, target: int) -> None:
    """ValueError unless the member's HF config class accepts `rope` and its rope init builds a table of the member's
    width from it (checked on the config alone, no weights)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from posprobe.backend.loading import load_config

    try:
        old = load_config(folder)
        new = load_config(folder, rope_parameters=dict(rope), max_position_embeddings=target)
        before, after = (_inv_freq(c, ROPE_INIT_FUNCTIONS) for c in (old, new))
    except Exception as e:  # noqa: BLE001 - HF raises KeyError/ValueError/TypeError for fields a type lacks
        raise ValueError(f"HF's config cannot carry rope_parameters {rope}: {type(e).__name__}: {e}") from None
    if before.shape != after.shape:
        raise ValueError(f"rope_parameters {rope} give {after.shape[0]} rotary bands where the member has "
                         f"{before.shape[0]}")


def _inv_freq(config: Any, init: dict) -> Any:
    params = config.rope_parameters
    kind = params.get("rope_type", "default")
    if kind == "default":
        import torch

        prf = float(params.get("partial_rotary_factor", 1.0))
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return torch.zeros(int(hd * prf) // 2)
    return init[kind](config, "cpu")[0]


def drope_config(folder: Path, target: int) -> tuple[dict, dict, dict]:
    """(rope_parameters, further config fields, notes) that turn the rotation off in every layer of the HF member
    at `folder`, in its own class's config: `no_rope_layers` all 0 where the class has that field (SmolLM3: 1 = a
    rotary layer), else HF's `proportional` rope type with `partial_rotary_factor` 0 (p-RoPE at p = 0: every band
    removed, cos 1 and sin 0 over the whole head) where the class's rotary module then builds a table that turns
    nothing (GPT-NeoX, Llama). Checked on the config alone (the class's rotary module and its own init, built on the
    meta device). ValueError naming what HF cannot carry for any other class (one whose rotary positions are not
    read from rope_parameters, e.g. GPT-J's own `rotary_dim` table).

    GPT-NeoX's `default` type with partial_rotary_factor 0 (zero rotated dims) would say the same, but a table of
    zero bands is not read back by posprobe's backend, so the proportional form is used for every class."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from posprobe.backend.loading import load_config

    config = load_config(folder)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    layers = getattr(config, "no_rope_layers", None)
    if isinstance(layers, (list, tuple)) and len(layers) == config.num_hidden_layers:
        return rope, {"no_rope_layers": [0] * len(layers)}, {"removed": "no_rope_layers", "was": list(layers)}
    cannot = (f"HF's {config.model_type} config cannot carry a model without rotation: it has no no_rope_layers, "
              "and")
    if not rope:
        raise ValueError(f"{cannot} its rotary positions are not read from rope_parameters")
    new_rope = {**rope, "rope_type": "proportional", "partial_rotary_factor": 0.0}
    try:
        new = load_config(folder, rope_parameters=dict(new_rope), max_position_embeddings=target)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(new)
        emb = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
        kinds = {getattr(m, "rope_type", None) for m in emb}
        inv_freq = ROPE_INIT_FUNCTIONS["proportional"](new, "cpu")[0]
    except Exception as e:  # noqa: BLE001 - HF raises KeyError/ValueError/TypeError by class
        raise ValueError(f"{cannot} its config refuses the proportional rope type: {type(e).__name__}: {e}") from None
    if not emb or kinds != {"proportional"}:
        raise ValueError(f"{cannot} its rotary module does not take HF's proportional rope type (it reads "
                         f"{sorted(map(str, kinds)) or 'no rope_parameters'})")
    if inv_freq.numel() and bool((inv_freq != 0).any()):
        raise ValueError(f"{cannot} the proportional rope type with partial_rotary_factor 0 still turns")
    return new_rope, {}, {"removed": "rope_type proportional, partial_rotary_factor 0",
                          "was": {k: rope.get(k) for k in ("rope_type", "partial_rotary_factor")}}


# ---- batches and model edits where a method differs ---------------------------------------------------------------

def pose_batch(ids: Any, step: int, seed: int, batch_size: int, length: int, target: int) -> tuple[Any, Any]:
    """PoSE's `[batch_size, length]` (token ids, position ids) of optimiser step `step`, drawn from a generator
    seeded by (seed, step) alone (so a resumed run continues exactly), by the rule of the authors' released code
    (dwzhu-pku/PoSE, `train_preprocess_function_pose` in src/train_pose.py, after its 2023-10 revision), N = 2 chunks:

    - a text window of W = min(5L, len(ids)) tokens at a uniform start (the code reads up to 5L tokens of a document);
    - the first chunk's length l0 ~ U{1, ..., floor((L + 1) / 2)}, the second's L - l0;
    - the content skip v ~ U{0, ..., W - L}: chunk 1 is the window's first l0 tokens, chunk 2 its tokens
      l0 + v ... L - 1 + v (the code's rt2 ~ U{L, ..., W}, lt2 = rt2 - (L - l0));
    - the position skip u ~ U{0, ..., L' - L}, the first chunk's skip fixed at 0 (the revision's `lt = 0`): position
      ids 0 ... l0 - 1, then l0 + u ... L - 1 + u, so every id lies in [0, L') and the last reaches L' - 1 when u does.

    Each row's draws come in the order start, l0, v, u. Positions are used as they are (plain PoSE, no PI/YaRN)."""
    import torch

    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(step))
    window = min(POSE_TEXT_WINDOW * length, len(ids))

    def draw(low: int, high: int) -> int:  # uniform on {low, ..., high}
        return int(torch.randint(low, high + 1, (1,), generator=g))

    rows, positions = [], []
    for _ in range(batch_size):
        start = draw(0, len(ids) - window)
        l0 = draw(1, (length + 1) // 2)
        v = draw(0, window - length)
        u = draw(0, target - length)
        text = ids[start:start + window]
        rows.append(torch.cat([text[:l0], text[l0 + v:length + v]]))
        positions.append(torch.cat([torch.arange(l0), torch.arange(l0, length) + u]))
    return torch.stack(rows), torch.stack(positions)


def _pose_rows(ids: Any, step: int, job: Any) -> tuple[Any, Any]:
    return pose_batch(ids, step, job.seed, job.batch_size, job.length, job.target)


def copy_rows(model: Any, target: int) -> None:
    """Grow the learned position table of a GPT-2-class `model` in place from its L rows to `target` rows by copying:
    row t = row t mod L (Longformer's initialisation: RoBERTa's 512 rows copied to 4,096; Beltagy et al. 2020), and
    set the config's length to `target`, so the saved folder loads anywhere with a table of `target` rows.
    ValueError for a model without GPT-2's `transformer.wpe` table."""
    import torch

    from posprobe.backend.model import hf_learned_table

    wpe = hf_learned_table(model)
    if wpe is None:
        raise ValueError(f"copy grows GPT-2's learned table (transformer.wpe); {type(model).__name__} has none")
    old = wpe.weight.detach()
    rows = torch.arange(target, device=old.device) % old.shape[0]
    new = torch.nn.Embedding(target, old.shape[1], device=old.device, dtype=old.dtype)
    with torch.no_grad():
        new.weight.copy_(old[rows])
    model.transformer.wpe = new
    model.config.n_positions = target


# ---- the rows -----------------------------------------------------------------------------------------------------

register(ExtendMethod("direct", "fine-tune at L' with the positions as they are (Chen et al.'s baseline)",
                      rope=_unchanged, controls=frozenset({SINUSOIDAL, ALIBI, NOPE, RELATIVE}), default=True))
register(ExtendMethod("pi", "Position Interpolation: every frequency / s (HF rope_type linear, factor s)",
                      rope=_pi, default=True))
register(ExtendMethod("ntk", "NTK-aware base b s^(d/(d-2)) (bloc97; rope_theta)", rope=_ntk, default=True))
register(ExtendMethod("yarn", "YaRN: HF's ramp by band index, cos/sin x (0.1 ln s + 1) (rope_type yarn)",
                      rope=_yarn, bands=yarn_bands, default=True))
register(ExtendMethod("abf", "base change (Xiong et al. 2023): rope_theta -> abf_base", rope=_abf, default=True))
register(ExtendMethod("pose", "PoSE (Zhu et al. 2024): fine-tune at L with skip-wise position ids covering [0, L')",
                      rope=_pose, at_train_length=True, batches=_pose_rows))
register(ExtendMethod("drope", "DroPE (Gelberg et al. 2025): the rotation removed in every layer, recalibrated at L",
                      config=drope_config, at_train_length=True))
register(ExtendMethod("custom", "a user's own rope_parameters laid over the member's", rope=_custom,
                      option="rope_parameters"))
register(ExtendMethod("copy", "the learned member's control: its table grown to L' rows by copying (Longformer)",
                      rotary=False, controls=frozenset({LEARNED}),
                      why_not_rotary="copy grows a learned position table, and a rotary member has none (its "
                                     "positions are rotations)",
                      control_note="its learned table of L = {L} rows is grown to L' = {target} by copying rows, as "
                                   "Longformer's was, then fine-tuned at L'",
                      prepare=lambda model, job: copy_rows(model, job.target),
                      notes=lambda L, target: {"rows": f"row t = row t mod {L}", "from_rows": L, "to_rows": target}))

