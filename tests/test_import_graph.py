"""The package's modules import one another without a cycle, never a higher layer, and stay small.

Read from the source with `ast`. Two graphs: the load-time one, where an import at module level
(or under a module-level `if`, `try` or `with`, but not under `if TYPE_CHECKING:`) is an edge,
and the full one, where every import counts, at load time or lazily inside a function, even
under `if TYPE_CHECKING:`. Neither has a cycle, inside a package or across them: a module
that needs another's caller takes a protocol or a predicate instead. In the full graph a lower
layer never knows a higher one.

Size: no module over 500 lines, no function over 60 lines of code (docstrings, comments and
blank lines not counted), but for the short allow-list below.

The layers, lowest first: `_compat` < `core` < `report` < `planner` < `runtime`, `checkpoint`
(side by side: neither imports the other) < `cli` < the top level (`__init__`, `__main__`,
`launch`).
"""

from __future__ import annotations

import ast
import functools
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


def _everywhere(body: list[ast.stmt]):
    yield from ast.walk(ast.Module(body=body, type_ignores=[]))


def import_graph(lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it loads (with `lazy`: anywhere in it)."""
    return {name: set(edges) for name, edges in _parsed_graph(lazy).items()}  # a copy to change


@functools.cache  # the package is parsed once per run and kind, not once per test
def _parsed_graph(lazy: bool) -> dict[str, frozenset[str]]:
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, frozenset[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        body = ast.parse(path.read_text(encoding="utf-8")).body
        for node in (_everywhere if lazy else _top_level)(body):
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
        graph[name] = frozenset(edges - {name})
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
    assert "keras_meshlayout.core._distribution" not in graph["keras_meshlayout.core._dry"]


@pytest.mark.parametrize("lazy", [False, True], ids=["at-load-time", "anywhere"])
def test_no_import_cycle(lazy):
    """No cycle, across packages or inside one (`core._distribution` <-> `core._trainer_hooks` was one)."""
    cycle = find_cycle(import_graph(lazy=lazy))
    assert cycle is None, " -> ".join(cycle or [])


def test_no_module_imports_the_public_surface_when_it_loads():
    graph = import_graph()
    offenders = sorted(
        name for name, edges in graph.items() if name != "keras_meshlayout" and "keras_meshlayout" in edges
    )
    assert offenders == []


#: Layer of each top-level part of the package, lowest first; equal numbers sit side by side.
LAYERS = {
    "_compat": 0,
    "core": 1,
    "report": 2,
    "planner": 3,
    "runtime": 4,
    "checkpoint": 4,
    "cli": 5,
    "": 6,  # the top level: __init__, __main__, launch
}


def layer_of(module: str) -> tuple[str, int]:
    parts = module.split(".")[1:]
    part = parts[0] if parts and parts[0] in LAYERS else ""
    return part, LAYERS[part]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module in a higher layer, or in another part of the same layer."""
    found = []
    for module, targets in sorted(graph.items()):
        part, level = layer_of(module)
        for target in sorted(targets):
            target_part, target_level = layer_of(target)
            if target_level > level or (target_level == level and target_part != part):
                found.append(
                    f"{module} ({part or 'top level'}) imports {target} ({target_part or 'top level'})"
                )
    return found


@pytest.mark.parametrize(
    "graph, found",
    [
        ({"keras_meshlayout.core._plan": {"keras_meshlayout._compat", "keras_meshlayout.core._mesh"}}, []),
        (
            {"keras_meshlayout.core._plan": {"keras_meshlayout.report._pictures"}},
            ["keras_meshlayout.core._plan (core) imports keras_meshlayout.report._pictures (report)"],
        ),
        (
            {"keras_meshlayout.runtime._x": {"keras_meshlayout.checkpoint._y"}},
            ["keras_meshlayout.runtime._x (runtime) imports keras_meshlayout.checkpoint._y (checkpoint)"],
        ),
        (
            {
                "keras_meshlayout": {"keras_meshlayout.cli._main"},
                "keras_meshlayout.launch": {"keras_meshlayout"},
            },
            [],
        ),
        (
            {"keras_meshlayout._compat": {"keras_meshlayout.core._errors"}},
            ["keras_meshlayout._compat (_compat) imports keras_meshlayout.core._errors (core)"],
        ),
    ],
    ids=["down", "core-to-report", "side-by-side", "top-level", "compat-to-core"],
)
def test_upward_imports_are_found(graph, found):
    assert upward_imports(graph) == found


def test_the_lazy_graph_sees_imports_inside_functions():
    graph = import_graph(lazy=True)
    assert "keras_meshlayout.core._distribution" in graph["keras_meshlayout.core._dry"]  # TYPE_CHECKING
    assert "keras_meshlayout.core._dry" not in graph["keras_meshlayout.core._distribution"]
    assert "keras_meshlayout.core._distribution" in graph["keras_meshlayout.cli._plan"]  # in a function
    assert "keras_meshlayout.core._distribution" not in import_graph()["keras_meshlayout.cli._plan"]


def test_every_module_has_a_layer():
    assert {layer_of(module)[0] for module in import_graph()} == set(LAYERS)


def test_no_module_imports_a_higher_layer():
    """Not at load time, not lazily inside a function: lower layers never know higher ones."""
    found = upward_imports(import_graph(lazy=True))
    assert found == [], "upward imports (move the code down, or the import up):\n" + "\n".join(found)


# -- size ------------------------------------------------------------------------------------

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60

#: Modules and functions still over the limits, each with why it may be for now. None in core/;
#: the others are being split on their owners' branches, and the merger removes each entry
#: that the merged tree no longer needs (the test fails while an entry is stale).
TOO_LONG: dict[str, str] = {}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(source: str, node: ast.AST, docstrings: set[int]) -> int:
    """Lines of code of `node`: not blank, not only a comment, not part of a docstring."""
    text = source.splitlines()
    return sum(
        1
        for number in range(node.lineno, node.end_lineno + 1)
        if number not in docstrings and (line := text[number - 1].strip()) and not line.startswith("#")
    )


def too_long(source: str, relative: str) -> dict[str, int]:
    """`{"path": lines}` for a module over the limit, `{"path:function": lines}` for each function."""
    found = {}
    if len(source.splitlines()) > MAX_MODULE_LINES:
        found[relative] = len(source.splitlines())
    tree = ast.parse(source)
    docstrings = _docstring_lines(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = code_lines(source, node, docstrings)
            if lines > MAX_FUNCTION_LINES:
                found[f"{relative}:{node.name}"] = lines
    return found


def test_too_long_counts_code_not_docstrings():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))  # and the `def` line: 61
    doc = '    """' + "\n" * 100 + '    """\n'
    assert too_long(f"def f():\n{doc}    # a comment\n\n{body}\n", "m.py") == {"m.py:f": 61}
    assert too_long(f"def f():\n{doc}" + "\n".join(f"    x{i} = {i}" for i in range(59)) + "\n", "m.py") == {}
    assert too_long("x = 1\n" * 501, "m.py") == {"m.py": 501}


def _sizes() -> dict[str, int]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found.update(too_long(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE))))
    return found


def test_modules_and_functions_are_small():
    over = {name: lines for name, lines in _sizes().items() if name not in TOO_LONG}
    assert over == {}, (
        f"over {MAX_MODULE_LINES} lines (module) or {MAX_FUNCTION_LINES} lines of code (function): {over}. "
        "Fix: split it along its concerns (CONTRIBUTING.md, 'Where things live')."
    )


def test_the_allow_list_is_short_and_exact():
    assert not [name for name in TOO_LONG if name.startswith("core/")], "core/ needs no exception"
    assert all(reason.strip() for reason in TOO_LONG.values())
    stale = sorted(set(TOO_LONG) - set(_sizes()))
    assert stale == [], f"these are small now; remove them from TOO_LONG: {stale}"
