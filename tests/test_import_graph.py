"""The import graph of specrun's modules has no cycle: every shared name has one owner and imports flow one way.
An edge is any `import specrun.x` / `from specrun.x import y` / relative import, at module level or inside a function."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "specrun"


def _module_name(path: Path) -> str:
    parts = ("specrun",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module file that `name` stands for: itself if it is one, else its nearest enclosing module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _edges(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name.split(".")[0] == "specrun")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "specrun":
                continue
            for alias in node.names:
                child = f"{source}.{alias.name}"
                targets.add(child if child in modules else source)
    owners = {_owner(t, modules) for t in targets}
    return {o for o in owners if o and o != module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; returns every component (each a list of module names)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete cycle through the component's first module, for the failure message."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for child in sorted(graph[node] & members):
            if child == start:
                return paths[node] + [start]
            if child not in paths:
                paths[child] = paths[node] + [child]
                frontier.append(child)
    return component


def test_strongly_connected_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert sorted(len(c) for c in strongly_connected(graph)) == [1, 3]
    assert _cycle_in(["a", "b", "c"], graph) == ["a", "b", "c", "a"]


def test_edges_resolve_modules_and_lazy_imports():
    graph = import_graph()
    assert "specrun.decoding.engine" in graph and "specrun.storage" in graph
    assert all(target in graph for targets in graph.values() for target in targets)


def test_no_import_cycle():
    graph = import_graph()
    cycles = [_cycle_in(c, graph) for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
