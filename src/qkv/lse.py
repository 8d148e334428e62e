"""What the log-sum-exp of a fast pass makes possible: the exact weights of chosen heads and
rows, recomputed without T_q × T_k (:func:`attention_weights`, :func:`row_scores`), and
attention over disjoint key sets merged exactly (:func:`merge_attention`: split-K decoding,
context parallelism).

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._checks import Problem, check_attention
from .core.call import torch_inputs
from .core.lowering import indices
from .core.recipe import dense_mask
from .kernels.contract import sink_factor
from .masks import Mask, MaskLike
from .scores import ScoreMod, as_score_mod


def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    lse: torch.Tensor,
    *,
    mask: MaskLike = None,
    scale: float | None = None,
    q_offset: int | None = None,
    heads: Sequence[int] | None = None,
    rows: Sequence[int] | slice | None = None,
    score_mod: ScoreMod | Callable[..., Any] | None = None,
) -> torch.Tensor:
    """The exact attention weights of chosen heads and query rows, recomputed from the
    log-sum-exp of a fast pass: ``exp(Q Kᵀ · scale - lse)``, masked. Memory is
    O(len(heads) · len(rows) · T_k), so weights stay inspectable at any length.

    Args:
        query, key: as given to :func:`attention`.
        lse: the (…, T_q) log-sum-exp it returned (``return_lse=True``).
        mask, scale, q_offset, score_mod: as given to :func:`attention`.
        heads: query heads to keep (4-d layout only); None keeps all.
        rows: query rows to keep; None keeps all.

    Returns:
        Weights of shape (…, len(heads), len(rows), T_k) in the inputs' layout.

    Example:
        >>> import torch, qkv
        >>> q = k = v = torch.randn(1, 4, 4096, 16)
        >>> out, lse = qkv.attention(q, k, v, mask=qkv.masks.sliding_window(64), return_lse=True)
        >>> w = qkv.attention_weights(q, k, lse, mask=qkv.masks.sliding_window(64),
        ...                           heads=[2], rows=[4000])
        >>> w.shape, round(w.sum().item(), 4)
        (torch.Size([1, 1, 1, 4096]), 1.0)
    """
    mask = torch_inputs(mask, query=query, key=key, lse=lse)
    p = check_attention(query, key, key, mask=mask, scale=scale, q_offset=q_offset)
    if tuple(lse.shape) != p.mask_shape[:-1]:
        letters = ", ".join(p.mask_letters[:-1])
        raise ValueError(
            f"lse must have shape ({letters}) = {tuple(p.mask_shape[:-1])}; got {tuple(lse.shape)}"
        )
    _, s, allowed, hs, rs = row_scores(query, key, p, mask, score_mod, heads, rows, dtype=lse.dtype)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    l_ = p.to4d(lse)[:, hs][:, :, rs, None]
    w = torch.exp(s - l_.masked_fill(l_ == float("-inf"), float("inf")))
    return p.restore(w.to(query.dtype))


def row_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    p: Problem,
    mask: MaskLike,
    score_mod: Any,
    heads: Sequence[int] | None,
    rows: Sequence[int] | slice | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The scores of chosen heads and rows, (B, h, r, T_k) each, in 4-d layout, first scaled
    and then modified (the same tensor without a score modification), with the mask there
    (None for no mask) and the head and row indices. It takes O(h · r · T_k) memory."""
    mod = as_score_mod(score_mod)
    if mod is not None:
        mod.validate(p.B, p.H, p.T_q, p.T_k)
    if heads is not None and p.rank != 4:
        raise ValueError("heads can be chosen only for (B, H, T_q, D) inputs")
    q, k = p.to4d(query), p.to4d(key)
    hs = torch.arange(p.H) if heads is None else torch.as_tensor(list(heads))
    rs = torch.arange(p.T_q)[rows if rows is not None else slice(None)].reshape(-1)
    q = q[:, hs][:, :, rs]  # (B, h, r, D)
    k = k[:, hs // (p.H // p.H_kv)]  # (B, h, T_k, D)
    scaled = (q @ k.transpose(-2, -1)).to(dtype) * p.scale  # (B, h, r, T_k)
    modified = scaled
    if mod is not None:  # at the chosen heads and rows only
        modified = mod.apply(scaled, *indices(p, query.device, rs, hs, 0, p.T_k)).expand(
            scaled.shape
        )
    allowed = None
    if isinstance(mask, Mask):  # evaluated at the chosen rows only: O(rows · T_k)
        kv = torch.arange(p.T_k, device=query.device)
        allowed = mask.at(p.B, p.H, (p.q_offset + rs).to(query.device), kv)
        allowed = allowed.expand(p.B, p.H, len(rs), p.T_k)[:, hs]
    elif mask is not None:
        dense = dense_mask(mask, p, query.device)
        assert dense is not None
        allowed = dense.expand(p.B, p.H, p.T_q, p.T_k)[:, hs][:, :, rs]
    return scaled, modified, allowed, hs, rs


def merge_attention(
    outs: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    *,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention computed over disjoint sets of keys into attention over their union.

    If ``out_i, lse_i = attention(q, k_i, v_i, return_lse=True)`` for key sets ``k_i``, the
    exact result over all keys is ``sum_i exp(lse_i - lse) · out_i`` with
    ``lse = logsumexp_i(lse_i)``. The building block of split-K decoding and of attention
    distributed over devices. Computed in float32 (float64 for float64 inputs). A row that
    saw no key in any part stays 0 with lse -inf. Differentiable: gradients reach every
    part's output and log-sum-exp, and through them the attention that made them.

    A part whose lse is ``+inf`` is an empty part, as in vLLM's ``merge_attn_states``
    (FlashAttention 2 reports a sequence with no key so): it adds nothing. Attention sinks
    are therefore not merged as parts: pass them as ``sinks``, which joins them once, after
    the parts (a sink of ``+inf`` then gives the row out 0 and lse ``+inf``).

    Args:
        outs: partial outputs, each (…, T_q, D_v), same shape.
        lses: their log-sum-exps, each (…, T_q).
        sinks: attention-sink logits as in :func:`qkv.attention`, (H,) or (B|1, H|1, T_q|1),
            for parts of shape (B, H, T_q, D_v); None for none.

    Returns:
        ``(out, lse)``: out in the dtype of ``outs[0]``, lse in float32 (or float64).
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(
            f"outs and lses must be non-empty and of equal length; got {len(outs)} and {len(lses)}"
        )
    for i, (o, l_) in enumerate(zip(outs, lses)):
        if o.shape != outs[0].shape or tuple(l_.shape) != tuple(o.shape[:-1]):
            raise ValueError(
                f"outs[{i}] must have shape {tuple(outs[0].shape)} and lses[{i}] "
                f"shape {tuple(outs[0].shape[:-1])}; got {tuple(o.shape)} and "
                f"{tuple(l_.shape)}"
            )
    if sinks is not None and outs[0].ndim != 4:
        raise ValueError(
            f"merge_attention with sinks needs parts of shape (B, H, T_q, D_v); "
            f"got {tuple(outs[0].shape)}"
        )
    acc = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    lse_all = torch.stack([x.to(acc) for x in lses])  # (parts, …, T_q)
    lse_all = lse_all.masked_fill(lse_all == float("inf"), float("-inf"))  # empty parts
    # Shifted by the detached row max, so exp cannot overflow; a row no part saw (every
    # lse -inf) gets weights 0, lse -inf and zero gradients, never NaN.
    m = lse_all.detach().amax(dim=0)
    m = m.masked_fill(m == float("-inf"), 0.0)
    weights = torch.exp(lse_all - m)  # (parts, …, T_q): 0 for parts that saw no key
    total = weights.sum(dim=0)
    unseen = total == 0
    total = total.masked_fill(unseen, 1.0)
    lse = (m + torch.log(total)).masked_fill(unseen, float("-inf"))
    out = sum(w[..., None] * o.to(acc) for w, o in zip(weights, outs)) / total[..., None]
    if sinks is not None:
        factor, lse = sink_factor(lse, sinks)
        out = out * factor[..., None]
    return out.to(outs[0].dtype), lse
