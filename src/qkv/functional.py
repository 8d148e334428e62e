"""The functional core: :func:`attention` validates, dispatches to a kernel and restores
the caller's layout; :func:`dispatch` says which kernel would run, and why.
:func:`attention_weights` recomputes exact weights from a log-sum-exp, and
:func:`merge_attention` combines attention over disjoint key sets.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from ._checks import Problem, check_attention
from .core import compiled as _compiled
from .core.dispatch import NATIVE_SCORES, Dispatch, MaskLike, check_backend, choose
from .core.lowering import dense_mask, float_mask, indices, mask_tile, mod_tile, modify
from .kernels.flex import flex
from .kernels.reference import reference
from .kernels.sdpa import sdpa
from .kernels.tiled import tiled
from .masks import Mask
from .masks.library import _Causal
from .scores import ScoreMod, as_score_mod

Backend = Literal["auto", "reference", "sdpa", "tiled", "flex"]

__all__ = ["Dispatch", "MaskLike", "attention", "attention_weights", "dispatch", "merge_attention"]


def _torch_side(mask: Any, **tensors: Any) -> MaskLike:
    """The checks only the torch entry points need: tensors, not arrays, and a mask that is
    a qkv mask or a bool tensor (a NumPy bool array is moved to the first tensor's device)."""
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor (use qkv.numpy for arrays); got {type(x).__name__}"
            )
    if isinstance(mask, np.ndarray):
        mask = torch.from_numpy(mask).to(next(iter(tensors.values())).device)
    if mask is not None and not isinstance(mask, (Mask, torch.Tensor)):
        raise TypeError(f"mask must be a qkv mask or a bool tensor; got {type(mask).__name__}")
    return mask


def _prepare(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any,
    scale: float | None,
    q_offset: int | None,
    dropout_p: float,
    score_mod: Any = None,
    **choice: Any,
) -> tuple[Problem, MaskLike, ScoreMod | None, Dispatch]:
    """Validate one call (the torch side of it, then the shared checks) and choose a kernel."""
    mask = _torch_side(mask, query=query, key=key, value=value)
    mod = as_score_mod(score_mod)
    compiling = torch.compiler.is_compiling()
    p = check_attention(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        q_offset=q_offset,
        dropout_p=dropout_p,
        validate_mask=not compiling,
    )
    if mod is not None:
        mod.validate(p.B, p.H, p.T_q, p.T_k)
    if compiling:  # decide without reading values: see qkv._compiled
        if choice["backend"] == "flex":
            raise ValueError(
                "backend='flex' plans its BlockMask from the mask's values, "
                "which a torch.compile trace cannot read: call it outside the "
                "compiled function, or use backend='auto' inside"
            )
        check_backend(
            choice["backend"],
            dropout_p=dropout_p,
            score_mod=mod,
            **{k: v for k, v in choice.items() if k != "backend"},
        )
        return (
            p,
            mask,
            mod,
            _compiled.choose(p, mask, mod, query.device, dropout_p=dropout_p, **choice),
        )
    return p, mask, mod, choose(p, mask, key, dropout_p=dropout_p, score_mod=mod, **choice)


def dispatch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: MaskLike = None,
    scale: float | None = None,
    q_offset: int | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: Backend = "auto",
    score_mod: ScoreMod | Callable[..., Any] | None = None,
) -> Dispatch:
    """Which kernel :func:`attention` would run on these arguments, and why.

    Takes the same arguments as :func:`attention` and validates them the same way. The
    rules are in ``qkv._dispatch``'s docstring and ``docs/kernels.md``.

    Example:
        >>> import torch, qkv
        >>> x = torch.randn(1, 2, 8, 4)
        >>> qkv.dispatch(x, x, x, mask=qkv.masks.causal()).backend
        'sdpa'
        >>> print(qkv.dispatch(x, x, x, return_weights=True))  # doctest: +NORMALIZE_WHITESPACE
        reference: the attention weights asked for: only the materialised reference kernel
        provides them
    """
    return _prepare(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        q_offset=q_offset,
        dropout_p=dropout_p,
        generator=generator,
        return_weights=return_weights,
        return_lse=return_lse,
        backend=backend,
        score_mod=score_mod,
    )[3]


#: The active :func:`qkv.heads.record` blocks (innermost last).
RECORDERS: list[Any] = []


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: MaskLike = None,
    scale: float | None = None,
    q_offset: int | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: Backend = "auto",
    score_mod: ScoreMod | Callable[..., Any] | None = None,
) -> Any:
    """Scaled dot-product attention: ``softmax(Q Kᵀ · scale, masked) V``.

    Args:
        query: (T_q, D), (B, T_q, D) or (B, H, T_q, D).
        key: (T_k, D), (B, T_k, D) or (B, H_kv, T_k, D); H % H_kv == 0 and query head h
            reads key/value head h // (H // H_kv) (GQA; H_kv = 1 is MQA).
        value: the layout of key, with last dim D_v (may differ from D).
        mask: a :mod:`qkv.masks` mask, or a bool tensor/array (True = may attend) of shape
            (T_q, T_k) or the full rank of the layout, size-1 dims broadcasting. None
            attends everywhere.
        scale: multiplies the scores; default 1/sqrt(D).
        q_offset: absolute position of query 0 for position-based masks; default
            T_k - T_q (bottom-right, as a KV cache needs).
        dropout_p: probability of dropping an attention weight (kept ones scaled by
            1/(1 - p)). Applied whenever > 0: modules pass 0 in eval mode.
        generator: makes dropout reproducible.
        return_weights: also return the (…, T_q, T_k) weights applied to value (after
            dropout, so ``out == weights @ value``).
        return_lse: also return the (…, T_q) log-sum-exp of the scaled, masked scores
            (float32 for half-precision inputs), differentiable on every backend.
        backend: "auto" (see :func:`dispatch`), "reference", "sdpa", "tiled" or "flex"
            (torch's FlexAttention, asked for only: :mod:`qkv.kernels.flex`).
        score_mod: a :mod:`qkv.scores` modification (or a callable ``fn(score, b, h,
            q_idx, kv_idx)``), applied to the scaled scores before the mask; the weights and
            the log-sum-exp are those of the modified scores.

    Returns:
        ``out`` of shape (…, T_q, D_v), or ``(out, weights?, lse?)`` in that order when
        either is asked for. Fully masked rows give out 0, weights 0 and lse -inf.

    Raises:
        ValueError, TypeError: bad input, naming the argument and its expected and actual
            shapes; or a backend that cannot provide what was asked.

    Example:
        >>> import torch, qkv
        >>> q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 3)
        >>> qkv.attention(q, k, v, mask=qkv.masks.causal()).shape
        torch.Size([2, 4, 5, 3])
    """
    if (
        not (RECORDERS or dropout_p or return_weights or return_lse)
        and backend == "auto"
        and score_mod is None
        and q_offset is None
    ):
        out = _plain_call(query, key, value, mask, scale)
        if out is not None:
            return out
    # A qkv.heads.record() block keeps every call's inputs and log-sum-exp (not while
    # compiling: a graph has no side effects). There, "auto" picks a backend that returns
    # the log-sum-exp (the tiled kernel: no T_q × T_k).
    recorders = RECORDERS if RECORDERS and not torch.compiler.is_compiling() else ()
    user_mask = mask
    lse_for_recorders = bool(recorders and backend == "auto" and dropout_p == 0)
    p, mask, mod, choice = _prepare(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        q_offset=q_offset,
        dropout_p=dropout_p,
        generator=generator,
        return_weights=return_weights,
        return_lse=return_lse or lse_for_recorders,
        backend=backend,
        score_mod=score_mod,
    )
    q, k, v = p.to4d(query), p.to4d(key), p.to4d(value)
    weights = lse = None
    if p.T_k == 0:  # no keys at all: every row is fully masked
        out = q.new_zeros(p.B, p.H, p.T_q, p.D_v)
        weights = q.new_zeros(p.B, p.H, p.T_q, 0)
        lse = torch.full((p.B, p.H, p.T_q), float("-inf"), device=q.device)
    elif choice.backend == "sdpa":
        if mod is not None:  # additive: its term and the mask as one float mask
            dense = float_mask(mask, mod, p, q)
        else:
            dense = dense_mask(mask, p, q.device) if choice.sdpa_mask == "dense" else None
        out = sdpa(
            q,
            k,
            v,
            mask=dense,
            is_causal=choice.sdpa_mask == "is_causal",
            scale=p.scale,
            dropout_p=dropout_p,
        )
    elif choice.backend == "flex":
        out, lse = flex(
            q,
            k,
            v,
            mask=mask,
            mod=mod,
            q_offset=p.q_offset,
            scale=p.scale,
            return_lse=return_lse or lse_for_recorders,
        )
    elif choice.backend == "tiled" and choice.compiled is not None:
        out, lse = _compiled.tiled_op(q, k, v, choice.compiled, p)
    elif choice.backend == "tiled":
        out, lse = tiled(
            q,
            k,
            v,
            plan=choice.plan,
            mask_tile=mask_tile(mask, p, q.device),
            scale=p.scale,
            mod_tile=mod_tile(mod, p, q.device),
            mod_tensors=mod.tensors() if mod is not None else (),
        )
    else:
        out, weights, lse = reference(
            q,
            k,
            v,
            mask=dense_mask(mask, p, q.device),
            scale=p.scale,
            dropout_p=dropout_p,
            generator=generator,
            modify=modify(mod, p, q.device),
        )
    for recorder in recorders:
        recorder.add(
            query,
            key,
            value,
            None if lse is None else p.restore(lse),
            mask=user_mask,
            scale=scale,
            q_offset=q_offset,
            score_mod=score_mod,
        )
    extras = ([weights] if return_weights else []) + ([lse] if return_lse else [])
    if not extras:
        return p.restore(out)
    return tuple(p.restore(x) for x in [out, *extras])


_PLAIN_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def _plain_call(query: Any, key: Any, value: Any, mask: Any, scale: Any) -> torch.Tensor | None:
    """The most common call — a decode step — with as little Python as it can have:
    (B, H, T, D) tensors of one float dtype and device whose sizes agree, and no mask, or
    causal with one query (which allows every key before it). It runs torch's fused kernel,
    which is what the full path would choose, on the same arguments. Anything else
    returns None and takes the full path, which checks, explains and dispatches."""
    if (
        type(query) is not torch.Tensor
        or type(key) is not torch.Tensor
        or type(value) is not torch.Tensor
        or query.ndim != 4
        or key.ndim != 4
        or value.ndim != 4
        or torch.compiler.is_compiling()
    ):
        return None
    B, H, T_q, D = query.shape
    B_k, H_kv, T_k, D_k = key.shape
    B_v, H_v, T_v, _ = value.shape
    if not (mask is None or (type(mask) is _Causal and T_q == 1)):
        return None
    if not (
        B == B_k == B_v
        and H_kv == H_v
        and T_k == T_v
        and D_k == D
        and T_q
        and T_k
        and D
        and H % H_kv == 0
    ):
        return None
    dtype = query.dtype
    if (
        dtype not in _PLAIN_DTYPES
        or key.dtype != dtype
        or value.dtype != dtype
        or key.device != query.device
        or value.device != query.device
    ):
        return None
    if dtype is torch.bfloat16 and T_q * T_k >= NATIVE_SCORES:  # dispatch rule 4's size
        return None
    if scale is None:
        scale = D**-0.5
    elif type(scale) is not float or not 0.0 < scale < math.inf:
        return None
    return sdpa(query, key, value, mask=None, is_causal=False, scale=scale)


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
    mask = _torch_side(mask, query=query, key=key, lse=lse)
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
    """The scores of chosen heads and rows, (B, h, r, T_k) each, in 4-d layout: scaled,
    then modified (the same tensor without a score modification); the mask there (None
    for no mask); the head and row indices. O(h · r · T_k) memory."""
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
        allowed = dense_mask(mask, p, query.device).expand(p.B, p.H, p.T_q, p.T_k)[:, hs][:, :, rs]
    return scaled, modified, allowed, hs, rs


def merge_attention(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention computed over disjoint sets of keys into attention over their union.

    If ``out_i, lse_i = attention(q, k_i, v_i, return_lse=True)`` for key sets ``k_i``, the
    exact result over all keys is ``sum_i exp(lse_i - lse) · out_i`` with
    ``lse = logsumexp_i(lse_i)``. The building block of split-K decoding and of attention
    distributed over devices. Computed in float32 (float64 for float64 inputs). A row that
    saw no key in any part stays 0 with lse -inf. Differentiable: gradients reach every
    part's output and log-sum-exp, and through them the attention that made them.

    Args:
        outs: partial outputs, each (…, T_q, D_v), same shape.
        lses: their log-sum-exps, each (…, T_q).

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
    acc = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    lse_all = torch.stack([x.to(acc) for x in lses])  # (parts, …, T_q)
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
    return out.to(outs[0].dtype), lse
