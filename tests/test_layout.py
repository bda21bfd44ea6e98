"""The package's shape: which layer may import which, and how large a module or class may grow."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "engramkv"

# Each layer and the layers it may import (directly). The floors of DESIGN.md:
# cli/tui -> public API -> lm -> session -> {chat, sampling, engine, retrieval, storage} -> memory -> {config, errors, spec};
# kernels (each with its PyTorch twin) sit under memory, hf, engine and storage; hf is for lm and engine, and for
# the fits that measure the model itself (calibration, lowrank_fit). tasks score a reply cut as chat cuts it.
ALLOWED = {
    "errors": set(),
    "spec": set(),
    "tasks": {"chat"},
    "config": {"errors"},
    "kernels": {"errors"},
    "memory": {"kernels", "config", "errors", "spec"},
    "retrieval": {"memory", "kernels", "config", "errors", "spec"},  # recall on the device (kernels.selection)
    "storage": {"memory", "kernels", "config", "errors", "spec"},
    "documents": {"errors", "memory", "results"},
    "results": {"memory"},
    "chat": {"config", "errors"},
    "sampling": {"config", "errors"},
    "hf": {"kernels", "config", "errors", "spec"},
    "engine": {"memory", "retrieval", "hf", "kernels", "config", "errors", "spec"},
    "reading": {"engine", "retrieval", "memory", "documents", "results", "config", "errors"},
    "answering": {"chat", "reading", "engine", "retrieval", "memory", "config", "errors"},
    "sharding": {"engine", "storage", "memory", "documents", "results", "config", "errors"},
    "session": {"answering", "chat", "sampling", "reading", "sharding", "engine", "retrieval", "memory", "documents", "results", "config", "errors", "spec"},
    "calibration": {"lm", "hf", "answering", "chat", "retrieval", "tasks", "config", "errors"},
    "lm": {"session", "storage", "memory", "hf", "config", "errors", "spec"},
    "lowrank_fit": {"lm", "hf", "storage", "config", "errors"},
    "__init__": {"calibration", "lowrank_fit", "lm", "session", "storage", "memory", "retrieval", "results", "config", "errors", "spec"},
    "cli": {"__init__"},
    "tui": {"__init__"},
    "server": {"__init__"},
}


def _layer(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imports(path: Path) -> set[str]:
    """The engramkv layers `path` imports (top-level, inside functions and under TYPE_CHECKING alike)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if node.module == "engramkv":
                names = [f"engramkv.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "engramkv" and len(parts) > 1:
                found.add(parts[1])
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _public_names() -> set[str]:
    import engramkv

    return set(engramkv.__all__)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_floors(path):
    layer = _layer(path)
    imported = _imports(path) - {layer}
    if layer in ("cli", "tui", "server"):
        # the CLI, TUI and HTTP server see the public API (the TUI app and the server are modules of the CLI's)
        imported = {name for name in imported if name not in _public_names() and name not in ("tui", "server")}
        assert imported <= {"__init__"} | set(), f"{path.name} reaches past the public API: {imported}"
        return
    assert imported <= ALLOWED[layer], f"{layer} may not import {imported - ALLOWED[layer]}"


def test_storage_imports_neither_retrieval_nor_hf():
    for path in (PACKAGE / "storage").glob("*.py"):
        assert not {"retrieval", "hf", "engine", "session"} & _imports(path), path.name


def test_sqlalchemy_is_imported_by_the_catalog_alone():
    users = [p.name for p in _modules() if "sqlalchemy" in p.read_text() and _imports_sqlalchemy(p)]
    assert users == ["catalog.py"]


def _imports_sqlalchemy(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sqlalchemy":
            return True
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "sqlalchemy" for a in node.names):
            return True
    return False


def test_no_import_cycle_between_layers():
    graph: dict[str, set[str]] = {}
    for path in _modules():
        graph.setdefault(_layer(path), set()).update(_imports(path) - {_layer(path)})
    graph = {k: {v for v in vs if v in graph} for k, vs in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join(trail + [node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(graph[node]):
            if node not in ("cli", "tui", "server") and nxt == "__init__":
                raise AssertionError(f"{node} imports the package's public face")
            visit(nxt, trail + [node])
        state[node] = 2

    for node in sorted(graph):
        if node != "__init__":
            visit(node, [])


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_classes_stay_small(path):
    source = path.read_text()
    assert len(source.splitlines()) <= 400, f"{path.name} has {len(source.splitlines())} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            assert size <= 300, f"class {node.name} has {size} lines"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_says_what_it_owns(path):
    if path.name == "__init__.py" and path.parent != PACKAGE:
        return  # sub-package markers are empty
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring and len(docstring.splitlines()[0]) > 20, f"{path} lacks a first docstring line"
