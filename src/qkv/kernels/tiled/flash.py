"""The tiled kernel's fused steps, forward and backward, where they win
(docs/kernels.md#the-tiled-kernel): a pass's calls (:mod:`.calls`) in one call of qkv's
native kernel, or one by one through torch's CPU flash kernel. Each call's mask as per-row
bounds or a float bias. The loop of :mod:`qkv.kernels.tiled` runs everything else and
stays the reference.

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length · D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..contract import Lowered, MaskTiles
from ..reference import accumulation_dtype, all_finite
from . import native as _native
from . import native_backward, scratch
from .calls import Call, backward_pieces, calls
from .plan import Chunk, Plan, _blocked, _fit, _rows, row_dot
from .torch_ops import FLASH, FLASH_BACKWARD


def supports(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_finite: bool | None = None
) -> bool:
    """Whether :func:`fused_forward` and :func:`fused_backward` can run this call through
    torch's flash kernel: torch's CPU kernels exist, the tensors are on the CPU in a
    floating dtype, D_v = D (torch's kernel's requirement), and K is finite — the kernel
    adds the mask to the scores, and NaN + (-inf) would carry a masked-out NaN key into the
    rows that mask it (the loop masks by assignment instead). Reads all of K unless
    ``key_finite`` says (the dispatch reads it once per call)."""
    return (
        FLASH is not None
        and FLASH_BACKWARD is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        and v.shape[-1] == q.shape[-1]
        and (all_finite(k) if key_finite is None else key_finite)
    )


def _working(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as torch's kernel is given them: half precision in float32. In its own
    dtype the kernel rounds the probabilities to it before ·V, which breaks the accuracy
    docs/semantics.md promises (within 1.5× the output's own rounding; a property test
    found 1.6× in bfloat16), and it runs no faster there (docs/kernels.md)."""
    return tuple(x.to(accumulation_dtype(x.dtype)) for x in xs)


def fused_forward(
    call: Lowered, *, native: torch.dtype | None, transient: bool = False, rounded: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass as fused calls. With ``native`` (a dtype: the inputs', or float32
    for half-precision inputs, widened as the kernel loads them; the dispatch has checked
    :func:`qkv.kernels.tiled.native.supports`): one call of qkv's native kernel for the
    whole pass, each query block one job over its key ranges (:func:`_native_ranges`), one
    online softmax across them. Else the calls of :func:`calls`, one by one through torch's
    CPU flash kernel, with their mask as an additive float mask — -inf where the mask blocks
    and over EMPTY blocks, 0 elsewhere. No mask at all where every key is FULL — the calls of
    a group of query blocks merged by their log-sum-exps, half precision in float32
    (:func:`_working`). Each call holds the G query heads of a key/value head as rows (GQA
    reads each key/value head once). out in the accumulation dtype, as lse; ``transient``
    (the caller copies out and drops it before this thread's next kernel call): out in the
    thread's scratch buffer (:mod:`qkv.kernels.tiled.scratch`), as the packs are.
    ``rounded`` (half-precision inputs, the native kernel): out in the inputs' dtype
    instead, each value rounded by the kernel as it writes it (as ``.to()`` rounds the
    float32 one: the same bits, with no float32 output written and read again)."""
    q, k, v, plan, mask_tile, scale = call.q, call.k, call.v, call.plan, call.tiles, call.scale
    mod = _native_mod(call, native)
    if native is None:
        q, k, v = _working(q, k, v)
    acc = accumulation_dtype(q.dtype)
    B, H, T_q, D = q.shape
    H_kv, G, D_v = k.shape[1], H // k.shape[1], v.shape[-1]
    q5 = _blocked(q, H_kv)
    scratch.start()
    n_out = B * H_kv * G * T_q * D_v
    if rounded and native is not None:
        out = torch.empty(B, H_kv, G, T_q, D_v, dtype=q.dtype, device=q.device)
    elif transient:
        out = scratch.take(n_out, acc, q.device).view(B, H_kv, G, T_q, D_v)
    else:
        out = torch.empty(B, H_kv, G, T_q, D_v, dtype=acc, device=q.device)
    lse = torch.empty(B, H_kv, G, T_q, dtype=acc, device=q.device)
    # A shift-invariant mask (causal, windows) repeats along each diagonal: one float mask
    # per layout of a call relative to its queries, not one per call.
    cache: dict | None = {} if mask_tile is not None and mask_tile.shift_invariant else None
    if native is not None:
        jobs = native_jobs(plan, q5, out, lse, mask_tile, cache, call.q_offset)
        packed = _native.pack(k, v, native, transient=True)  # dropped on return
        _native.attend_many(jobs, packed, scale, call.tuning.p_parts, **mod)
        return out.view(B, H, T_q, D_v), lse.view(B, H, T_q)
    for g0, g1, group in calls(plan, call.tuning):
        done = torch.zeros(g1 - g0, dtype=torch.bool)
        for c in group:
            bias, empty = _call_bias(c, mask_tile, H_kv, G, acc, cache)
            at = slice(c.q0, c.q1)
            first = not done[c.q0 - g0 : c.q1 - g0].any()  # a call's rows: all or none done
            done[c.q0 - g0 : c.q1 - g0] = True
            o, l_ = FLASH(
                _rows(q5, c.q0, c.q1),
                k[:, :, c.k0 : c.k1],
                v[:, :, c.k0 : c.k1],
                0.0,
                False,
                attn_mask=bias,
                scale=scale,
            )
            if empty is not None:  # torch's kernel gives such a row lse 0: make it -inf
                l_ = l_.masked_fill(empty, float("-inf"))
            o, l_ = o.view(B, H_kv, G, c.q1 - c.q0, D), l_.view(B, H_kv, G, c.q1 - c.q0)
            if first:
                out[:, :, :, at], lse[:, :, :, at] = o, l_
            else:
                out[:, :, :, at], lse[:, :, :, at] = _merge(
                    out[:, :, :, at], lse[:, :, :, at], o, l_
                )
        if not done.all():  # rows with no key: out 0, lse -inf
            rows = torch.arange(g0, g1)[~done]
            out[:, :, :, rows], lse[:, :, :, rows] = 0.0, float("-inf")
    return out.view(B, H, T_q, D), lse.view(B, H, T_q)


def _native_mod(call: Lowered, native: torch.dtype | None) -> dict[str, Any]:
    """The modification the native kernel applies, as its keywords: {} (none), or its
    soft-cap and ALiBi slopes (float32 (H,)), either or both. The fused steps take no other
    (the dispatch sends every other to the loop): anything else is refused, not dropped."""
    mod = call.mod_tiles
    if mod is None:
        return {}
    if native is not None and (mod.softcap is not None or mod.alibi is not None):
        slopes = None if mod.alibi is None else mod.alibi.detach().to(torch.float32).contiguous()
        return {"softcap": mod.softcap or 0.0, "slopes": slopes}
    raise ValueError(
        "the fused steps apply no score modification but a soft-cap or ALiBi, in the native "
        f"kernel (path {call.path!r}): run it through the PyTorch loop"
    )


def native_jobs(
    plan: Plan,
    q5: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask_tile: MaskTiles | None,
    cache: dict | None,
    q_offset: int = 0,
) -> list[_native.Job]:
    """The forward pass as the native kernel's jobs: each query block of the plan one job
    over its key ranges (:func:`_native_ranges`), written into its rows of ``out`` (B, H_kv,
    G, T_q, D) and ``lse``. The queries q5 are (B, H_kv, G, T_q, D), the first at q_idx
    ``q_offset`` + q0 (for ALiBi)."""
    H_kv, G = q5.shape[1], q5.shape[2]
    return [
        _native.Job(
            q5[:, :, :, q0:q1],
            _native_ranges(q0, q1, chunks, mask_tile, H_kv, G, cache),
            out[:, :, :, q0:q1],
            lse[:, :, :, q0:q1],
            q_offset + q0,
        )
        for q0, q1, chunks in plan.rows
    ]


def _native_ranges(
    q0: int,
    q1: int,
    chunks: Sequence[Chunk],
    mask_tile: MaskTiles | None,
    H_kv: int,
    G: int,
    cache: dict | None,
) -> list[_native.Range]:
    """A query block's keys as the native kernel's ranges: every FULL stretch unmasked
    (stretches that meet joined), every chunk's masked range masked over just those keys —
    by each row's bounds where the mask gives every row one interval of keys
    (:meth:`qkv.masks.Mask.intervals`: no tile evaluated), else by the mask's float bias.
    The kernel skips, per 32 keys and 8 rows, what the mask leaves empty."""
    ranges: list[_native.Range] = []
    for c in chunks:
        m0, m1 = c.masked if c.masked is not None else (c.k1, c.k1)
        for a, b, masked in ((c.k0, m0, False), (m0, m1, True), (m1, c.k1, False)):
            if a == b:
                continue
            if masked:
                bounds, bias = _bounds(mask_tile, q0, q1, a, b, cache), None
                if bounds is None:
                    tile = Call(q0, q1, a, b, (Chunk(a, b, (a, b)),))
                    bias = _call_bias(tile, mask_tile, H_kv, G, torch.float32, cache)[0]
                ranges.append(_native.Range(a, b, bias, bounds))
            elif ranges and ranges[-1].k1 == a and ranges[-1].bias is ranges[-1].bounds is None:
                ranges[-1] = ranges[-1]._replace(k1=b)
            else:
                ranges.append(_native.Range(a, b, None))
    return ranges


def _bounds(
    mask_tile: MaskTiles | None, q0: int, q1: int, k0: int, k1: int, cache: dict | None
) -> torch.Tensor | None:
    """Queries q0..q1-1's keys within k0..k1-1 as the native kernel's row bounds (int32
    (B|1, q1 - q0, 2), [lo, hi) counted from k0), where the mask gives each row one interval
    of keys; None where it does not (or there is no mask). Within a call's span they are
    the mask itself: its FULL blocks inside every row's interval, its EMPTY ones outside.
    ``cache`` (a shift-invariant mask's, as :func:`_call_bias`'s) keeps one per layout."""
    key = ("bounds", q1 - q0, q0 - k0, k1 - k0)
    if cache is not None and key in cache:
        return cache[key]
    found = None if mask_tile is None else mask_tile.bounds(q0, q1)
    bounds = None
    if found is not None:
        lo, hi = np.broadcast_arrays(*(np.clip(x - k0, 0, k1 - k0) for x in found))
        bounds = torch.from_numpy(np.ascontiguousarray(np.stack([lo, hi], -1), dtype=np.int32))
    if cache is not None:
        cache[key] = bounds
    return bounds


def fused_backward(
    call: Lowered,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    *,
    native: torch.dtype | None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward pass over the calls of :func:`calls` (which cover each query block's
    keys once, as the forward's ranges do): each call's share of the gradients, from the
    whole rows' out and lse (dQ of its queries, dK and dV of its keys) summed in the
    accumulation dtype. Used where the forward was fused and nothing reaches the
    log-sum-exp. With ``native`` (a dtype, as for :func:`fused_forward`) the calls run in
    one call of qkv's native kernel, which rounds half-precision gradients itself, head by
    head (``native_backward.backward_many``'s ``grads``). Otherwise half precision is computed in
    float32 (:func:`_working`). The gradients come back in the inputs' dtypes.
    ``delta`` (rowsum(dout ∘ out), accumulation dtype) is computed here where the native
    kernel needs it, unless given."""
    q, k, v, plan, mask_tile, scale = call.q, call.k, call.v, call.plan, call.tiles, call.scale
    mod = _native_mod(call, native)
    dtypes = q.dtype, k.dtype, v.dtype
    if native is None:
        q, k, v = _working(q, k, v)
    natively = native is not None
    acc = accumulation_dtype(q.dtype)
    B, H, T_q, D = q.shape
    H_kv, G = k.shape[1], H // k.shape[1]
    q5 = _blocked(q, H_kv)
    dout = dout.to(q.dtype).contiguous()  # (a sum's dout is expanded; Delta reads it too)
    do5 = _blocked(dout, H_kv)
    shapes = [(B, H_kv, G, T_q, D), k.shape, v.shape]
    grads = None
    if natively and q.dtype != acc:  # rounded by the kernel, head by head: no float32 ones
        dq5, dk, dv = (torch.empty(s, dtype=q.dtype, device=q.device) for s in shapes)
        grads = dq5, dk, dv
    else:  # one zero fill for the three (one parallel region, not three); from the scratch
        # buffer where they are rounded to the inputs' dtype below (nothing holds them after)
        rounded = all(d != acc for d in dtypes)
        if not rounded:  # returned as they are: the scratch buffer would sit beside them idle
            scratch.release()
        dq5, dk, dv = _zeros(shapes, acc, q.device, rounded)
    if natively:  # reads Delta, and lse -inf as "no key"
        lse5 = _blocked(lse.to(acc)[..., None], H_kv)[..., 0]
        delta = row_dot(dout, out, acc) if delta is None else delta
        delta5 = _blocked(delta[..., None], H_kv)[..., 0]
    else:  # torch's: a row with no key had lse 0 in its forward (and P = 0 via the mask)
        o5 = _blocked(out.to(q.dtype), H_kv)
        lse5 = _blocked(lse.to(acc).masked_fill(lse == float("-inf"), 0.0)[..., None], H_kv)
    cache: dict | None = {} if mask_tile is not None and mask_tile.shift_invariant else None
    span = call.tuning.backward_span
    jobs: list[native_backward.BackwardJob] = []
    for _, _, group in calls(plan, call.tuning):
        for c in (piece for one in group for piece in backward_pieces(one, span)):
            bounds = _bounds(mask_tile, c.q0, c.q1, c.k0, c.k1, cache) if natively else None
            bias = None if bounds is not None else _call_bias(c, mask_tile, H_kv, G, acc, cache)[0]
            if natively:  # run at the end, every call at once
                at = slice(c.q0, c.q1)
                jobs.append(
                    native_backward.BackwardJob(
                        q5[:, :, :, at],
                        do5[:, :, :, at],
                        c.k0,
                        c.k1,
                        bias,
                        lse5[..., at],
                        delta5[..., at],
                        None if grads else dq5[:, :, :, at],
                        None if grads else dk[:, :, c.k0 : c.k1],
                        None if grads else dv[:, :, c.k0 : c.k1],
                        bounds,
                        call.q_offset + c.q0,
                        c.q0,
                    )
                )
                continue
            dqc, dkc, dvc = FLASH_BACKWARD(
                _rows(do5, c.q0, c.q1),
                _rows(q5, c.q0, c.q1),
                k[:, :, c.k0 : c.k1],
                v[:, :, c.k0 : c.k1],
                _rows(o5, c.q0, c.q1),
                _rows(lse5, c.q0, c.q1)[..., 0],
                0.0,
                False,
                attn_mask=bias,
                scale=scale,
            )
            dq5[:, :, :, c.q0 : c.q1] += dqc.view(B, H_kv, G, c.q1 - c.q0, D)
            dk[:, :, c.k0 : c.k1] += dkc
            dv[:, :, c.k0 : c.k1] += dvc
    if natively:
        native_backward.backward_many(jobs, k, v, scale, **mod, dtype=native, grads=grads)
    return dq5.view(q.shape).to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])


def _zeros(
    shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device,
    transient: bool = False,
) -> list[torch.Tensor]:
    """Zero tensors of these shapes, views of one buffer: filled at once. ``transient``
    (the caller copies them out and drops them before it returns): the buffer is this
    thread's scratch buffer, in a scope of their own (:mod:`qkv.kernels.tiled.scratch`)."""
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    if transient:
        scratch.start()
        whole = scratch.take(n, dtype, device).zero_()
    else:
        whole = torch.zeros(n, dtype=dtype, device=device)
    return [x.view(*s) for x, s in zip(whole.split(sizes), shapes)]


def _merge(
    o: torch.Tensor, lse: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint sets of keys merged into attention over both (a row
    neither saw stays 0 with lse -inf). The arithmetic of ``qkv.merge_attention`` for two
    parts without gradients, kept apart from it. The general N-part form is safe for
    gradients (stacked, shifted by a detached max) and slower per merge, and this is the
    kernel's hot path."""
    both = torch.logaddexp(lse, lse2)
    at = both.masked_fill(both == float("-inf"), 0.0)
    w, w2 = torch.exp(lse - at)[..., None], torch.exp(lse2 - at)[..., None]
    return (o * w + o2 * w2).to(o.dtype), both


def _call_bias(
    c: Call, mask_tile: MaskTiles | None, H_kv: int, G: int, dtype: torch.dtype, cache: dict | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The additive float mask of a call in the kernel's (B|1, H_kv|1, G·rows, keys) layout,
    and the rows it leaves no key; (None, None) when every key is FULL. ``cache`` (a
    shift-invariant mask's) keeps one per layout of the call relative to its queries."""
    if c.chunks is None:
        return None, None
    key = (
        None
        if cache is None
        else (
            c.q1 - c.q0,
            c.q0 - c.k0,
            tuple(
                (
                    x.k0 - c.k0,
                    x.k1 - c.k0,
                    None if x.masked is None else (x.masked[0] - c.k0, x.masked[1] - c.k0),
                )
                for x in c.chunks
            ),
        )
    )
    if key is not None and cache is not None and key in cache:
        return cache[key]
    allowed = _fit(_span_mask(c.chunks, c.q0, c.q1, mask_tile), H_kv, G)
    # In q's dtype: torch 2.13 reads a float32 mask beside float64 inputs as float64
    # (silently wrong numbers), so the dtypes must match.
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    found = bias, ~allowed.any(-1)
    if key is not None and cache is not None:
        cache[key] = found
    return found


def _span_mask(
    chunks: Sequence[Chunk], q0: int, q1: int, mask_tile: MaskTiles | None
) -> torch.Tensor:
    """The mask of queries q0..q1-1 over the keys from the first chunk's start to the last
    chunk's end, (B|1, H|1, bq, span) bool: True over FULL blocks, the mask over each
    chunk's masked range, False over EMPTY blocks between chunks."""
    bq, pieces, at = q1 - q0, [], chunks[0].k0
    ones = lambda n: torch.ones(1, 1, bq, n, dtype=torch.bool)  # noqa: E731
    for c in chunks:
        if c.k0 > at:  # EMPTY blocks between chunks
            pieces.append(~ones(c.k0 - at))
        if c.masked is None:
            pieces.append(ones(c.k1 - c.k0))
        else:
            m0, m1 = c.masked
            assert mask_tile is not None  # a masked range comes from a mask
            t = mask_tile(q0, q1, m0, m1)
            t = t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
            pieces += [
                ones(m0 - c.k0),
                t.expand(t.shape[0], t.shape[1], bq, m1 - m0),
                ones(c.k1 - m1),
            ]
        at = c.k1
    B, H = max(p.shape[0] for p in pieces), max(p.shape[1] for p in pieces)
    return torch.cat([p.expand(B, H, bq, p.shape[3]) for p in pieces], dim=-1)
