"""The package's modules import one another without a cycle.

Read from the source with `ast`: an import at module level (or under a module-level `if`,
`try` or `with`, but not under `if TYPE_CHECKING:`) is an edge. Imports inside functions are
left out on purpose: they run when called, after every module has loaded.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "keras_meshlayout"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, (ast.Try, ast.With)):
            yield from _top_level(node.body)
        else:
            yield node


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it loads."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _top_level(ast.parse(path.read_text(encoding="utf-8")).body):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                submodules = {f"{target}.{alias.name}" for alias in node.names} & files.keys()
                # `from . import _x` loads the submodule; a name that is no module comes
                # from `target` itself.
                edges |= submodules or ({target} & files.keys())
            elif isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names} & files.keys()
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or `None`."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


@pytest.mark.parametrize(
    "graph, cycle",
    [
        ({"a": {"b"}, "b": set()}, None),
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
    ],
    ids=["chain", "two-cycle", "cycle-below-the-root"],
)
def test_find_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "keras_meshlayout.core._rules" in graph["keras_meshlayout.core._distribution"]
    assert "keras_meshlayout.planner" in graph
    # TYPE_CHECKING only:
    assert "keras_meshlayout.core._distribution" not in graph["keras_meshlayout.core._plan"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_no_module_imports_the_public_surface_when_it_loads():
    graph = import_graph()
    offenders = sorted(
        name for name, edges in graph.items() if name != "keras_meshlayout" and "keras_meshlayout" in edges
    )
    assert offenders == []
