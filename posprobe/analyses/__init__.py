"""One module per analysis: a frozen config, a run function, a result of tidy tables + meta."""
