"""The layers of docs/architecture.md hold in the code: every import in src/qkv runs down a
floor (or stays inside its unit), no circle, no private name taken across a unit, the apps
use public names only — checked from the page's own table by tools/structure.py."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
