"""Check the import layering of the three packages; exit status 1 on a violation.

- ``gockpt`` (the framework-free engine) imports neither adapter package, ``lightning_gockpt``
  nor ``accelerate_gockpt``: not at module level, not inside a function, not by
  ``importlib.import_module`` / ``__import__`` with a literal name. Adapters reach the engine
  through seams such as the ``gockpt.frameworks`` entry point group instead.
- No import cycle among the modules of the three packages, local imports included.

Imports under ``if TYPE_CHECKING:`` are ignored (they never run), and so are the imports of a
package's ``__init__`` (its public names re-exported), which would otherwise close a cycle
through every ``from package import name``.

Reads the source with :mod:`ast` and imports nothing, so it runs without torch or the
frameworks installed::

    python scripts/check_imports.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gockpt", "lightning_gockpt", "accelerate_gockpt")
ENGINE = "gockpt"
ADAPTERS = ("lightning_gockpt", "accelerate_gockpt")


def modules(repo: Path = REPO) -> dict[str, Path]:
    """Module name -> source file, for every ``.py`` file of the three packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST):
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:`` (``else`` kept)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield stmt
                yield from _walk(stmt)
            continue
        yield child
        yield from _walk(child)


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """``(imported module, line)`` for each import in the module ``name``.

    ``from X import Y`` counts as an import of ``X.Y`` when that is a module of ``known``, else
    of ``X``; relative imports are resolved against ``name``.
    """
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # A package's own name is its first relative level; a module's parent is.
                parent = name.split(".")
                parent = parent[:len(parent) - node.level + (1 if is_package else 0)]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name)
                       and node.func.id in ("import_module", "__import__")))):
            found.append((node.args[0].value, node.lineno))
    return found


def _top(module: str) -> str:
    return module.partition(".")[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graphs here are a few dozen nodes deep
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def check(repo: Path = REPO) -> list[str]:
    """Every violation, as a line naming the file and line or the modules of the cycle."""
    mods = modules(repo)
    known = set(mods)
    problems = []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, line in imports(name, path, known):
            where = f"{path.relative_to(repo)}:{line}"
            if _top(name) == ENGINE and _top(target) in ADAPTERS:
                problems.append(f"{where}: the engine package imports the adapter {target}")
            if path.name != "__init__.py" and target in known and target != name:
                graph[name].add(target)
    packages: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for name, targets in graph.items():
        packages[_top(name)] |= {_top(t) for t in targets if _top(t) != _top(name)}
    for component in cycles(packages):
        problems.append(f"package import cycle: {' <-> '.join(component)}")
    for component in cycles(graph):
        problems.append(f"module import cycle: {' <-> '.join(component)}")
    return problems


def main() -> int:
    problems = check()
    for line in problems:
        print(line, file=sys.stderr)
    if not problems:
        print(f"ok: {ENGINE} imports no adapter; no import cycle among {', '.join(PACKAGES)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
