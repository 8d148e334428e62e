"""Context-parallel attention: a sequence split across ranks, attended exactly.

Each rank holds the queries, keys and values of the positions its :class:`Layout` gives it.
With the ``"allgather"`` schedule the keys and values are gathered once (one collective for
both), each run of this rank's queries attends over all of them through
:func:`qkv.attention` at its absolute positions (``q_offset`` = the run's start), and the
backward pass returns every rank's key/value gradients to the ranks that hold them. qkv
masks are predicates over absolute positions, so every mask — causal, windows, documents,
padding, prefixes, predicates, and their compositions — splits exactly, whatever the layout.

Legend: B batch · H query heads · H_kv key/value heads · T the whole sequence · T_r the
positions this rank holds · D head dim · D_v value head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..functional import attention as local_attention
from ..masks import Mask
from .layout import Layout, _rank

SCHEDULES = ("allgather",)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
              layout: Layout, mask: Any = None, schedule: str = "allgather",
              scale: float | None = None, dropout_p: float = 0.0,
              group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Attention over the whole sequence, each rank passing and receiving its own positions.

    Args:
        query: (B, H, T_r, D), this rank's queries, in the layout's order.
        key, value: (B, H_kv, T_r, D) and (B, H_kv, T_r, D_v), this rank's keys and values.
        layout: which positions each rank holds (the same on every rank).
        mask: a qkv mask over absolute positions, or a dense bool (…, T, T) mask of the
            whole sequence (True = may attend); None attends everywhere.
        schedule: "allgather" (keys and values gathered once).
        scale, dropout_p: as in :func:`qkv.attention` (each rank draws its own dropout).
        group: the process group (default: the world).

    Returns:
        (B, H, T_r, D_v): the output at this rank's positions, equal to one process attending
        over the whole sequence; differentiable with respect to the local shards.

    Raises:
        ValueError: an unknown schedule, or shards that do not match the layout.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a qkv.distributed.Layout; got {type(layout).__name__}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise ValueError(f"{name} must be a 4-d (B, H, T_r, ·) tensor; got "
                             f"{tuple(getattr(x, 'shape', ()))}")
    rank = _rank(None, group)
    if query.shape[2] != layout.size(rank) or key.shape[2] != layout.size(rank):
        raise ValueError(f"rank {rank} holds T_r={layout.size(rank)} positions; got query "
                         f"{tuple(query.shape)} and key {tuple(key.shape)}")
    if isinstance(mask, torch.Tensor) and mask.shape[-2:] != (layout.T, layout.T):
        raise ValueError(f"a dense mask must cover the whole sequence, (…, T, T) = (…, "
                         f"{layout.T}, {layout.T}); got {tuple(mask.shape)}")
    D = key.shape[-1]
    # One collective for keys and values together: every rank issues the same calls in the
    # same order, forward and backward.
    kv = layout.gather(torch.cat([key, value], dim=-1), dim=2, group=group)  # (B, H_kv, T, ·)
    k, v = kv[..., :D], kv[..., D:]
    outs, start = [], 0
    for a, b in layout.runs[rank]:
        q = query[:, :, start:start + b - a]  # (B, H, b - a, D): queries at positions a..b-1
        run_mask = mask[..., a:b, :] if isinstance(mask, torch.Tensor) else mask
        outs.append(local_attention(q, k, v, mask=run_mask, scale=scale, dropout_p=dropout_p,
                                    q_offset=a if isinstance(mask, Mask) else None))
        start += b - a
    if not outs:  # this rank holds no position
        return query.new_zeros(*query.shape[:3], value.shape[-1])
    return torch.cat(outs, dim=2)  # (B, H, T_r, D_v)
