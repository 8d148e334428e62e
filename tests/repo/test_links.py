"""The docs stand alone: every path and link README.md and docs/ cite resolves in a fresh
clone (files of the repository, or pages of the docs site that tools/mkdocs_hooks.py makes),
and none points at material a clone does not have."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: a markdown link's target
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: a repository path written as code, `examples/x.py` or `tests/test_x.py::name`, or the
#: name of a test of the file cited before it, `::name`
TESTS = re.compile(
    r"`(?:((?:examples|benchmarks|docs|tests|tools|src|notebooks)/[\w./-]+))?(?:::(\w+))?"
)


def _site_pages() -> set[str]:
    """The pages the docs site generates (index.md from README.md, api/*.md, ...)."""
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "tools/mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mkdocs_hooks", module)
    spec.loader.exec_module(module)
    return set(module.PAGES) | {f"api/{name}.md" for name in module.API}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_cited_path_and_link_resolves(page):
    pytest.importorskip("mkdocs")
    generated = _site_pages()
    text = page.read_text(encoding="utf-8")
    missing = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = target.split("#")[0]
        if not path:
            continue
        here = page.parent / path
        in_site = page.parent.name == "docs" and path in generated
        if not (here.exists() or in_site):
            missing.append(target)
    last = None  # `::name` after a `tests/x.py::name` names a test of that file
    for cited, name in TESTS.findall(text):
        path = cited.rstrip(".") if cited else last
        if path is None or "*" in path:
            continue
        last = path
        if not (ROOT / path).exists():
            missing.append(path)
        elif name and f"def {name}" not in (ROOT / path).read_text(encoding="utf-8"):
            missing.append(f"{path}::{name}")
    assert not missing, f"{page.name} cites what a clone does not have: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_no_page_leans_on_material_a_clone_lacks(page):
    text = page.read_text(encoding="utf-8")
    for phrase in ("shared/seeds", "seed notebook", "the seeds' ", "seed 00"):
        assert phrase not in text.lower(), f"{page.name} says {phrase!r}"
