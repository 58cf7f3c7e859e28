"""The one result type of every analysis: named tidy tables + metadata, saved atomically in one layout."""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from posprobe.report.html import Section, _has_trivial_index, render_html
from posprobe.report.pages import page_for

__all__ = ["Result", "environment_meta"]

# Distributions whose versions every meta.json records, by their PyPI names.
_DISTS = ("torch", "transformers", "transformer-lens", "numpy", "pandas", "posprobe")


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment_meta() -> dict[str, Any]:
    """Versions of the relevant packages (None if not installed), platform, UTC time."""
    env: dict[str, Any] = {"python": platform.python_version()}
    env.update({name: _dist_version(name) for name in _DISTS})
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
    """What every analysis returns: named tidy tables + a `meta` dict (schema in `posprobe.report.schema`).

    Figures and the HTML report are rebuilt from the tables and meta alone, by the page module
    registered for `meta["analysis"]` (`posprobe.report.pages`). `save(dir)` is the one way results
    are written.

    Examples:
        >>> import pandas as pd
        >>> from posprobe import Result
        >>> result = Result({"scores": pd.DataFrame({"layer": [0, 1], "value": [0.5, 0.25]})}, {"analysis": "demo"})
        >>> sorted(p.name for p in result.save("demo-out").values())
        ['meta.json', 'report.html', 'scores.csv', 'scores.parquet']
        >>> Result.load("demo-out").tables["scores"]["value"].tolist()
        [0.5, 0.25]
    """

    tables: dict[str, pd.DataFrame]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.tables, pd.DataFrame):  # Result(df, meta): a single table named after the analysis
            self.tables = {_stem(self.meta): self.tables}
        for name in self.tables:
            _check_name(name)

    @property
    def df(self) -> pd.DataFrame:
        """The main table (the first one)."""
        return next(iter(self.tables.values()))

    @property
    def analysis(self) -> str:
        """The analysis that produced this result (`meta["analysis"]`)."""
        return str(self.meta.get("analysis", "result"))

    def figures(self) -> list:
        """The analysis's plotly figures, built from the tables and meta."""
        return list(page_for(self).figures(self))

    def to_html(self, *, plotly_src: str | None = None, csv: str = "auto") -> str:
        """The HTML report: self-contained (plotly.js inline, no network), or loading plotly.js from the relative
        path `plotly_src` (a folder of reports sharing one local copy)."""
        page = page_for(self)
        sections = list(page.sections(self))
        with_csv = csv_tables(self.tables, csv)
        files = [f"<code>{_esc(k)}</code> ({len(v)} rows{'' if k in with_csv else ', parquet only'})"
                 for k, v in self.tables.items()]
        sections.append(
            Section(
                "Tables",
                html="<p>" + ", ".join(files) + " — full data in the parquet files (and a CSV beside each table of at "
                f"most {CSV_MAX_ROWS:,} rows; <code>--csv all</code> / <code>save(csv='all')</code> writes every "
                "CSV).</p>",
            )
        )
        return render_html(page.title(self), sections, meta=_footer_meta(self.meta), plotly_src=plotly_src)

    def save(
        self, out_dir: str | os.PathLike, *, figure_formats: str | tuple[str, ...] | list[str] = (),
        csv: str = "auto", plotly_src: str | None = None, extra: dict[str, Callable[[str], None]] | None = None,
    ) -> dict[str, Path]:
        """Write `<table>.parquet` per table (and `<table>.csv` for tables of at most CSV_MAX_ROWS rows, or every
        table with `csv="all"`), `meta.json` and `report.html`, atomically; `plotly_src` as in `to_html`, `extra`
        more files (name -> writer of a path) staged and committed with the rest.

        `figure_formats` ("svg,pdf,png" or a sequence of those) also writes every figure of the report as
        `figures/<nn>-<slug>.<fmt>` (numbered in report order, slug from the figure title, caption printed
        below the plot), with kaleido >= 1.0 and a system Chrome/Chromium (`posprobe.report.export`).
        Everything is staged as hidden temp files and renamed into place together; on any error (a
        missing exporter included, `FigureExportError`) nothing new is left. Returns paths keyed
        `<table>.parquet`, `<table>.csv`, `meta`, `report` and, per exported file, `figures/<nn>-<slug>.<fmt>`.
        """
        from posprobe.report.export import parse_formats

        formats = parse_formats(figure_formats)  # a bad format fails before anything is written
        with_csv = csv_tables(self.tables, csv)
        meta = {**self.meta, "tables": list(self.tables), "csv_tables": sorted(with_csv)}
        return _write_bundle(out_dir, self.tables, meta, lambda: self.to_html(plotly_src=plotly_src, csv=csv),
                             figures=self.report_figures if formats else None, figure_formats=formats,
                             csv=with_csv, extra=extra)

    def report_figures(self) -> list:
        """Every figure of the HTML report, in page order (what `save(figure_formats=...)` exports)."""
        return [f for sec in page_for(self).sections(self) for f in (sec.figures or [])]

    @classmethod
    def load(cls, out_dir: str | os.PathLike) -> Result:
        """Read back a result written by :meth:`save`."""
        out = Path(out_dir)
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
        names = meta.get("tables") or [p.stem for p in sorted(out.glob("*.parquet"))]
        return cls({n: pd.read_parquet(out / f"{n}.parquet") for n in names}, meta)


#: Tables longer than this are written as parquet only unless CSV is asked for (an atlas's frequency profile alone
#: was a 16 MB CSV).
CSV_MAX_ROWS = 20_000


def csv_tables(tables: dict[str, pd.DataFrame], csv: str) -> set[str]:
    """The tables that get a CSV beside their parquet: "auto" (those of at most CSV_MAX_ROWS rows), "all", "none"."""
    if csv not in ("auto", "all", "none"):
        raise ValueError(f"csv must be 'auto', 'all' or 'none'; got {csv!r}")
    return {n for n, df in tables.items() if csv == "all" or (csv == "auto" and len(df) <= CSV_MAX_ROWS)}


def _stem(meta: dict) -> str:
    return str(meta.get("analysis", "result")).replace("-", "_")


def _check_name(name: str) -> None:
    if not name or name.startswith(".") or any(c in name for c in "/\\\0") or name in ("meta", "report"):
        raise ValueError(f"invalid table name: {name!r}")


def _esc(x: Any) -> str:
    import html

    return html.escape(str(x), quote=True)


def _footer_meta(meta: dict) -> dict:
    # The footer shows provenance; long per-analysis payloads stay in meta.json.
    keep = ("analysis", "posprobe_version", "created_utc", "model", "data", "config")
    out = {k: meta[k] for k in keep if k in meta}
    if isinstance(out.get("model"), dict):
        out["model"] = {k: out["model"][k] for k in ("name", "source", "positional_kind", "n_ctx") if k in out["model"]}
    out.update(meta.get("environment", {}))
    return out


def _write_bundle(
    out_dir: str | os.PathLike,
    tables: dict[str, pd.DataFrame],
    meta: dict,
    html: Callable[[], str] | str | None,
    *,
    figures: Callable[[], list] | None = None,
    figure_formats: tuple[str, ...] = (),
    csv: set[str] | None = None,
    extra: dict[str, Callable[[str], None]] | None = None,
) -> dict[str, Path]:
    """Write each table as ``<name>.parquet`` and ``<name>.csv``, plus ``meta.json`` and ``report.html``.

    All-or-nothing: every payload is built and staged as a hidden temp file in ``out_dir`` first,
    then renamed into place; on any error temps are removed and renamed files rolled back.
    Returns paths keyed ``<name>.parquet``, ``<name>.csv``, ``meta``, ``report``.
    """
    for name in tables:
        _check_name(name)
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    targets: dict[str, Path] = {}
    csv = set(tables) if csv is None else csv
    for name in tables:
        targets[f"{name}.parquet"] = out / f"{name}.parquet"
        if name in csv:
            targets[f"{name}.csv"] = out / f"{name}.csv"
    for name in extra or {}:
        _check_name(name)
        targets[name] = out / name
    targets["meta"] = out / "meta.json"
    if html is not None:
        targets["report"] = out / "report.html"
    temps: dict[str, str] = {}
    fig_dir = out / "figures"
    fig_dir_created = False

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
            if name in csv:
                stage(f"{name}.csv", lambda p, df=df: df.to_csv(p, index=not _has_trivial_index(df)))
        for name, write in (extra or {}).items():
            stage(name, write)
        stage("meta", lambda p: Path(p).write_text(meta_json + "\n", encoding="utf-8"))
        if page is not None:
            stage("report", lambda p: Path(p).write_text(page, encoding="utf-8"))
        if figures is not None and figure_formats:
            from posprobe.report.export import export_figures, figure_names

            figs = figures()
            if figs:
                fig_dir_created = not fig_dir.exists()
                fig_dir.mkdir(exist_ok=True)
                jobs = []
                for name, fig in zip(figure_names(figs), figs):
                    for fmt in figure_formats:
                        key = f"figures/{name}.{fmt}"
                        targets[key] = fig_dir / f"{name}.{fmt}"
                        fd, tmp = _mkstemp_for(targets[key])
                        os.close(fd)
                        temps[key] = tmp
                        jobs.append((fig, tmp, fmt))
                export_figures([j[0] for j in jobs], [j[1] for j in jobs], [j[2] for j in jobs])
                for _, tmp, _ in jobs:
                    _fsync_path(tmp)
        _commit(temps, targets)
    except BaseException as exc:
        for tmp in temps.values():
            Path(tmp).unlink(missing_ok=True)
        if fig_dir_created:
            try:
                fig_dir.rmdir()
            except OSError:
                pass
        if created:
            try:
                out.rmdir()  # only succeeds if we left it empty
            except OSError:
                pass
        if disk_full(exc):
            raise OSError(errno.ENOSPC, f"no space left on the device holding {out} while writing the results; "
                                        "nothing there was changed (free space and rerun)") from exc
        raise
    _fsync_path(out)  # persist the renames
    if fig_dir_created or fig_dir in {t.parent for t in targets.values()}:
        _fsync_path(fig_dir)
    return targets


def disk_full(exc: BaseException) -> bool:
    """Whether an exception is "no space left on device" (pyarrow's IO errors carry it only in the message)."""
    return isinstance(exc, OSError) and (exc.errno == errno.ENOSPC or "No space left on device" in str(exc))


def _umask() -> int:
    try:  # read without the racy os.umask() set/reset dance
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _mkstemp_for(path: Path) -> tuple[int, str]:
    """Hidden temp file next to ``path`` (same filesystem), normal permissions."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    if hasattr(os, "fchmod"):
        os.fchmod(fd, 0o666 & ~_umask())
    return fd, tmp
