"""Mutation testing for qkv: plant one small bug at a time and see whether the tests notice.

    python tools/mutate.py --list                  # count the mutants, run nothing
    python tools/mutate.py --sample 240 --jobs 2   # run a deterministic sample (~20 min)
    python tools/mutate.py --only functional.py:64:47:Gt->GtE   # rerun one mutant

Each mutant changes one operator or constant of the AST in one of the core files (kernels,
masks, dispatch rules, functional, modules, cache, rope): ``<`` ↔ ``<=``, ``==`` ↔ ``!=``, ``+`` ↔
``-``, ``*`` ↔ ``/``, ``and`` ↔ ``or``, a dropped ``not``, an integer ``n`` → ``n + 1``,
``True`` ↔ ``False``. Docstrings, strings and error messages are left alone. A mutant runs in
a scratch copy of the repository against the default test suite less the apps' tests
(``pytest -x``, one thread per job); it is *killed* if any test fails or it hangs past
``--timeout``. The report lists
the score and every survivor: docs/mutation.md records the latest run and argues each
survivor killed or equivalent. Not part of CI: it takes minutes per hundred mutants.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [
    "kernels/reference.py",
    "kernels/sdpa.py",
    "kernels/tiled/__init__.py",
    "kernels/tiled/loop.py",
    "kernels/tiled/plan.py",
    "kernels/tiled/flash.py",
    "masks/algebra.py",
    "masks/library.py",
    "masks/tiles.py",
    "core/dispatch.py",
    "core/rules.py",
    "core/planning.py",
    "functional.py",
    "nn/modules.py",
    "nn/cache.py",
    "nn/rope.py",
]
# Tests of the apps (training loop, command line, benchmark harness): they exercise none of
# the core files' logic that the rest of the suite does not, and take half its time.
APP_TESTS = [
    "--ignore=tests/training/test_train.py",
    "--ignore=tests/cli/test_cli.py",
    "--ignore=tests/cli/test_bench.py",
]
SWAPS = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.And: ast.Or,
    ast.Or: ast.And,
}


@dataclass(frozen=True)
class Mutant:
    file: str  # relative to src/qkv
    line: int
    col: int
    what: str  # e.g. "Lt->LtE", "3->4", "not-removed"

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line}:{self.col}:{self.what}"


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _sites(tree: ast.AST):
    """(node, field, index, replacement-maker, label) for every mutable spot, in order."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in SWAPS:
                    yield (
                        node,
                        "ops",
                        i,
                        SWAPS[type(op)],
                        f"{type(op).__name__}->{SWAPS[type(op)].__name__}",
                    )
        elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in SWAPS:
            yield (
                node,
                "op",
                None,
                SWAPS[type(node.op)],
                f"{type(node.op).__name__}->{SWAPS[type(node.op)].__name__}",
            )
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node, "not", None, None, "not-removed"
        elif isinstance(node, ast.Constant) and type(node.value) in (int, bool):
            label = (
                f"{node.value}->{not node.value}"
                if isinstance(node.value, bool)
                else f"{node.value}->{node.value + 1}"
            )
            yield node, "value", None, None, label


def find_mutants(files: list[str]) -> list[Mutant]:
    out = []
    for rel in files:
        tree = ast.parse((ROOT / "src/qkv" / rel).read_text())
        docs = _docstring_nodes(tree)
        for node, _, _, _, label in _sites(tree):
            if id(node) in docs:
                continue
            out.append(Mutant(rel, node.lineno, node.col_offset, label))
    return out


class _Apply(ast.NodeTransformer):
    def __init__(self, mutant: Mutant) -> None:
        self.m, self.done = mutant, False

    def generic_visit(self, node):
        node = super().generic_visit(node)
        if (
            self.done
            or getattr(node, "lineno", None) != self.m.line
            or node.col_offset != self.m.col
        ):
            return node
        for site, field, i, new, label in _sites(node):
            if site is not node or label != self.m.what:
                continue
            self.done = True
            if field == "ops":
                node.ops[i] = new()
            elif field == "op":
                node.op = new()
            elif field == "not":
                return node.operand
            elif isinstance(node.value, bool):
                node.value = not node.value
            else:
                node.value = node.value + 1
            break
        return node


def mutated_source(m: Mutant) -> str:
    tree = ast.parse((ROOT / "src/qkv" / m.file).read_text())
    applier = _Apply(m)
    tree = ast.fix_missing_locations(applier.visit(tree))
    if not applier.done:
        raise ValueError(f"mutant {m.name} not found")
    return ast.unparse(tree)


def run_one(m: Mutant, workdir: Path, timeout: float) -> tuple[Mutant, str, float]:
    target = workdir / "src/qkv" / m.file
    original = target.read_text()
    target.write_text(mutated_source(m))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": str(workdir / "src"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                "--hypothesis-seed=0",
                *APP_TESTS,
            ],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        status = "survived" if r.returncode == 0 else "killed"
    except subprocess.TimeoutExpired:
        status = "killed (timeout)"
    finally:
        target.write_text(original)
    return m, status, time.perf_counter() - t0


def _scratch() -> Path:
    d = Path(tempfile.mkdtemp(prefix="qkv-mutant-"))
    for part in ("src", "tests", "tools", "docs", "README.md", "pyproject.toml"):
        src = ROOT / part
        (shutil.copytree if src.is_dir() else shutil.copy)(src, d / part)
    return d


def main() -> None:
    parser = argparse.ArgumentParser(description="Mutation testing over qkv's core files.")
    parser.add_argument("--list", action="store_true", help="count the mutants per file")
    parser.add_argument("--sample", type=int, help="run this many, drawn with --seed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample (0)")
    parser.add_argument("--only", nargs="+", help="run only these (file:line:col:what)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel jobs (2)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mutant (300)")
    args = parser.parse_args()
    mutants = find_mutants(TARGETS)
    if args.list:
        for f in TARGETS:
            print(f"{f}: {sum(m.file == f for m in mutants)}")
        print(f"total: {len(mutants)}")
        return
    if args.only:  # file:line:col:what, or file:line:what for every column of the line
        only = set(args.only)
        mutants = [m for m in mutants if m.name in only or f"{m.file}:{m.line}:{m.what}" in only]
    elif args.sample:
        mutants = sorted(
            random.Random(args.seed).sample(mutants, min(args.sample, len(mutants))),
            key=lambda m: (m.file, m.line, m.col, m.what),
        )
    dirs = [_scratch() for _ in range(args.jobs)]
    free = list(dirs)
    results = []

    def job(m: Mutant):
        d = free.pop()
        try:
            return run_one(m, d, args.timeout)
        finally:
            free.append(d)

    print(f"{len(mutants)} mutants, {args.jobs} jobs", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        for m, status, seconds in pool.map(job, mutants):
            results.append((m, status))
            print(f"{status:>16}  {seconds:5.1f}s  {m.name}", flush=True)
    for d in dirs:
        shutil.rmtree(d)
    killed = sum(s.startswith("killed") for _, s in results)
    print(f"\nscore: {killed}/{len(results)} killed ({killed / max(1, len(results)):.1%})")
    for m, s in results:
        if s == "survived":
            line = (ROOT / "src/qkv" / m.file).read_text().splitlines()[m.line - 1].strip()
            print(f"survivor  {m.name}  | {line}")


if __name__ == "__main__":
    main()
