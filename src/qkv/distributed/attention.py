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

import zlib
from typing import Any

import torch
import torch.distributed as dist

from ..functional import attention as local_attention
from ..masks import Mask
from .layout import Layout

SCHEDULES = ("allgather",)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
              layout: Layout, mask: Any = None, schedule: str = "allgather",
              scale: float | None = None, dropout_p: float = 0.0,
              group: dist.ProcessGroup | None = None, check: bool = True) -> torch.Tensor:
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
        check: first compare every rank's call (shapes, dtype, layout, mask) in one small
            all_gather, so inputs that differ between ranks end in the same clear error on
            every rank instead of a hang or a wrong answer. ``False`` saves that collective.

    Returns:
        (B, H, T_r, D_v): the output at this rank's positions, equal to one process attending
        over the whole sequence; differentiable with respect to the local shards.

    Raises:
        ValueError: an unknown schedule, shards that do not match the layout, or (with
            ``check``) a call that differs between ranks — raised on every rank.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem = _local_problem(query, key, value, layout, mask, schedule, rank, world)
    if check:  # before anything can raise on one rank only and leave the others waiting
        _check_same_call(query, key, value, layout, mask, schedule, problem, group)
    if problem is not None:
        raise ValueError(problem)
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


def _local_problem(query, key, value, layout, mask, schedule, rank, world) -> str | None:
    """What is wrong with this rank's call on its own, in words; None if nothing."""
    if schedule not in SCHEDULES:
        return f"schedule must be one of {SCHEDULES}; got {schedule!r}"
    if not isinstance(layout, Layout):
        return f"layout must be a qkv.distributed.Layout; got {type(layout).__name__}"
    if layout.world_size != world:
        return f"the layout is for {layout.world_size} ranks; the group has {world}"
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            return (f"{name} must be a 4-d (B, H, T_r, ·) tensor; got "
                    f"{tuple(getattr(x, 'shape', ()))}")
    if query.shape[2] != layout.size(rank) or key.shape[2] != layout.size(rank) or \
            value.shape[2] != layout.size(rank):
        return (f"rank {rank} holds T_r={layout.size(rank)} positions; got query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if isinstance(mask, torch.Tensor) and mask.shape[-2:] != (layout.T, layout.T):
        return (f"a dense mask must cover the whole sequence, (…, T, T) = (…, {layout.T}, "
                f"{layout.T}); got {tuple(mask.shape)}")
    return None


_SIGNATURE = ("valid input", "schedule", "B", "H", "H_kv", "D", "D_v", "dtype", "T",
              "layout", "mask")


def _signature(query, key, value, layout, mask, schedule, problem) -> list[int]:
    """What must agree across ranks, as integers (CRC-32 where a value is not one)."""
    crc = lambda text: zlib.crc32(str(text).encode())  # noqa: E731
    if problem is not None:  # shapes may not even exist: only the failure is compared
        return [0, crc(schedule)] + [-1] * (len(_SIGNATURE) - 2)
    if isinstance(mask, torch.Tensor):
        described = f"dense{tuple(mask.shape)}:{int(mask.count_nonzero())}"
    else:
        described = repr(mask)
    return [1, crc(schedule), query.shape[0], query.shape[1], key.shape[1], key.shape[-1],
            value.shape[-1], crc(query.dtype), layout.T, crc(layout.runs), crc(described)]


def _check_same_call(query, key, value, layout, mask, schedule, problem, group) -> None:
    mine = torch.tensor(_signature(query, key, value, layout, mask, schedule, problem),
                        dtype=torch.int64)
    every = torch.stack(_all_gather(mine, group))  # (world, fields)
    failed = (every[:, 0] == 0).nonzero().flatten().tolist()
    if failed and problem is None:
        raise ValueError(f"rank(s) {failed} passed invalid input to "
                         "qkv.distributed.attention (their error says what)")
    if failed:
        return  # this rank raises its own problem
    for name, column in zip(_SIGNATURE, every.T):
        if (column != column[0]).any():
            raise ValueError(f"the ranks' calls differ in {name}: every rank must pass the "
                             f"same schedule, B, H, H_kv, D, D_v, dtype, layout and mask "
                             f"(per rank: {column.tolist()})")


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out
