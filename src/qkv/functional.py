"""The functional core: :func:`attention` validates, dispatches to a kernel and restores
the caller's layout. :func:`dispatch` says which kernel would run, and why.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

import numpy as np
import torch

from ._checks import Problem, check_attention
from .kernels.reference import reference
from .kernels.sdpa import sdpa
from .masks import Mask, _Causal

Backend = Literal["auto", "reference", "sdpa"]
MaskLike = Union[Mask, torch.Tensor, np.ndarray, None]
BACKENDS: tuple[str, ...] = ("auto", "reference", "sdpa")


@dataclass(frozen=True)
class Dispatch:
    """Which kernel runs an attention call, and why, in words."""

    backend: str
    reason: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.reason}"


def _choose(p: Problem, mask: MaskLike, key: torch.Tensor, *, dropout_p: float, generator: Any,
            return_weights: bool, return_lse: bool, backend: str) -> Dispatch:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; "
                         f"got {backend!r}")
    needs = [what for what, asked in (
        ("the attention weights", return_weights),
        ("the log-sum-exp", return_lse),
        ("dropout from a torch.Generator", dropout_p > 0 and generator is not None),
    ) if asked]
    if backend == "reference":
        return Dispatch("reference", "requested with backend='reference'")
    if backend == "sdpa":
        if needs:
            raise ValueError(f"backend='sdpa' cannot give {' and '.join(needs)}; "
                             "use backend='reference' or 'auto'")
        return Dispatch("sdpa", "requested with backend='sdpa'")
    if needs:
        return Dispatch("reference", f"{' and '.join(needs)} asked for: only the "
                        "materialised reference kernel provides them")
    if mask is None:
        return Dispatch("sdpa", "no mask: torch's fused kernel is the fastest dense path")
    if not torch.isfinite(key).all():
        return Dispatch("reference", "key holds NaN or inf and a mask is given: torch's fused "
                        "kernel would spread it into rows that mask that key out")
    if _is_top_left_causal(p, mask):
        return Dispatch("sdpa", "causal with T_q == T_k: torch's fused kernel with is_causal")
    return Dispatch("sdpa", f"mask {_describe(mask)} passed to torch's fused kernel as a "
                    f"dense bool mask of (B, H, T_q, T_k) = ({p.B}, {p.H}, {p.T_q}, {p.T_k})")


def _describe(mask: MaskLike) -> str:
    return repr(mask) if isinstance(mask, Mask) else f"tensor{tuple(mask.shape)}"


def _is_top_left_causal(p: Problem, mask: MaskLike) -> bool:
    return isinstance(mask, _Causal) and p.q_offset == 0 and p.T_q == p.T_k


def _dense(mask: MaskLike, p: Problem, device: torch.device) -> torch.Tensor | None:
    """The mask as a bool (B, H, T_q, T_k) tensor (a broadcast view), or None."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        return mask.dense(p.B, p.H, p.T_q, p.T_k, q_offset=p.q_offset, device=device)
    return p.to4d(mask.expand(p.mask_shape))


def _prepare(query: Any, key: Any, value: Any, *, mask: Any, scale: float | None,
             q_offset: int | None, dropout_p: float, **choice: Any
             ) -> tuple[Problem, MaskLike, Dispatch]:
    """Validate one call (the torch side of it, then the shared checks) and choose a kernel."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (use qkv.numpy for arrays); "
                            f"got {type(x).__name__}")
    if isinstance(mask, np.ndarray):
        mask = torch.from_numpy(mask).to(query.device)
    if mask is not None and not isinstance(mask, (Mask, torch.Tensor)):
        raise TypeError(f"mask must be a qkv mask or a bool tensor; got {type(mask).__name__}")
    p = check_attention(query, key, value, mask=mask, scale=scale, q_offset=q_offset,
                        dropout_p=dropout_p)
    return p, mask, _choose(p, mask, key, dropout_p=dropout_p, **choice)


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
) -> Dispatch:
    """Which kernel :func:`attention` would run on these arguments, and why.

    Takes the same arguments as :func:`attention` and validates them the same way.

    Example:
        >>> import torch, qkv
        >>> x = torch.randn(1, 2, 8, 4)
        >>> qkv.dispatch(x, x, x, mask=qkv.masks.causal()).backend
        'sdpa'
        >>> print(qkv.dispatch(x, x, x, return_weights=True))
        reference: the attention weights asked for: only the materialised reference kernel provides them
    """
    return _prepare(query, key, value, mask=mask, scale=scale, q_offset=q_offset,
                    dropout_p=dropout_p, generator=generator, return_weights=return_weights,
                    return_lse=return_lse, backend=backend)[2]


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
) -> Any:
    """Scaled dot-product attention: ``softmax(Q Kᵀ · scale, masked) V``.

    Args:
        query: (T_q, D), (B, T_q, D) or (B, H, T_q, D).
        key: (T_k, D), (B, T_k, D) or (B, H_kv, T_k, D); H % H_kv == 0 and query head h
            reads key/value head h // (H // H_kv) (GQA; H_kv = 1 is MQA).
        value: the layout of key, with last dim D_v (may differ from D).
        mask: a :mod:`qkv.masks` mask, or a bool tensor/array (True = may attend)
            broadcastable to (T_q, T_k), (B, T_q, T_k) or (B, H, T_q, T_k) as the inputs'
            layout. None attends everywhere.
        scale: multiplies the scores; default 1/sqrt(D).
        q_offset: absolute position of query 0 for position-based masks; default
            T_k - T_q (bottom-right, as a KV cache needs).
        dropout_p: probability of dropping an attention weight (kept ones scaled by
            1/(1 - p)). Applied whenever > 0: modules pass 0 in eval mode.
        generator: makes dropout reproducible.
        return_weights: also return the (…, T_q, T_k) weights applied to value (after
            dropout, so ``out == weights @ value``).
        return_lse: also return the (…, T_q) log-sum-exp of the scaled, masked scores
            (float32 for half-precision inputs).
        backend: "auto" (see :func:`dispatch`), "reference" or "sdpa".

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
    p, mask, choice = _prepare(query, key, value, mask=mask, scale=scale, q_offset=q_offset,
                               dropout_p=dropout_p, generator=generator,
                               return_weights=return_weights, return_lse=return_lse,
                               backend=backend)
    q, k, v = p.to4d(query), p.to4d(key), p.to4d(value)
    weights = lse = None
    if p.T_k == 0:  # no keys at all: every row is fully masked
        out = q.new_zeros(p.B, p.H, p.T_q, p.D_v)
        weights = q.new_zeros(p.B, p.H, p.T_q, 0)
        lse = torch.full((p.B, p.H, p.T_q), float("-inf"), device=q.device)
    elif choice.backend == "sdpa":
        causal = _is_top_left_causal(p, mask)
        out = sdpa(q, k, v, mask=None if causal else _dense(mask, p, q.device),
                   is_causal=causal, scale=p.scale, dropout_p=dropout_p)
    else:
        out, weights, lse = reference(q, k, v, mask=_dense(mask, p, q.device), scale=p.scale,
                                      dropout_p=dropout_p, generator=generator)
    extras = ([weights] if return_weights else []) + ([lse] if return_lse else [])
    if not extras:
        return p.restore(out)
    return tuple(p.restore(x) for x in [out, *extras])
