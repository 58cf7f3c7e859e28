"""The `posprobe` command: a thin layer over the library (one module per subcommand)."""

from posprobe.cli.args import add_model_arguments
from posprobe.cli.main import build_parser, main

__all__ = ["add_model_arguments", "build_parser", "main"]
