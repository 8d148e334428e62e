"""The tiled kernel's loop: online softmax over query blocks × key blocks, in pure PyTorch.

A mask is first lowered to a block map (``Mask.blocks``): EMPTY tiles are skipped, FULL
tiles run with no mask at all, and the predicate is evaluated only on PARTIAL tiles. So a
sliding window or packed documents cost what they attend to, and memory is O(T·D) plus one
(block_q × chunk_k) score tile, never O(T_q·T_k).

For each query block, consecutive non-empty key blocks are fused into chunks of up to
``chunk_k`` keys, one matmul each (fewer, larger matmuls run closer to the CPU's peak). The
running max ``m`` and sum ``l`` of the online softmax are kept in float32 (or float64).
Where the dispatch chooses them, the same plan runs as calls of a fused kernel instead
(:mod:`qkv.kernels.tiled.flash`). The loop stays the fallback and the readable reference.

The backward pass recomputes the probabilities from the saved log-sum-exp, FlashAttention-2
style: ``P = exp(S - lse)``, ``dV += Pᵀ dO``, ``dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O) + dlse)``,
``dQ += dS K · scale``, ``dK += dSᵀ Q · scale``. Nothing of size T_q × T_k is stored. The
``dlse`` term is the gradient that reaches the returned log-sum-exp (``∂lse_i/∂S_ij = P_ij``),
so split-K attention merged with ``merge_attention`` trains correctly. ``dQ`` and ``dK`` read
non-finite entries of K and Q as 0: a masked-out score has ``dS = 0``, and ``0 · NaN`` must
not carry a NaN into rows that mask it out (a row that attends to it is NaN through dS).

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length · D head dim · D_v value head dim.
"""

from __future__ import annotations

import torch

from ..contract import Lowered, MaskTiles, ModTiles
from ..reference import accumulation_dtype, finite_or_zero
from .plan import Chunk, _blocked, _fit, _rows, row_dot


def _scores(
    qb: torch.Tensor,
    k: torch.Tensor,
    chunk: Chunk,
    q0: int,
    q1: int,
    mask_tile: MaskTiles | None,
    H_kv: int,
    G: int,
    mod_tile: ModTiles | None = None,
) -> torch.Tensor:
    """Scores of one (pre-scaled) query block against one chunk, modified, -inf where
    masked."""
    s = qb @ k[:, :, chunk.k0 : chunk.k1].transpose(-2, -1)  # (B, H_kv, G·bq, L)
    if mod_tile is not None:
        s = mod_tile(s, q0, q1, chunk.k0, chunk.k1)
    return _masked(s, chunk, q0, q1, mask_tile, H_kv, G)


def _masked(
    s: torch.Tensor, chunk: Chunk, q0: int, q1: int, mask_tile: MaskTiles | None, H_kv: int, G: int
) -> torch.Tensor:
    """The tile's scores, -inf (in place) where the mask blocks."""
    if chunk.masked is not None:
        c0, c1 = chunk.masked
        assert mask_tile is not None  # a chunk with a masked range comes from a mask
        m = mask_tile(q0, q1, c0, c1)
        m = m.reshape((1,) * (4 - m.ndim) + tuple(m.shape))  # (B|1, H|1, ·, ·)
        m = _fit(m.expand(m.shape[0], m.shape[1], q1 - q0, c1 - c0), H_kv, G)
        s[..., c0 - chunk.k0 : c1 - chunk.k0].masked_fill_(~m, float("-inf"))
    return s


def loop_forward(call: Lowered) -> tuple[torch.Tensor, torch.Tensor]:
    """The readable kernel and the fallback: online softmax over the plan's chunks in
    PyTorch, one tile at a time. out (B, H, T_q, D_v) and lse (B, H, T_q), both in the
    accumulation dtype."""
    q, k, v, plan, scale = call.q, call.k, call.v, call.plan, call.scale
    mask_tile, mod_tile = call.tiles, call.mod_tiles
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
        m: torch.Tensor | None = None
        l: torch.Tensor | None = None  # noqa: E741
        o: torch.Tensor | None = None
        for chunk in chunks:
            s = _scores(qb, k, chunk, q0, q1, mask_tile, H_kv, G, mod_tile)  # (B, H_kv, G·bq, L)
            row_max = s.amax(dim=-1, keepdim=True)
            m_new = row_max if m is None else torch.maximum(m, row_max)
            # A row with every score -inf so far keeps max 0: exp(-inf - 0) = 0, not NaN.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = s.sub_(m_safe).exp_()  # in place of s
            pv = p @ v[:, :, chunk.k0 : chunk.k1]  # (B, H_kv, G·bq, D_v)
            if m is None or l is None or o is None:  # the first chunk sets them
                l, o = p.sum(dim=-1, keepdim=True), pv  # noqa: E741
            else:  # rescale what was summed under the old max; 0 while m was -inf
                alpha = torch.exp(m - m_safe)
                l = l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))  # noqa: E741
                o = o.mul_(alpha).add_(pv)
            m = m_new
        bq = q1 - q0
        assert l is not None and o is not None  # the row had a chunk
        out[:, :, :, q0:q1] = (o / l.masked_fill(l == 0, 1.0)).view(B, H_kv, G, bq, D_v)
        lse[:, :, :, q0:q1] = (m_safe + torch.log(l)).view(B, H_kv, G, bq)
    return out.view(B, H, T_q, D_v), lse.view(B, H, T_q)


def _finite_operand(x: torch.Tensor) -> torch.Tensor:
    return x if bool(torch.isfinite(x).all()) else finite_or_zero(x)


def loop_backward(
    call: Lowered,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None = None,
    *,
    delta: torch.Tensor | None = None,
    need_mod: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of the loss w.r.t. q, k, v and, if ``need_mod``, ``call.mod_tensors`` (the
    tensors the score modification reads; else Nones), recomputing each score tile once.
    ``delta``, rowsum(dout ∘ out) in the accumulation dtype, is computed here unless given.
    ``dlse`` is the gradient reaching the log-sum-exp (None when it is unused)."""
    q, k, v, plan, scale = call.q, call.k, call.v, call.plan, call.scale
    mask_tile, mod_tile, mod_tensors, need = call.tiles, call.mod_tiles, call.mod_tensors, need_mod
    acc = accumulation_dtype(q.dtype)
    H_kv = k.shape[1]
    q5, k_, v_ = _blocked(q.to(acc), H_kv), k.to(acc), v.to(acc)
    do = dout.to(acc)
    do5 = _blocked(do, H_kv)
    empty = lse == float("-inf")  # rows that saw no key: P = 0, nothing flows back
    if delta is None:  # rowsum(dO ∘ O); a caller that backpropagates many parts passes it
        delta = row_dot(do, out, acc)  # (B, H, T_q)
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
                p = (
                    _masked(
                        mod_tile(raw.clone(), q0, q1, chunk.k0, chunk.k1),
                        chunk,
                        q0,
                        q1,
                        mask_tile,
                        H_kv,
                        G,
                    )
                    .sub_(lse_b)
                    .exp_()
                )
            dv[:, :, ks] += p.transpose(-2, -1) @ dob
            ds = p.mul_((dob @ v_[:, :, ks].transpose(-2, -1)).sub_(delta_b))  # dS, in place of P
            if mod_tile is not None:  # dS of the raw scores, and of the modification's tensors
                ds, dts = mod_tile.vjp(ds, raw, q0, q1, chunk.k0, chunk.k1, need=need)
                for i, dt in enumerate(dts):
                    if dt is not None:
                        prev = dmod[i]
                        dmod[i] = dt if prev is None else prev + dt
            dqb += ds @ k0_[:, :, ks]
            dk[:, :, ks] += ds.transpose(-2, -1) @ qb0  # qb0 carries the scale already
        dq5[:, :, :, q0:q1] = dqb.view(*dqb.shape[:2], G, q1 - q0, -1)
    dq = dq5.view(q.shape).mul_(scale)
    return (
        dq.to(q.dtype),
        dk.to(k.dtype),
        dv.to(v.dtype),
        *[None if d is None else d.to(t.dtype) for d, t in zip(dmod, mod_tensors)],
    )
