"""The project's import structure: no cycles, and each layer imports only downward.

A small static checker (the ``ast`` of every module; imports inside functions
count, ``if TYPE_CHECKING:`` blocks do not) rather than an import-graph
library: the installed packages map ``skyrl_lora.client`` and
``skyrl_lora.server`` to folders outside ``skyrl_lora/``, which such tools,
walking one folder per package, do not follow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Folder -> dotted package, as pyproject.toml's package-dir maps them.
SOURCES = {
    "skyrl_lora": "skyrl_lora",
    "client": "skyrl_lora.client",
    "server": "skyrl_lora.server",
    "examples": "examples",
    "benchmarks": "benchmarks",
    "gpu_tests": "gpu_tests",
}
#: Server subpackages, lowest first: a package may import only those before it
#: (and the server's base, which is below every one of them; the entry points
#: cli, demo and __main__ sit on top).
SERVER_LAYERS = ["adapters", "transfer", "loading", "engine", "tinker", "http", "cluster"]
SERVER_ENTRY_POINTS = {"cli", "demo", "__main__"}
#: The server's base: its top-level modules (compat, ...) and these packages,
#: which import nothing of the layers above (among themselves, only no cycles).
SERVER_BASE_PACKAGES = {"telemetry", "embedded", "kernels"}
#: A package a newcomer can hold, and a top level that reads at a glance.
MAX_PACKAGE_MODULES = 12
MAX_TOP_LEVEL_MODULES = 10


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``module`` imports (a name imported from a package
    that is itself a module counts as that module)."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names: list[str] = []
        else:
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                bases = [".".join([*anchor, *([node.module] if node.module else [])])]
            else:
                bases = [node.module or ""]
            names = [alias.name for alias in node.names]
        for base in bases:
            for candidate in [f"{base}.{n}" for n in names] + [base]:
                while candidate and candidate not in known:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != module:
                    targets.add(candidate)
                    break
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
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
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _server_layer(module: str) -> int | None:
    """Rank of a server module: the base 0, layered subpackages 1..n, entry points last."""
    parts = module.split(".")
    if parts[:2] != ["skyrl_lora", "server"] or len(parts) < 3:
        return None
    if parts[2] in SERVER_LAYERS:  # a module of the subpackage, or its own __init__
        return 1 + SERVER_LAYERS.index(parts[2])
    if parts[2] in SERVER_ENTRY_POINTS:
        return len(SERVER_LAYERS) + 1
    return 0


def test_the_checker_sees_every_kind_of_import() -> None:
    graph = _graph()
    assert "skyrl_lora.server.adapters.registry" in graph["skyrl_lora.server.engine.gated"]
    assert "skyrl_lora.server.cluster.actor" in graph["skyrl_lora.server.cli"]  # in a function
    assert "skyrl_lora.stitching" in graph["skyrl_lora.client.client"]
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(fake) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_server_layers_import_only_downward() -> None:
    upward = []
    for module, targets in _graph().items():
        mine = _server_layer(module)
        if mine is None:
            continue
        for target in targets:
            theirs = _server_layer(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_the_client_and_core_never_import_the_server_and_examples_no_harness() -> None:
    graph = _graph()
    for module, targets in graph.items():
        if module.startswith(("skyrl_lora.server", "examples", "benchmarks", "gpu_tests")):
            continue
        bad = [t for t in targets if t.startswith(("skyrl_lora.server", "examples", "benchmarks"))]
        assert bad == [], module
    for module, targets in graph.items():
        if module.startswith("examples"):
            harness = ("benchmarks", "gpu_tests", "tests")
            assert not [t for t in targets if t.startswith(harness)], module


def test_every_server_package_has_a_place_and_stays_small() -> None:
    server = ROOT / "server"
    packages = {p.parent.name for p in server.glob("*/__init__.py")}
    assert packages == set(SERVER_LAYERS) | SERVER_BASE_PACKAGES  # a new one is ranked here
    listed = (ROOT / "pyproject.toml").read_text()
    unlisted = [p for p in packages if f'"skyrl_lora.server.{p}"' not in listed]
    assert unlisted == [], "pyproject.toml's packages must list them (or a wheel leaves them out)"
    for package in packages:
        modules = sorted(p.name for p in (server / package).glob("*.py"))
        assert len(modules) <= MAX_PACKAGE_MODULES, (package, modules)
    top_level = sorted(p.name for p in server.glob("*.py"))
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, top_level
