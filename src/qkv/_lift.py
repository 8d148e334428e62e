"""Functions written for scalar indices, made to take broadcastable index arrays.

FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` and ``score_mod(score, b, h, q_idx,
kv_idx)`` are written for one position at a time and vmapped by torch; qkv calls its
predicates and score functions on broadcastable index arrays. :func:`lifted` turns the
former into the latter with one ``torch.vmap`` over the broadcast positions, so code written
for Flex (a table indexed by a scalar, ``table[q_idx][kv_idx]``) runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def lifted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` over scalar tensors, applied at every position of broadcastable arguments
    (torch tensors or NumPy arrays; the result is of the arguments' kind). Arguments that
    are already scalars (FlexAttention's own vmap) go to ``fn`` as they are."""

    def at_every_position(*args: Any) -> Any:
        numpy = any(isinstance(a, np.ndarray) for a in args)
        tensors = [torch.as_tensor(a) for a in args]
        if all(t.ndim == 0 for t in tensors):
            return fn(*tensors)
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        flat = [t.expand(shape).reshape(-1) for t in tensors]
        out = torch.vmap(fn)(*flat).reshape(shape)
        return out.numpy() if numpy else out

    at_every_position.__name__ = getattr(fn, "__name__", "lifted")
    return at_every_position
