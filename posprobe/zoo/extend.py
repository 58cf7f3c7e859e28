"""Context extension by fine-tuning (issue #49, first step): the zoo's members continued from their training length L
to L' under a positional method, each saved as an ordinary Hugging Face folder whose `config.json` carries the
method in HF's own `rope_parameters`, so `AutoModelForCausalLM.from_pretrained` gives the extended model anywhere.

Methods (s = L'/L, b the member's base, d the dims its frequency exponent runs over):
- `direct`: fine-tune at L' with the positions as they are (Chen et al.'s baseline);
- `pi`: Position Interpolation, every frequency theta_j / s (HF `rope_type="linear"`, `factor` s; p-RoPE's
  `proportional` type takes the same `factor`);
- `ntk`: NTK-aware base b' = b s^{d/(d-2)} (bloc97; `rope_theta`);
- `yarn`: YaRN (HF `rope_type="yarn"`, `factor` s, `original_max_position_embeddings` L: HF's ramp by band index
  between the bands that turn beta_fast = 32 and beta_slow = 1 times within L, cos/sin times 0.1 ln s + 1);
- `abf`: base change (Xiong et al. 2023; `rope_theta` -> `abf_base`);
- `pose`: PoSE (Zhu et al. 2024): fine-tune at L with skip-wise position ids covering [0, L') (`pose_batch`: the
  rule of the authors' released code), the rope as it is (`rope_parameters` unchanged, `max_position_embeddings` L');
- `drope`: DroPE (Gelberg et al. 2025): the rotation removed in every layer (HF's `no_rope_layers` all 0 where the
  class has it, else HF's `proportional` type with `partial_rotary_factor` 0: every band removed), recalibrated
  at L;
- `custom`: a user's own `rope_parameters` dict, laid over the member's.
Non-rotary members (sinusoidal, ALiBi, NoPE, T5) are the controls: fine-tuned at L' with the same budget (`direct`).
The learned member is a control too, by `copy`: its table of L rows grown to L' by copying rows 0..L-1 in turn
(row t = row t mod L, as Longformer initialised its 4,096 rows from RoBERTa's 512; Beltagy et al. 2020, Section 5),
then fine-tuned at L' like `direct`.

This module plans (every refusal raised before any training) and trains through the zoo's loop
(`train.train_member` started from the saved member); evaluation at the checkpoints is a callback given by the
caller (`posprobe.analyses.context_extension`), so the zoo stays a model factory. Torch-free at import."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

from posprobe.backend.families import LEARNED, ROTARY
from posprobe.core.config import option
from posprobe.zoo.config import ZooConfig
from posprobe.zoo.folder import extended_folder_name, read_zoo
from posprobe.zoo.members import member

__all__ = ["ABF_REFERENCE", "DEFAULT_METHODS", "METHODS", "YARN_REFERENCE", "ExtendConfig", "ExtendJob",
           "abf_default_base", "copy_rows", "drope_config", "extend_member", "method_rope_parameters", "plan_extension",
           "pose_batch", "scaled_yarn_betas", "steps_to_threshold"]

METHODS = ("direct", "pi", "ntk", "yarn", "abf", "pose", "drope", "custom", "copy")
#: The methods that fine-tune at the member's own length L (the others at L').
AT_L = ("pose", "drope")
#: PoSE's text window: the released code reads up to 5L tokens of a document and takes both chunks from them.
POSE_TEXT_WINDOW = 5
#: YaRN's reference setting (Peng et al. 2023, Llama 2): L = 4,096, base 1e4, beta = 32, alpha = 1 turns within L.
YARN_REFERENCE = (4096, 10000.0, 32.0, 1.0)
DEFAULT_METHODS = ("direct", "pi", "ntk", "yarn", "abf")
#: The method the non-rotary controls are fine-tuned with (the learned member's: `LEARNED_CONTROL`).
CONTROL_METHOD = "direct"
#: The learned member's control: its table grown to L' rows by copying (Longformer), then fine-tuned at L'.
LEARNED_CONTROL = "copy"
#: Xiong et al. 2023 (ABF): base 1e4 -> 5e5 for Llama 2 from 4,096 to 32,768 tokens (s = 8), a x50 base.
ABF_REFERENCE = (50.0, 8.0)
#: Passkey prompts per distance when the zoo was trained with the skill and none were asked for.
PASSKEY_TRIALS = 10
Method = Literal["direct", "pi", "ntk", "yarn", "abf", "pose", "drope", "custom", "copy"]


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


@dataclass(frozen=True, kw_only=True)
class ExtendConfig:
    """What `posprobe zoo extend` does: every chosen member x seed of a zoo continued from its length L to L' under
    each method, for `steps` optimiser steps through the zoo's loop (AdamW, cosine schedule with warmup, bit-exact
    resume), evaluated at `checkpoints` (0 = the method at inference only). Fields left None are derived per member
    from its zoo.json."""

    length: int | None = option(None, "target length L' in tokens (default: 4 x the members' training length L)")
    methods: tuple[Method, ...] = option(DEFAULT_METHODS, "methods for the rotary members (repeatable): direct, pi, "
                                                          "ntk, yarn, abf, pose, drope (custom is added by "
                                                          "--rope-parameters; copy: the learned member's control, "
                                                          "its table grown to L' rows by copying, as Longformer's)",
                                         flag="--method")
    members: tuple[str, ...] | None = option(None, "members to extend (repeatable; default: every member of the zoo, "
                                                   "the non-rotary ones fine-tuned directly as controls)",
                                             flag="--member")
    seeds: tuple[int, ...] | None = option(None, "seeds to extend (repeatable; default: every seed in the zoo)",
                                           flag="--seed")
    steps: int = option(200, "fine-tuning steps per member and method (Chen et al.: PI recovers within 200)")
    checkpoints: tuple[int, ...] = option((0, 25, 50, 100, 200), "steps at which each run is evaluated (0 = the "
                                                                 "method at inference only; the last step always)")
    batch_size: int | None = option(None, "sequences of L' tokens per step (pose, drope: of L tokens; default: the "
                                          "member's pre-training batch x L / L' (pose, drope: x 1), the same tokens "
                                          "per step)")
    lr: float | None = option(None, "peak AdamW learning rate (default: a tenth of the member's pre-training lr, "
                                    "continued training as Chen et al.'s 2e-5 after LLaMA's 3e-4)")
    warmup: int | None = option(None, "linear warmup steps (default: 20 as Chen et al., at most a tenth of the steps)")
    weight_decay: float = option(0.0, "AdamW weight decay on matrices (Chen et al. fine-tune with none)")
    grad_clip: float = option(1.0, "gradient norm clip")
    abf_base: float | None = option(None, "abf: the new rope base (default: Xiong et al.'s x50 for an 8x extension "
                                          "kept per doubling, b x 50^(log s / log 8): 1.36e5 from 1e4 for s = 4)")
    yarn_ramp: Literal["paper", "scaled"] = option(
        "paper", "yarn's ramp: paper (beta_fast 32, beta_slow 1 turns within L) or scaled (both moved so that each "
                 "ramp end falls at the same share of the bands as the paper's for Llama 2 at 4,096: beta x L/4096 "
                 "at base 1e4; some bands stay untouched at L = 128)")
    rope_parameters: dict | None = option(None, "", cli=False)
    eval_tokens: int = option(8192, "scored tokens per length and protocol at each checkpoint (as zoo eval, so "
                                    "'ppl at L' is one number in both; 4,096 halves the scoring time)")
    sliding: Literal["last", "every", "never"] = option(
        "last", "Press et al.'s sliding protocol (each block of L/2 targets scored at the end of its own window, ~8x "
                "the cost of chunks): on the unextended member and at the last checkpoint, at every checkpoint, or "
                "never; chunks (non-overlapping sequences) are scored at every checkpoint")
    mechanism: bool = option(True, "after the runs, the frequency pass on every member before and after each method: "
                                   "per head a(s) inside and beyond the trained length, Chen's bounds, band usage "
                                   "(seconds per model)")
    passkey_trials: int | None = option(None, "passkey prompts per distance at each checkpoint, for Chen et al.'s "
                                              "effective window (default: 10 when the zoo was trained with --passkey, "
                                              "else 0: not measured)")
    passkey_step: int | None = option(None, "tokens between the passkey distances measured, up to L' (default L/8)")
    passkey: float = option(0.0, "share of each fine-tuning batch replaced by passkey sequences of the batch's length "
                                 "(L', or L with skip-wise ids for pose; 0: the text alone, as Chen et al.)")
    checkpoint_every: int = option(25, "steps between saved training states (a killed run resumes from the last)")
    device: str = option("cpu", "", cli=False)
    progress: bool = option(True, "", cli=False)

    def __post_init__(self) -> None:
        methods = tuple(dict.fromkeys(self.methods))
        if self.rope_parameters is not None:
            if not isinstance(self.rope_parameters, dict) or not self.rope_parameters:
                raise ValueError("rope_parameters must be a non-empty JSON object of HF rope_parameters fields")
            methods = tuple(dict.fromkeys((*methods, "custom")))
        elif "custom" in methods:
            raise ValueError("method custom needs --rope-parameters JSON (a dict of HF rope_parameters fields)")
        bad = [m for m in methods if m not in METHODS]
        if bad or not methods:
            raise ValueError(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
        object.__setattr__(self, "methods", methods)
        if self.members is not None:
            object.__setattr__(self, "members", tuple(dict.fromkeys(self.members)))
            for name in self.members:
                member(name)  # an unknown name fails here, naming the known ones
        if self.seeds is not None:
            object.__setattr__(self, "seeds", tuple(dict.fromkeys(int(s) for s in self.seeds)))
        if self.length is not None and self.length < 2:
            raise ValueError(f"length must be >= 2 tokens, got {self.length}")
        for name in ("steps", "checkpoint_every", "eval_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.passkey_trials is not None and self.passkey_trials < 0:
            raise ValueError(f"passkey_trials must be >= 0, got {self.passkey_trials}")
        if not 0 <= self.passkey <= 1:
            raise ValueError(f"passkey must be a share in [0, 1], got {self.passkey}")
        if self.passkey_step is not None and self.passkey_step < 1:
            raise ValueError(f"passkey_step must be >= 1, got {self.passkey_step}")
        for name in ("batch_size", "warmup"):
            v = getattr(self, name)
            if v is not None and v < (1 if name == "batch_size" else 0):
                raise ValueError(f"{name} must be >= {1 if name == 'batch_size' else 0}, got {v}")
        if self.warmup is not None and self.warmup >= self.steps:
            raise ValueError(f"warmup must be < steps; got {self.warmup} with {self.steps} steps")
        cps = tuple(sorted({int(c) for c in self.checkpoints} | {self.steps}))
        if any(c < 0 or c > self.steps for c in cps):
            raise ValueError(f"checkpoints must lie in 0..steps ({self.steps}); got {self.checkpoints}")
        object.__setattr__(self, "checkpoints", cps)
        if (self.lr is not None and self.lr <= 0) or self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError("lr and grad_clip must be > 0 and weight_decay >= 0")
        if self.sliding not in ("last", "every", "never"):
            raise ValueError(f"sliding must be last, every or never; got {self.sliding!r}")
        if self.yarn_ramp not in ("paper", "scaled"):
            raise ValueError(f"yarn_ramp must be paper or scaled; got {self.yarn_ramp!r}")
        if self.abf_base is not None and self.abf_base <= 1:
            raise ValueError(f"abf_base must be > 1, got {self.abf_base}")

    def protocols_at(self, step: int | None) -> tuple[str, ...]:
        """Press et al.'s protocols scored at checkpoint `step` (None: the unextended member)."""
        sliding = self.sliding == "every" or (self.sliding == "last" and step in (None, self.steps))
        return ("chunks", "sliding") if sliding else ("chunks",)

    def passkey_trials_for(self, trained_with_passkey: bool) -> int:
        """Passkey prompts per distance: as asked, else `PASSKEY_TRIALS` when the members were trained with the
        skill and 0 when not."""
        if self.passkey_trials is not None:
            return self.passkey_trials
        return PASSKEY_TRIALS if trained_with_passkey else 0

    @property
    def default_warmup(self) -> int:
        """The warmup used when none is given: 20 steps (Chen et al.), at most a tenth of the steps."""
        return self.warmup if self.warmup is not None else min(20, self.steps // 10)


@dataclass(frozen=True)
class ExtendJob:
    """One fine-tuning run: a member folder of a zoo, the method, L -> L', and the run's derived settings."""

    member: str
    seed: int
    method: str
    source: Path
    record: dict
    length: int  # L (tokens)
    target: int  # L' (tokens)
    rope_parameters: dict | None  # the HF rope_parameters the extended member carries (None: non-rotary, unchanged)
    batch_size: int
    lr: float
    warmup: int
    notes: dict = field(default_factory=dict)
    overrides: dict = field(default_factory=dict)  # further HF config fields (drope: no_rope_layers)

    @property
    def scale(self) -> float:
        """s = L'/L."""
        return self.target / self.length

    @property
    def train_length(self) -> int:
        """The length of the fine-tuning sequences: L for pose and drope, L' for the others."""
        return self.length if self.method in AT_L else self.target

    @property
    def folder_name(self) -> str:
        """`<member>-s<seed>-<method>`: the extended member's folder inside the output."""
        return extended_folder_name(self.member, self.seed, self.method)

    def train_config(self, cfg: ExtendConfig) -> ZooConfig:
        """The zoo loop's config for this run: the member's widths at length L', the fine-tuning schedule."""
        w = self.record["widths"]
        return ZooConfig(members=(self.member,), seeds=(self.seed,), d_model=w["d_model"], n_layers=w["n_layers"],
                         n_heads=w["n_heads"], length=self.target, vocab_size=w["vocab_size"],
                         batch_size=self.batch_size, steps=cfg.steps, lr=self.lr, warmup=self.warmup,
                         weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                         checkpoint_every=cfg.checkpoint_every, passkey=cfg.passkey, device=cfg.device,
                         progress=cfg.progress)


def _rope_of(folder: Path) -> tuple[dict, int]:
    """(the member's HF rope_parameters, its head dim) from config.json."""
    c = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    rope = dict(c.get("rope_parameters") or {})
    if "rope_theta" not in rope and "rope_theta" in c:
        rope["rope_theta"] = c["rope_theta"]
    heads = c.get("num_attention_heads")
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return rope, int(head_dim)


def method_rope_parameters(method: str, rope: dict, head_dim: int, length: int, target: int, *,
                           abf_base: float | None = None, custom: dict | None = None,
                           yarn_ramp: str = "paper") -> tuple[dict, dict]:
    """(the HF `rope_parameters` of a member whose own are `rope` extended by `method` from `length` to `target`
    tokens, notes: the numbers chosen). ValueError with one sentence where HF's config cannot carry the method for
    this rope type (p-RoPE's `proportional` type has no YaRN), or for a type whose table changes with the input.
    `pose` keeps the rope as it is; `drope`'s removal depends on the class (`drope_config`), not on rope alone."""
    s = target / length
    kind = rope.get("rope_type", "default")
    base = float(rope["rope_theta"])
    prf = float(rope.get("partial_rotary_factor", 1.0))
    if kind not in ("default", "proportional"):
        raise ValueError(f"the member's rope type {kind!r} is neither default nor proportional: this step extends "
                         "plain and p-RoPE members only")
    # The dims the frequency exponent 2j/d runs over: the rotated dims for default (partial rotary included), the
    # whole head for proportional (its removed bands keep their place in the exponent).
    d = head_dim if kind == "proportional" else int(head_dim * prf)
    out = dict(rope)
    notes: dict[str, Any] = {"scale": s}
    if method in ("direct", "pose"):
        if method == "pose":
            notes.update(chunks=2, text_window=POSE_TEXT_WINDOW * length, positions="unscaled")
    elif method == "pi":
        if kind == "default":
            out["rope_type"] = "linear"
        out["factor"] = s
    elif method == "ntk":
        out["rope_theta"] = base * s ** (d / (d - 2))
        notes.update(ntk_base=out["rope_theta"], exponent_dims=d)
    elif method == "yarn":
        if kind == "proportional":
            raise ValueError("HF's proportional rope type (p-RoPE) takes a PI factor but has no YaRN ramp, and its "
                             "yarn type would rotate only a quarter-width table without p-RoPE's removed bands: "
                             "yarn cannot be carried for this member (use pi, ntk or abf)")
        out.update(rope_type="yarn", factor=s, original_max_position_embeddings=length)
        notes.update(temperature=0.1 * math.log(s) + 1, rotary_dims=d, ramp=yarn_ramp)
        if yarn_ramp == "scaled":
            fast, slow = scaled_yarn_betas(length, base)
            out.update(beta_fast=fast, beta_slow=slow)
            notes.update(beta_fast=fast, beta_slow=slow)
    elif method == "abf":
        out["rope_theta"] = float(abf_base) if abf_base is not None else abf_default_base(base, s)
        notes.update(abf_base=out["rope_theta"])
    elif method == "custom":
        out.update(custom or {})
        new = out.get("rope_type", "default")
        if new in ("yarn", "llama3"):
            # HF would take it from max_position_embeddings, which the extended config sets to L'.
            out.setdefault("original_max_position_embeddings", length)
        if new in ("dynamic", "longrope"):
            raise ValueError(f"rope type {new!r} rebuilds its table from each input's length, so one checkpoint's "
                             "perplexity would depend on the lengths scored before it: not a fixed extension")
        if kind == "proportional" and new != "proportional":
            raise ValueError(f"p-RoPE's rope type is 'proportional'; rope_type {new!r} would drop its removed bands")
    elif method == "drope":
        raise ValueError("drope removes the rotation through the member's HF class: use drope_config")
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    return out, notes


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
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from posprobe.backend import t5_decoder

    t5_decoder.register_auto_class()
    config = AutoConfig.from_pretrained(folder)
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
        new = AutoConfig.from_pretrained(folder, rope_parameters=dict(new_rope), max_position_embeddings=target)
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


def _check_hf_carries(folder: Path, rope: dict, target: int) -> None:
    """ValueError unless the member's HF config class accepts `rope` and its rope init builds a table of the member's
    width from it (checked on the config alone, no weights)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from posprobe.backend import t5_decoder

    t5_decoder.register_auto_class()
    try:
        old = AutoConfig.from_pretrained(folder)
        new = AutoConfig.from_pretrained(folder, rope_parameters=dict(rope), max_position_embeddings=target)
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


def plan_extension(zoo: str | Path, cfg: ExtendConfig) -> tuple[list[ExtendJob], list[dict]]:
    """(the runs, the combinations left out with their reason) for extending the zoo folder `zoo` under `cfg`.
    Members named in `cfg.members` must be runnable with every method asked; otherwise a ValueError says which and
    why, before any training. Without `cfg.members`, every rotary member gets every method HF can carry for it,
    non-rotary members are fine-tuned directly (the controls), and what cannot run is returned as left out."""
    found = read_zoo(zoo)
    named = cfg.members is not None
    seeds = sorted({int(r["seed"]) for _, r in found}) if cfg.seeds is None else list(cfg.seeds)
    names = list(dict.fromkeys(r["member"] for _, r in found)) if not named else list(cfg.members)
    by_key = {(r["member"], int(r["seed"])): (f, r) for f, r in found}
    missing = [f"{n}-s{s}" for n in names for s in seeds if (n, s) not in by_key]
    if missing and (named or cfg.seeds is not None):
        raise ValueError(f"{zoo} has no member folder {', '.join(missing)}")
    lengths = {int(r["widths"]["length"]) for _, r in found}
    if len(lengths) > 1:
        raise ValueError(f"{zoo} holds members of different training lengths {sorted(lengths)}; extend one at a time")
    L = lengths.pop()
    target = cfg.length if cfg.length is not None else 4 * L
    if target <= L:
        raise ValueError(f"the target length L' = {target} must be longer than the members' training length L = {L}")
    jobs, left_out = [], []
    for name in names:
        m = member(name)
        rotary = m.family == ROTARY
        if not rotary:
            control = LEARNED_CONTROL if m.family == LEARNED else CONTROL_METHOD
            asked = [x for x in cfg.methods if x != control]
            if named and asked:
                pose = (" (pose included: it reaches a model through HF's position_ids, which the ALiBi and T5 "
                        "classes do not read and NoPE has no use for)" if "pose" in asked else "")
                table = (f" (its learned table of L = {L} rows is grown to L' = {target} by copying rows, as "
                         "Longformer's was, then fine-tuned at L')" if control == LEARNED_CONTROL else "")
                raise ValueError(f"{name} has no rotary positions ({m.family} family), so {', '.join(asked)} "
                                 f"cannot apply to it{pose}: a non-rotary member is a control, extended with "
                                 f"--method {control} only{table}")
        elif LEARNED_CONTROL in cfg.methods:
            why = (f"{name} with {LEARNED_CONTROL}: copy grows a learned position table, and a rotary member has "
                   "none (its positions are rotations)")
            if named:
                raise ValueError(why)
            left_out.append({"member": name, "method": LEARNED_CONTROL, "why": why})
        methods = [x for x in cfg.methods if x != LEARNED_CONTROL] if rotary else [control]
        for method in methods:
            for seed in seeds:
                if (name, seed) not in by_key:
                    continue
                folder, rec = by_key[(name, seed)]
                rope, notes, overrides = None, {}, {}
                if method == LEARNED_CONTROL:
                    notes = {"rows": f"row t = row t mod {L}", "from_rows": L, "to_rows": target}
                if rotary:
                    own, head_dim = _rope_of(folder)
                    try:
                        if method == "drope":
                            rope, overrides, notes = drope_config(folder, target)
                        else:
                            rope, notes = method_rope_parameters(method, own, head_dim, L, target,
                                                                 abf_base=cfg.abf_base, custom=cfg.rope_parameters,
                                                                 yarn_ramp=cfg.yarn_ramp)
                            _check_hf_carries(folder, rope, target)
                    except ValueError as e:
                        why = f"{name} with {method}: {e}"
                        if named:
                            raise ValueError(why) from None
                        left_out.append({"member": name, "method": method, "why": why})
                        break
                at = L if method in AT_L else target
                batch = cfg.batch_size or max(1, round(int(rec["batch_size"]) * L / at))
                lr = cfg.lr if cfg.lr is not None else float(rec["lr"]) / 10
                jobs.append(ExtendJob(name, seed, method, folder, rec, L, target, rope, batch, lr,
                                      cfg.default_warmup, notes, overrides))
    if not jobs:
        raise ValueError(f"nothing to extend in {zoo}: " + "; ".join(r["why"] for r in left_out))
    return jobs, left_out


def load_start(job: ExtendJob) -> Any:
    """The member of `job` loaded from its folder with the method's config (float32, eager attention, training
    mode): the starting point of the fine-tuning, weights unchanged."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from posprobe.backend import t5_decoder

    t5_decoder.register_auto_class()
    if job.rope_parameters is None:
        config = AutoConfig.from_pretrained(job.source)
    else:
        config = AutoConfig.from_pretrained(job.source, rope_parameters=dict(job.rope_parameters),
                                            max_position_embeddings=job.target, **job.overrides)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Loading weights" bar would break the zoo's progress line
    try:
        model = AutoModelForCausalLM.from_pretrained(job.source, config=config, attn_implementation="eager",
                                                     dtype=torch.float32)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if job.method == LEARNED_CONTROL:
        copy_rows(model, job.target)
    return model.train()


def copy_rows(model: Any, target: int) -> None:
    """Grow the learned position table of a GPT-2-class `model` in place from its L rows to `target` rows by copying:
    row t = row t mod L (Longformer's initialisation: RoBERTa's 512 rows copied to 4,096; Beltagy et al. 2020), and
    set the config's length to `target`, so the saved folder loads anywhere with a table of `target` rows.
    ValueError for a model without GPT-2's `transformer.wpe` table."""
    import torch

    wpe = getattr(getattr(model, "transformer", None), "wpe", None)
    if not isinstance(wpe, torch.nn.Embedding):
        raise ValueError(f"copy grows GPT-2's learned table (transformer.wpe); {type(model).__name__} has none")
    old = wpe.weight.detach()
    rows = torch.arange(target, device=old.device) % old.shape[0]
    new = torch.nn.Embedding(target, old.shape[1], device=old.device, dtype=old.dtype)
    with torch.no_grad():
        new.weight.copy_(old[rows])
    model.transformer.wpe = new
    model.config.n_positions = target


def extend_member(job: ExtendJob, cfg: ExtendConfig, ids: Any, tokenizer: Any, folder: Path,
                  state_io: tuple[Callable[[], dict | None], Callable[[dict], None]], *,
                  on_checkpoint: Callable[[int, Any], Any] | None = None, later_steps: int = 0) -> dict:
    """Fine-tune `job`'s member on token ids `ids` at L' through the zoo's loop and save it at `folder` (an HF
    folder whose zoo.json says `extension`: method, L, L', rope_parameters). `on_checkpoint(step, model)` is called
    at `cfg.checkpoints` (model in eval mode) and its values kept in the training state. Returns the loop's record
    (losses in nats/token, seconds, tokens/s, `checkpoints`: [(step, value)])."""
    from posprobe.zoo.train import train_member

    extension = {"method": job.method, "from_length": job.length, "length": job.target, "scale": job.scale,
                 "source": job.source.name, "rope_parameters": job.rope_parameters, "notes": job.notes,
                 "config_fields": job.overrides, "train_length": job.train_length,
                 "steps": cfg.steps, "batch_size": job.batch_size, "lr": job.lr, "warmup": job.warmup}
    zoo_cfg = job.train_config(cfg)
    return train_member(job.member, job.seed, zoo_cfg, ids, tokenizer, folder, state_io,
                        later_steps=later_steps, start=lambda: load_start(job), checkpoints=cfg.checkpoints,
                        batches=job_batches(job, zoo_cfg, ids, tokenizer),
                        on_checkpoint=on_checkpoint, record={"extension": extension, "method": job.method},
                        label=f"extend {job.member} seed {job.seed} {job.method} {job.length}->{job.target}")


def job_batches(job: ExtendJob, zoo_cfg: ZooConfig, ids: Any, tokenizer: Any = None
                ) -> Callable[[int], tuple] | None:
    """The batches of `job`'s fine-tuning by step: PoSE's (ids, labels, position ids) at L, DroPE's windows of L
    (the zoo's `batch_ids` at L), None for the others (the loop's own windows of L'); each with passkey sequences at
    `zoo_cfg.passkey` (PoSE's keep the rows' skip-wise position ids)."""
    from posprobe.zoo.passkey import with_passkey
    from posprobe.zoo.train import batch_ids

    def mixed(x: Any, step: int) -> Any:
        return with_passkey(x, tokenizer, step, job.seed, zoo_cfg.passkey)

    if job.method == "pose":
        def pose(step: int) -> tuple:
            x, pos = pose_batch(ids, step, job.seed, job.batch_size, job.length, job.target)
            x = mixed(x, step)
            return x, x, pos
        return pose
    if job.method == "drope":
        at_l = replace(zoo_cfg, length=job.length)
        return lambda step: (lambda x: (x, x))(mixed(batch_ids(ids, step, at_l, job.seed), step))
    return None


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


def steps_to_threshold(curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first checkpoint step (ascending) whose value is <= `threshold` (e.g. ppl at L' against the unextended
    member's ppl at L); None if none is."""
    for step, value in sorted(curve):
        if value <= threshold:
            return int(step)
    return None
