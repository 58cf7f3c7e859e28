"""The notebooks in analyses/ as the docs site's tutorials, with their outputs (text, tables, plotly figures).

The notebooks are executed by the test suite already (`run_notebook` in tests/conftest.py); each run saves its
executed copy into `.tutorials/<name>.ipynb` (git-ignored) with the SHA-256 of the notebook's source. The site
renders from those copies, so building it executes nothing:

* mkdocs.yml names this file as a hook: on every build it writes `tutorials/<name>.md` for each notebook of
  `TUTORIALS` (virtual pages, in the nav's "Tutorials" section) from the executed copy whose source hash matches
  the notebook, or, where there is none (a fresh clone), from the notebook's source with a note that says how
  to fill its outputs; the figures are drawn by the installed plotly.js, copied into the site (offline).
* `python tests/docs_tutorials.py [NAME ...]` executes notebooks into `.tutorials/` (all without a NAME), the
  way the tests do, so that a full site can be built without running the test suite.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "analyses"
#: Where the executed notebooks are kept (git-ignored); POSPROBE_TUTORIALS moves it.
CACHE = Path(os.environ.get("POSPROBE_TUTORIALS") or ROOT / ".tutorials")

#: The tutorials in the order a newcomer follows them: the Config -> run -> Result call on a tiny model first,
#: then the atlas (every analysis on a real model), then one analysis at a time, the zoo (training) last.
#: (notebook, nav title, what it teaches)
TUTORIALS = [
    ("shift_test", "1. Shift test: the first call",
     "one `run_*(model, data, Config())` call on a tiny model: a `Result` with its tables and figures"),
    ("position_probes", "2. Position probes and geometry", "linear probes for position per layer, W_pos geometry"),
    ("score_decomposition", "3. Score decomposition", "attention scores split into word and position terms"),
    ("positional_atlas", "4. The atlas of a real model",
     "every analysis on SmolLM2 (RoPE decoder) and MiniLM (BERT encoder), one report"),
    ("frequency_usage", "5. Frequency usage", "which RoPE frequency bands each head uses, and ablating them"),
    ("key_squishing", "6. Key squishing", "surgery: an instruction squished into fewer positions"),
    ("retrieval_heads", "7. Retrieval heads", "which heads copy the needle, and masking them"),
    ("long_context", "8. Long context", "loss by position and passkey retrieval past the trained context"),
    ("positional_zoo", "9. The positional zoo", "training matched models that differ only in positions"),
]
#: The environment variables a notebook reads are recorded beside its executed copy (the tests shrink some runs).
ENV_PREFIX = "POSPROBE_"
PLOTLY_JS = "assets/javascripts/plotly.min.js"


def source_hash(name: str) -> str:
    return hashlib.sha256((NOTEBOOKS / f"{name}.py").read_bytes()).hexdigest()


def save_executed(name: str, nb) -> Path:
    """Keep an executed notebook (an nbformat node) as the tutorial's outputs, atomically (xdist workers share it)."""
    import nbformat

    source = (NOTEBOOKS / f"{name}.py").read_text(encoding="utf-8")
    nb.metadata["posprobe"] = {"source_sha256": source_hash(name),
                               "env": {k: v for k, v in sorted(os.environ.items())  # the ones this notebook reads
                                       if k.startswith(ENV_PREFIX) and k != "POSPROBE_OUT" and f'"{k}"' in source}}
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{name}.ipynb"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    nbformat.write(nb, str(tmp))
    os.replace(tmp, path)
    return path


def executed(name: str) -> dict | None:
    """The executed copy of notebook `name` (its JSON), or None where there is none for its current source."""
    path = CACHE / f"{name}.ipynb"
    if not path.is_file():
        return None
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if nb.get("metadata", {}).get("posprobe", {}).get("source_sha256") != source_hash(name):
        return None
    return nb


def execute(name: str, workdir: Path | None = None, timeout: int = 900) -> Path:
    """Execute analyses/<name>.py headless (in a temporary folder) and keep the result; fails on an error output."""
    import tempfile

    import jupytext
    from nbclient import NotebookClient

    nb = jupytext.read(NOTEBOOKS / f"{name}.py")
    saved = {k: os.environ.get(k) for k in ("POSPROBE_OUT", "PYTHONPATH")}
    with tempfile.TemporaryDirectory(prefix=f"posprobe-{name}-") as tmp:
        os.environ.setdefault("POSPROBE_OUT", str(Path(tmp) / "out"))  # notebooks that write reports write there
        # The kernel imports this checkout's posprobe (not another one an editable install points to).
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved["PYTHONPATH"]) if p)
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(workdir or tmp)}}).execute()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    if errors:
        raise RuntimeError(f"{name}: {errors[0].get('ename')}: {errors[0].get('evalue')}")
    return save_executed(name, nb)


# ---------------------------------------------------------------------------------------------- rendering

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value)


def _fence(body: str, lang: str = "text") -> str:
    body = _ANSI.sub("", body).rstrip("\n")
    ticks = "```"
    while ticks in body:
        ticks += "`"
    return f"{ticks}{lang}\n{body}\n{ticks}"


def _script_json(obj) -> str:
    """JSON safe inside a <script> element."""
    return json.dumps(obj, separators=(",", ":")).replace("</", "<\\/").replace("<!--", "<\\!--")


def _output(out: dict, fig_id: str) -> tuple[str, bool]:
    """Markdown (raw HTML where needed) for one output; and whether it is a plotly figure."""
    kind = out.get("output_type")
    if kind == "stream":  # stderr is warnings and progress bars: left out
        return (_fence(_text(out.get("text", ""))), False) if out.get("name") == "stdout" else ("", False)
    if kind not in ("execute_result", "display_data"):
        return "", False
    data = out.get("data", {})
    if "application/vnd.plotly.v1+json" in data:
        fig = data["application/vnd.plotly.v1+json"]
        layout = fig.get("layout", {})
        height = int(layout.get("height") or 450)
        config = {"responsive": True, "displaylogo": False, **fig.get("config", {})}
        return ((f'<div class="pp-tutorial-figure" id="{fig_id}" style="width:100%;height:{height}px"></div>\n'
                 f'<script>Plotly.newPlot("{fig_id}", {_script_json(fig.get("data", []))}, '
                 f'{_script_json(layout)}, {_script_json(config)});</script>'), True)
    for mime in ("image/png", "image/jpeg", "image/svg+xml"):
        if mime in data:
            raw = _text(data[mime])
            b64 = base64.b64encode(raw.encode()).decode() if mime == "image/svg+xml" else raw.replace("\n", "")
            return f'<p class="pp-tutorial-image"><img alt="figure" src="data:{mime};base64,{b64}"></p>', False
    if "text/html" in data:
        body = "\n".join(line for line in _text(data["text/html"]).splitlines() if line.strip())
        return f'<div class="pp-tutorial-html">\n{body}\n</div>', False
    if "text/markdown" in data:
        return _text(data["text/markdown"]), False
    if "text/plain" in data:
        return _fence(_text(data["text/plain"])), False
    return "", False


def render(name: str, nb: dict | None = None) -> str:
    """The Markdown page of tutorial `name`: its cells with the outputs of the executed copy (if any)."""
    title, what = next((t, w) for n, t, w in TUTORIALS if n == name)
    source = f"analyses/{name}.py"
    if nb is None:
        nb = executed(name)
    have_outputs = nb is not None
    if nb is None:
        import jupytext

        nb = json.loads(jupytext.writes(jupytext.read(NOTEBOOKS / f"{name}.py"), fmt="ipynb"))
    parts: list[str] = []
    n_fig = 0
    heading_done = False
    for cell in nb["cells"]:
        text = _text(cell.get("source", "")).strip("\n")
        if cell["cell_type"] == "markdown":
            if not heading_done and text.startswith("# "):
                first, _, rest = text.partition("\n")
                parts.append(first)
                parts.append(_banner(source, what, nb, have_outputs))
                text = rest
                heading_done = True
            if text.strip():
                parts.append(text)
            continue
        if cell["cell_type"] != "code" or not text.strip():
            continue
        parts.append(_fence(text, "python"))
        for out in cell.get("outputs", []):
            md, is_fig = _output(out, f"pp-tutorial-fig-{n_fig}")
            n_fig += is_fig
            if md:
                parts.append(md)
    if not heading_done:
        parts.insert(0, f"# {title}\n\n" + _banner(source, what, nb, have_outputs))
    page = "\n\n".join(parts) + "\n"
    if n_fig:  # plotly.js from the site itself (offline); pages live in tutorials/, one level down
        page = f'<script src="../{PLOTLY_JS}"></script>\n\n' + page
    return page


def _banner(source: str, what: str, nb: dict, have_outputs: bool) -> str:
    name = Path(source).stem
    if have_outputs:
        env = nb.get("metadata", {}).get("posprobe", {}).get("env", {})
        ran = ("; it ran with " + ", ".join(f"`{k}={v}`" for k, v in env.items()) + " (the test suite's smaller run)"
               if env else "")
        note = (f'!!! info "The notebook `{source}`, executed"\n    What it shows: {what}. The outputs below are those '
                f"of its last run by the test suite (or `python tests/docs_tutorials.py {name}`){ran}. Open it in "
                f"Jupyter with jupytext, or run it as a script: `python {source}`.")
    else:
        note = (f'!!! warning "The notebook `{source}`, not executed yet"\n    What it shows: {what}. This build has '
                f"no executed copy of the notebook for its current source, so its outputs are not shown: run "
                f"`python tests/docs_tutorials.py {name}` (or the notebook's test), then build the site again.")
    return note


# ---------------------------------------------------------------------------------------------- mkdocs hook

def on_files(files, config):
    """Add tutorials/<name>.md for every notebook, and plotly.js where a tutorial draws a figure."""
    from mkdocs.structure.files import File

    any_figure = False
    for name, _, _ in TUTORIALS:
        page = render(name)
        any_figure |= "Plotly.newPlot(" in page
        files.append(File.generated(config, f"tutorials/{name}.md", content=page))
    if any_figure:
        from plotly.offline import get_plotlyjs

        files.append(File.generated(config, PLOTLY_JS, content=get_plotlyjs()))
    return files


def on_serve(server, config, builder):
    """`mkdocs serve` rebuilds when a notebook or an executed copy changes."""
    server.watch(str(NOTEBOOKS))
    if CACHE.is_dir():
        server.watch(str(CACHE))
    return server


if __name__ == "__main__":
    names = sys.argv[1:] or [n for n, _, _ in TUTORIALS]
    unknown = sorted(set(names) - {n for n, _, _ in TUTORIALS})
    if unknown:
        sys.exit(f"unknown notebooks {unknown}; these are: {[n for n, _, _ in TUTORIALS]}")
    for name in names:
        import time

        t0 = time.perf_counter()
        path = execute(name)
        print(f"{name}: executed in {time.perf_counter() - t0:.0f} s -> {path.relative_to(ROOT)}", flush=True)
