"""`posprobe squish-study`: does a squished instruction still steer the model, and more globally? Checkable
instructions x questions x placements x distances x conditions, scored without a judge model."""

from __future__ import annotations

import argparse

HELP = ("Key-squishing study: built-in checkable instructions (language, case, keyword, ending, length, commas, JSON, "
        "persona) on many questions, as system message or user turn, after N filler turns, at normal positions, "
        "squished or moved; adherence with Wilson intervals and paired tests, acknowledgement, KL vs no instruction, "
        "attention on the instruction, reference-answer loss.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import SquishStudyConfig
    from posprobe.cli.args import add_config_arguments, add_model_arguments, add_output_arguments, add_resume_arguments

    add_model_arguments(p)
    p.add_argument("--questions-file", default=None,
                   help="your own questions: .jsonl with 'question' (and optional 'reference') per line, or one "
                        "question per line (replaces the built-in ones; --questions still takes the first N)")
    add_config_arguments(p, SquishStudyConfig)
    add_output_arguments(p, required=True)
    add_resume_arguments(p)


def run(args: argparse.Namespace) -> int:
    import sys

    from posprobe.analyses.configs import SquishStudyConfig
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args
    from posprobe.data.instructions import builtin_instructions, validate_checkers
    from posprobe.data.questions import builtin_questions, load_questions

    # Validation before torch is imported: bad input fails in about a second.
    if args.n_ctx is not None:
        raise ValueError("--n-ctx does not apply to squish-study (the model runs at full length)")
    config = config_from_args(SquishStudyConfig, args, progress=not args.no_progress)
    checks.check_out(args.out)
    checks.require_rotary(checks.peek_model(args), "squish-study")
    instructions = builtin_instructions(config.instructions)
    validate_checkers(instructions)
    if args.questions_file:
        questions = load_questions(args.questions_file)
        if config.questions < len(questions):
            questions = questions[:config.questions]
    else:
        questions = builtin_questions(config.questions)

    from posprobe.analyses.squish_study import run_squish_study
    from posprobe.backend.loading import load_hf_model
    from posprobe.report.checkpoint import discard_work_folder, work_folder_for
    from posprobe.report.squish_study import summary_text

    # Every finished cell is kept in <out>.work: a rerun of the same command resumes from there.
    work = work_folder_for(args.out)
    print(f"loading {args.model} ...", file=sys.stderr)
    model, tokenizer = load_hf_model(args.model, dtype=args.dtype, device=args.device)
    result = run_squish_study(model, config, tokenizer=tokenizer, instructions=instructions, questions=questions,
                              work=work, fresh=args.fresh)
    print(summary_text(result))
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    discard_work_folder(work)
    print(f"wrote {paths['report']}")
    return 0
