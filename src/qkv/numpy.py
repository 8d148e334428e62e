"""The float64 NumPy reference: the oracle every backend is tested against, and the
teaching text.

Every computation here is the textbook one, materialised and in float64:
``softmax(Q Kᵀ · scale, masked) V``. It has the same shapes and semantics as
:func:`qkv.attention` (see ``docs/semantics.md``) and imports nothing from torch.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.

Example:
    >>> import numpy as np
    >>> from qkv import numpy as qnp
    >>> x = np.ones((3, 2))
    >>> out, w = qnp.attention(x, x, x, mask=np.tri(3, dtype=bool), return_weights=True)
    >>> w.round(3)[1]
    array([0.5, 0.5, 0. ])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._checks import Problem, check_attention, check_dense_mask

__all__ = ["attention", "logsumexp", "scaled_dot_product_attention", "softmax"]


def _row_max(x: np.ndarray, axis: int) -> np.ndarray:
    """Row maxima for a stable softmax; 0 where the whole row is -inf (fully masked),
    so that ``x - max`` stays -inf there instead of becoming NaN."""
    m = np.max(x, axis=axis, keepdims=True)
    return np.where(m == -np.inf, 0.0, m)


def softmax(x: Any, axis: int = -1) -> np.ndarray:
    """Stable softmax along ``axis``, in float64.

    Subtracting the row maximum first means ``exp`` never sees a large positive number,
    so logits of 1e8 do not overflow (the naive ``exp(x) / sum(exp(x))`` returns NaN there).
    A row that is entirely ``-inf`` (fully masked) gives all zeros, never NaN. A row with
    ``+inf`` entries gives them all its mass, shared equally: the limit of a logit that
    grows without bound (an infinite attention sink takes the whole row).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.shape[axis] == 0:
        return x.copy()
    m = _row_max(x, axis)
    with np.errstate(invalid="ignore"):  # inf - inf in rows that hold +inf: replaced below
        e = np.where(m == np.inf, (x == np.inf).astype(np.float64), np.exp(x - m))
    s = e.sum(axis=axis, keepdims=True)
    return e / np.where(s == 0, 1.0, s)


def logsumexp(x: Any, axis: int = -1) -> np.ndarray:
    """``log(sum(exp(x)))`` along ``axis`` without overflow; ``-inf`` for an all ``-inf`` row
    and ``+inf`` for a row that holds ``+inf``."""
    x = np.asarray(x, dtype=np.float64)
    if x.shape[axis] == 0:
        return np.full(np.delete(x.shape, axis % x.ndim), -np.inf)
    m = _row_max(x, axis)
    finite_m = np.where(m == np.inf, 0.0, m)
    # log(0) = -inf is the answer for an empty row; m + log(...) is +inf where m is
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        total = np.log(np.exp(x - finite_m).sum(axis=axis, keepdims=True))
    return np.squeeze(np.where(m == np.inf, np.inf, m + total), axis=axis)


def _allowed(mask: Any, p: Problem) -> np.ndarray | None:
    """The mask as a (B, H, T_q, T_k) bool array, or None for no mask."""
    if mask is None:
        return None
    if hasattr(mask, "to_numpy"):  # a qkv.masks.Mask
        return mask.to_numpy(p.B, p.H, p.T_q, p.T_k, q_offset=p.q_offset)
    return p.to4d(np.broadcast_to(np.asarray(mask), p.mask_shape))


def _modified(scores: np.ndarray, score_mod: Any, p: Problem) -> np.ndarray:
    """``score_mod`` applied to every scaled score at absolute positions."""
    if not hasattr(score_mod, "apply"):  # a plain callable, as qkv.scores.function wraps it
        fn = score_mod
        apply = lambda s, b, h, q, kv, row: fn(s, b, h, q, kv)  # noqa: E731
    else:
        score_mod.validate(p.B, p.H, p.T_q, p.T_k)
        apply = score_mod.apply
    b, h = np.arange(p.B).reshape(-1, 1, 1, 1), np.arange(p.H).reshape(1, -1, 1, 1)
    row = np.arange(p.T_q).reshape(1, 1, -1, 1)
    kv = np.arange(p.T_k).reshape(1, 1, 1, -1)
    out = np.asarray(apply(scores, b, h, row + p.q_offset, kv, row), dtype=np.float64)
    return np.broadcast_to(out, scores.shape)


def attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    scale: float | None = None,
    q_offset: int | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    score_mod: Any = None,
    sinks: Any = None,
) -> Any:
    """Scaled dot-product attention in float64: the oracle.

    Args:
        query: (T_q, D), (B, T_q, D) or (B, H, T_q, D).
        key: (T_k, D), (B, T_k, D) or (B, H_kv, T_k, D), with H % H_kv == 0.
        value: same layout as key with last dim D_v.
        mask: a qkv mask, or a bool array (True = may attend) broadcastable to
            (T_q, T_k), (B, T_q, T_k) or (B, H, T_q, T_k) as the inputs' layout.
        scale: multiplies the scores; default 1/sqrt(D).
        q_offset: absolute position of query 0; default T_k - T_q (bottom-right).
        return_weights: also return the (…, T_q, T_k) attention weights.
        return_lse: also return the (…, T_q) log-sum-exp of the scaled, masked scores.
        score_mod: a :mod:`qkv.scores` modification, applied to the scaled scores before
            the mask; a callable ``fn(score, b, h, q_idx, kv_idx)`` gets NumPy arrays here.
        sinks: attention-sink logits, (H,) or per row (B|1, H|1, T_q|1): each row's
            softmax gets one more column with that logit and no value, dropped from the
            weights returned.

    Returns:
        ``out`` of shape (…, T_q, D_v), or a tuple ``(out, weights?, lse?)`` in that order.
        Fully masked rows give out 0, weights 0 and lse -inf (with sinks: the sink).

    Raises:
        ValueError, TypeError: bad input, with the expected and actual shapes.
    """
    p = check_attention(query, key, value, mask=mask, scale=scale, q_offset=q_offset)
    q, k, v = (p.to4d(np.asarray(x, dtype=np.float64)) for x in (query, key, value))
    # Query head h reads key/value head h // (H // H_kv).
    k = np.repeat(k, p.H // p.H_kv, axis=1)  # (B, H, T_k, D)
    v = np.repeat(v, p.H // p.H_kv, axis=1)  # (B, H, T_k, D_v)
    scores = (q @ k.swapaxes(-1, -2)) * p.scale  # (B, H, T_q, T_k)
    if score_mod is not None:
        scores = _modified(scores, score_mod, p)
    allowed = _allowed(mask, p)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)
        rows = sink[None, :, None] if sink.ndim == 1 else sink  # (H,) or (B|1, H|1, T_q|1)
        column = np.broadcast_to(rows[..., None], (*scores.shape[:3], 1))
        scores = np.concatenate([scores, column], axis=-1)  # the sink: one more key
        weights = softmax(scores)[..., :-1]  # (B, H, T_q, T_k), the sink's share dropped
    else:
        weights = softmax(scores)  # (B, H, T_q, T_k)
    out = weights @ v  # (B, H, T_q, D_v)
    extras = ([weights] if return_weights else []) + ([logsumexp(scores)] if return_lse else [])
    if not extras:
        return p.restore(out)
    return tuple(p.restore(x) for x in [out, *extras])


def scaled_dot_product_attention(
    Q: Any, K: Any, V: Any, mask: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """Seed 003's function, kept for learners and corrected.

    ``softmax(Q Kᵀ / sqrt(d_k) + M) V``. The seed's version used a naive softmax
    (overflow for large scores, NaN for a fully masked row), ``K.T`` (wrong for batched
    inputs) and ``np.infty`` (removed in NumPy 2). Here:

    Args:
        Q: (…, T_q, D). K: (…, T_k, D). V: (…, T_k, D_v), in one of the layouts of
            :func:`attention`.
        mask: an additive float mask (0 = keep, -inf = block, as in the seed) or a
            bool mask (True = may attend), broadcastable to (…, T_q, T_k).

    Returns:
        ``(out, attention_weights)``.

    Example:
        >>> import numpy as np
        >>> M = np.where(np.tri(2, dtype=bool), 0.0, -np.inf)
        >>> out, w = scaled_dot_product_attention(np.ones((2, 4)), np.ones((2, 4)), np.eye(2), M)
        >>> w
        array([[1. , 0. ],
               [0.5, 0.5]])
    """
    p = check_attention(Q, K, V)
    if p.H_kv != p.H:
        raise ValueError(
            f"scaled_dot_product_attention needs H == H_kv; got H={p.H}, "
            f"H_kv={p.H_kv} (use qkv.numpy.attention for GQA)"
        )
    if mask is not None:
        mask = np.asarray(mask)
        check_dense_mask(mask, p, like=mask, additive=True)
    Q, K, V = (np.asarray(x, dtype=np.float64) for x in (Q, K, V))
    scaled = Q @ np.swapaxes(K, -1, -2) / math.sqrt(Q.shape[-1])  # (…, T_q, T_k)
    if mask is not None:
        scaled = np.where(mask, scaled, -np.inf) if mask.dtype == bool else scaled + mask
    weights = softmax(scaled)
    return weights @ V, weights
