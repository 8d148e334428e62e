"""The flex kernel: torch's FlexAttention, compiled, over a call lowered to its forms.

A qkv mask is already a predicate over absolute positions and already has a block map, which
is what FlexAttention consumes (:func:`qkv.core.lowering.lower` makes both):

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
a window's width, a prefix's length), score modification, dtype and device. Dynamo's cache
keeps each. On CPU that takes seconds per structure and torch 2.13 gives neither the
log-sum-exp nor a backward pass there (``NotImplementedError``), so on CPU this backend runs
inference only and says so when asked for more.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length · D head
dim · D_v value head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from .contract import Lowered, Result, with_sinks

#: FlexAttention's block (queries and keys); the block map is classified at this size.
BLOCK = 128

#: compiled variants kept (one per mask structure, modification, dtype, device); beyond it
#: torch runs flex_attention unfused, with a warning
RECOMPILE_LIMIT = 256

_COMPILED: Any = None


def run(call: Lowered) -> Result:
    """The contract's entry: the compiled FlexAttention over the call's block mask and
    score_mod, with the log-sum-exp when the call needs it."""
    global _COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = call.q, call.k, call.v
    cpu = q.device.type == "cpu"
    if cpu and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(
            "backend='flex' on CPU runs inference only: torch's FlexAttention "
            "has no backward pass on CPU. Use backend='tiled' (or 'auto') to "
            "train there, or run under torch.no_grad()"
        )
    need_lse = call.need_lse or call.sinks is not None
    if cpu and need_lse:
        what = (
            "attention sinks (made from the log-sum-exp)"
            if call.sinks is not None
            else "the log-sum-exp"
        )
        raise ValueError(
            f"backend='flex' cannot give {what} on CPU: torch's "
            "compiled FlexAttention does not return it there; use backend='tiled'"
        )
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    result = run_compiled(
        _COMPILED,
        q,
        k,
        v,
        score_mod=call.score_mod,
        block_mask=call.block_mask,
        scale=call.scale,
        enable_gqa=k.shape[1] != q.shape[1],
        return_lse=need_lse,
    )
    return with_sinks(Result(result[0], result[1]) if need_lse else Result(result), call.sinks)


def run_compiled(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a compiled flex_attention. Each mask structure is a compiled variant. Past
    dynamo's default limit of 8, torch would fall back to flex's unfused eager path, which
    materialises T_q × T_k scores (at T = 16K in bfloat16 that ran this machine out of
    memory): raise the limit, and fail rather than fall back past it."""
    with torch._dynamo.config.patch(
        recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True
    ):
        return fn(*args, **kwargs)
