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

import ctypes
import ctypes.util
import functools
import itertools
import zlib
from typing import Any

import torch
import torch.distributed as dist

from ..core.call import tiled_call
from ..functional import attention as local_attention
from ..functional import merge_attention
from ..kernels import tiled
from ..kernels.reference import accumulation_dtype
from ..masks import EMPTY, Mask
from .layout import Layout

SCHEDULES = ("allgather", "ring")


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
    ring_piece: int = 2048,
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

    Returns:
        (B, H, T_r, D_v): the output at this rank's positions, equal to one process attending
        over the whole sequence; differentiable with respect to the local shards.

    Raises:
        ValueError: an unknown schedule, shards that do not match the layout, or (with
            ``check``) a call that differs between ranks — raised on every rank.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    problem = _local_problem(query, key, value, layout, mask, schedule, rank, world, ring_piece)
    if check:  # before anything can raise on one rank only and leave the others waiting
        _check_same_call(query, key, value, layout, mask, schedule, problem, group, ring_piece)
    if problem is not None:
        raise ValueError(problem)
    # Keys and values travel together: one collective (or one ring pass) for both, so every
    # rank issues the same calls in the same order, forward and backward.
    if schedule == "allgather":
        kv = torch.cat([key, value], dim=-1)  # (B, H_kv, T_r, D + D_v)
        outs = _allgather(
            query, kv, layout, mask, rank, group, key.shape[-1], scale=scale, dropout_p=dropout_p
        )
    else:
        outs = _ring(
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
        )
    if not outs:  # this rank holds no position
        return query.new_zeros(*query.shape[:3], value.shape[-1])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, H, T_r, D_v)


def _runs_of(layout: Layout, rank: int, longest: int | None = None):
    """(start, stop, where the run starts in the rank's local tensors) for each of its runs,
    cut into pieces of at most ``longest`` positions if given."""
    local = 0
    for a, b in layout.runs[rank]:
        step = b - a if longest is None else longest
        for start in range(a, b, max(step, 1)):
            stop = min(start + step, b)
            yield start, stop, local + start - a
        local += b - a


def _allgather(query, kv, layout, mask, rank, group, D, **kw) -> list[torch.Tensor]:
    kv = layout.gather(kv, dim=2, group=group)  # (B, H_kv, T, D + D_v)
    k, v = kv[..., :D], kv[..., D:]
    outs = []
    for a, b, local in _runs_of(layout, rank):
        q = query[:, :, local : local + b - a]  # (B, H, b - a, D): queries at positions a..b-1
        run_mask = mask[..., a:b, :] if isinstance(mask, torch.Tensor) else mask
        outs.append(
            local_attention(
                q, k, v, mask=run_mask, **kw, q_offset=a if isinstance(mask, Mask) else None
            )
        )
    return outs


def _ring(
    query, key, value, layout, mask, rank, world, group, *, scale, dropout_p, piece
) -> list[torch.Tensor]:
    if dropout_p > 0:
        raise ValueError(
            "the ring schedule has no dropout (its pairs run the tiled kernel); "
            "use schedule='allgather'"
        )
    out = _RingAttention.apply(query, key, value, layout, mask, scale, rank, world, group, piece)
    return [out] if out.shape[2] else []


def _pieces(layout: Layout, piece: int) -> list[list[tuple[int, int]]]:
    """Each rank's local positions cut into the same number of consecutive pieces of at most
    ``piece`` positions (as even as possible): [(lo, hi), …] per rank."""
    count = max(1, -(-max(layout.size(r) for r in range(layout.world_size)) // piece))
    cuts = [
        [n * i // count for i in range(count + 1)]
        for n in (layout.size(r) for r in range(layout.world_size))
    ]
    return [list(itertools.pairwise(c)) for c in cuts]


class _RingAttention(torch.autograd.Function):
    """The ring, streamed: each rank's keys and values travel in pieces of at most ``piece``
    positions, one ring per piece, so a rank holds one piece in flight (and the next one
    arriving), never a whole foreign shard. The backward pass sends the pieces around again
    instead of saving what it received: each rank keeps only its own shards, its output and
    its log-sum-exp.

    Forward, for each piece p: step s attends this rank's query runs to piece p of rank
    (r - s) mod W, then passes it on to rank r + 1; pairs the mask leaves empty are skipped,
    and each query run's partial results are merged by their log-sum-exps. Backward, for each
    piece: the piece travels the ring again with a dK/dV accumulator; every rank adds the
    gradients of its queries against it (the tiled kernel's backward against the merged
    output and log-sum-exp, FlashAttention-2 style), and one last pass brings the
    accumulator home."""

    @staticmethod
    def forward(ctx, query, key, value, layout, mask, scale, rank, world, group, piece):
        runs = list(_runs_of(layout, rank, piece))  # query runs, no longer than a piece
        D, D_v = key.shape[-1], value.shape[-1]
        acc = accumulation_dtype(query.dtype)
        # Each query run's result so far, merged pair by pair. Before any key: 0, lse -inf.
        outs = [query.new_zeros(*query.shape[:2], qb - qa, D_v) for qa, qb, _ in runs]
        lses = [
            torch.full((*query.shape[:2], qb - qa), float("-inf"), dtype=acc, device=query.device)
            for qa, qb, _ in runs
        ]
        pieces = _pieces(layout, piece)
        for p, (lo, hi) in enumerate(pieces[rank]):
            current = torch.cat([key[:, :, lo:hi], value[:, :, lo:hi]], dim=-1)
            for step in range(world):
                owner = (rank - step) % world
                if step > 0:
                    current = _pass_on(current, _length(pieces[owner][p]), rank, world, group)
                for i, _, pair in _pairs(
                    query, current, layout, mask, runs, owner, pieces[owner][p], scale, D
                ):
                    o, l_ = _tiled(*pair)
                    outs[i], lses[i] = merge_attention([outs[i], o], [lses[i], l_])
                _trim()
        out = torch.cat(outs, dim=2) if outs else query.new_zeros(*query.shape[:3], D_v)
        lse = torch.cat(lses, dim=2) if lses else query.new_zeros(*query.shape[:3])
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.args = (layout, mask, scale, rank, world, group, piece)
        return out

    @staticmethod
    def backward(ctx, dout):
        query, key, value, out, lse = ctx.saved_tensors
        layout, mask, scale, rank, world, group, piece = ctx.args
        runs = list(_runs_of(layout, rank, piece))
        D = key.shape[-1]
        dquery, dkey, dvalue = (torch.zeros_like(x) for x in (query, key, value))
        acc = accumulation_dtype(query.dtype)
        # rowsum(dO ∘ O), (B, H, T_r): once, not once a pair, and a run at a time, so no
        # (B, H, T_r, D_v) product is ever held.
        delta = (
            torch.cat(
                [
                    (
                        dout[:, :, ql : ql + qb - qa].to(acc) * out[:, :, ql : ql + qb - qa].to(acc)
                    ).sum(-1)
                    for qa, qb, ql in runs
                ],
                dim=2,
            )
            if runs
            else out.new_zeros(out.shape[:3], dtype=acc)
        )
        pieces = _pieces(layout, piece)
        for p, (lo, hi) in enumerate(pieces[rank]):
            current = torch.cat([key[:, :, lo:hi], value[:, :, lo:hi]], dim=-1)
            dcurrent = torch.zeros_like(current)
            for step in range(world):
                owner = (rank - step) % world
                if step > 0:
                    length = _length(pieces[owner][p])
                    current = _pass_on(current, length, rank, world, group)
                    dcurrent = _pass_on(dcurrent, length, rank, world, group)
                for i, (ka, kb, kl), (q, k, v, pair_mask, s) in _pairs(
                    query, current, layout, mask, runs, owner, pieces[owner][p], scale, D
                ):
                    qa, qb, ql = runs[i]
                    rows = slice(ql, ql + qb - qa)
                    call = tiled_call(q, k, v, mask=pair_mask, scale=s)
                    dq, dk, dv = tiled.backward(
                        call,
                        out[:, :, rows],
                        lse[:, :, rows],
                        dout[:, :, rows],
                        delta=delta[:, :, rows],
                    )
                    assert dq is not None and dk is not None and dv is not None
                    dquery[:, :, rows] += dq
                    dcurrent[:, :, kl : kl + kb - ka, :D] += dk
                    dcurrent[:, :, kl : kl + kb - ka, D:] += dv
                _trim()
            # The accumulator of rank (r + 1)'s piece is here; one more pass takes it home.
            if world > 1:
                dcurrent = _pass_on(dcurrent, hi - lo, rank, world, group)
            dkey[:, :, lo:hi], dvalue[:, :, lo:hi] = dcurrent[..., :D], dcurrent[..., D:]
        return dquery, dkey, dvalue, None, None, None, None, None, None, None


@functools.cache
def _find_malloc_trim() -> Any:
    """glibc's malloc_trim, or None (another C library)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
    except OSError:
        return None


def _trim() -> None:
    """Give the memory a ring step freed back to the system. glibc keeps freed buffers of a
    few MB for reuse, so without this a rank's resident memory remembers every piece and
    partial it has held (at T = 65536 on 4 ranks: 0.40 of one process instead of 0.32)."""
    trim = _find_malloc_trim()  # looked up on the first ring step, not at import
    if trim is not None:
        trim(0)


def _length(bounds: tuple[int, int]) -> int:
    return bounds[1] - bounds[0]


def _pairs(query, kv, layout, mask, runs, owner, bounds, scale, D):
    """(query run index, key run, (q, k, v, mask, scale)) for every pair of this rank's
    query runs with the key runs in piece ``bounds`` = (lo, hi) of ``owner``'s local
    positions (held in kv) that the mask leaves non-empty; key runs as (start, stop, where
    the run starts in kv)."""
    lo, hi = bounds
    for ka, kb, kl in _runs_of(layout, owner):
        ka, kb, kl = ka + max(lo - kl, 0), kb - max(kl + kb - ka - hi, 0), max(kl, lo)
        if kb <= ka:  # the run lies outside this piece
            continue
        kl -= lo  # where the clipped run starts in kv
        k = kv[:, :, kl : kl + kb - ka, :D]  # keys at positions ka..kb-1
        v = kv[:, :, kl : kl + kb - ka, D:]
        for i, (qa, qb, ql) in enumerate(runs):
            pair = _pair_mask(mask, qa, qb, ka, kb, layout.T)
            if pair is not _EMPTY:
                yield i, (ka, kb, kl), (query[:, :, ql : ql + qb - qa], k, v, pair, scale)


def _tiled(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = tiled.forward(tiled_call(q, k, v, mask=mask, scale=scale))
    return out.to(q.dtype), lse


def _pass_on(x: torch.Tensor, recv_len: int, rank: int, world: int, group: Any) -> torch.Tensor:
    """Send x to rank + 1, receive rank - 1's (recv_len positions along dim 2). Plain
    isend/irecv pairs: gloo's batch_isend_irecv is reported to hang."""
    shape = list(x.shape)
    shape[2] = recv_len
    return _exchange(
        x,
        _global(group, (rank + 1) % world),
        x.new_empty(shape),
        _global(group, (rank - 1) % world),
        group,
    )


_EMPTY = object()


def _pair_mask(mask: Any, qa: int, qb: int, ka: int, kb: int, T: int) -> Any:
    """The mask of queries qa..qb-1 against keys ka..kb-1 as a call over just them sees it,
    or _EMPTY when it allows nothing there. The call places its queries bottom-right
    (query i at (kb - ka) - (qb - qa) + i), so the shift moves them to qa + i."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        part = mask[..., qa:qb, ka:kb]
        return part if part.any() else _EMPTY
    shifted = mask.shifted(qa - ((kb - ka) - (qb - qa)), ka, T)
    codes = shifted.blocks(mask.batch or 1, 1, qb - qa, kb - ka, block_q=qb - qa, block_k=kb - ka)
    return _EMPTY if (codes == EMPTY).all() else shifted


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _exchange(
    send: torch.Tensor, to: int, recv: torch.Tensor, source: int, group: Any
) -> torch.Tensor:
    requests = [
        dist.isend(send.contiguous(), to, group=group),
        dist.irecv(recv, source, group=group),
    ]
    for r in requests:
        if r is not None:  # None only when this rank is outside the group
            r.wait()
    return recv


def _local_problem(
    query, key, value, layout, mask, schedule, rank, world, ring_piece
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


def _signature(query, key, value, layout, mask, schedule, problem, ring_piece) -> list[int]:
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


def _check_same_call(query, key, value, layout, mask, schedule, problem, group, ring_piece) -> None:
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


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return out
