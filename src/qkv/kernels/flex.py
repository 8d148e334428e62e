"""The flex kernel: torch's FlexAttention, lowered from qkv's masks and score modifications.

A qkv mask is already a predicate over absolute positions and already has a block map, which
is what FlexAttention consumes:

- the ``BlockMask`` is built from the mask's own block map (``Mask.blocks`` at 128 × 128:
  FULL blocks and PARTIAL blocks apart, EMPTY ones absent) with ``BlockMask.from_kv_blocks``
  — never by evaluating the predicate over T_q × T_k as ``create_block_mask`` does;
- the ``mask_mod`` is the predicate itself, moved to the call's absolute positions
  (``q_idx + q_offset``), with the arrays it reads (document ids, padding lengths) as torch
  tensors: the compiled kernel reads them as inputs, so new ids with the same shape do not
  recompile;
- a :mod:`qkv.scores` modification becomes the ``score_mod`` (``ScoreMod.apply`` at the
  same positions).

``torch.compile(flex_attention)`` is compiled once per mask structure (kind and constants:
a window's width, a prefix's length), score modification, dtype and device; dynamo's cache
keeps each. On CPU that takes seconds per structure and torch 2.13 gives neither the
log-sum-exp nor a backward pass there (``NotImplementedError``), so on CPU this backend runs
inference only and says so when asked for more.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length · D head
dim · D_v value head dim.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from ..masks import FULL, PARTIAL, Mask

#: FlexAttention's block (queries and keys); the block map is classified at this size.
BLOCK = 128

#: compiled variants kept (one per mask structure, modification, dtype, device); beyond it
#: torch runs flex_attention unfused, with a warning
RECOMPILE_LIMIT = 256

_COMPILED: Any = None


def block_mask(
    mask: Mask | None, B: int, H: int, T_q: int, T_k: int, q_offset: int, device: torch.device
) -> Any:
    """The ``BlockMask`` of a qkv mask (None: every block FULL), from its block map."""
    from torch.nn.attention.flex_attention import BlockMask

    if mask is None:
        codes = np.full((-(-T_q // BLOCK), -(-T_k // BLOCK)), FULL, dtype=np.int8)
    else:
        codes = mask.blocks(B, H, T_q, T_k, block_q=BLOCK, block_k=BLOCK, q_offset=q_offset)

    def pack(chosen: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # per query block: how many key blocks, and their indices first (stable: in order)
        count = chosen.sum(-1).astype(np.int32)
        order = np.argsort(~chosen, axis=-1, kind="stable").astype(np.int32)
        return (
            torch.from_numpy(count).to(device)[None, None],
            torch.from_numpy(order).to(device)[None, None],
        )

    partial, partial_idx = pack(codes == PARTIAL)
    full, full_idx = pack(codes == FULL)
    return BlockMask.from_kv_blocks(
        partial,
        partial_idx,
        full,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod(mask, q_offset, device),
        seq_lengths=(T_q, T_k),
    )


def mask_mod(mask: Mask | None, q_offset: int, device: torch.device) -> Any:
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` for a qkv mask: its predicate at
    absolute query positions, reading its arrays as tensors on ``device``."""
    if mask is None:
        return lambda b, h, q_idx, kv_idx: kv_idx >= 0
    on_device = _tensors(mask, device)

    def fn(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return on_device(b, h, q_idx + q_offset, kv_idx)

    return fn


def score_mod(mod: Any, q_offset: int) -> Any:
    """FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` for a qkv modification."""
    if mod is None:
        return None

    def fn(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mod.apply(score, b, h, q_idx + q_offset, kv_idx, q_idx)

    return fn


def _tensors(mask: Mask, device: torch.device) -> Mask:
    """A copy of the mask tree whose NumPy arrays are torch tensors on ``device`` (the
    predicates index them either way)."""
    out = copy.copy(mask)
    for name, value in vars(mask).items():
        if isinstance(value, np.ndarray):
            setattr(out, name, torch.from_numpy(value).to(device))
        elif isinstance(value, Mask):
            setattr(out, name, _tensors(value, device))
    return out


def flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | None,
    mod: Any,
    q_offset: int,
    scale: float,
    return_lse: bool,
) -> tuple[torch.Tensor, Any]:
    """Run the compiled FlexAttention: (out, lse or None), inputs (B, H|H_kv, T, D)."""
    global _COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    cpu = q.device.type == "cpu"
    if cpu and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(
            "backend='flex' on CPU runs inference only: torch's FlexAttention "
            "has no backward pass on CPU. Use backend='tiled' (or 'auto') to "
            "train there, or run under torch.no_grad()"
        )
    if cpu and return_lse:
        raise ValueError(
            "backend='flex' cannot give the log-sum-exp on CPU (torch's "
            "compiled FlexAttention does not return it there); use "
            "backend='tiled'"
        )
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    B, H, T_q, _ = q.shape
    T_k = k.shape[2]
    blocks = block_mask(mask, B, H, T_q, T_k, q_offset, q.device)
    result = run_compiled(
        _COMPILED,
        q,
        k,
        v,
        score_mod=score_mod(mod, q_offset),
        block_mask=blocks,
        scale=scale,
        enable_gqa=k.shape[1] != H,
        return_lse=return_lse,
    )
    return (result[0], result[1]) if return_lse else (result, None)


def run_compiled(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a compiled flex_attention. Each mask structure is a compiled variant; past
    dynamo's default limit of 8, torch would fall back to flex's unfused eager path, which
    materialises T_q × T_k scores (at T = 16K in bfloat16 that ran this machine out of
    memory): raise the limit, and fail rather than fall back past it."""
    with torch._dynamo.config.patch(
        recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True
    ):
        return fn(*args, **kwargs)
