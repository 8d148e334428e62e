"""Attention beyond one process: a sequence split across ranks of ``torch.distributed``
(any backend; tested with gloo on CPU), attended exactly for every qkv mask, forward and
backward. :class:`Layout` says which positions each rank holds; :func:`attention` is the
context-parallel counterpart of :func:`qkv.attention`."""

from .attention import attention
from .layout import Layout

__all__ = ["Layout", "attention"]
