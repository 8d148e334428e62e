"""Context-parallel attention: a sequence split across ranks, attended exactly.

Each rank holds the queries, keys and values of the positions its :class:`Layout` gives it.
With the ``"allgather"`` schedule the keys and values are gathered once (one collective for
both), each run of this rank's queries attends over all of them through
:func:`qkv.attention` at its absolute positions (``q_offset`` = the run's start), and the
backward pass returns every rank's key/value gradients to the ranks that hold them. qkv
masks are predicates over absolute positions, so every mask (causal, windows, documents,
padding, prefixes, predicates, and their compositions) splits exactly, whatever the layout.

Legend: B batch · H query heads · H_kv key/value heads · T the whole sequence · T_r the
positions this rank holds · D head dim · D_v value head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..functional import attention as local_attention
from ..masks import Mask
from .checks import check_same_call, local_problem
from .layout import Layout
from .ring import ring, runs_of


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    layout: Layout,
    mask: Any = None,
    schedule: str = "allgather",
    scale: float | None = None,
    dropout_p: float = 0.0,
    group: dist.ProcessGroup | None = None,
    check: bool = True,
    ring_piece: int = 1024,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the whole sequence, each rank passing and receiving its own positions.

    Args:
        query: (B, H, T_r, D), this rank's queries, in the layout's order.
        key, value: (B, H_kv, T_r, D) and (B, H_kv, T_r, D_v), this rank's keys and values.
        layout: which positions each rank holds (the same on every rank).
        mask: a qkv mask over absolute positions, or a dense bool (…, T, T) mask of the
            whole sequence (True = may attend); None attends everywhere.
        schedule: "allgather" (keys and values gathered once) or "ring" (passed around the
            ring while computing, empty shard pairs skipped, partials merged exactly).
        scale, dropout_p: as in :func:`qkv.attention` (each rank draws its own dropout).
        group: the process group (default: the world).
        check: first compare every rank's call (shapes, dtype, layout, mask) in one small
            all_gather, so inputs that differ between ranks end in the same clear error on
            every rank instead of a hang or a wrong answer. ``False`` saves that collective.
        ring_piece: the most positions of keys and values one ring step carries: the ring
            streams each shard in pieces this long, so a rank holds about two pieces in
            flight rather than whole shards (smaller: less memory, more steps).
        sinks: per-head attention sinks (H,), as in :func:`qkv.attention`, applied once per
            query after all keys (the same on every rank: their gradient on each rank is
            that rank's queries' share, summed as a replicated parameter's is).

    Returns:
        (B, H, T_r, D_v): the output at this rank's positions, equal to one process attending
        over the whole sequence; differentiable with respect to the local shards.

    Raises:
        ValueError: an unknown schedule, shards that do not match the layout, or (with
            ``check``) a call that differs between ranks — raised on every rank.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem = local_problem(query, key, value, layout, mask, schedule, rank, world, ring_piece)
    if check:  # before anything can raise on one rank only and leave the others waiting
        check_same_call(query, key, value, layout, mask, schedule, problem, group, ring_piece)
    if problem is None and sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        problem = (
            f"context parallelism takes per-head sinks (H,) = ({query.shape[1]},); "
            f"got {tuple(sinks.shape)}"
        )
    if problem is not None:
        raise ValueError(problem)
    # Keys and values travel together: one collective (or one ring pass) for both, so every
    # rank issues the same calls in the same order, forward and backward.
    if schedule == "allgather":
        kv = torch.cat([key, value], dim=-1)  # (B, H_kv, T_r, D + D_v)
        outs = _allgather(
            query,
            kv,
            layout,
            mask,
            rank,
            group,
            key.shape[-1],
            scale=scale,
            dropout_p=dropout_p,
            sinks=sinks,
        )
    else:
        outs = ring(
            query,
            key,
            value,
            layout,
            mask,
            rank,
            world,
            group,
            scale=scale,
            dropout_p=dropout_p,
            piece=ring_piece,
            sinks=sinks,
        )
    if not outs:  # this rank holds no position
        return query.new_zeros(*query.shape[:3], value.shape[-1])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, H, T_r, D_v)


def _allgather(
    query: torch.Tensor,
    kv: torch.Tensor,
    layout: Layout,
    mask: Any,
    rank: int,
    group: Any,
    D: int,
    **kw: Any,
) -> list[torch.Tensor]:
    kv = layout.gather(kv, dim=2, group=group)  # (B, H_kv, T, D + D_v)
    k, v = kv[..., :D], kv[..., D:]
    outs = []
    for a, b, local in runs_of(layout, rank):
        q = query[:, :, local : local + b - a]  # (B, H, b - a, D): queries at positions a..b-1
        run_mask = mask[..., a:b, :] if isinstance(mask, torch.Tensor) else mask
        outs.append(
            local_attention(
                q, k, v, mask=run_mask, **kw, q_offset=a if isinstance(mask, Mask) else None
            )
        )
    return outs
