"""Analysis results: a tidy long DataFrame + metadata, saved atomically."""

from __future__ import annotations

import json
import os
import platform
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from posprobe.report.html import Section, _has_trivial_index, _mkstemp_for, render_html

__all__ = ["Result", "environment_meta"]

#: Rows of ``df`` shown in the report's data preview table.
PREVIEW_ROWS = 50

# key in environment_meta() -> distribution names to try
_DISTS = {k: (k,) for k in ("torch", "transformers", "numpy", "pandas", "posprobe")}
_DISTS["transformer_lens"] = ("transformer-lens", "transformer_lens")


def _dist_version(names: tuple[str, ...]) -> str | None:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment_meta() -> dict[str, Any]:
    """Versions of the relevant packages (None if not installed), platform, UTC time."""
    env: dict[str, Any] = {"python": platform.python_version()}
    env.update({key: _dist_version(names) for key, names in _DISTS.items()})
    env["platform"] = platform.platform()
    env["timestamp_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return env


def _json_default(o: Any) -> Any:
    """numpy/torch scalars & arrays -> plain JSON values; anything else -> str."""
    return o.tolist() if callable(getattr(o, "tolist", None)) else str(o)


def _fsync_path(path: str | Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. directories on Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _commit(temps: dict[str, str], targets: dict[str, Path]) -> None:
    """Rename all temps onto targets; on failure restore the previous state."""
    backups: dict[str, Path] = {}
    done: list[str] = []
    try:
        for key in temps:
            dst = targets[key]
            if dst.exists():
                bak = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.bak")
                try:
                    os.link(dst, bak)
                except OSError:
                    shutil.copy2(dst, bak)
                backups[key] = bak
        for key, tmp in temps.items():
            os.replace(tmp, targets[key])
            done.append(key)
    except BaseException:
        for key in reversed(done):  # best-effort rollback
            try:
                if key in backups:
                    os.replace(backups.pop(key), targets[key])
                else:
                    targets[key].unlink(missing_ok=True)
            except OSError:
                pass
        raise
    finally:
        for bak in backups.values():
            bak.unlink(missing_ok=True)


@dataclass
class Result:
    """A tidy long-format DataFrame plus JSON-able metadata."""

    df: pd.DataFrame
    meta: dict = field(default_factory=dict)

    def save(
        self,
        out_dir: str | os.PathLike,
        *,
        name: str,
        figures: list | None = None,
        title: str = "",
        summary_html: str = "",
    ) -> dict[str, Path]:
        """Write ``<name>.parquet``, ``<name>.csv``, ``meta.json``, ``report.html``.

        All-or-nothing: every payload is staged as a hidden temp file in
        ``out_dir`` and only then renamed into place; on any error temps are
        removed and already-renamed files are rolled back.  Returns the paths
        keyed ``parquet``, ``csv``, ``meta``, ``report``.
        """
        sections = []
        if summary_html:
            sections.append(Section("Summary", html=summary_html))
        if figures:
            sections.append(Section("Figures", figures=list(figures)))
        n = len(self.df)
        heading = f"Data ({n} rows)" if n <= PREVIEW_ROWS else f"Data (first {PREVIEW_ROWS} of {n} rows)"
        sections.append(Section(heading, table=self.df.head(PREVIEW_ROWS)))
        paths = save_bundle(out_dir, {name: self.df}, self.meta, lambda: render_html(title or name, sections, meta=self.meta))
        return {"parquet": paths[f"{name}.parquet"], "csv": paths[f"{name}.csv"], "meta": paths["meta"],
                "report": paths["report"]}

    @classmethod
    def load(cls, out_dir: str | os.PathLike, *, name: str) -> "Result":
        """Read back a result written by :meth:`save`."""
        out = Path(out_dir)
        df = pd.read_parquet(out / f"{name}.parquet")
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
        return cls(df=df, meta=meta)


def save_bundle(
    out_dir: str | os.PathLike,
    tables: dict[str, pd.DataFrame],
    meta: dict,
    html: Callable[[], str] | str | None,
) -> dict[str, Path]:
    """Write each table as ``<name>.parquet`` and ``<name>.csv``, plus ``meta.json`` and ``report.html``.

    All-or-nothing: every payload is built and staged as a hidden temp file in ``out_dir`` first,
    then renamed into place; on any error temps are removed and renamed files rolled back.
    Returns paths keyed ``<name>.parquet``, ``<name>.csv``, ``meta``, ``report``.
    """
    for name in tables:
        if not name or name.startswith(".") or any(c in name for c in "/\\\0"):
            raise ValueError(f"invalid result name: {name!r}")
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    targets: dict[str, Path] = {}
    for name in tables:
        targets[f"{name}.parquet"] = out / f"{name}.parquet"
        targets[f"{name}.csv"] = out / f"{name}.csv"
    targets["meta"] = out / "meta.json"
    if html is not None:
        targets["report"] = out / "report.html"
    temps: dict[str, str] = {}

    def stage(key: str, write: Callable[[str], None]) -> None:
        fd, tmp = _mkstemp_for(targets[key])
        os.close(fd)
        temps[key] = tmp  # registered before writing, so cleanup sees partials
        write(tmp)
        _fsync_path(tmp)

    try:
        page = html() if callable(html) else html
        meta_json = json.dumps(meta, sort_keys=True, indent=2, default=_json_default)
        for name, df in tables.items():
            stage(f"{name}.parquet", lambda p, df=df: df.to_parquet(p))
            stage(f"{name}.csv", lambda p, df=df: df.to_csv(p, index=not _has_trivial_index(df)))
        stage("meta", lambda p: Path(p).write_text(meta_json + "\n", encoding="utf-8"))
        if page is not None:
            stage("report", lambda p: Path(p).write_text(page, encoding="utf-8"))
        _commit(temps, targets)
    except BaseException:
        for tmp in temps.values():
            Path(tmp).unlink(missing_ok=True)
        if created:
            try:
                out.rmdir()  # only succeeds if we left it empty
            except OSError:
                pass
        raise
    _fsync_path(out)  # persist the renames
    return targets
