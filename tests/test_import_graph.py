"""No import circles between cobatch's modules.

Every import counts, wherever it is written: at module level, inside a function, or under TYPE_CHECKING. A
function-level import only postpones a circle; the two modules still cannot be understood one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


def module_names(src: Path) -> dict[str, Path]:
    """Every module under src/cobatch by its dotted name (a package by its own name, for its __init__)."""
    names = {}
    for path in sorted((src / "cobatch").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The cobatch modules `module` imports. `from a.b import c` imports a.b.c where that is a module, else a.b."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {name for name in found if name in known and name != module}


def import_graph(src: Path) -> dict[str, set[str]]:
    names = module_names(src)
    known = set(names)
    return {name: imported_modules(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
            for name, path in names.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_circles_in_cobatch():
    graph = import_graph(SRC)
    assert len(graph) > 30, "the source tree was not found"
    assert circles(graph) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "cobatch" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize("a_text, b_text", [
    ("from cobatch import b\n", "import cobatch.a\n"),                                 # module level both ways
    ("from cobatch.b import thing\n", "def f():\n    from cobatch.a import other\n"),   # a function-level import
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cobatch.b import T\n",
     "from . import a\n"),                                                            # relative, typing-only
])
def test_a_circle_is_found(tmp_path, a_text, b_text):
    src = _write(tmp_path, {"__init__.py": "", "a.py": a_text, "b.py": b_text})
    assert circles(import_graph(src)) == [["cobatch.a", "cobatch.b"]]


def test_from_package_import_name_is_the_package_not_a_circle(tmp_path):
    # b takes a name defined in the package's __init__, which imports nothing: no circle with a.
    src = _write(tmp_path, {"__init__.py": "VERSION = 1\n", "a.py": "from cobatch.b import f\n",
                            "b.py": "from cobatch import VERSION\n"})
    graph = import_graph(src)
    assert graph["cobatch.b"] == {"cobatch"}
    assert graph["cobatch.a"] == {"cobatch.b"}
    assert circles(graph) == []


def test_from_subpackage_import_module(tmp_path):
    src = _write(tmp_path, {"__init__.py": "", "pkg/__init__.py": "", "pkg/m.py": "from ..pkg import n\n",
                            "pkg/n.py": "from cobatch.pkg import m\n"})
    graph = import_graph(src)
    assert graph["cobatch.pkg.m"] == {"cobatch.pkg.n"}
    assert circles(graph) == [["cobatch.pkg.m", "cobatch.pkg.n"]]
