"""The import structure of ``src/qkv``: units, the arrows between them, circles, imports that
run up a floor, and private names imported across units. Checked against the floors of
``docs/architecture.md`` when that page exists (``tests/repo/test_architecture.py`` runs it).

    python tools/structure.py                 # this checkout
    python tools/structure.py --root OTHER    # another checkout's src/qkv (e.g. a worktree)

A *unit* is a package directly under ``src/qkv`` or a module there on its own; ``__init__``
is the package's own ``__init__.py``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: private modules of the ground floor whose public names the layers below the apps may use
GROUND_PRIVATE = {"_checks", "_lift", "_memory", "_recipes"}
#: from this floor up, a unit is an app: public names only
APPS_FLOOR = 9


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted (qkv.core.dispatch)
    target: str  # the imported module (qkv.masks)
    names: tuple[str, ...]  # the names taken from it ("*" for a plain import)
    line: int


def modules(src: Path) -> dict[str, Path]:
    """Every Python module of the package under ``src`` (src/qkv), by dotted name."""
    found = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> Iterator[Import]:
    """The qkv imports of one module, relative ones resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "qkv":
                    yield Import(name, alias.name, ("*",), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "qkv":
                continue
            for alias in node.names:  # `from . import masks` imports a module
                sub = f"{target}.{alias.name}"
                if sub in known or f"{sub}.__init__" in known:
                    yield Import(name, sub, ("*",), node.lineno)
                else:
                    yield Import(name, target, (alias.name,), node.lineno)


def unit(module: str) -> str:
    """qkv.core.dispatch -> core; qkv.functional -> functional; qkv.__init__ -> __init__."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def floors(doc: Path) -> dict[str, int]:
    """The units and floors of the table in docs/architecture.md."""
    found = {}
    for row in re.finditer(r"^\| (\d+) \| ([^|]+) \|", doc.read_text(), re.M):
        for name in re.findall(r"`([^`]+)`", row.group(2)):
            found[name] = int(row.group(1))
    return found


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected groups of more than one unit (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def private(imp: Import) -> list[str]:
    """The private parts of what an import takes: modules in its path past qkv, and names."""
    parts = [p for p in imp.target.split(".")[1:] if p.startswith("_") and p != "__init__"]
    return parts + [n for n in imp.names if n.startswith("_")]


def report(root: Path) -> dict[str, object]:
    src = root / "src" / "qkv"
    mods = modules(src)
    known = set(mods)
    found = [imp for name, path in mods.items() for imp in imports(name, path, known)]
    crossing = [i for i in found if unit(i.source) != unit(i.target)]
    edges = {(unit(i.source), unit(i.target)) for i in crossing}
    private_across = {
        (i.source, i.line, i.target): i
        for i in crossing
        if private(i)
        and not (unit(i.target) in GROUND_PRIVATE and not [n for n in i.names if n.startswith("_")])
    }
    out: dict[str, object] = {
        "modules": len(mods),
        "units": len({unit(m) for m in mods}),
        "arrows between units": len(edges),
        "circles": circles(edges),
        "private names imported across units": [
            f"{src}:{line} takes {', '.join(sorted(set(private(i))))} from {target}"
            for (src, line, target), i in private_across.items()
        ],
    }
    doc = root / "docs" / "architecture.md"
    if doc.exists():
        floor = floors(doc)
        out["floors"] = len(set(floor.values()))
        out["units not in the table"] = sorted({unit(m) for m in mods} - set(floor))
        out["imports running up or across a floor"] = [
            f"{i.source}:{i.line} (floor {floor.get(unit(i.source))}) imports {i.target} "
            f"(floor {floor.get(unit(i.target))})"
            for i in crossing
            if floor.get(unit(i.target), 99) >= floor.get(unit(i.source), -1)
        ]
        out["apps taking a ground floor private module"] = [
            f"{i.source}:{i.line} imports {i.target}"
            for i in crossing
            if floor.get(unit(i.source), 0) >= APPS_FLOOR and unit(i.target) in GROUND_PRIVATE
        ]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="a checkout (default: this one)")
    found = report(parser.parse_args().root)
    for key, value in found.items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"    {item}")
        else:
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
