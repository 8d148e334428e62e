"""The ring schedule of context-parallel attention: each rank's keys and values travel around
the ring in pieces while every rank attends its queries to them, empty shard pairs skipped,
partial results merged exactly by their log-sum-exps. The backward sends the pieces around
again with a dK/dV accumulator.

Legend: B batch · H query heads · H_kv key/value heads · T the whole sequence · D head dim ·
D_v value head dim."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..core.lowering import tiled_call
from ..kernels import tiled
from ..kernels.contract import sink_factor, sink_grad
from ..kernels.reference import accumulation_dtype
from ..lse import merge_attention
from ..masks import EMPTY
from .layout import Layout


def runs_of(
    layout: Layout, rank: int, longest: int | None = None
) -> Iterator[tuple[int, int, int]]:
    """(start, stop, where the run starts in the rank's local tensors) for each of its runs,
    cut into pieces of at most ``longest`` positions if given."""
    local = 0
    for a, b in layout.runs[rank]:
        step = b - a if longest is None else longest
        for start in range(a, b, max(step, 1)):
            stop = min(start + step, b)
            yield start, stop, local + start - a
        local += b - a


def ring(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Layout,
    mask: Any,
    rank: int,
    world: int,
    group: Any,
    *,
    scale: float | None,
    dropout_p: float,
    piece: int,
    sinks: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    if dropout_p > 0:
        raise ValueError(
            "the ring schedule has no dropout (its pairs run the tiled kernel); "
            "use schedule='allgather'"
        )
    out = _RingAttention.apply(
        query, key, value, layout, mask, scale, rank, world, group, piece, sinks
    )
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
    (r - s) mod W, then passes it on to rank r + 1. Pairs the mask leaves empty are skipped,
    and each query run's partial results are merged by their log-sum-exps. Backward, for each
    piece: the piece travels the ring again with a dK/dV accumulator. Every rank adds the
    gradients of its queries against it (the tiled kernel's backward against the merged
    output and log-sum-exp, FlashAttention-2 style), and one last pass brings the
    accumulator home. Sinks are applied to the merged result, so the saved output and
    log-sum-exp include them and the backward is unchanged (a sink has no value). Their
    gradient is this rank's rows' share."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layout: Layout,
        mask: Any,
        scale: float,
        rank: int,
        world: int,
        group: Any,
        piece: int,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        runs = list(runs_of(layout, rank, piece))  # query runs, no longer than a piece
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
        if sinks is not None:
            factor, lse = sink_factor(lse, sinks)
            out = (out.to(factor.dtype) * factor[..., None]).to(out.dtype)
        ctx.save_for_backward(query, key, value, out, lse, sinks)
        ctx.args = (layout, mask, scale, rank, world, group, piece)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, out, lse, sinks = ctx.saved_tensors
        layout, mask, scale, rank, world, group, piece = ctx.args
        runs = list(runs_of(layout, rank, piece))
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
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[10]:  # nothing reaches lse: −delta
            dsinks = sink_grad(sinks, lse, delta.neg())
        return dquery, dkey, dvalue, None, None, None, None, None, None, None, dsinks


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


def _pairs(
    query: torch.Tensor,
    kv: torch.Tensor,
    layout: Layout,
    mask: Any,
    runs: list[tuple[int, int, int]],
    owner: int,
    bounds: tuple[int, int],
    scale: float,
    D: int,
) -> Iterator[tuple[int, tuple[int, int, int], tuple[Any, ...]]]:
    """(query run index, key run, (q, k, v, mask, scale)) for every pair of this rank's
    query runs with the key runs in piece ``bounds`` = (lo, hi) of ``owner``'s local
    positions (held in kv) that the mask leaves non-empty. A key run is (start, stop, where
    the run starts in kv)."""
    lo, hi = bounds
    for ka, kb, kl in runs_of(layout, owner):
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


def _tiled(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
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
