"""``import flash_attn`` answered by :mod:`qkv.flash_attn`: the module names a project imports,
pointed at qkv's module in ``sys.modules``, and put back as they were."""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

#: the names projects import FlashAttention 2 by
NAMES = ("flash_attn", "flash_attn.flash_attn_interface")

#: what those names held before :func:`install` (None: nothing), for :func:`uninstall`
_before: dict[str, ModuleType | None] = {}


def install() -> None:
    """Make ``import flash_attn`` (and ``from flash_attn import flash_attn_func``, and
    ``flash_attn.flash_attn_interface``) give :mod:`qkv.flash_attn`, so code written for
    the GPU runs on a CPU unchanged. Warns when a real ``flash_attn`` is already imported:
    modules that imported it keep it. Imports after this get qkv's. Undone by
    :func:`uninstall`. Calling it twice is the same as once."""
    ours = importlib.import_module("qkv.flash_attn")
    present = sys.modules.get(NAMES[0])
    if present is not None and present is not ours:
        warnings.warn(
            f"a flash_attn module is already imported ({getattr(present, '__file__', present)}); "
            "code that imported it keeps it, imports from now on get qkv.flash_attn",
            stacklevel=2,
        )
    for name in NAMES:
        if sys.modules.get(name) is not ours:
            _before[name] = sys.modules.get(name)
            sys.modules[name] = ours


def uninstall() -> None:
    """Put back what ``flash_attn`` named before :func:`install` (nothing, or the real one)."""
    for name, module in list(_before.items()):
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
        del _before[name]
