"""What a context-parallel call checks before it communicates: each rank's own call, then
that every rank passes the same call (one small all_gather), so bad input ends in the same
clear error on every rank instead of a hang."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from .layout import Layout

SCHEDULES = ("allgather", "ring")


def local_problem(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Any,
    mask: Any,
    schedule: str,
    rank: int,
    world: int,
    ring_piece: Any,
) -> str | None:
    """What is wrong with this rank's call on its own, in words; None if nothing."""
    if schedule not in SCHEDULES:
        return f"schedule must be one of {SCHEDULES}; got {schedule!r}"
    if isinstance(ring_piece, bool) or not isinstance(ring_piece, int) or ring_piece < 1:
        return f"ring_piece must be an int >= 1; got {ring_piece!r}"
    if not isinstance(layout, Layout):
        return f"layout must be a qkv.distributed.Layout; got {type(layout).__name__}"
    if layout.world_size != world:
        return f"the layout is for {layout.world_size} ranks; the group has {world}"
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            return (
                f"{name} must be a 4-d (B, H, T_r, ·) tensor; got {tuple(getattr(x, 'shape', ()))}"
            )
    if (
        query.shape[2] != layout.size(rank)
        or key.shape[2] != layout.size(rank)
        or value.shape[2] != layout.size(rank)
    ):
        return (
            f"rank {rank} holds T_r={layout.size(rank)} positions; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if isinstance(mask, torch.Tensor) and mask.shape[-2:] != (layout.T, layout.T):
        return (
            f"a dense mask must cover the whole sequence, (…, T, T) = (…, {layout.T}, "
            f"{layout.T}); got {tuple(mask.shape)}"
        )
    return None


_SIGNATURE = (
    "valid input",
    "schedule",
    "B",
    "H",
    "H_kv",
    "D",
    "D_v",
    "dtype",
    "T",
    "layout",
    "mask",
    "ring_piece",
)


def _signature(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Layout,
    mask: Any,
    schedule: str,
    problem: Any,
    ring_piece: int,
) -> list[int]:
    """What must agree across ranks, as integers (CRC-32 where a value is not one)."""
    crc = lambda text: zlib.crc32(str(text).encode())  # noqa: E731
    if problem is not None:  # shapes may not even exist: only the failure is compared
        return [0, crc(schedule)] + [-1] * (len(_SIGNATURE) - 2)
    if isinstance(mask, torch.Tensor):
        described = f"dense{tuple(mask.shape)}:{int(mask.count_nonzero())}"
    else:
        described = repr(mask)
    return [
        1,
        crc(schedule),
        query.shape[0],
        query.shape[1],
        key.shape[1],
        key.shape[-1],
        value.shape[-1],
        crc(query.dtype),
        layout.T,
        crc(layout.runs),
        crc(described),
        ring_piece,
    ]


def check_same_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Layout,
    mask: Any,
    schedule: str,
    problem: Any,
    group: Any,
    ring_piece: int,
) -> None:
    mine = torch.tensor(
        _signature(query, key, value, layout, mask, schedule, problem, ring_piece),
        dtype=torch.int64,
    )
    every = torch.stack(_all_gather(mine, group))  # (world, fields)
    failed = (every[:, 0] == 0).nonzero().flatten().tolist()
    if failed and problem is None:
        raise ValueError(
            f"rank(s) {failed} passed invalid input to "
            "qkv.distributed.attention (their error says what)"
        )
    if failed:
        return  # this rank raises its own problem
    for name, column in zip(_SIGNATURE, every.T):
        if (column != column[0]).any():
            raise ValueError(
                f"the ranks' calls differ in {name}: every rank must pass the "
                f"same schedule, B, H, H_kv, D, D_v, dtype, layout, mask and "
                f"ring_piece "
                f"(per rank: {column.tolist()})"
            )


def _all_gather(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out
