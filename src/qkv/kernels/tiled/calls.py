"""A plan's query blocks as the calls of one pass of the tiled kernel's fused steps
(:mod:`qkv.kernels.tiled.flash`): which queries go over which keys in one call, with
their mask or none. Planning only: no tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from ...tuning import Tuning
from .plan import Chunk, Plan


class Call(NamedTuple):
    """One call of torch's kernel: queries q0..q1-1 (one or more query blocks) over keys
    k0..k1-1; ``chunks`` (one query block's) give the mask there, or are None where every
    key is FULL for every query of the call (no mask)."""

    q0: int
    q1: int
    k0: int
    k1: int
    chunks: tuple[Chunk, ...] | None


def calls(plan: Plan, tuning: Tuning) -> list[tuple[int, int, list[Call]]]:
    """The plan as fused calls, per group of ``tuning.group`` query blocks: (q0, q1, its
    calls), whose results merge (by log-sum-exp) into the group's rows. Each query block's
    keys are covered exactly once. The key stretch FULL for all the blocks of a group runs as
    one call over their queries (larger calls run nearer the matmul peak) when it has at
    least ``tuning.shared_min`` keys. A masked span longer than ``tuning.fused_span`` keys is
    cut into its FULL stretches (no mask) and its masked stretches."""
    rows, n = plan.rows, tuning.group
    return [
        (group[0][0], group[-1][1], _group_calls(group, tuning))
        for group in (rows[g : g + n] for g in range(0, len(rows), n))
    ]


def _group_calls(group: Sequence[tuple[int, int, tuple[Chunk, ...]]], tuning: Tuning) -> list[Call]:
    """The calls for consecutive query blocks: the key stretches FULL for all of them as one
    unmasked call each over all their queries, then the rest the same way for each half of
    the group, down to single blocks (:func:`_segments`). A causal triangle becomes large
    rectangles and small triangles. A window, whose blocks share no FULL stretch, becomes one
    call per block."""
    if len(group) == 1:
        q0, q1, chunks = group[0]
        return [
            Call(q0, q1, p[0].k0, p[-1].k1, None if _all_full(p) else p)
            for p in (_segments(chunks, tuning.fused_span) if chunks else ())
        ]
    # A block with no keys shares nothing, so a shared stretch covers every block.
    shared = _shared_full([c for _, _, c in group], tuning.shared_min)
    found = [Call(group[0][0], group[-1][1], a, b, None) for a, b in shared]
    rest = [(q0, q1, _without(chunks, shared)) for q0, q1, chunks in group]
    half = len(rest) // 2
    return found + _group_calls(rest[:half], tuning) + _group_calls(rest[half:], tuning)


def _all_full(chunks: Sequence[Chunk]) -> bool:
    return all(c.masked is None for c in chunks) and all(
        a.k1 == b.k0 for a, b in itertools.pairwise(chunks)
    )


def _full_stretches(chunks: Sequence[Chunk]) -> list[tuple[int, int]]:
    """The maximal key ranges where every block is FULL."""
    found: list[tuple[int, int]] = []
    for c in chunks:
        pieces = [(c.k0, c.k1)] if c.masked is None else [(c.k0, c.masked[0]), (c.masked[1], c.k1)]
        for a, b in pieces:
            if a == b:
                continue
            if found and found[-1][1] == a:
                found[-1] = (found[-1][0], b)
            else:
                found.append((a, b))
    return found


def _shared_full(blocks: Sequence[Sequence[Chunk]], at_least: int) -> list[tuple[int, int]]:
    """Key ranges of at least ``at_least`` keys FULL for every one of the blocks."""
    common = _full_stretches(blocks[0])
    for chunks in blocks[1:]:
        other, both = _full_stretches(chunks), []
        for a, b in common:
            for c, d in other:
                if max(a, c) < min(b, d):
                    both.append((max(a, c), min(b, d)))
        common = both
    return [(a, b) for a, b in common if b - a >= at_least]


def _without(chunks: Sequence[Chunk], cut: Sequence[tuple[int, int]]) -> tuple[Chunk, ...]:
    """The chunks less the key ranges ``cut`` (FULL there, so no masked range is cut)."""
    out = list(chunks)
    for a, b in cut:
        kept = []
        for c in out:
            if c.k1 <= a or c.k0 >= b:
                kept.append(c)
                continue
            for x, y in ((c.k0, a), (b, c.k1)):
                if x < y:
                    inside = c.masked is not None and x <= c.masked[0] and c.masked[1] <= y
                    kept.append(Chunk(x, y, c.masked if inside else None))
        out = kept
    return tuple(out)


def _segments(chunks: Sequence[Chunk], span: int) -> list[tuple[Chunk, ...]]:
    """A query block's keys as the parts of one call each: all of them when they span at
    most ``span`` keys (one call, the mask over the span). A longer span cut into its
    FULL stretches (calls with no mask) and its masked stretches (the mask over just those
    keys)."""
    if chunks[-1].k1 - chunks[0].k0 <= span:
        return [tuple(chunks)]
    full = _full_stretches(chunks)
    parts = [(Chunk(a, b, None),) for a, b in full]
    parts += [(Chunk(*c.masked, c.masked),) for c in chunks if c.masked is not None]
    return sorted(parts, key=lambda p: p[0].k0)


def backward_pieces(c: Call, span: int) -> list[Call]:
    """A call's keys in pieces of at most ``span`` keys (only unmasked calls are longer):
    each piece's dK and dV are that long (an unmasked call over a long FULL stretch, causal
    at T = 64K, is cut), and its gradients are its exact share, given the whole rows' out
    and lse."""
    if c.chunks is not None or c.k1 - c.k0 <= span:
        return [c]
    return [c._replace(k0=a, k1=min(a + span, c.k1)) for a in range(c.k0, c.k1, span)]
