"""A mask as the kernels that take it whole receive it: a dense bool tensor
(:func:`dense_mask`), and, while ``torch.compile`` traces, the *recipe* the compiled tiled
op rebuilds the mask and the score modification from (:func:`recipe`; see
:mod:`qkv.core.compiled`).

Legend: B batch · H query heads · T_q/T_k query/key length.
"""

from __future__ import annotations

from typing import Any

import torch

from .._checks import Problem
from ..masks import Mask, MaskLike
from ..scores import ScoreMod


def dense_mask(mask: MaskLike, p: Problem, device: torch.device) -> torch.Tensor | None:
    """The mask as a 4-d bool tensor broadcastable to (B, H, T_q, T_k), or None. It keeps
    size 1 on the dims the mask does not use: kernels broadcast it, and SDPA runs slower
    on an expanded (B, H, T_q, T_k) view than on the compact mask."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        out = mask.block(p.B, p.H, p.q_offset, p.q_offset + p.T_q, 0, p.T_k, device=device)
        return out.reshape((1,) * (4 - out.ndim) + tuple(out.shape))
    dense = torch.as_tensor(mask)
    return dense[None, None] if dense.ndim == 2 else p.to4d(dense)


def recipe(
    mask: MaskLike, mod: ScoreMod | None, p: Problem, device: torch.device
) -> tuple[Any, ...] | None:
    """What the compiled op receives for this mask and modification: (mask tokens,
    modification tokens, tensors, ints); None for a user score function. A mask that data
    cannot rebuild (a user predicate) is lowered to a dense bool tensor here, in the graph."""
    tensors: list[torch.Tensor] = []
    ints: list[Any] = []
    mod_tokens = [] if mod is None else mod.recipe(tensors, ints)
    if mod_tokens is None:
        return None
    if mask is None:
        mask_tokens: list[str] = []
    elif isinstance(mask, Mask):
        found = mask.recipe(tensors, ints)
        if found is None:  # a predicate: lowered densely, here in the graph
            found = _dense_recipe(dense_mask(mask, p, device), tensors)
        mask_tokens = found
    else:
        mask_tokens = _dense_recipe(torch.as_tensor(mask), tensors)
    return " ".join(mask_tokens), " ".join(mod_tokens), tensors, ints


def _dense_recipe(dense: Any, tensors: list[torch.Tensor]) -> list[str]:
    tensors.append(dense)
    return [f"dense:{len(tensors) - 1}"]
