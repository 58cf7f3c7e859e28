"""`posprobe zoo`: train matched small causal LMs that differ only in their positions (`zoo train`), compare how
they extrapolate past the training length (`zoo eval`), run every positional analysis across them side by side
(`zoo atlas`), extend their context by fine-tuning (`zoo extend`), list the members (`zoo list`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

HELP = ("The positional zoo: small causal LMs that differ only in positions (learned, sinusoidal, ALiBi, rotary, "
        "partial rotary, p-RoPE, NoPE, RoPE/NoPE hybrid), trained here and compared side by side.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from dataclasses import fields

    from posprobe.analyses.configs import ExtrapolationConfig, ZooAtlasConfig
    from posprobe.cli.args import add_config_arguments, add_output_arguments, add_resume_arguments
    from posprobe.zoo.config import TaskConfig, ZooConfig
    from posprobe.zoo.extend import ExtendConfig

    sub = p.add_subparsers(dest="zoo_command", metavar="ZOO_COMMAND")
    t = sub.add_parser("train", help="train the zoo's members (each an ordinary Hugging Face folder)",
                       description="Train every member x seed on one byte-level BPE and one token order; a killed run "
                                   "resumes when the same command is repeated.")
    t.add_argument("--text", metavar="PATH", default=None,
                   help="training text (UTF-8; WikiText is detokenised); default: posprobe's built-in corpus, enough "
                        "for a smoke run only")
    t.add_argument("--eval-text", metavar="PATH", default=None,
                   help="held-out evaluation text (default: the last --eval-fraction of --text)")
    t.add_argument("--config", metavar="FILE", default=None,
                   help="JSON file of ZooConfig fields; flags given on the command line override it")
    t.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps or auto (default: the tier's)")
    add_config_arguments(t, ZooConfig)
    # Unset flags stay None, so a --config file's values are not overwritten by the fields' defaults.
    t.set_defaults(**{f.name: None for f in fields(ZooConfig)})
    from posprobe.zoo.corpus import CorpusConfig

    add_config_arguments(t, CorpusConfig)  # a `datasets` corpus instead of --text (docs/zoo.md#research-tier)
    t.add_argument("--budget-steps", type=int, default=None, metavar="N",
                   help="timed warm-up steps per member before training, for the estimated hours printed with N, D "
                        "and 6ND (default: 3, 0 on the cpu tier; 0: no warm-up)")
    t.add_argument("--out", metavar="DIR", required=True, help="new folder for the zoo (its parent must exist)")
    t.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    add_resume_arguments(t)
    e = sub.add_parser("eval", help="perplexity past the training length for every member (Press et al. 2022)",
                       description="Perplexity vs evaluation length (L to 8L) under both of Press et al.'s protocols "
                                   "for every member of the zoo folders and any other models named.")
    e.add_argument("models", nargs="+", metavar="MODEL", help="zoo folders, member folders or other model specs")
    e.add_argument("--text", metavar="PATH", default=None,
                   help="evaluation text (default: the zoo's held-out eval.txt)")
    e.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (default: cpu)")
    add_config_arguments(e, ExtrapolationConfig)
    add_output_arguments(e)
    a = sub.add_parser("atlas", help="every positional analysis across the members, side by side",
                       description="The shift test, position probes, head classes, head similarity, sinks, add or "
                                   "concatenate, score decomposition, RoPE frequency usage and perplexity past L on "
                                   "every member of the zoo folders and any other models named; one report.")
    a.add_argument("models", nargs="+", metavar="MODEL", help="zoo folders, member folders or other model specs")
    a.add_argument("--text", metavar="PATH", default=None, help="text (default: the zoo's held-out eval.txt)")
    a.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (default: cpu)")
    add_config_arguments(a, ZooAtlasConfig)
    add_output_arguments(a)
    from posprobe.analyses.configs import EmergenceConfig

    g = sub.add_parser("emergence", help="positional measurements at every saved step of training, against tokens",
                       description="Sinks, head classes and the shift test on every checkpoint of the zoo members "
                                   "(zoo train --save-every K) and on models named as MODEL@step<N> (a hub model's "
                                   "revisions, e.g. Pythia's), one number per metric against training tokens.")
    g.add_argument("models", nargs="+", metavar="MODEL",
                   help="zoo folders, member folders (their saved steps, then themselves) or MODEL@REVISION specs")
    g.add_argument("--text", metavar="PATH", default=None, help="text (default: the zoo's held-out eval.txt)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, mps or auto (default: cpu)")
    add_config_arguments(g, EmergenceConfig)
    add_output_arguments(g)
    k = sub.add_parser("tasks", help="train every member on copy, reverse, addition and sorting; accuracy up to 3L",
                       description="Kazemnejad et al.'s length generalisation: every member x seed trained on the "
                                   "synthetic tasks at instance lengths 1..L, exact-answer accuracy measured on "
                                   "lengths up to 3L; a killed run resumes when the same command is repeated.")
    k.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps or auto (default: the tier's)")
    add_config_arguments(k, TaskConfig)
    add_config_arguments(k, ZooConfig, skip=("length", "vocab_size", "eval_fraction", "steps", "batch_size", "tokens"))
    k.set_defaults(**{f.name: None for f in fields(ZooConfig)})
    k.add_argument("--out", metavar="DIR", required=True, help="new folder for the task zoo (its parent must exist)")
    k.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    add_resume_arguments(k)
    from posprobe.cli.main import docs_epilog

    x = sub.add_parser("extend", epilog=docs_epilog("docs/zoo-extend.md"),
                       help="continue every rotary member from L to L' under PI, NTK, YaRN, base change, PoSE, DroPE "
                            "(Chen et al., bloc97, Peng et al., Xiong et al., Zhu et al., Gelberg et al.); perplexity "
                            "curves",
                       description="Context extension by fine-tuning: every rotary member x seed of a zoo continued "
                                   "from its training length L to L' under each method (its config.json carries the "
                                   "method as HF's own rope_parameters or no_rope_layers; PoSE and DroPE train at "
                                   "L), the non-rotary members fine-tuned directly "
                                   "as controls; perplexity at L, L' and 2L' at each checkpoint. A killed run "
                                   "resumes when the same command is repeated.")
    x.add_argument("zoo", metavar="ZOO", help="a zoo folder written by posprobe zoo train")
    x.add_argument("--text", metavar="PATH", default=None,
                   help="fine-tuning text (default: the zoo's own training text where it can be had again: posprobe's "
                        "built-in corpus)")
    x.add_argument("--eval-text", metavar="PATH", default=None, help="evaluation text (default: the zoo's eval.txt)")
    x.add_argument("--rope-parameters", metavar="JSON", default=None,
                   help="method custom: a JSON object of HF rope_parameters laid over each rotary member's own, e.g. "
                        "'{\"rope_type\": \"linear\", \"factor\": 2}' (a yarn or llama3 type without "
                        "original_max_position_embeddings gets L)")
    x.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    add_config_arguments(x, ExtendConfig)
    x.add_argument("--out", metavar="DIR", required=True,
                   help="new folder for the extended members and the result (its parent must exist)")
    x.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    add_resume_arguments(x)
    st = sub.add_parser("extend-study", epilog=docs_epilog("docs/zoo-extend.md"),
                        help="several zoo extend runs side by side: passkey success within and beyond L with 95% "
                             "intervals, windows per seed, the bands turning within L and L/s, the fast-band share",
                        description="The head-dim x L table over `zoo extend` output folders trained with the "
                                    "passkey skill (benchmarks/pi_study.sh makes them): one row per head dim, L, "
                                    "fine-tuning, method and checkpoint, pooled over seeds.")
    st.add_argument("runs", nargs="+", metavar="RUN", help="folders written by posprobe zoo extend")
    st.add_argument("--steps", choices=("last", "all"), default="last",
                    help="each method at its last checkpoint (default) or at every checkpoint")
    st.add_argument("--min-skill", metavar="P", type=float, default=0.0,
                    help="leave out the seeds whose unextended member succeeds within L on less than this share of "
                         "its passkey trials (default 0: every seed; the table says how many were left out)")
    add_output_arguments(st)
    c = sub.add_parser("sink-control", help="a positive control for sinks: members trained on Bigram-Backcopy "
                                            "(Guo et al. 2024), their Sink_1^0.3, value drain and residual peak",
                       description="Members of 1-3 layers trained on the Bigram-Backcopy task (a bigram chain whose "
                                   "trigger characters are followed by a copy of the character before them), where "
                                   "attention sinks on the first token are known to form; Gu et al.'s Sink_1^0.3, the "
                                   "first token's value and residual norms and each head's active/dormant split, "
                                   "measured at step 0, on the way and at the end. A killed run resumes when the same "
                                   "command is repeated.")
    from posprobe.zoo.backcopy import BackcopyConfig

    c.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    add_config_arguments(c, BackcopyConfig)
    c.add_argument("--out", metavar="DIR", required=True, help="new folder for the control zoo (its parent must exist)")
    c.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    add_resume_arguments(c)
    sub.add_parser("list", help="the members, their families and blocks", description="The zoo's members.")


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "zoo_command", None)
    if command == "list":
        return _list()
    if command == "train":
        return _train(args)
    if command == "eval":
        return _eval(args)
    if command == "atlas":
        return _atlas(args)
    if command == "tasks":
        return _tasks(args)
    if command == "extend":
        return _extend(args)
    if command == "emergence":
        from posprobe.analyses.configs import EmergenceConfig

        return _across_models(args, EmergenceConfig,
                              ("posprobe.analyses.emergence", "run_emergence"),
                              ("posprobe.analyses.emergence", "printed_emergence"))
    if command == "extend-study":
        return _extend_study(args)
    if command == "sink-control":
        return _sink_control(args)
    raise ValueError("choose a zoo command: train, eval, atlas, emergence, tasks, extend, extend-study, sink-control "
                     "or list (posprobe zoo --help)")


def _list() -> int:
    from posprobe.zoo.members import MEMBERS

    for m in MEMBERS.values():
        print(f"{m.name:11s} {m.family:17s} block {m.block:6s} {m.model_type:9s} {m.positions}")
    return 0


def _zoo_flags(args: argparse.Namespace) -> dict:
    # The ZooConfig fields given on the command line (unset flags are None, so a --config file's values or the
    # fields' defaults apply), with the device and the progress switch.
    from dataclasses import fields

    from posprobe.zoo.config import ZooConfig

    flags = {f.name: getattr(args, f.name) for f in fields(ZooConfig) if getattr(args, f.name, None) is not None}
    flags = {k: tuple(v) if isinstance(v, list) else v for k, v in flags.items()}
    flags.update(device=args.device, progress=not args.no_progress)
    return {k: v for k, v in flags.items() if v is not None}


def _train(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from posprobe.cli import checks
    from posprobe.zoo.config import ZooConfig, load_config_file

    checks.check_out(args.out)
    flags = _zoo_flags(args)
    cfg = load_config_file(args.config, **flags) if args.config else ZooConfig(**flags)
    corpus = _corpus(args)
    text = checks.read_text_early(args.text)
    eval_text = checks.read_text_early(args.eval_text)
    out = Path(args.out)

    from posprobe.cli.threads import warn_if_busy
    from posprobe.data import builtin_corpus
    from posprobe.zoo.run import check_device, train_zoo

    check_device(cfg)
    warn_if_busy()
    if text is None and corpus is None:
        print("zoo: training on posprobe's built-in corpus (~13,600 words): a smoke run; pass --text or --dataset "
              "for a real corpus", file=sys.stderr)
    result = train_zoo(cfg, corpus or (text if text is not None else builtin_corpus()), out, eval_text=eval_text,
                       source=args.text or (None if corpus else "built-in corpus"), fresh=args.fresh,
                       budget_steps=args.budget_steps)
    print(summary_text(result))
    print(f"wrote {out} ({len(result.tables['members'])} members) and {out / 'training' / 'report.html'}")
    return 0


def _corpus(args: argparse.Namespace) -> Any:
    # The `datasets` corpus the flags name (None without --dataset), checked before anything heavy: --text and
    # --dataset together, corpus flags without --dataset, `datasets` missing, local files absent.
    from posprobe.cli.args import config_from_args
    from posprobe.zoo.corpus import CorpusConfig, check_corpus

    if args.budget_steps is not None and (args.budget_steps < 0 or args.budget_steps == 1):
        raise ValueError(f"--budget-steps must be 0 (no warm-up) or >= 2 (the first is not timed), got "
                         f"{args.budget_steps}")
    if not args.dataset:
        if args.data_files or args.dataset_config:
            raise ValueError("--data-files and --dataset-config need --dataset (json, text, parquet, csv or a hub "
                             "dataset name)")
        return None
    if args.text:
        raise ValueError("give --text or --dataset, not both")
    corpus = config_from_args(CorpusConfig, args)
    check_corpus(corpus)
    return corpus


def summary_text(result) -> str:
    """One line per trained member: family, block, parameters, final loss, tokens/s."""
    lines = []
    for r in result.tables["members"].itertuples():
        lines.append(f"[zoo] {r.model}: {r.family} ({r.block} block), {r.params / 1e6:.2f}M parameters, final "
                     f"training loss {r.loss:.3f} nats/token, {r.tokens_per_s / 1000:.1f}k tokens/s")
    return "\n".join(lines)


def _eval(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import ExtrapolationConfig

    return _across_models(args, ExtrapolationConfig, ("posprobe.analyses.atlas_many", "evaluate_zoo"),
                          ("posprobe.report.extrapolation", "ratio_table"))


def _atlas(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import ZooAtlasConfig

    return _across_models(args, ZooAtlasConfig, ("posprobe.analyses.atlas_many", "run_zoo_atlas"),
                          ("posprobe.report.zoo_atlas", "printed"))


def _across_models(args: argparse.Namespace, config_cls: type, run: tuple[str, str], table: tuple[str, str]) -> int:
    # An analysis over zoo folders and other models: config and text checked before any import of the heavy
    # modules (`run` and `table` name a module and a function), then run, summary table on stdout, result saved.
    import importlib

    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    checks.check_out(args.out)
    config = config_from_args(config_cls, args, progress=not args.no_progress)
    text = checks.read_text_early(args.text)
    fn, summary = (getattr(importlib.import_module(mod), name) for mod, name in (run, table))
    from posprobe.cli.threads import warn_if_busy
    from posprobe.zoo.folder import zoo_models

    zoo_models(args.models)  # a spec that is no model: refused in one line, before the busy warning or any load
    warn_if_busy()
    result = fn(args.models, config, text=text, source=args.text, device=args.device)
    return print_and_save(result, args, summary, "zoo")


def print_and_save(result: Any, args: argparse.Namespace, summary: Any, tag: str) -> int:
    """A result over several models on stdout (its summary table, then every model refused at all with why, each
    line tagged `[tag]`), saved to --out; returns the exit code 0."""
    said = summary(result)
    print(said if isinstance(said, str) else said.to_string(index=False))
    for model, why in refused_models(result):
        print(f"[{tag}] refused {model}: {why}")
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    print(f"wrote {paths['report']}")
    return 0


def refused_models(result) -> list[tuple[str, str]]:
    """(model, why) of every model given that could not be loaded or measured at all, in the order given."""
    t = result.tables.get("models")
    if t is None:  # zoo eval: a refused model is one perplexity row with its reason
        t = result.tables["perplexity"]
    bad = t[t["status"] == "refused"].drop_duplicates("model")
    return [(str(m), str(w).splitlines()[0] if isinstance(w, str) and w else "no reason recorded")
            for m, w in zip(bad["model"], bad["why"] if "why" in bad else [""] * len(bad))]


def _tasks(args: argparse.Namespace) -> int:
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args
    from posprobe.zoo.config import TaskConfig, ZooConfig

    checks.check_out(args.out)
    tasks = config_from_args(TaskConfig, args)
    cfg = ZooConfig(**_zoo_flags(args))

    from posprobe.report.zoo_tasks import accuracy_table
    from posprobe.zoo.run import check_device
    from posprobe.zoo.task_zoo import train_task_zoo

    check_device(cfg)
    from posprobe.cli.threads import warn_if_busy

    warn_if_busy()
    result = train_task_zoo(cfg, tasks, args.out, fresh=args.fresh)
    print(accuracy_table(result).to_string(index=False))
    print(f"wrote {args.out} ({len(result.tables['members'])} members) and {args.out}/tasks/report.html")
    return 0


def _sink_control(args: argparse.Namespace) -> int:
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args, resolve_device
    from posprobe.zoo.backcopy import BackcopyConfig

    checks.check_out(args.out)
    cfg = config_from_args(BackcopyConfig, args, device=resolve_device(args.device), progress=not args.no_progress)

    from posprobe.analyses.sink_control import run_sink_control
    from posprobe.cli.threads import warn_if_busy

    warn_if_busy()
    result = run_sink_control(cfg, args.out, fresh=args.fresh)
    print(sink_control_table(result).to_string(index=False))
    print(f"wrote {args.out} ({len(result.tables['members'])} members) and {args.out}/sink-control/report.html")
    return 0


def sink_control_table(result: Any) -> Any:
    """One row per model, layer and head at step 0 and at the last step.

    Args:
        result: a `run_sink_control` Result.

    Returns:
        A DataFrame: Gu et al.'s sink rate, the mean attention on the first token over all queries and over
        non-trigger queries, trigger queries' attention on the previous token, the first token's value-norm ratio and
        the layer's residual-norm ratio (first token / median of the others)."""
    h = result.tables["sink_heads"]
    h = h[h.step.isin([0, h.step.max()])]
    wide = h.pivot_table(index=["model", "step", "layer", "head"], columns="metric", values="value").reset_index()
    r = result.tables["residual_norms"]
    r = r[r.metric == "ratio"][["model", "step", "layer", "value"]].rename(columns={"value": "resid_ratio"})
    wide = wide.merge(r, on=["model", "step", "layer"], how="left")
    cols = {"sink_rate": "sink_rate", "first_attention": "first_attn", "dormant_first_attention": "nontrigger_first",
            "active_previous_attention": "trigger_prev", "first_value_norm_ratio": "value_ratio",
            "resid_ratio": "resid_ratio"}
    return wide[["model", "step", "layer", "head", *cols]].rename(columns=cols).round(3)


def _extend(args: argparse.Namespace) -> int:
    from pathlib import Path

    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args, json_object, resolve_device
    from posprobe.zoo.extend import ExtendConfig, plan_extension

    checks.check_out(args.out)
    cfg = config_from_args(ExtendConfig, args, rope_parameters=json_object(args.rope_parameters, "--rope-parameters"),
                           device=resolve_device(args.device),
                           progress=not args.no_progress)
    text = checks.read_text_early(args.text)
    eval_text = checks.read_text_early(args.eval_text)
    plan_extension(args.zoo, cfg)  # every refusal before anything heavy is imported or trained

    from posprobe.analyses.context_extension import extend_zoo
    from posprobe.cli.threads import warn_if_busy

    warn_if_busy()
    result = extend_zoo(args.zoo, cfg, args.out, text=text, source=args.text, eval_text=eval_text, fresh=args.fresh)
    from posprobe.report.zoo_extend import printed

    print(printed(result))
    print(f"wrote {args.out} ({len(result.tables['runs'])} extended members) and "
          f"{Path(args.out) / 'extend' / 'report.html'}")
    return 0



def _extend_study(args: argparse.Namespace) -> int:
    from posprobe.analyses.extend_study import extend_study, printed_study
    from posprobe.cli import checks

    checks.check_out(args.out)
    # reads tables only: every refusal before anything is written
    result = extend_study(args.runs, steps=args.steps, min_skill=args.min_skill)
    for x in result.meta["data"]["seeds_left_out"]:
        print(f"left out: head dim {x['head_dim']}, L = {x['L']}, {x['fine_tuning']}, seed {x['seed']} (its member "
              f"succeeds on {x['member_within_L']:.3f} within L, under --min-skill {args.min_skill:g})",
              file=sys.stderr)
    print(printed_study(result.tables["study"]))
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    print(f"wrote {paths['report']}")
    return 0
