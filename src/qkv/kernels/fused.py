"""The tiled kernel's fused steps: one call of torch's CPU flash kernel per query block over
its key span, forward and backward, where that wins (docs/kernels.md#the-tiled-kernel); the
loop of :mod:`qkv.kernels.tiled` runs everything else and stays the reference.

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length · D head dim.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .blocks import Chunk, MaskTile, Plan, _blocked, _fit, _rows
from .reference import accumulation_dtype

# torch's fused CPU flash kernel: softmax(Q Kᵀ · scale + mask) V and its log-sum-exp, the
# online softmax in float32 (float64 for float64) and the matmuls in the inputs' dtype.
FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
#: the fused step is used when True (tests turn it off to compare it with the loop)
FUSED = True


def fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`fused_forward` can run this call: torch's CPU kernel exists, the
    tensors are float32 or float64 on the CPU, D_v = D (the kernel's requirement), and K is
    finite — the kernel adds the mask to the scores, and NaN + (-inf) would carry a
    masked-out NaN key into the rows that mask it (the loop masks by assignment instead).
    Half precision keeps the loop: the kernel rounds the probabilities to the inputs' dtype
    before ·V, which breaks the accuracy docs/semantics.md promises (within 1.5× the
    output's own rounding; a property test found 1.6× in bfloat16)."""
    return (FUSED and FLASH is not None and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.float64)
            and v.shape[-1] == q.shape[-1] and bool(torch.isfinite(k).all()))


def fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan,
                  mask_tile: MaskTile | None, scale: float,
                  into: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward pass with one fused call per query block: torch's CPU flash kernel over
    the block's key span (its first chunk's start to its last chunk's end), with the mask of
    that span as an additive float mask — -inf where the mask blocks and over EMPTY blocks
    inside the span, 0 elsewhere; no mask at all when every block of the span is FULL. The
    query block holds the G query heads of each key/value head as rows (GQA reads each
    key/value head once). out in q's dtype, lse in the accumulation dtype; with
    ``into`` = (out, lse) of the full problem, only the plan's rows are written there."""
    acc = accumulation_dtype(q.dtype)
    B, H, T_q, D = q.shape
    H_kv, G = k.shape[1], H // k.shape[1]
    q5 = _blocked(q, H_kv)
    if into is None:
        out = q.new_empty(B, H_kv, G, T_q, D)
        lse = torch.empty(B, H_kv, G, T_q, dtype=acc, device=q.device)
    else:
        out, lse = into[0].view(B, H_kv, G, T_q, D), into[1].view(B, H_kv, G, T_q)
    # A shift-invariant mask (causal, windows) repeats along each diagonal: one float mask
    # per layout of the span relative to the queries, not one per block.
    cache: dict | None = {} if getattr(mask_tile, "shift_invariant", False) else None
    for q0, q1, chunks in plan.rows:
        bq = q1 - q0
        if not chunks:  # every key masked: out 0, lse -inf
            out[:, :, :, q0:q1] = 0.0
            lse[:, :, :, q0:q1] = float("-inf")
            continue
        k0, k1 = chunks[0].k0, chunks[-1].k1
        bias, empty = _span_bias(chunks, q0, q1, mask_tile, H_kv, G, q.dtype, cache)
        o, l_ = FLASH(_rows(q5, q0, q1), k[:, :, k0:k1], v[:, :, k0:k1], 0.0, False,
                       attn_mask=bias, scale=scale)
        if empty is not None:  # the kernel gives a row with no key lse 0: make it -inf
            l_ = l_.masked_fill(empty, float("-inf"))
        out[:, :, :, q0:q1] = o.view(B, H_kv, G, bq, D)
        lse[:, :, :, q0:q1] = l_.view(B, H_kv, G, bq)
    return out.view(B, H, T_q, D), lse.view(B, H, T_q)


FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                          None)


def fused_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor, plan: Plan,
                   mask_tile: MaskTile | None, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward pass with one fused call per query block (torch's CPU flash backward)
    over the span and float mask of :func:`fused_forward`: dQ of the block, dK and dV of
    the span, accumulated over blocks in the accumulation dtype. Used where the forward was
    fused and nothing reaches the log-sum-exp."""
    acc = accumulation_dtype(q.dtype)
    B, H, T_q, D = q.shape
    H_kv, G = k.shape[1], H // k.shape[1]
    q5, o5 = _blocked(q, H_kv), _blocked(out.to(q.dtype), H_kv)
    do5 = _blocked(dout.to(q.dtype), H_kv)
    # A row with no key: the kernel's own forward gave it lse 0 (and P = 0 through the mask).
    lse5 = _blocked(lse.to(acc).masked_fill(lse == float("-inf"), 0.0)[..., None],
                    H_kv)
    dq5 = torch.zeros(B, H_kv, G, T_q, D, dtype=acc, device=q.device)
    dk, dv = (torch.zeros(x.shape, dtype=acc, device=q.device) for x in (k, v))
    cache: dict | None = {} if getattr(mask_tile, "shift_invariant", False) else None
    for q0, q1, chunks in plan.rows:
        if not chunks:
            continue
        bq, k0, k1 = q1 - q0, chunks[0].k0, chunks[-1].k1
        bias, _ = _span_bias(chunks, q0, q1, mask_tile, H_kv, G, q.dtype, cache)
        l_ = _rows(lse5, q0, q1)[..., 0]
        dqb, dkb, dvb = FLASH_BACKWARD(
            _rows(do5, q0, q1), _rows(q5, q0, q1), k[:, :, k0:k1], v[:, :, k0:k1],
            _rows(o5, q0, q1), l_, 0.0, False, attn_mask=bias, scale=scale)
        dq5[:, :, :, q0:q1] = dqb.view(B, H_kv, G, bq, D)
        dk[:, :, k0:k1] += dkb
        dv[:, :, k0:k1] += dvb
    return dq5.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


#: the longest key span (keys) a query block runs fused, forward and backward; longer ones
#: run the loop
FUSED_SPAN = FUSED_BACKWARD_SPAN = 1024


def split(plan: Plan, span: int) -> tuple[Plan, Plan]:
    """The plan's query blocks whose key span is at most ``span`` keys, and the others
    (blocks with no key among them)."""
    fits = (plan.at[1:] > plan.at[:-1]) & (plan.spans <= span)
    return plan.select(fits), plan.select(~fits)


def _span_key(chunks: Sequence[Chunk], q0: int, q1: int) -> tuple:
    """What a shift-invariant mask's span bias depends on: the block's size and the span's
    layout relative to the queries."""
    k0 = chunks[0].k0
    return (q1 - q0, q0 - k0, tuple(
        (c.k0 - k0, c.k1 - k0, None if c.masked is None else
         (c.masked[0] - k0, c.masked[1] - k0)) for c in chunks))


def _span_bias(chunks: Sequence[Chunk], q0: int, q1: int, mask_tile: MaskTile | None,
               H_kv: int, G: int, dtype: torch.dtype, cache: dict | None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The additive float mask of a query block over its key span in the kernel's
    (B|1, H_kv|1, G·bq, span) layout, and the rows it leaves no key; (None, None) when the
    span is all FULL. ``cache`` (a shift-invariant mask's) keeps one per span layout."""
    key = None if cache is None else _span_key(chunks, q0, q1)
    if key is not None and key in cache:
        return cache[key]
    allowed = _span_mask(chunks, q0, q1, mask_tile)
    if allowed is None:
        found: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    else:
        allowed = _fit(allowed, H_kv, G)
        # In q's dtype: torch 2.13 reads a float32 mask beside float64 inputs as float64
        # (silently wrong numbers), so the dtypes must match.
        bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        found = bias, ~allowed.any(-1)
    if key is not None:
        cache[key] = found
    return found


def _span_mask(chunks: Sequence[Chunk], q0: int, q1: int, mask_tile: MaskTile | None
               ) -> torch.Tensor | None:
    """The mask of queries q0..q1-1 over the keys from the first chunk's start to the last
    chunk's end, (B|1, H|1, bq, span) bool, or None if it allows everything there."""
    gaps = any(a.k1 != b.k0 for a, b in zip(chunks, chunks[1:]))
    if not gaps and all(c.masked is None for c in chunks):
        return None
    bq, pieces, at = q1 - q0, [], chunks[0].k0
    ones = lambda n: torch.ones(1, 1, bq, n, dtype=torch.bool)  # noqa: E731
    for c in chunks:
        if c.k0 > at:  # EMPTY blocks between chunks
            pieces.append(~ones(c.k0 - at))
        if c.masked is None:
            pieces.append(ones(c.k1 - c.k0))
        else:
            m0, m1 = c.masked
            t = mask_tile(q0, q1, m0, m1)
            t = t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))
            pieces += [ones(m0 - c.k0), t.expand(t.shape[0], t.shape[1], bq, m1 - m0),
                       ones(c.k1 - m1)]
        at = c.k1
    B, H = max(p.shape[0] for p in pieces), max(p.shape[1] for p in pieces)
    return torch.cat([p.expand(B, H, bq, p.shape[3]) for p in pieces], dim=-1)
