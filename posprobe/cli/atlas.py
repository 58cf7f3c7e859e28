"""`posprobe atlas`: every positional analysis that applies to a model, bounded, in one report."""

from __future__ import annotations

import argparse
from typing import Any

from posprobe.analyses.configs import ATLAS_SECTIONS

HELP = ("One report on a model's positional machinery, every section that applies to the model: "
        + "; ".join(f"{s}: {e.help}" for s, e in ATLAS_SECTIONS.items()) + ".")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.analyses.configs import AtlasConfig
    from posprobe.cli.args import add_analysis_arguments

    add_analysis_arguments(p, AtlasConfig)
    p.add_argument("more_models", nargs="*", metavar="MODEL",
                   help="more models or zoo folders: with them, the atlas over many models side by side (the "
                        "machinery of posprobe zoo atlas; the sections both atlases have, the flags they share)")


def run(args: argparse.Namespace) -> int:
    from posprobe.analyses.configs import AtlasConfig
    from posprobe.cli import checks
    from posprobe.cli.args import config_from_args

    # Validation before torch / TransformerLens are imported: bad input fails in about a second.
    checks.check_out(args.out)
    config = config_from_args(AtlasConfig, args, progress=not args.no_progress)
    if args.more_models:
        return _many(args, config)
    config.check_one_model()
    early = checks.peek_model(args)
    if config.window is not None:  # the default is capped at the model's context; a given window must fit
        checks.check_window(early, args, config.window)
    ctx = checks.context(early, args)
    window = config.window_for(ctx) if ctx else config.window
    text = checks.read_text_early(args.text, window)  # None: the built-in corpus

    from posprobe.analyses.atlas import run_atlas
    from posprobe.backend.loading import load_model

    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    result = run_atlas(model, text, config, source=args.text)
    from posprobe.report.atlas import paragraph, skipped_sections

    for s in result.meta["sections"]:
        print(f"[{s}] {paragraph(result, s)}")
    for s, why in skipped_sections(result.meta):
        print(f"[{s}] not run: {why}")
    paths = result.save(args.out, figure_formats=args.figures, csv=args.csv)
    print(f"wrote {paths['report']} (and one folder per section)")
    return 0


def _many(args: argparse.Namespace, config: Any) -> int:
    # `posprobe atlas A B ...`: the atlas over many models, as `posprobe zoo atlas` runs it.
    from posprobe.analyses.configs import ZooAtlasConfig
    from posprobe.cli import checks
    from posprobe.zoo.folder import default_text

    if args.dtype != "float32" or args.n_ctx is not None:
        raise SystemExit("posprobe atlas: --dtype and --n-ctx apply to one model; the atlas over several models "
                         "loads each in float32 at its own context")
    many = ZooAtlasConfig.from_atlas(config)
    text, source = checks.read_text_early(args.text), args.text
    models = [args.model, *args.more_models]
    if text is None and default_text(models) is None:  # as the atlas of one model: the built-in corpus
        from posprobe.data import BUILTIN_CORPUS_SOURCE, builtin_corpus

        text, source = builtin_corpus(), BUILTIN_CORPUS_SOURCE
    from posprobe.analyses.atlas_many import run_zoo_atlas
    from posprobe.cli.zoo import print_and_save
    from posprobe.report.zoo_atlas import printed

    result = run_zoo_atlas(models, many, text=text, source=source, device=args.device)
    return print_and_save(result, args, printed, "atlas")
