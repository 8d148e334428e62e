"""The layers of docs/architecture.md hold in the code: every import in src/qkv runs down a
floor (or stays inside its unit), no circle, no private name taken across a unit, the apps
use public names only — checked from the page's own table by tools/structure.py."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def structure():
    spec = importlib.util.spec_from_file_location("structure", ROOT / "tools" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["structure"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def found(structure):
    return structure.report(ROOT)


@pytest.mark.parametrize(
    "rule",
    [
        "circles",
        "private names imported across units",
        "units not in the table",
        "imports running up or across a floor",
        "apps taking a ground floor private module",
    ],
)
def test_the_layers_hold(found, rule):
    assert found[rule] == [], f"{rule}: {found[rule]}"


def test_the_checker_sees_a_violation(structure, tmp_path):
    # A checker that cannot fail proves nothing: a copy whose kernel imports the functional
    # core (floor 2 reaching up to 4) and a private name of masks is caught on both counts.
    for path in (ROOT / "src").rglob("*.py"):
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text((ROOT / "docs/architecture.md").read_text())
    bad = tmp_path / "src/qkv/kernels/sdpa.py"
    bad.write_text(
        bad.read_text()
        + "\nfrom ..functional import attention  # noqa\nfrom ..masks.library import _Causal\n"
    )
    found = structure.report(tmp_path)
    assert any("qkv.kernels.sdpa" in x for x in found["imports running up or across a floor"])
    assert any("_Causal" in x for x in found["private names imported across units"])


def _legend_table() -> dict[str, str]:
    """docs/semantics.md's legend: letter -> meaning."""
    import re

    text = (ROOT / "docs" / "semantics.md").read_text().split("## The legend", 1)[1]
    table = {}
    for letters, meaning in re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|$", text, re.M):
        for letter in re.findall(r"`([^`]+)`", letters):
            assert letter not in table, f"{letter} twice in the legend"
            table[letter] = meaning
    return table


def test_every_module_uses_the_one_legend():
    """Each module's ``Legend:`` line names letters of docs/semantics.md's one legend, so a
    letter means one thing across the package (L layers, never a tile's keys as well)."""
    import re

    table = _legend_table()
    assert {"B", "H", "T_q", "T_k", "D", "D_v", "L", "N", "S"} <= set(table)
    found = 0
    for path in sorted((ROOT / "src" / "qkv").rglob("*.py")):
        m = re.search(r"^Legend:(.*?)(?:\n\n|\"\"\")", path.read_text(), re.S | re.M)
        if not m or m.group(1).strip().startswith("none"):
            continue
        found += 1
        for part in " ".join(m.group(1).split()).split("·"):
            # "T_q/T_k query/key length", "G = H / H_kv", "d_head = E / H", "w = r + ..."
            letters = re.match(r"\s*([A-Za-z_…]+(?:/[A-Za-z_]+)?(?:,\s*[A-Za-z_]+)*)", part)
            assert letters, f"{path.name}: cannot read {part!r}"
            for letter in re.split(r"[/,]\s*", letters.group(1)):
                assert letter in table, f"{path.relative_to(ROOT)}: {letter!r} not in the legend"
    assert found > 50


def test_the_tests_are_laid_out_like_the_package():
    """Each folder of tests/ names a unit of src/qkv, a package or a module with many tests
    (``functional``: qkv.attention's), but for ``repo``, the repository's own checks; a test
    file at the top names a module of src/qkv, then maybe a part of it."""
    src, tests = ROOT / "src" / "qkv", ROOT / "tests"
    units = {p.stem for p in src.glob("*.py")} | {p.parent.name for p in src.glob("*/__init__.py")}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - {"repo"} <= units, sorted(folders - {"repo"} - units)
    for path in tests.glob("test_*.py"):
        module = path.stem[5:].split("_")[0]  # test_varlen_paged.py: varlen.py's paged part
        assert (src / f"{module}.py").exists(), f"{path.name} names no module of src/qkv"
    for folder in folders:
        assert (tests / folder / "__init__.py").exists(), f"tests/{folder} is no package"
