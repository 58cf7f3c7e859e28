"""One module per CLI subcommand: HELP, add_arguments(parser), run(args) -> exit code."""
