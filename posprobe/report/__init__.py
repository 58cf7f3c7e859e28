"""Results and their outputs: the `Result` type with its atomic save, the HTML writer, figures per analysis."""
