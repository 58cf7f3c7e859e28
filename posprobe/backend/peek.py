"""A model's positional facts read from its spec alone: no weights, no torch, no TransformerLens.

The CLI calls `peek` before loading so that a wrong kind of model, a k past the context or a window
too long fails in about a second. Sources: the built-in tiny specs, a Hugging Face folder's
config.json (local or in the HF cache) and a GGUF file's header. Hub names that are not on disk
give None: those are checked after loading, as before.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posprobe.backend import families
from posprobe.backend.architectures import of_config
from posprobe.backend.sources import ModelLoadError, Source, read_hf_config, resolve_local
from posprobe.backend.tiny_specs import SPECS as TINY_SPECS

UNKNOWN = families.UNKNOWN
# GGUF `general.architecture` values of bidirectional encoders (GGUF names, not HF model types).
_GGUF_ENCODERS = {"bert", "nomic-bert", "jina-bert-v2", "t5encoder"}


class WrongModelKind(ValueError):
    """An analysis was asked of a model whose positional scheme it does not apply to."""


@dataclass(frozen=True)
class PeekedFacts:
    """What a spec says about a model before it loads.

    positional_kind: "learned_absolute", "rotary", "alibi", "relative_bias", ... or "unknown" when the
    config does not say (checks that need the kind are then left to after loading).
    context_length: positions the model has (n_ctx / n_positions / max_position_embeddings), None if unknown.
    n_layers, n_heads: None where the spec does not give them.
    """

    name: str
    positional_kind: str
    context_length: int | None
    is_encoder: bool
    n_layers: int | None
    source: str  # "tiny spec", "config.json" or "gguf header"
    is_tiny: bool = False
    n_heads: int | None = None

    @property
    def is_rotary(self) -> bool:
        """True for RoPE models."""
        return self.positional_kind == families.ROTARY

    @property
    def family(self) -> families.Family | None:
        """The positional family's adapter, None where the spec does not say or posprobe has none."""
        return families.find(self.positional_kind)

    @property
    def has_w_pos(self) -> bool:
        """True where the model has a learned position table W_pos (a learned family, or TL's shortformer, which adds
        its table to q and k only): what the W_pos views read (as `ModelFacts.has_w_pos` after loading)."""
        return self.positional_kind == "shortformer" or (self.family is not None and self.family.learned_table)

    @property
    def known_kind(self) -> bool:
        """False where the spec does not say how positions enter (kind checks wait for loading)."""
        return self.positional_kind != UNKNOWN

    def context_after_load(self, n_ctx: int | None) -> int | None:
        """The context `load_model(spec, n_ctx=n_ctx)` will give: tiny specs ignore the cap, encoders
        take at most their table, other models take the cap as given."""
        if n_ctx is None or self.is_tiny:
            return self.context_length
        if self.is_encoder and self.context_length is not None:
            return min(n_ctx, self.context_length)
        return n_ctx


def peek(spec: Any) -> PeekedFacts | None:
    """Positional facts of `spec` without loading it; None where only loading can tell (hub names,
    model objects, an unreadable header). Raises `ModelLoadError` for local paths that do not exist
    or are not models, with the same message loading would give."""
    if not isinstance(spec, (str, os.PathLike)):
        return None
    source = resolve_local(spec, assemble=False)
    if source is None:
        return None
    return peek_source(source)


def peek_source(source: Source) -> PeekedFacts | None:
    """`peek` for an already resolved Source."""
    if source.kind == "tiny":
        cfg = TINY_SPECS[source.name]
        pet = cfg["positional_embedding_type"]
        return PeekedFacts(source.name, tl_positional_kind(pet), int(cfg["n_ctx"]), False, int(cfg["n_layers"]),
                           "tiny spec", is_tiny=True, n_heads=int(cfg["n_heads"]))
    if source.path is None:
        return None
    if source.path.suffix == ".gguf":
        if not source.path.is_file():  # a packaged GGUF not assembled yet: reading it would mean writing it
            return None
        try:
            meta = read_gguf_metadata(source.path)
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"Could not read GGUF file {source.path}: {e}") from e
        return _from_gguf(source.name, meta)
    try:
        cfg = read_hf_config(source.path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"Could not read {source.path / 'config.json'}: {e}") from e
    return _from_hf_config(source.name, cfg)


def tl_positional_kind(positional_embedding_type: str) -> str:
    """posprobe's name for a TransformerLens `positional_embedding_type` ("standard" -> "learned_absolute")."""
    return families.from_tl(positional_embedding_type)


def hf_is_encoder(cfg: dict) -> bool:
    """True where a Hugging Face config dict describes a bidirectional encoder (BERT family)."""
    arch = str((cfg.get("architectures") or [""])[0])
    return arch.startswith("Bert") or of_config(cfg).encoder


def hf_positional_kind(cfg: dict) -> str:
    """Positional kind named by a Hugging Face config dict ("unknown" if it does not say): the families'
    detectors, asked with the family the config's architecture row lists."""
    return families.from_hf_config(cfg, of_config(cfg).family)


def _from_hf_config(name: str, cfg: dict) -> PeekedFacts:
    ctx = _first_int(cfg, ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"))
    layers = _first_int(cfg, ("num_hidden_layers", "n_layer", "num_layers"))
    is_encoder = hf_is_encoder(cfg)  # the legacy loader builds a HookedEncoder for every "Bert*" architecture
    heads = _first_int(cfg, ("num_attention_heads", "n_head", "num_heads"))
    return PeekedFacts(name, hf_positional_kind(cfg), ctx, is_encoder, layers, "config.json", n_heads=heads)


def _first_int(d: dict, keys: tuple[str, ...]) -> int | None:
    for k in keys:
        v = d.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _from_gguf(name: str, meta: dict[str, Any]) -> PeekedFacts:
    arch = str(meta.get("general.architecture", ""))
    ctx = meta.get(f"{arch}.context_length")
    layers = meta.get(f"{arch}.block_count")
    heads = meta.get(f"{arch}.attention.head_count")
    kind = families.from_gguf(arch, meta)

    def count(v: Any) -> int | None:
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    return PeekedFacts(name, kind, count(ctx), arch in _GGUF_ENCODERS, count(layers), "gguf header",
                       n_heads=count(heads))


# GGUF value types (ggml's gguf.h): fixed sizes and struct codes; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: Path, *, max_array: int = 64) -> dict[str, Any]:
    """Key/value metadata of a GGUF file, read from its header only.

    Arrays longer than `max_array` (the tokenizer's vocabulary and merges) are skipped, not decoded:
    the `gguf` package's reader decodes them and every tensor record, ~3 s for SmolLM2, where this
    takes a few milliseconds.
    """
    return _read_header(path, max_array, names=False)[0]


def gguf_tensor_names(path: Path) -> list[str]:
    """The names of the tensors a GGUF file holds, read from its header (milliseconds; no tensor data read)."""
    return _read_header(path, 64, names=True)[1]


def _read_header(path: Path, max_array: int, *, names: bool) -> tuple[dict[str, Any], list[str]]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        (version,) = struct.unpack_from("<I", buf, 4)
        end = "<" if version < 0x10000 else ">"  # a big-endian file reads its small version byte-swapped
        n_tensors, kv_count = struct.unpack_from(end + "QQ", buf, 8)
        off = 24
        meta: dict[str, Any] = {}

        def string(o: int) -> tuple[str, int]:
            (n,) = struct.unpack_from(end + "Q", buf, o)
            return bytes(buf[o + 8 : o + 8 + n]).decode("utf-8", "replace"), o + 8 + n

        def value(vtype: int, o: int, keep: bool) -> tuple[Any, int]:
            if vtype in _GGUF_SCALARS:
                code = _GGUF_SCALARS[vtype]
                return (struct.unpack_from(end + code, buf, o)[0] if keep else None), o + struct.calcsize(end + code)
            if vtype == _GGUF_STRING:
                if keep:
                    return string(o)
                (n,) = struct.unpack_from(end + "Q", buf, o)
                return None, o + 8 + n
            if vtype == _GGUF_ARRAY:
                etype, count = struct.unpack_from(end + "IQ", buf, o)
                o += 12
                keep_items = keep and count <= max_array
                if etype in _GGUF_SCALARS and not keep_items:
                    return None, o + count * struct.calcsize(end + _GGUF_SCALARS[etype])
                items = []
                for _ in range(count):
                    item, o = value(etype, o, keep_items)
                    items.append(item)
                return (items if keep_items else None), o
            raise ValueError(f"unknown GGUF value type {vtype} at byte {o}")

        for _ in range(kv_count):
            key, off = string(off)
            (vtype,) = struct.unpack_from(end + "I", buf, off)
            val, off = value(vtype, off + 4, names is False)
            if val is not None:
                meta[key] = val
        tensors = []
        for _ in range(n_tensors if names else 0):  # name, n_dims, dims (u64 each), type (u32), offset (u64)
            name, off = string(off)
            (n_dims,) = struct.unpack_from(end + "I", buf, off)
            off += 4 + 8 * n_dims + 4 + 8
            tensors.append(name)
        return meta, tensors
