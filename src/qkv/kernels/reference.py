"""The reference kernel: the seeds' math, materialised, in PyTorch.

``softmax(Q Kᵀ · scale, masked) V`` with the full (T_q, T_k) score matrix. It is the one
kernel that returns the attention weights for free. float16/bfloat16 inputs are computed
in float32 and the output cast back.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .contract import Lowered, Result, with_sinks


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are kept in float32 at least."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def all_finite(x: torch.Tensor) -> bool:
    """Whether x holds no NaN/inf, exactly, by one reduction (NaN and ±inf reach the min or
    the max)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    """x with NaN and ±inf read as 0."""
    return x.masked_fill(~torch.isfinite(x), 0.0)


class _Scores(torch.autograd.Function):
    """``Q Kᵀ`` whose backward reads non-finite entries of Q and K as 0. A score that the
    mask removes gets ``dS = 0``, and ``0 · NaN`` must not carry a NaN key (or query) into
    the gradients of rows that mask it out. A row that does attend to it is NaN through dS."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, k)
        return q @ k.transpose(-2, -1)

    @staticmethod
    def backward(ctx: Any, ds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = ctx.saved_tensors
        return ds @ finite_or_zero(k), ds.transpose(-2, -1) @ finite_or_zero(q)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    modify: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Materialised attention.

    Args:
        q: (B, H, T_q, D). k: (B, H_kv, T_k, D). v: (B, H_kv, T_k, D_v), T_k >= 1.
        mask: bool, True = may attend, broadcastable to (B, H, T_q, T_k); or None.
        scale: multiplies the scores.
        dropout_p: drop probability on the weights; kept ones are scaled by 1/(1 - p).
        generator: the source of the dropout pattern.
        modify: the score modification over the (B, H, T_q, T_k) scaled scores, applied
            before the mask; or None.

    Returns:
        out (B, H, T_q, D_v) in q's dtype; weights (B, H, T_q, T_k) as applied to v (after
        dropout), in q's dtype; lse (B, H, T_q) in the accumulation dtype.
    """
    acc = accumulation_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    # Query head h reads key/value head h // groups.
    k = k.repeat_interleave(groups, dim=1)  # (B, H, T_k, D)
    v = v.repeat_interleave(groups, dim=1)  # (B, H, T_k, D_v)
    scores = _Scores.apply(q.to(acc), k.to(acc)) * scale  # (B, H, T_q, T_k)
    if modify is not None:
        scores = modify(scores)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # Softmax is unchanged by subtracting any per-row constant, so the max is detached;
    # a fully masked row has max -inf and uses 0 instead, keeping exp(-inf) = 0 (no NaN).
    m = scores.detach().amax(dim=-1, keepdim=True)  # (B, H, T_q, 1)
    m = m.masked_fill(m == float("-inf"), 0.0)
    e = torch.exp(scores - m)
    s = e.sum(dim=-1, keepdim=True)
    empty = s == 0  # fully masked rows: by the mask, or by a score modification's -inf
    s = s.masked_fill(empty, 1.0)  # so that neither 1/s nor log(s) sends NaN back
    weights = e / s  # (B, H, T_q, T_k); 0 on fully masked rows
    lse = (m + torch.log(s)).masked_fill(empty, float("-inf")).squeeze(-1)  # (B, H, T_q)
    if dropout_p > 0.0:
        keep = torch.rand(weights.shape, generator=generator, device=weights.device) >= dropout_p
        weights = weights * keep / (1.0 - dropout_p)
    out = weights @ v.to(acc)  # (B, H, T_q, D_v)
    return out.to(q.dtype), weights.to(q.dtype), lse


def run(call: Lowered) -> Result:
    """The contract's entry: :func:`reference` on the call's dense mask and modification,
    then the call's sinks."""
    out, weights, lse = reference(
        call.q,
        call.k,
        call.v,
        mask=call.dense,
        scale=call.scale,
        dropout_p=call.dropout_p,
        generator=call.generator,
        modify=call.modify,
    )
    return with_sinks(Result(out, lse, weights), call.sinks)
