"""The import direction is the architecture: this test fails on an import against it.

Layers, lowest first (ARCHITECTURE.md draws them):

    process, wire  <-  models  <-  dht  <-  peers  <-  swarm

`process` (flags, environment, the metrics endpoint, the version) and `wire` (what crosses between
a trainer and a peer) are leaves: they import no project package, not even each other. A package
may import its own modules and any lower layer, never a higher one. Every import counts: at module
level, inside functions, and under `TYPE_CHECKING`. The same walk checks that no two modules import
each other in a circle.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = {"process": 0, "wire": 0, "models": 1, "dht": 2, "peers": 3, "swarm": 4}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _project_modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for package in LAYERS for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(path: pathlib.Path, module: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported project module) for every import in the file, wherever it stands."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a import b`: the module a.b where b is one, else the names of module a
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # `from wire import compression` names a module; `import a.b.c` too
                name = name.rpartition(".")[0]
            if name:
                found.append((node.lineno, name))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _project_modules()
    known = set(modules)
    return {
        name: {target for _, target in _imports(path, name, known) if target != name} for name, path in modules.items()
    }


def test_every_package_is_in_a_layer():
    top_level = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests", "benchmarks"}
    assert top_level == set(LAYERS), f"packages without a layer: {sorted(top_level - set(LAYERS))}"


def test_imports_run_one_way():
    modules = _project_modules()
    known = set(modules)
    against = []
    for name, path in modules.items():
        own = name.split(".")[0]
        for line, target in _imports(path, name, known):
            other = target.split(".")[0]
            if other != own and LAYERS[other] >= LAYERS[own]:
                against.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({own} may not import {other})")
    assert not against, "imports against the layering:\n" + "\n".join(against)


def test_no_circular_imports():
    graph = _graph()
    # Tarjan's strongly connected components: any component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, "modules that import each other in a circle: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The walk must not miss an import hidden in a function body (the kind a cycle hides behind)."""
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from peers.serving import server\n    return server\n")
    assert _imports(source, "swarm.mod", {"peers.serving", "peers.serving.server"}) == [(2, "peers.serving.server")]
