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

Each method is one row of `posprobe.zoo.methods`. This module plans (every refusal raised before any training): a
run is an `ExtendJob`, handed to the zoo's loop as a `posprobe.zoo.job.Job` started from the saved member;
evaluation at the checkpoints is a callback given by the caller (`posprobe.analyses.context_extension`), so the zoo
stays a model factory. Torch-free at import."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

from posprobe.backend.families import ROTARY
from posprobe.core.config import option
from posprobe.zoo.config import ZooConfig
from posprobe.zoo.folder import extended_folder_name, member_folder_name, read_zoo
from posprobe.zoo.job import Job
from posprobe.zoo.members import member
from posprobe.zoo.methods import (
    ABF_REFERENCE,
    METHODS,
    POSE_TEXT_WINDOW,
    YARN_REFERENCE,
    RopeCase,
    abf_default_base,
    control_method,
    copy_rows,
    drope_config,
    method_rope_parameters,
    pose_batch,
    scaled_yarn_betas,
)

__all__ = ["ABF_REFERENCE", "DEFAULT_METHODS", "METHOD_NAMES", "POSE_TEXT_WINDOW", "YARN_REFERENCE", "ExtendConfig",
           "ExtendJob", "abf_default_base", "copy_rows", "drope_config", "job_batches", "method_rope_parameters",
           "plan_extension", "pose_batch", "scaled_yarn_betas", "steps_to_threshold"]

#: Every method's name, in the registry's order.
METHOD_NAMES = tuple(METHODS)
DEFAULT_METHODS = tuple(n for n, m in METHODS.items() if m.default)
#: Passkey prompts per distance when the zoo was trained with the skill and none were asked for.
PASSKEY_TRIALS = 10
Method = Literal[METHOD_NAMES]  # type: ignore[valid-type]  # the CLI's choices, from the rows


#: The checkpoints of `zoo extend` when none are given: those within the steps are kept (the last step is added).
DEFAULT_CHECKPOINTS = (0, 25, 50, 100, 200)


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
    checkpoints: tuple[int, ...] | None = option(None, "steps at which each run is evaluated (0 = the method at "
                                                       "inference only; the last step always; default: 0, 25, 50, "
                                                       "100, 200 where within the steps)")
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
        for row in METHODS.values():  # a method that reads an option: added when it is set, refused without it
            if row.option is not None and getattr(self, row.option) is not None:
                methods = tuple(dict.fromkeys((*methods, row.name)))
            elif row.option is not None and row.name in methods:
                raise ValueError(f"method {row.name} needs --{row.option.replace('_', '-')} JSON (a dict of HF "
                                 f"{row.option} fields)")
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
        given = self.checkpoints
        if given is None:
            given = [c for c in DEFAULT_CHECKPOINTS if c <= self.steps]
        cps = tuple(sorted({int(c) for c in given} | {self.steps}))
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
    def row(self) -> Any:
        """The method's row (`posprobe.zoo.methods.ExtendMethod`)."""
        return METHODS[self.method]

    @property
    def train_length(self) -> int:
        """The length of the fine-tuning sequences: L for the methods that train at L (pose, drope), else L'."""
        return self.length if self.row.at_train_length else self.target

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

    def start(self) -> Any:
        """The member loaded from its folder with the method's config (float32, eager attention, training mode) and
        the method's edit of the model (copy's grown table): the starting point of the fine-tuning."""
        from posprobe.backend.loading import load_causal_lm, load_config

        config = None if self.rope_parameters is None else load_config(
            self.source, rope_parameters=dict(self.rope_parameters), max_position_embeddings=self.target,
            **self.overrides)
        model = load_causal_lm(self.source, config=config, train=True)
        if self.row.prepare is not None:
            self.row.prepare(model, self)
        return model

    def job(self, cfg: ExtendConfig, ids: Any, tokenizer: Any) -> Job:
        """This run as a job of the zoo's loop: started from the saved member, fine-tuned on token ids `ids` by
        `cfg`'s schedule, looked at `cfg.checkpoints`, its folder's zoo.json saying `extension` (method, L, L',
        rope_parameters, settings) and `method`."""
        extension = {"method": self.method, "from_length": self.length, "length": self.target, "scale": self.scale,
                     "source": self.source.name, "rope_parameters": self.rope_parameters, "notes": self.notes,
                     "config_fields": self.overrides, "train_length": self.train_length,
                     "steps": cfg.steps, "batch_size": self.batch_size, "lr": self.lr, "warmup": self.warmup}
        zoo_cfg = self.train_config(cfg)
        return Job(self.member, self.seed, zoo_cfg, tokenizer, job_batches(self, zoo_cfg, ids, tokenizer),
                   start=self.start, record={"extension": extension, "method": self.method},
                   checkpoints=cfg.checkpoints, folder=self.folder_name,
                   unit=f"{self.member}/{self.seed}/{self.method}",
                   label=f"extend {self.member} seed {self.seed} {self.method} {self.length}->{self.target}")


def _rope_of(folder: Path) -> tuple[dict, int]:
    """(the member's HF rope_parameters, its head dim) from config.json."""
    c = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    rope = dict(c.get("rope_parameters") or {})
    if "rope_theta" not in rope and "rope_theta" in c:
        rope["rope_theta"] = c["rope_theta"]
    heads = c.get("num_attention_heads")
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return rope, int(head_dim)


def plan_extension(zoo: str | Path, cfg: ExtendConfig) -> tuple[list[ExtendJob], list[dict]]:
    """(the runs, the combinations left out with their reason) for extending the zoo folder `zoo` under `cfg`.
    Members named in `cfg.members` must be runnable with every method asked; otherwise a ValueError says which and
    why, before any training. Without `cfg.members`, every rotary member gets every method HF can carry for it,
    non-rotary members are fine-tuned by their control method (`posprobe.zoo.methods`), and what cannot run is
    returned as left out."""
    found = read_zoo(zoo)
    named = cfg.members is not None
    seeds = sorted({int(r["seed"]) for _, r in found}) if cfg.seeds is None else list(cfg.seeds)
    names = list(dict.fromkeys(r["member"] for _, r in found)) if not named else list(cfg.members)
    by_key = {(r["member"], int(r["seed"])): (f, r) for f, r in found}
    missing = [member_folder_name(n, s) for n in names for s in seeds if (n, s) not in by_key]
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
            control = control_method(m.family)
            asked = [x for x in cfg.methods if x != control]
            if named and asked:
                pose = (" (pose included: it reaches a model through HF's position_ids, which the ALiBi and T5 "
                        "classes do not read and NoPE has no use for)" if "pose" in asked else "")
                note = METHODS[control].control_note.format(L=L, target=target)
                raise ValueError(f"{name} has no rotary positions ({m.family} family), so {', '.join(asked)} "
                                 f"cannot apply to it{pose}: a non-rotary member is a control, extended with "
                                 f"--method {control} only{f' ({note})' if note else ''}")
        for other in (x for x in cfg.methods if rotary and not METHODS[x].rotary):
            why = f"{name} with {other}: {METHODS[other].why_not_rotary}"
            if named:
                raise ValueError(why)
            left_out.append({"member": name, "method": other, "why": why})
        methods = [x for x in cfg.methods if METHODS[x].rotary] if rotary else [control]
        for method in methods:
            row = METHODS[method]
            for seed in seeds:
                if (name, seed) not in by_key:
                    continue
                folder, rec = by_key[(name, seed)]
                rope, overrides = None, {}
                notes = row.notes(L, target) if row.notes is not None else {}
                if rotary:
                    own, head_dim = _rope_of(folder)
                    case = RopeCase(own, head_dim, L, target, cfg.abf_base, cfg.rope_parameters, cfg.yarn_ramp)
                    try:
                        rope, overrides, notes = row.carried(folder, case)
                    except ValueError as e:
                        why = f"{name} with {method}: {e}"
                        if named:
                            raise ValueError(why) from None
                        left_out.append({"member": name, "method": method, "why": why})
                        break
                at = L if row.at_train_length else target
                batch = cfg.batch_size or max(1, round(int(rec["batch_size"]) * L / at))
                lr = cfg.lr if cfg.lr is not None else float(rec["lr"]) / 10
                jobs.append(ExtendJob(name, seed, method, folder, rec, L, target, rope, batch, lr,
                                      cfg.default_warmup, notes, overrides))
    if not jobs:
        raise ValueError(f"nothing to extend in {zoo}: " + "; ".join(r["why"] for r in left_out))
    return jobs, left_out


def job_batches(job: ExtendJob, zoo_cfg: ZooConfig, ids: Any, tokenizer: Any = None) -> Callable[[int], tuple]:
    """The batches of `job`'s fine-tuning by step: the method's own where its row has them (PoSE's (ids, labels,
    position ids) at L), else the zoo's text windows at the run's training length (L for drope, L' for the others);
    each with passkey sequences at `zoo_cfg.passkey` (PoSE's keep the rows' skip-wise position ids)."""
    from posprobe.zoo.passkey import with_passkey
    from posprobe.zoo.train import text_windows

    own = job.row.batches
    if own is None:
        return text_windows(ids, tokenizer, replace(zoo_cfg, length=job.train_length), job.seed)

    def batches(step: int) -> tuple:
        x, pos = own(ids, step, job)
        x = with_passkey(x, tokenizer, step, job.seed, zoo_cfg.passkey)
        return x, x, pos

    return batches


def steps_to_threshold(curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first checkpoint step (ascending) whose value is <= `threshold` (e.g. ppl at L' against the unextended
    member's ppl at L); None if none is."""
    for step, value in sorted(curve):
        if value <= threshold:
            return int(step)
    return None
