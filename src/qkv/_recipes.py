"""The convention masks and score modifications share to cross into the compiled tiled op
(:mod:`qkv.core.compiled`): each describes itself as postfix tokens, with the tensors and
ints it reads kept aside in two lists and named in its tokens by their index."""

from __future__ import annotations

from typing import Any


def keep_int(ints: list[Any], n: Any) -> str:
    """Put an int parameter aside and name it by its index (symbolic under
    ``torch.compile(dynamic=True)``: its value is never written into a token)."""
    ints.append(n)
    return str(len(ints) - 1)
