"""The tiled kernel: online softmax over query blocks × key blocks, in pure PyTorch.

A mask is first lowered to a block map (``Mask.blocks``): EMPTY tiles are skipped, FULL
tiles run with no mask at all, and the predicate is evaluated only on PARTIAL tiles. So a
sliding window or packed documents cost what they attend to, and memory is O(T·D) plus one
(block_q × chunk_k) score tile, never O(T_q·T_k).

For each query block, consecutive non-empty key blocks are fused into chunks of up to
``chunk_k`` keys, one matmul each (fewer, larger matmuls run closer to the CPU's peak). The
running max ``m`` and sum ``l`` of the online softmax are kept in float32 (or float64).
On the CPU in float32/float64, a query block whose key span is short (a window) runs as one
call of torch's fused flash kernel instead, forward and backward (:func:`fused_forward`,
:func:`fused_backward`); the loop stays the fallback and the readable reference.

The backward pass recomputes the probabilities from the saved log-sum-exp, FlashAttention-2
style: ``P = exp(S - lse)``, ``dV += Pᵀ dO``, ``dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O) + dlse)``,
``dQ += dS K · scale``, ``dK += dSᵀ Q · scale``; nothing of size T_q × T_k is stored. The
``dlse`` term is the gradient that reaches the returned log-sum-exp (``∂lse_i/∂S_ij = P_ij``),
so split-K attention merged with ``merge_attention`` trains correctly. ``dQ`` and ``dK`` read
non-finite entries of K and Q as 0: a masked-out score has ``dS = 0``, and ``0 · NaN`` must
not carry a NaN into rows that mask it out (a row that attends to it is NaN through dS).

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length · D head dim · D_v value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from ..masks import EMPTY, PARTIAL
from .reference import accumulation_dtype, finite_or_zero

# Measured on the 2-core CPU this project targets (docs/kernels.md): 128-query blocks make
# the matmuls larger, 64-key blocks keep the work wasted at a mask's ragged edge small, and
# chunks of up to 1024 keys make each matmul large enough to run near peak.
BLOCK_Q = 128
BLOCK_K = 64
CHUNK_K = 1024

# mask_tile(q0, q1, k0, k1) -> bool tensor broadcastable to (B, H, q1 - q0, k1 - k0),
# positions relative to the start of the query and key sequences.
MaskTile = Callable[[int, int, int, int], torch.Tensor]


class ModTile(Protocol):
    """A score modification on (B, H_kv, G·bq, L) tiles of scaled scores for queries
    q0..q1-1 and keys k0..k1-1, and its backward (see ``qkv.scores.ScoreMod.vjp``)."""

    def __call__(self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor: ...

    def vjp(self, ds: torch.Tensor, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int, *,
            need: bool) -> tuple[torch.Tensor, list]: ...


@dataclass(frozen=True)
class Chunk:
    """Keys k0..k1-1 for one query block, and the key range (from the first PARTIAL block
    to the last) where the mask must be evaluated, or None if every block is FULL."""

    k0: int
    k1: int
    masked: tuple[int, int] | None


@dataclass(frozen=True)
class Plan:
    """What to compute: for each query block (q0, q1), its chunks of keys."""

    T_q: int
    T_k: int
    rows: tuple[tuple[int, int, tuple[Chunk, ...]], ...]

    @property
    def density(self) -> float:
        """Fraction of the T_q × T_k scores the plan computes (1.0 = dense)."""
        done = sum((q1 - q0) * (c.k1 - c.k0) for q0, q1, chunks in self.rows for c in chunks)
        return done / (self.T_q * self.T_k) if self.T_q * self.T_k else 0.0


def make_plan(codes: np.ndarray, T_q: int, T_k: int, *, block_q: int = BLOCK_Q,
              block_k: int = BLOCK_K, chunk_k: int = CHUNK_K) -> Plan:
    """Turn a block map (codes from ``Mask.blocks``) into chunks of consecutive
    non-empty key blocks, at most ``chunk_k`` keys each."""
    per_chunk = max(1, chunk_k // block_k)
    rows = []
    for i, row in enumerate(codes):
        blocks = np.flatnonzero(row != EMPTY)
        runs = np.split(blocks, np.flatnonzero(np.diff(blocks) != 1) + 1) if len(blocks) else []
        chunks = []
        for run in runs:
            for piece in np.array_split(run, -(-len(run) // per_chunk)):
                partial = piece[row[piece] == PARTIAL]
                masked = (int(partial[0]) * block_k, min((int(partial[-1]) + 1) * block_k, T_k)
                          ) if len(partial) else None
                chunks.append(Chunk(int(piece[0]) * block_k,
                                    min((int(piece[-1]) + 1) * block_k, T_k), masked))
        rows.append((i * block_q, min((i + 1) * block_q, T_q), tuple(chunks)))
    return Plan(T_q, T_k, tuple(rows))


def _fit(m: torch.Tensor, H_kv: int, G: int) -> torch.Tensor:
    """A (B|1, H|1, r, c) mask tile in the kernel's (B|1, H_kv|1, G·r, c) layout."""
    b, h, r, c = m.shape
    m = m.view(b, H_kv, G, r, c) if h != 1 else m[:, :, None].expand(b, 1, G, r, c)
    return m.reshape(b, m.shape[1], G * r, c)


def _scores(qb: torch.Tensor, k: torch.Tensor, chunk: Chunk, q0: int, q1: int,
            mask_tile: MaskTile | None, H_kv: int, G: int, mod_tile: ModTile | None = None
            ) -> torch.Tensor:
    """Scores of one (pre-scaled) query block against one chunk, modified, -inf where
    masked."""
    s = qb @ k[:, :, chunk.k0:chunk.k1].transpose(-2, -1)  # (B, H_kv, G·bq, L)
    if mod_tile is not None:
        s = mod_tile(s, q0, q1, chunk.k0, chunk.k1)
    return _masked(s, chunk, q0, q1, mask_tile, H_kv, G)


def _masked(s: torch.Tensor, chunk: Chunk, q0: int, q1: int, mask_tile: MaskTile | None,
            H_kv: int, G: int) -> torch.Tensor:
    """The tile's scores, -inf (in place) where the mask blocks."""
    if chunk.masked is not None:
        c0, c1 = chunk.masked
        m = mask_tile(q0, q1, c0, c1)
        m = m.reshape((1,) * (4 - m.ndim) + tuple(m.shape))  # (B|1, H|1, ·, ·)
        m = _fit(m.expand(m.shape[0], m.shape[1], q1 - q0, c1 - c0), H_kv, G)
        s[..., c0 - chunk.k0:c1 - chunk.k0].masked_fill_(~m, float("-inf"))
    return s


def _blocked(x: torch.Tensor, H_kv: int) -> torch.Tensor:
    """(B, H, T, ·) -> (B, H_kv, G, T, ·): query head h = kv_head * G + g."""
    B, H, T, D = x.shape
    return x.view(B, H_kv, H // H_kv, T, D)


def _rows(x5: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
    """Rows q0..q1-1 of a (B, H_kv, G, T, ·) tensor as (B, H_kv, G·bq, ·)."""
    B, H_kv, G, _, D = x5.shape
    return x5[:, :, :, q0:q1].reshape(B, H_kv, G * (q1 - q0), D)


def tiled_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan,
                  mask_tile: MaskTile | None, scale: float, mod_tile: ModTile | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, T_q, D_v) and lse (B, H, T_q) in the accumulation dtype: the fused step
    (:func:`fused_forward`) where it applies, else the loop over tiles
    (:func:`loop_forward`)."""
    if mod_tile is None and fusable(q, k, v):
        # Measured (docs/kernels.md): the fused call wins over short spans (a window); over
        # long ones (causal, long documents) the loop's unmasked FULL chunks win.
        short, long = _split(plan, FUSED_SPAN)
        if not long.rows:
            return fused_forward(q, k, v, short, mask_tile, scale)
        out, lse = loop_forward(q, k, v, long, mask_tile, scale)
        if short.rows:
            fused_forward(q, k, v, short, mask_tile, scale, into=(out, lse))
        return out, lse
    return loop_forward(q, k, v, plan, mask_tile, scale, mod_tile)


# torch's fused CPU flash kernel: softmax(Q Kᵀ · scale + mask) V and its log-sum-exp, the
# online softmax in float32 (float64 for float64) and the matmuls in the inputs' dtype.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
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
    return (FUSED and _FLASH is not None and q.device.type == "cpu"
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
        o, l_ = _FLASH(_rows(q5, q0, q1), k[:, :, k0:k1], v[:, :, k0:k1], 0.0, False,
                       attn_mask=bias, scale=scale)
        if empty is not None:  # the kernel gives a row with no key lse 0: make it -inf
            l_ = l_.masked_fill(empty, float("-inf"))
        out[:, :, :, q0:q1] = o.view(B, H_kv, G, bq, D)
        lse[:, :, :, q0:q1] = l_.view(B, H_kv, G, bq)
    return out.view(B, H, T_q, D), lse.view(B, H, T_q)


_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
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
        dqb, dkb, dvb = _FLASH_BACKWARD(
            _rows(do5, q0, q1), _rows(q5, q0, q1), k[:, :, k0:k1], v[:, :, k0:k1],
            _rows(o5, q0, q1), l_, 0.0, False, attn_mask=bias, scale=scale)
        dq5[:, :, :, q0:q1] = dqb.view(B, H_kv, G, bq, D)
        dk[:, :, k0:k1] += dkb
        dv[:, :, k0:k1] += dvb
    return dq5.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


#: the longest key span (keys) a query block runs fused, forward and backward; longer ones
#: run the loop
FUSED_SPAN = FUSED_BACKWARD_SPAN = 1024


def _split(plan: Plan, span: int) -> tuple[Plan, Plan]:
    """The plan's query blocks whose key span is at most ``span`` keys, and the others
    (blocks with no key among them)."""
    fits = [bool(r[2]) and r[2][-1].k1 - r[2][0].k0 <= span for r in plan.rows]
    short = tuple(r for r, f in zip(plan.rows, fits) if f)
    long = tuple(r for r, f in zip(plan.rows, fits) if not f)
    return Plan(plan.T_q, plan.T_k, short), Plan(plan.T_q, plan.T_k, long)


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


def loop_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan,
                 mask_tile: MaskTile | None, scale: float, mod_tile: ModTile | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The readable kernel and the fallback: online softmax over the plan's chunks in
    PyTorch, one tile at a time. out (B, H, T_q, D_v) and lse (B, H, T_q), both in the
    accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    B, H, T_q, _ = q.shape
    H_kv, G, D_v = k.shape[1], H // k.shape[1], v.shape[-1]
    q5, k, v = _blocked(q.to(acc), H_kv), k.to(acc), v.to(acc)
    out = torch.empty(B, H_kv, G, T_q, D_v, dtype=acc, device=q.device)
    lse = torch.empty(B, H_kv, G, T_q, dtype=acc, device=q.device)
    for q0, q1, chunks in plan.rows:
        if not chunks:  # every key masked: out 0, lse -inf
            out[:, :, :, q0:q1] = 0.0
            lse[:, :, :, q0:q1] = float("-inf")
            continue
        # The scale is folded into the query block, not applied to every score tile.
        qb = _rows(q5, q0, q1) * scale  # (B, H_kv, G·bq, D)
        # Running row max m, sum l and output o of the online softmax, set by the first chunk.
        m = l = o = None  # noqa: E741
        for chunk in chunks:
            s = _scores(qb, k, chunk, q0, q1, mask_tile, H_kv, G, mod_tile)  # (B, H_kv, G·bq, L)
            row_max = s.amax(dim=-1, keepdim=True)
            m_new = row_max if m is None else torch.maximum(m, row_max)
            # A row with every score -inf so far keeps max 0: exp(-inf - 0) = 0, not NaN.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = s.sub_(m_safe).exp_()  # in place of s
            pv = p @ v[:, :, chunk.k0:chunk.k1]  # (B, H_kv, G·bq, D_v)
            if m is None:
                l, o = p.sum(dim=-1, keepdim=True), pv  # noqa: E741
            else:  # rescale what was summed under the old max; 0 while m was -inf
                alpha = torch.exp(m - m_safe)
                l = l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))  # noqa: E741
                o = o.mul_(alpha).add_(pv)
            m = m_new
        bq = q1 - q0
        out[:, :, :, q0:q1] = (o / l.masked_fill(l == 0, 1.0)).view(B, H_kv, G, bq, D_v)
        lse[:, :, :, q0:q1] = (m_safe + torch.log(l)).view(B, H_kv, G, bq)
    return out.view(B, H, T_q, D_v), lse.view(B, H, T_q)


def _finite_operand(x: torch.Tensor) -> torch.Tensor:
    return x if bool(torch.isfinite(x).all()) else finite_or_zero(x)


def tiled_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None,
                   plan: Plan, mask_tile: MaskTile | None, scale: float,
                   mod_tile: ModTile | None = None, mod_tensors: Sequence[torch.Tensor] = (),
                   need: bool = False, delta: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, ...]:
    """Gradients of the loss w.r.t. q, k, v and, if ``need``, ``mod_tensors`` (the tensors
    the score modification reads; else Nones), recomputing each score tile once. ``delta``,
    rowsum(dout ∘ out) in the accumulation dtype, is computed here unless given.
    ``dlse`` is the gradient reaching the log-sum-exp (None when it is unused)."""
    acc = accumulation_dtype(q.dtype)
    H_kv = k.shape[1]
    q5, k_, v_ = _blocked(q.to(acc), H_kv), k.to(acc), v.to(acc)
    do = dout.to(acc)
    do5 = _blocked(do, H_kv)
    empty = lse == float("-inf")  # rows that saw no key: P = 0, nothing flows back
    if delta is None:  # rowsum(dO ∘ O); a caller that backpropagates many parts passes it
        delta = (do * out.to(acc)).sum(-1)  # (B, H, T_q)
    delta = delta.contiguous()  # viewed per block below
    if dlse is not None:
        delta = delta - dlse.to(acc).masked_fill(empty, 0.0)
    delta5 = _blocked(delta[..., None], H_kv)
    # +inf for empty rows makes their probabilities exp(-inf) = 0.
    lse5 = _blocked(lse.to(acc).masked_fill(empty, float("inf"))[..., None], H_kv)
    # The right operands of dQ and dK, non-finite entries read as 0: a copy only when there
    # is one, so the common backward holds no second Q or K.
    k0_, q05 = _finite_operand(k_), _finite_operand(q5)
    dq5, dk, dv = torch.zeros_like(q5), torch.zeros_like(k_), torch.zeros_like(v_)
    G = q5.shape[2]
    dmod: list[torch.Tensor | None] = [None] * len(mod_tensors)
    for q0, q1, chunks in plan.rows:
        if not chunks:
            continue
        qb, dob = _rows(q5, q0, q1) * scale, _rows(do5, q0, q1)
        qb0 = qb if q05 is q5 else _rows(q05, q0, q1) * scale  # no second copy if finite
        lse_b, delta_b = _rows(lse5, q0, q1), _rows(delta5, q0, q1)
        dqb = torch.zeros_like(qb)
        for chunk in chunks:
            ks = slice(chunk.k0, chunk.k1)
            if mod_tile is None:
                p = _scores(qb, k_, chunk, q0, q1, mask_tile, H_kv, G).sub_(lse_b).exp_()
            else:  # keep the raw scores: the modification's backward needs them
                raw = qb @ k_[:, :, ks].transpose(-2, -1)  # (B, H_kv, G·bq, L)
                p = _masked(mod_tile(raw.clone(), q0, q1, chunk.k0, chunk.k1), chunk, q0, q1,
                            mask_tile, H_kv, G).sub_(lse_b).exp_()
            dv[:, :, ks] += p.transpose(-2, -1) @ dob
            ds = p.mul_((dob @ v_[:, :, ks].transpose(-2, -1)).sub_(delta_b))  # dS, in place of P
            if mod_tile is not None:  # dS of the raw scores, and of the modification's tensors
                ds, dts = mod_tile.vjp(ds, raw, q0, q1, chunk.k0, chunk.k1, need=need)
                for i, dt in enumerate(dts):
                    if dt is not None:
                        dmod[i] = dt if dmod[i] is None else dmod[i] + dt
            dqb += ds @ k0_[:, :, ks]
            dk[:, :, ks] += ds.transpose(-2, -1) @ qb0  # qb0 carries the scale already
        dq5[:, :, :, q0:q1] = dqb.view(*dqb.shape[:2], G, q1 - q0, -1)
    dq = dq5.view(q.shape).mul_(scale)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
            *[None if d is None else d.to(t.dtype) for d, t in zip(dmod, mod_tensors)])


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, mask_tile, scale, mod_tile, *mod_tensors):  # type: ignore[override]
        out, lse = tiled_forward(q, k, v, plan, mask_tile, scale, mod_tile)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *mod_tensors)
        ctx.plan, ctx.mask_tile, ctx.scale, ctx.mod_tile = plan, mask_tile, scale, mod_tile
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        q, k, v, out, lse, *mod_tensors = ctx.saved_tensors
        no_dlse = dlse is None or not bool(dlse.any())
        if ctx.mod_tile is None and _FLASH_BACKWARD is not None and no_dlse and \
                fusable(q, k, v):
            # Measured (docs/kernels.md): torch's fused backward beats the loop over short
            # spans only.
            short, long = _split(ctx.plan, FUSED_BACKWARD_SPAN)
            dq, dk, dv = fused_backward(q, k, v, out, lse, dout, short, ctx.mask_tile, ctx.scale)
            if long.rows:
                rest = tiled_backward(q, k, v, out, lse, dout, None, long, ctx.mask_tile,
                                      ctx.scale)
                dq, dk, dv = dq + rest[0], dk + rest[1], dv + rest[2]
            return dq, dk, dv, None, None, None, None
        dq, dk, dv, *dmod = tiled_backward(
            q, k, v, out, lse, dout, dlse, ctx.plan, ctx.mask_tile, ctx.scale, ctx.mod_tile,
            mod_tensors, need=any(ctx.needs_input_grad[7:]))
        return (dq, dk, dv, None, None, None, None, *dmod)


def tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, plan: Plan,
          mask_tile: MaskTile | None, scale: float, mod_tile: ModTile | None = None,
          mod_tensors: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention with its own backward.

    Args:
        q: (B, H, T_q, D). k: (B, H_kv, T_k, D). v: (B, H_kv, T_k, D_v), T_k >= 1.
        plan: from :func:`make_plan`. mask_tile: evaluates the mask on a PARTIAL tile.
        scale: multiplies the scores.
        mod_tile: applies a score modification to every computed tile, before the mask.
        mod_tensors: the tensors the modification reads; gradients reach them.

    Returns:
        out (B, H, T_q, D_v) in q's dtype and lse (B, H, T_q) in the accumulation dtype;
        gradients flow through both.
    """
    return _TiledAttention.apply(q, k, v, plan, mask_tile, scale, mod_tile, *mod_tensors)
