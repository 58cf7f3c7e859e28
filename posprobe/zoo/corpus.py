"""A real corpus for the zoo through Hugging Face `datasets`: a hub dataset by name (streamed) or local files (the
`json`, `text`, `parquet` and `csv` builders) read by the same `datasets.load_dataset(..., streaming=True)` call,
made into the zoo's training tokens once per zoo and kept as a token cache every member trains from.

The stream is read in its own order (no shuffle buffer): its first documents, up to `eval_chars` characters, are
held out as the evaluation text (`<zoo>/eval.txt`, never trained on); the next ones, up to `tokenizer_chars`,
train the zoo's byte-level BPE (`posprobe.zoo.tokenizer`) and are the first training documents; every training
document is tokenised and followed by EOT (rows of the `text` builder are lines: they are joined by newlines
instead, as `--text` reads a file), and the ids are appended to `tokens.bin` until `corpus_tokens`. Training
draws its windows from these ids exactly as from `--text`'s (`train.batch_ids`: random starts by seed and step),
so every member sees the same tokens in the same order, for a seed.

Resumable mid-stream: the cache is written in chunks, each followed by an atomic `progress.json` holding the tokens
written and the stream's own position (`IterableDataset.state_dict()`); a killed run truncates `tokens.bin` to the
last recorded chunk, restores the stream there (`load_state_dict`) and goes on, ending with the same bytes as an
uninterrupted run. Training from the finished cache resumes through the zoo's TrainState as before.
`datasets` is imported lazily (extra `research`); torch-free at import."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from posprobe.core.config import option
from posprobe.places import hub_offline

__all__ = ["LOCAL_BUILDERS", "CorpusConfig", "CorpusData", "TokenCache", "check_corpus", "check_hub",
           "prepare_corpus"]

#: The `datasets` builders that read local files (`--data-files`).
LOCAL_BUILDERS = ("json", "text", "parquet", "csv")
#: Characters of documents tokenised and written per chunk (a resume starts again at the last chunk written).
CHUNK_CHARS = 1 << 24
_INSTALL = "pip install 'posprobe[research]'"


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """Where the zoo's text comes from when it is a `datasets` corpus rather than one file (`--text`)."""

    dataset: str = option("", "a Hugging Face dataset by name, streamed (e.g. HuggingFaceFW/fineweb-edu), or a local "
                              "builder read through the same datasets call: json, text, parquet or csv with "
                              "--data-files")
    dataset_config: str | None = option(None, "the dataset's configuration (e.g. sample-10BT)")
    dataset_split: str = option("train", "the split streamed")
    text_field: str = option("text", "the column holding each document's text")
    data_files: tuple[str, ...] = option((), "local files (or glob patterns) of the json / text / parquet / csv "
                                             "builders (repeatable)")
    corpus_tokens: float | None = option(None, "tokens read from the stream into the zoo's token cache (default: "
                                               "one member's training tokens D, so no token repeats; Gu et al. "
                                               "sampled 5e9)")
    eval_chars: int = option(2_000_000, "characters of the stream's first documents held out as the evaluation "
                                        "text (eval.txt)")
    tokenizer_chars: int = option(20_000_000, "characters of the following documents the zoo's BPE is trained on")

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_files", tuple(str(f) for f in self.data_files))
        if not self.dataset:
            raise ValueError("a corpus needs --dataset: a hub dataset name or one of " + ", ".join(LOCAL_BUILDERS))
        if self.dataset in LOCAL_BUILDERS and not self.data_files:
            raise ValueError(f"--dataset {self.dataset} reads local files: give them with --data-files PATH")
        if self.corpus_tokens is not None and not self.corpus_tokens >= 1:
            raise ValueError(f"corpus_tokens must be >= 1, got {self.corpus_tokens}")
        if self.eval_chars < 1 or self.tokenizer_chars < 1:
            raise ValueError("eval_chars and tokenizer_chars must be >= 1")

    @property
    def is_hub(self) -> bool:
        """True when `dataset` names a hub dataset (not a local builder nor a local folder)."""
        return self.dataset not in LOCAL_BUILDERS and not Path(self.dataset).is_dir()

    @property
    def source(self) -> str:
        """What the training records name as the text: the dataset, its configuration and split, or its files."""
        if not self.is_hub and self.data_files:
            return f"datasets {self.dataset}: {', '.join(self.data_files)}"
        return f"datasets {self.dataset}" + (f" ({self.dataset_config})" if self.dataset_config else "") + \
            f" split {self.dataset_split}"

    def key(self) -> dict:
        """What identifies the corpus in a run's checkpoint key: the fields, and each local file's size and time."""
        files = {f: [os.path.getsize(f), os.path.getmtime(f)] for f in _expand(self.data_files)}
        return {**asdict(self), "files": files}


def _expand(patterns: tuple[str, ...]) -> list[str]:
    out = []
    for p in patterns:
        out += sorted(glob.glob(p)) if any(c in p for c in "*?[") else [p]
    return out


def check_corpus(corpus: CorpusConfig) -> None:
    """Refuse, in one sentence and before anything heavy, a corpus that cannot be read: `datasets` missing, local
    files that do not exist. (A hub name is checked by `check_hub` when the run starts.)

    Args:
        corpus: the corpus.

    Returns:
        None; ValueError otherwise."""
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"--dataset reads text through Hugging Face `datasets`, which is not installed: {_INSTALL}")
    for p in corpus.data_files:
        if not _expand((p,)) or not all(Path(f).is_file() for f in _expand((p,))):
            raise ValueError(f"--data-files {p}: no such file")


def check_hub(corpus: CorpusConfig) -> None:
    """Refuse a hub dataset when the hub cannot be reached (HF_HUB_OFFLINE, or no route), in one sentence naming
    the local alternative.

    Args:
        corpus: the corpus.

    Returns:
        None; ValueError otherwise."""
    if corpus.is_hub and hub_offline():
        raise ValueError(f"--dataset {corpus.dataset}: the Hugging Face hub cannot be reached from here (offline or "
                         "HF_HUB_OFFLINE set); stream it where the hub is reachable, or give local files through the "
                         "same path: --dataset json --data-files PATH (or text, parquet, csv)")


class TokenCache:
    """The cache's ids as the zoo's window cutter reads them: `len(cache)` and `cache[a:b]` (a torch int64 tensor),
    read from a memory map (a 5e9-token cache is 10 GB on disk, not in memory)."""

    def __init__(self, path: Path, dtype: str) -> None:
        import numpy as np

        self.path = Path(path)
        self._mm = np.memmap(self.path, dtype=dtype, mode="r") if self.path.stat().st_size else np.zeros(0, dtype)

    def __len__(self) -> int:
        return len(self._mm)

    def __getitem__(self, index: Any) -> Any:
        import numpy as np
        import torch

        return torch.from_numpy(np.asarray(self._mm[index], dtype=np.int64))


@dataclass(frozen=True)
class CorpusData:
    """A prepared corpus: the zoo's tokenizer, the training ids, the held-out text, the documents read and the
    SHA-256 of the token cache."""

    tokenizer: Any
    ids: TokenCache
    eval_text: str
    documents: int
    sha256: str


def _dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _open(corpus: CorpusConfig) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--dataset needs Hugging Face `datasets`: {_INSTALL}") from None
    datasets.disable_progress_bars()
    kw: dict[str, Any] = {"split": corpus.dataset_split, "streaming": True}
    if corpus.data_files:
        kw["data_files"] = _expand(corpus.data_files)
    return datasets.load_dataset(corpus.dataset, corpus.dataset_config, **kw)


def _documents(it: Iterator[dict], field: str) -> Iterator[str]:
    for row in it:
        if field not in row:
            raise ValueError(f"--text-field {field}: the dataset's rows have no such column (they have "
                             f"{', '.join(map(str, row))})")
        yield "" if row[field] is None else str(row[field])


def _take(docs: Iterator[str], chars: int) -> list[str]:
    # Documents from `docs` until they hold `chars` characters (the last one whole).
    out, n = [], 0
    for d in docs:
        out.append(d)
        n += len(d)
        if n >= chars:
            break
    return out


def _encode(tokenizer: Any, docs: list[str], lines: bool) -> list[int]:
    # Each document's ids then EOT (id 0); the text builder's rows are lines, joined by newlines instead.
    if lines:
        docs = [d + "\n" for d in docs]
    else:
        docs = [d for d in docs if d.strip()]
    ids: list[int] = []
    for row in tokenizer(docs)["input_ids"] if docs else []:
        ids += row if lines else [*row, tokenizer.bos_token_id]
    return ids


def _write_progress(folder: Path, progress: dict) -> None:
    tmp = folder / "progress.json.tmp"
    tmp.write_text(json.dumps(progress), encoding="utf-8")
    os.replace(tmp, folder / "progress.json")


def _append(path: Path, ids: list[int], dtype: str, at: int) -> int:
    import numpy as np

    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(at * np.dtype(dtype).itemsize)  # a killed run's partial chunk goes
        f.seek(0, os.SEEK_END)
        f.write(np.asarray(ids, dtype=dtype).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return at + len(ids)


def prepare_corpus(corpus: CorpusConfig, vocab_size: int, limit: int, folder: str | os.PathLike, *,
                   eval_text: str | None = None, progress: bool = False) -> CorpusData:
    """Read the corpus into the token cache in `folder` (created; resumed where an earlier call stopped): the held-out
    text, the zoo's tokenizer trained on the sample and up to `limit` training tokens.

    Args:
        corpus: the corpus.
        vocab_size: the BPE's size (`ZooConfig.vocab_size`).
        limit: training tokens to read (the stream may end before).
        folder: the cache folder (`<out>.work/corpus` in `train_zoo`).
        eval_text: a held-out text given apart (None: the stream's first `corpus.eval_chars` characters).
        progress: say on stderr how far the cache is.

    Returns:
        The CorpusData."""
    import sys

    from transformers import PreTrainedTokenizerFast

    from posprobe.zoo.tokenizer import train_tokenizer

    check_corpus(corpus)
    check_hub(corpus)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens, dtype, lines = folder / "tokens.bin", _dtype(vocab_size), corpus.dataset == "text"
    sep = "\n" if lines else "\n\n"
    state_file = folder / "progress.json"
    if state_file.exists():  # an earlier run's cache: finished, or resumed where its last chunk ended
        state = json.loads(state_file.read_text(encoding="utf-8"))
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer")
        held_out = (folder / "eval.txt").read_text(encoding="utf-8")
        if not state["done"]:
            stream = _open(corpus)
            stream.load_state_dict(state["stream"])
            docs = _documents(iter(stream), corpus.text_field)
    else:
        stream = _open(corpus)
        docs = _documents(iter(stream), corpus.text_field)
        held_out = eval_text if eval_text is not None else sep.join(_take(docs, corpus.eval_chars))
        sample = _take(docs, corpus.tokenizer_chars)
        if not "".join(sample).strip():
            raise ValueError(f"{corpus.source}: no training text after the {len(held_out):,} held-out characters")
        tokenizer = train_tokenizer(sep.join(sample), vocab_size)
        tokenizer.save_pretrained(folder / "tokenizer")
        (folder / "eval.txt").write_text(held_out, encoding="utf-8")
        ids = _encode(tokenizer, sample, lines)[:limit]
        state = {"written": _append(tokens, ids, dtype, 0), "documents": len(sample), "stream": stream.state_dict(),
                 "done": False}
        state["done"] = state["written"] >= limit
        _write_progress(folder, state)
    while not state["done"]:
        chunk = _take(docs, CHUNK_CHARS)
        ids = _encode(tokenizer, chunk, lines)[:limit - state["written"]]
        written = _append(tokens, ids, dtype, state["written"])
        state = {"written": written, "documents": state["documents"] + len(chunk), "stream": stream.state_dict(),
                 "done": written >= limit or not chunk}
        _write_progress(folder, state)
        if progress:
            print(f"zoo corpus: {written:,} tokens from {state['documents']:,} documents", file=sys.stderr)
    _append(tokens, [], dtype, state["written"])  # a resumed finished cache: nothing past what was recorded
    sha = hashlib.sha256()
    with open(tokens, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            sha.update(block)
    return CorpusData(tokenizer, TokenCache(tokens, dtype), held_out, state["documents"], sha.hexdigest())
