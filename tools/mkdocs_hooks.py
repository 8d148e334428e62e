"""MkDocs hooks for the docs site (mkdocs.yml): pages made from files outside ``docs/``.

- ``index.md`` is README.md, ``changelog.md`` CHANGELOG.md, ``contributing.md``
  CONTRIBUTING.md, their links rewritten for the site: ``docs/x.md`` becomes ``x.md``, a
  link to another file of the repository becomes its path in code (the site holds no copy).
- ``api/*.md``: the API reference, one page per entry of :data:`API`, each object rendered
  by mkdocstrings from its docstring. The docstrings name other objects with Sphinx roles
  (``:func:`x```, read by ``help()`` and IDEs as plain text); on the site the role is
  dropped and the name stays in code.

The repository's files stay the single source: nothing here is copied into ``docs/``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent

#: site page -> the repository file it shows
PAGES = {
    "index.md": "README.md",
    "changelog.md": "CHANGELOG.md",
    "contributing.md": "CONTRIBUTING.md",
}

#: API page -> (title, what it says first, the objects it documents)
API: dict[str, tuple[str, str, list[str]]] = {
    "qkv": (
        "qkv",
        "The functions and modules most code needs, importable as `qkv.<name>`.",
        [
            "qkv.attention",
            "qkv.dispatch",
            "qkv.attention_weights",
            "qkv.merge_attention",
            "qkv.varlen_attention",
            "qkv.paged_attention",
            "qkv.cascade_attention",
            "qkv.explain",
            "qkv.Tuning",
            "qkv.tuned",
        ],
    ),
    "masks": ("qkv.masks", "Masks: predicates on positions, composable.", ["qkv.masks"]),
    "scores": ("qkv.scores", "Score modifications.", ["qkv.scores"]),
    "nn": (
        "qkv.nn",
        "PyTorch modules: the seeds' stages, multi-head attention, caches, RoPE.",
        ["qkv.nn"],
    ),
    "serving": (
        "qkv.serving",
        "The serving runtime: paged caches, the page allocator, continuous batching.",
        ["qkv.serving"],
    ),
    "models": ("qkv.models", "The GPT.", ["qkv.models"]),
    "heads": (
        "qkv.heads",
        "What heads do: recording, head scores, losses by position, copying, ablation.",
        ["qkv.heads"],
    ),
    "numpy": ("qkv.numpy", "The float64 NumPy oracle.", ["qkv.numpy"]),
    "flash_attn": (
        "qkv.flash_attn",
        "FlashAttention 2's API on a CPU ([the mapping](../flash-attn.md)).",
        ["qkv.flash_attn"],
    ),
    "training": ("qkv.training", "Training a GPT on a CPU.", ["qkv.training"]),
}

_LINK = re.compile(r"\[([^\]]*)\]\(([^)#\s]+)(#[^)\s]*)?\)")


def site_links(text: str) -> str:
    """A repository file's markdown with its links pointed at the site's pages."""
    pages = {source: page for page, source in PAGES.items()}

    def fix(match: re.Match[str]) -> str:
        label, target, anchor = match[1], match[2], match[3] or ""
        if target.startswith(("http://", "https://", "mailto:")):
            return match[0]
        if target.startswith("docs/"):
            return f"[{label}]({target[len('docs/') :]}{anchor})"
        if target in pages:
            return f"[{label}]({pages[target]}{anchor})"
        return label  # another file of the repository: the site holds no copy of it

    return _LINK.sub(fix, text)


def on_files(files: Files, config: Any) -> Files:
    for page, source in PAGES.items():
        text = site_links((ROOT / source).read_text(encoding="utf-8"))
        files.append(File.generated(config, page, content=text))
    for name, (title, intro, objects) in API.items():
        body = "\n\n".join(f"::: {obj}" for obj in objects)
        files.append(
            File.generated(config, f"api/{name}.md", content=f"# {title}\n\n{intro}\n\n{body}\n")
        )
    return files


#: a Sphinx role before an inline code span, as mkdocstrings renders ``:func:`x```
_ROLE = re.compile(r":(?:func|class|mod|data|meth|attr|exc|obj):(?=<code>)")


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    return _ROLE.sub("", html)
