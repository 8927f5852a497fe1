"""The house's rules, read from the source: imports flow one way (no circles; swarm/ reaches into the
peer only from the command line and the launcher), and no file or function grows past what a newcomer
reads in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> import name (pyproject's package-dir)
PACKAGES = {"swarm": "swarm", "peer": "swarm.peer", "compression": "swarm.compression"}
MAY_IMPORT_PEER = ("swarm.cli", "swarm.launch")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join([PACKAGES[folder], *rest])
    return name.removesuffix(".__init__")


def source_files() -> dict[str, Path]:
    return {
        module_name(path): path
        for folder in PACKAGES
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not path.name.endswith("_pb2.py")
    }


def imported_names(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """Every module name an import in `tree` may refer to, wherever the import sits (functions and
    TYPE_CHECKING blocks included: a deferred import is still a dependency)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    files = source_files()
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        names = imported_names(tree, name, path.name == "__init__.py")
        graph[name] = {other for other in names if other in files and other != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
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
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_imports_form_no_circle():
    assert circles(import_graph()) == []


def test_swarm_reaches_into_the_peer_only_from_the_command_line_and_the_launcher():
    offenders = {
        name: sorted(other for other in imports if other.startswith("swarm.peer"))
        for name, imports in import_graph().items()
        if not name.startswith(("swarm.peer", "swarm.compression")) and not name.startswith(MAY_IMPORT_PEER)
    }
    assert {name: peer for name, peer in offenders.items() if peer} == {}


def test_no_file_or_function_is_too_long_to_read():
    too_long = []
    for path in source_files().values():
        text = path.read_text()
        if text.count("\n") + 1 > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10)) + 1} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert too_long == []


def test_every_package_folder_ships_in_an_installed_copy():
    """`pip install .` (not -e) installs only the packages pyproject lists: a folder left out imports in a
    checkout and fails on an installed peer."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(settings["packages"])
    folders = {folder: name for name, folder in settings["package-dir"].items()}
    found = {
        ".".join([folders[top], *init.parent.relative_to(ROOT / top).parts])
        for top in folders
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found - listed == set(), "package folders missing from pyproject's [tool.setuptools] packages"
