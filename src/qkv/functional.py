"""The functional core: :func:`attention` validates, dispatches to a kernel and restores
the caller's layout; :func:`dispatch` says which kernel would run, and why.
:func:`attention_weights` recomputes exact weights from a log-sum-exp, and
:func:`merge_attention` combines attention over disjoint key sets.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch

from ._checks import Problem, check_attention
from .core import compiled
from .core.call import lowered, prepare, torch_inputs
from .core.dispatch import Dispatch, plain
from .core.lowering import dense_mask, indices
from .core.record import listeners
from .kernels import Lowered, Result, flex, reference, sdpa, tiled
from .masks import Mask, MaskLike
from .scores import ScoreMod, as_score_mod
from .tuning import tuning

Backend = Literal["auto", "reference", "sdpa", "tiled", "flex"]

__all__ = [
    "Dispatch",
    "MaskLike",
    "Problem",
    "attention",
    "attention_weights",
    "dispatch",
    "merge_attention",
    "problem",
    "row_scores",
    "torch_inputs",
]


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
    rules are in :mod:`qkv.core.dispatch` and ``docs/kernels.md``; ``path`` names the code
    that runs (for the tiled kernel: its PyTorch loop, torch's flash calls or qkv's native
    kernel).

    Example:
        >>> import torch, qkv
        >>> x = torch.randn(1, 2, 8, 4)
        >>> qkv.dispatch(x, x, x, mask=qkv.masks.causal()).backend
        'sdpa'
        >>> print(qkv.dispatch(x, x, x, return_weights=True))  # doctest: +NORMALIZE_WHITESPACE
        reference: the attention weights asked for: only the materialised reference kernel
        provides them
    """
    prep = prepare(
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
    )
    choice = prep.choice
    if (
        _plain_applies(
            query,
            key,
            value,
            mask,
            scale,
            dropout_p,
            return_weights,
            return_lse,
            backend,
            score_mod,
            q_offset,
        )
        is not None
    ):
        why = f"{choice.reason}; attention() takes the decode fast path to it (rule 'plain')"
        return dataclasses.replace(choice, reason=why)
    return choice


#: the kernels, by the backend the dispatch names
KERNELS: dict[str, Callable[[Lowered], Result]] = {
    "reference": reference.run,
    "sdpa": sdpa.run,
    "tiled": tiled.run,
    "flex": flex.run,
}


@overload
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
    return_weights: Literal[False] = False,
    return_lse: Literal[False] = False,
    backend: Backend = "auto",
    score_mod: ScoreMod | Callable[..., Any] | None = None,
) -> torch.Tensor: ...


@overload
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
) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


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
) -> torch.Tensor | tuple[torch.Tensor, ...]:
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
    listening = listeners()
    if not listening:
        scale_ = _plain_applies(
            query,
            key,
            value,
            mask,
            scale,
            dropout_p,
            return_weights,
            return_lse,
            backend,
            score_mod,
            q_offset,
        )
        if scale_ is not None:  # the decode fast path (qkv.core.dispatch.plain)
            return sdpa.sdpa(query, key, value, mask=None, is_causal=False, scale=scale_)
    # A qkv.heads.record() block keeps every call's inputs and log-sum-exp. There, "auto"
    # picks a backend that returns the log-sum-exp (the tiled kernel: no T_q × T_k).
    lse_for_listeners = bool(listening and backend == "auto" and dropout_p == 0)
    prep = prepare(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        q_offset=q_offset,
        dropout_p=dropout_p,
        generator=generator,
        return_weights=return_weights,
        return_lse=return_lse or lse_for_listeners,
        backend=backend,
        score_mod=score_mod,
    )
    p, choice = prep.p, prep.choice
    q, k, v = p.to4d(query), p.to4d(key), p.to4d(value)
    if p.T_k == 0:  # no keys at all: every row is fully masked
        result = Result(
            q.new_zeros(p.B, p.H, p.T_q, p.D_v),
            torch.full((p.B, p.H, p.T_q), float("-inf"), device=q.device),
            q.new_zeros(p.B, p.H, p.T_q, 0),
        )
    elif choice.compiled is not None:  # while tracing: the tiled kernel as one opaque op
        result = Result(*compiled.tiled_op(q, k, v, choice.compiled, p))
    else:
        call = lowered(
            prep,
            q,
            k,
            v,
            dropout_p=dropout_p,
            generator=generator,
            need_lse=return_lse or lse_for_listeners,
        )
        result = KERNELS[choice.backend](call)
    for listener in listening:
        listener.add(
            query,
            key,
            value,
            None if result.lse is None else p.restore(result.lse),
            mask=mask,
            scale=scale,
            q_offset=q_offset,
            score_mod=score_mod,
        )
    extras = ([result.weights] if return_weights else []) + ([result.lse] if return_lse else [])
    if not extras:
        return p.restore(result.out)
    return tuple(p.restore(x) for x in [result.out, *extras])


def _plain_applies(
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    scale: Any,
    dropout_p: float,
    return_weights: bool,
    return_lse: bool,
    backend: str,
    score_mod: Any,
    q_offset: Any,
) -> float | None:
    """The scale of the decode fast path (:func:`qkv.core.dispatch.plain`), or None: a call
    with no option set and tensors it takes."""
    if (
        dropout_p
        or return_weights
        or return_lse
        or backend != "auto"
        or score_mod is not None
        or q_offset is not None
        or torch.compiler.is_compiling()  # (and a graph cannot read the knobs' ContextVar)
    ):
        return None
    return plain(query, key, value, mask, scale, tuning())


def problem(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: MaskLike = None,
    scale: float | None = None,
    q_offset: int | None = None,
) -> Problem:
    """The sizes of a call as :func:`attention` sees them, validated the same way: the
    layout the caller used (``rank``), B, H, H_kv, T_q, T_k, D, D_v, ``q_offset`` and
    ``scale``, with ``to4d``/``restore`` between the caller's layout and (B, H, T, ·)."""
    mask = torch_inputs(mask, query=query, key=key, value=value)
    return check_attention(query, key, value, mask=mask, scale=scale, q_offset=q_offset)


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
        dense = dense_mask(mask, p, query.device)
        assert dense is not None
        allowed = dense.expand(p.B, p.H, p.T_q, p.T_k)[:, hs][:, :, rs]
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
