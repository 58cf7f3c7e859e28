"""Arguments several subcommands share (argparse only: importing this stays instant)."""

from __future__ import annotations

import argparse


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL plus the loading options every model-taking subcommand shares."""
    p.add_argument("model", help="TL model name, HF folder, .gguf file, packaged alias (smollm2, gemma3-270m, "
                                 "minilm) or built-in random spec (tiny-ape, tiny-rope)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=["float64", "float32", "bfloat16", "float16"])
    p.add_argument("--n-ctx", type=int, default=None, help="cap the context length (bounds buffers)")


def add_text_arguments(p: argparse.ArgumentParser) -> None:
    """--text/--window/--max-windows: where the token rows come from (probe, geometry)."""
    p.add_argument("--text", default=None, help="UTF-8 text file (WikiText auto-detokenised); default: posprobe's built-in text")
    p.add_argument("--window", type=int, default=64, help="tokens per row, incl. BOS/CLS if the tokenizer has one (default 64)")
    p.add_argument("--max-windows", type=int, default=32, help="at most this many rows (default 32)")


def int_list(text: str | None) -> tuple[int, ...] | None:
    """'0,3,5' -> (0, 3, 5); None stays None. Raises ValueError with the offending text."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
