"""`posprobe conform`: an engine's rotary positions for a model against Hugging Face's (argparse only at import)."""

from __future__ import annotations

import argparse

HELP = ("Check an engine's rotary positions for a model against Hugging Face's, which posprobe proves: per layer "
        "type, the engine's declared per-band frequencies and cos/sin multiplier (llama.cpp: the GGUF metadata and "
        "its rope options) against HF's, a mismatch named by its bug class (base off, scale off, attention factor "
        "missing or doubled, rotated dims, layer types swapped, a YaRN ramp off); the engine's next-token "
        "distributions against HF's on the same ids by position; cached against uncached scores around the position "
        "where a rope type switches; rotary phase error against position in bf16 / fp16 / float32 and the engine's "
        "own arithmetic.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli.args import add_config_arguments, add_output_arguments

    p.add_argument("model", metavar="MODEL", help="a GGUF file or a packaged GGUF model (smollm2, gemma3-270m)")
    p.add_argument("--rope-scaling", metavar="JSON", default=None,
                   help="the scaling under test, as HF rope_parameters, e.g. '{\"rope_type\": \"yarn\", \"factor\": "
                        "2}': laid over HF's config (its global layers where it has layer types) and given to the "
                        "engine as its options (llama.cpp: linear and yarn)")
    p.add_argument("--text", metavar="PATH", default=None,
                   help="behaviour and cache: the text whose token ids both sides read (default: posprobe's built-in "
                        "corpus)")
    add_config_arguments(p, _config_class())
    add_output_arguments(p)


def _config_class() -> type:
    from posprobe.analyses.configs import ConformConfig

    return ConformConfig


def run(args: argparse.Namespace) -> int:
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args, json_object

    checks.check_out(args.out)
    cfg = config_from_args(_config_class(), args, rope_scaling=json_object(args.rope_scaling, "--rope-scaling"))
    text = checks.read_text_early(args.text)

    from posprobe.analyses.conform import run_conform
    from posprobe.report.conform import summary_text

    # run_conform refuses a file that is not GGUF, a scaling the engine has no form of and a missing engine package
    # before HF is imported
    result = run_conform(args.model, cfg, text=text)
    print(summary_text(result))
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    print(f"wrote {paths['report']}")
    return 0
