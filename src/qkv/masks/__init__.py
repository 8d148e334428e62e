"""Masks as predicates over absolute positions: ``mask(b, h, q_idx, kv_idx) -> bool``.

``True`` means *may attend*. Query ``i`` sits at absolute position ``q_offset + i`` and key
``j`` at position ``j``. The default ``q_offset`` is ``T_k - T_q`` (bottom-right, what a KV
cache needs), so for ``T_q == T_k`` :func:`causal` is the usual lower triangle.

Masks compose with ``&``, ``|`` and ``~`` and lower to a dense bool tensor for given shapes.
A predicate is evaluated on broadcastable index arrays (NumPy or torch), so it is written
with operators only: ``lambda b, h, q, kv: kv <= q``.

Legend: B batch · H query heads · T_q/T_k query/key length.

Example:
    >>> from qkv import masks
    >>> m = masks.causal() & masks.sliding_window(2)
    >>> m
    causal() & sliding_window(2)
    >>> print(m.picture(4))
    █ · · ·
    █ █ · ·
    · █ █ ·
    · · █ █
"""

from typing import Union

import numpy as np
import torch

from .algebra import Mask, Predicate, predicate
from .interop import from_torch
from .library import causal, document, full, key_indices, padding, prefix_lm, sliding_window
from .tiles import EMPTY, FULL, PARTIAL

#: What an attention call takes as ``mask=``: a qkv mask, a bool tensor or array (True = may
#: attend), or None.
MaskLike = Union[Mask, torch.Tensor, np.ndarray, None]  # noqa: UP007 (a runtime alias on 3.10)

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Mask",
    "MaskLike",
    "Predicate",
    "causal",
    "document",
    "from_torch",
    "full",
    "key_indices",
    "padding",
    "predicate",
    "prefix_lm",
    "sliding_window",
]
