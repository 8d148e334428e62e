"""Which positions of a sequence each rank holds.

A :class:`Layout` gives every rank a sorted tuple of runs ``(start, stop)`` of absolute
positions. ``Layout.contiguous`` cuts the sequence into one run per rank; ``Layout.balanced``
cuts it into equal chunks and deals them so that each rank scores about the same number of
(query, key) blocks of the mask: heaviest chunk first, each to the least-loaded rank. For
causal attention with two chunks per rank that is the head-tail (zigzag) layout (rank r
holds chunks r and 2W-1-r) and documents, windows and prefixes get their own balance.

Legend: T sequence length · W world size.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..masks import EMPTY, Mask

Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    """Runs of absolute positions held by each rank: ``runs[r]`` for rank r."""

    T: int
    runs: tuple[Runs, ...]

    def __post_init__(self) -> None:
        held = sorted(p for rank in self.runs for a, b in rank for p in range(a, b))
        if held != list(range(self.T)):
            raise ValueError(f"a layout must give every position of T={self.T} to exactly one rank")

    @property
    def world_size(self) -> int:
        return len(self.runs)

    def size(self, rank: int) -> int:
        """How many positions rank holds."""
        return sum(b - a for a, b in self.runs[rank])

    def positions(self, rank: int) -> torch.Tensor:
        """The absolute positions rank holds, in its local order: (size(rank),) int64."""
        return torch.cat(
            [torch.arange(a, b) for a, b in self.runs[rank]] or [torch.zeros(0, dtype=torch.long)]
        )

    @classmethod
    def contiguous(cls, T: int, world_size: int) -> Layout:
        """One run per rank. The first ``T % world_size`` ranks hold one position more."""
        _check(T, world_size)
        sizes = [T // world_size + (r < T % world_size) for r in range(world_size)]
        starts = np.cumsum([0, *sizes])
        return cls(
            T,
            tuple(
                ((int(starts[r]), int(starts[r + 1])),) if sizes[r] else ()
                for r in range(world_size)
            ),
        )

    @classmethod
    def balanced(
        cls,
        T: int,
        world_size: int,
        mask: Mask | None = None,
        *,
        chunks_per_rank: int = 16,
        block_k: int = 64,
    ) -> Layout:
        """``chunks_per_rank · world_size`` equal chunks of positions, each weighed by the
        work the mask leaves in it — its non-empty (chunk × block_k) blocks in the mask's
        block map (a mask of unknown structure, or None, counts every block) — and dealt
        heaviest first to the least-loaded rank. With ``chunks_per_rank=2`` and a causal
        mask this is the head-tail (zigzag) layout: rank r holds chunks r and 2W-1-r."""
        _check(T, world_size)
        if mask is not None and not isinstance(mask, Mask):
            raise TypeError(
                f"mask must be a qkv mask or None; got {type(mask).__name__} "
                "(a dense mask has no structure to balance: use contiguous)"
            )
        n = chunks_per_rank * world_size
        bounds = [T * i // n for i in range(n + 1)]
        chunks = [(bounds[i], bounds[i + 1]) for i in range(n) if bounds[i + 1] > bounds[i]]
        work = []
        for a, b in chunks:
            if mask is None:
                work.append(-(-T // block_k))
            else:  # the rows of this chunk against every key block, at absolute positions
                codes = mask.blocks(
                    mask.batch or 1, 1, b - a, T, block_q=b - a, block_k=block_k, q_offset=a
                )
                work.append(int((codes != EMPTY).sum()))
        loads = [(0, r) for r in range(world_size)]  # a heap of (work so far, rank)
        held: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        for i in sorted(range(len(chunks)), key=lambda i: -work[i]):  # stable: ties in order
            load, r = heapq.heappop(loads)
            held[r].append(chunks[i])
            heapq.heappush(loads, (load + work[i], r))
        return cls(T, tuple(_merge(sorted(runs)) for runs in held))

    # -- moving tensors -------------------------------------------------------------------

    def shard(self, x: torch.Tensor, dim: int, rank: int | None = None) -> torch.Tensor:
        """This rank's part of a full tensor: the positions it holds, along ``dim``."""
        rank = _rank(rank)
        if x.shape[dim] != self.T:
            raise ValueError(
                f"x must have T={self.T} positions along dim {dim}; got shape {tuple(x.shape)}"
            )
        return x.index_select(dim, self.positions(rank).to(x.device))

    def gather(
        self, x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        """The full tensor back from every rank's part (differentiable: the gradient of
        each part is the sum of every rank's gradient at its positions)."""
        return _Gather.apply(x, dim, self, group)


def _check(T: int, world_size: int) -> None:
    for name, n, low in (("T", T, 0), ("world_size", world_size, 1)):
        if isinstance(n, bool) or not isinstance(n, int) or n < low:
            raise ValueError(f"{name} must be an int >= {low}; got {n!r}")


def _merge(runs: list[tuple[int, int]]) -> Runs:
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def _rank(rank: int | None, group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if rank is None else rank


class _Gather(torch.autograd.Function):
    """all_gather of unevenly sized parts (padded to the largest), placed at their
    positions. The backward all-reduces the full gradient and keeps this rank's positions
    (gloo has no reduce_scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, layout: Layout, group: Any) -> torch.Tensor:
        dim = dim % x.ndim
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if world != layout.world_size:
            raise ValueError(f"the layout is for {layout.world_size} ranks; the group has {world}")
        if x.shape[dim] != layout.size(rank):
            raise ValueError(
                f"rank {rank} holds {layout.size(rank)} positions; got "
                f"{x.shape[dim]} along dim {dim}"
            )
        longest = max(layout.size(r) for r in range(world))
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        padded = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous()
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        shape = list(x.shape)
        shape[dim] = layout.T
        full = x.new_empty(shape)
        for r, part in enumerate(parts):
            index = layout.positions(r).to(x.device)
            full.index_copy_(dim, index, part.narrow(dim, 0, len(index)))
        ctx.dim, ctx.layout, ctx.group, ctx.rank = dim, layout, group, rank
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        mine = ctx.layout.positions(ctx.rank).to(grad.device)
        return grad.index_select(ctx.dim, mine), None, None, None
