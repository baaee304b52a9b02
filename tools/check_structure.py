"""Check the package's structure: no import circle and no import of another file's private name.

Reads every module under ``src/aah`` with :mod:`ast` (nothing is imported or run). An import
counts wherever it stands, inside a function too: a circle hidden behind a local import is
still a circle. A name is private when it starts with one underscore (``_helper``); a module
may import private names only from itself, never from another file. Private *modules*
(``aah.hf._transformers``) are fine to import as a whole from inside their own package.

Exit 0 and one summary line when the structure is clean; exit 1 and one line per problem
otherwise. Run as ``python tools/check_structure.py [SRC_DIR]``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(importer: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside ``importer``."""
    if level == 0:
        return target or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def scan(src: Path):
    """Yield (importer, imported module, private names taken, line) for every import in src/aah."""
    root = src / "aah"
    modules = {}
    for path in sorted(root.rglob("*.py")):
        modules[module_name(path, root)] = path
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "aah":
                        yield name, alias.name, [], node.lineno
            elif isinstance(node, ast.ImportFrom):
                target = resolve(name, is_package, node.level, node.module)
                if target.split(".")[0] != "aah":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:  # `from aah.hf import cache` imports the module aah.hf.cache
                        yield name, sub, [], node.lineno
                    else:
                        private = [alias.name] if alias.name.startswith("_") and not alias.name.startswith("__") else []
                        yield name, target, private, node.lineno
    return modules


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(src: Path) -> list[str]:
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    root = src / "aah"
    known = {module_name(p, root) for p in root.rglob("*.py")}
    for importer, imported, private, line in scan(src):
        if imported in known and imported != importer:
            # A package's __init__ importing its own children is how packages re-export; a child
            # importing its parent package is an edge only when the parent is not a mere namespace.
            graph.setdefault(importer, set()).add(imported)
        for name in private:
            if imported != importer:
                problems.append(f"{importer}:{line}: imports private name {name} from {imported}")
    for cycle in find_cycles(graph):
        problems.append("import circle: " + " <-> ".join(cycle))
    return problems


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "src"
    problems = check(src)
    for p in problems:
        print(p)
    if problems:
        print(f"check_structure: {len(problems)} problem(s) in {src / 'aah'}")
        return 1
    print(f"check_structure: no import circle and no private import in {src / 'aah'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
