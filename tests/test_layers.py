"""The house's layer order, written once: no module imports a higher layer, and no import cycles.

Layers, low to high. A module may import its own package or any lower layer:
  0  posprobe/<name>.py   pure maths (rope.py): imports nothing of posprobe
  1  backend              the only package that touches TransformerLens or Hugging Face internals
  2  core, data           position control, capture, scoring, the long-context engine; data sets
  3  report               Result, schema, pages, figures (from tables and meta only)
  3.5 zoo                 a model factory: matched models per positional family, trained and extended (no analysis)
  4  analyses             Config -> run(model, data, config) -> Result; across many models too (atlas_many)
  5  cli                  flags and commands over the analyses
posprobe/__init__.py and __main__.py are the public face (lazy re-exports) and sit outside the order.
Imports inside functions count the same as top-level ones: a lazy import up the layers is still one.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "posprobe"
LAYERS = {"backend": 1, "core": 2, "data": 2, "report": 3, "zoo": 3.5, "analyses": 4, "cli": 5}
FACE = {"posprobe", "posprobe.__main__"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> float | None:
    parts = module.split(".")
    if module in FACE:
        return None
    if len(parts) == 2 and parts[1] not in LAYERS:
        return 0
    return LAYERS[parts[1]]


def _target(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """posprobe modules an import statement names (a name imported from a package may be a submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name.startswith("posprobe"):
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the posprobe modules it imports (anywhere in the file)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(t for t in _target(module, node) if t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_module_imports_a_higher_layer():
    up = [f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})"
          for a, targets in import_graph().items() for b in sorted(targets)
          if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]
    assert not up, "imports up the layers:\n" + "\n".join(up)


#: Imports the layer order allows but the house does not: (importer prefix, imported prefix, why).
FORBIDDEN = (
    ("posprobe.analyses", "posprobe.backend.hf", "analyses ask the facts or the façades, not the HF door itself"),
    ("posprobe.data", "posprobe.backend", "data sets are read without models (the cache lives in posprobe.places)"),
)


def forbidden(graph: dict[str, set[str]]) -> list[str]:
    """Edges of `graph` that FORBIDDEN names, as "a -> b (why)"."""
    return [f"{a} -> {b} ({why})" for a, targets in graph.items() for b in sorted(targets)
            for src, dst, why in FORBIDDEN if (a + ".").startswith(src + ".") and (b + ".").startswith(dst + ".")]


def test_no_forbidden_import():
    found = forbidden(import_graph())
    assert not found, "imports the house forbids:\n" + "\n".join(found)
    planted = {"posprobe.analyses.shift": {"posprobe.backend.hf"}, "posprobe.data.x": {"posprobe.backend"}}
    assert len(forbidden(planted)) == 2


def test_the_zoo_imports_no_analysis():
    # The zoo makes models; comparing them is the analyses' work (#50). The layer order says so (zoo 3.5 < analyses
    # 4): the check above sees a planted zoo -> analyses edge as upward, and no real one exists.
    graph = import_graph()
    found = sorted(f"{a} -> {b}" for a, targets in graph.items() if a.startswith("posprobe.zoo")
                   for b in targets if b.startswith("posprobe.analyses"))
    assert not found, "the zoo imports analyses:\n" + "\n".join(found)
    assert layer_of("posprobe.analyses.shift") > layer_of("posprobe.zoo.train") > layer_of("posprobe.report.result")


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_can_fail():
    # A graph with a cycle and an upward edge, built by hand: the checks above must see both.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert layer_of("posprobe.rope") == 0 and layer_of("posprobe.cli.main") == 5
    assert layer_of("posprobe.backend.hf") < layer_of("posprobe.core.long_engine")


def test_every_package_has_a_layer():
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert on_disk == set(LAYERS), f"packages without a layer: {on_disk - set(LAYERS)}; gone: {set(LAYERS) - on_disk}"


def test_both_backend_adapters_offer_the_same_operations():
    # dispatch.ops(model) picks one of the two modules: a function only one of them defines would fail on the
    # other backend at run time, far from here.
    import inspect

    from posprobe.backend import bridge_ops, legacy_ops

    def own(mod):
        return {n for n, f in vars(mod).items()
                if inspect.isfunction(f) and f.__module__ == mod.__name__ and not n.startswith("_")}

    assert own(bridge_ops) - own(legacy_ops) == set(), "only the bridge adapter defines these"
    assert own(legacy_ops) - own(bridge_ops) == set(), "only the legacy adapter defines these"
    assert {"forward", "rotate_at", "rotary_specs"} <= own(bridge_ops)
