"""The functional core: :func:`attention` validates, dispatches to a kernel and restores
the caller's layout; :func:`dispatch` says which kernel would run, and why.
:func:`problem` gives a call's validated sizes. The tools that work from the log-sum-exp
(exact weights, merging) are in :mod:`qkv.lse`.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, overload

import torch

from ._checks import Problem, check_attention
from .core import compiled
from .core.call import lowered, prepare, torch_inputs
from .core.dispatch import Dispatch, plain
from .core.record import editors, listeners
from .kernels import Lowered, Result, flex, reference, sdpa, tiled
from .kernels.contract import with_sinks
from .masks import MaskLike
from .scores import ScoreMod
from .tuning import tuning

Backend = Literal["auto", "reference", "sdpa", "tiled", "flex"]

__all__ = ["Dispatch", "MaskLike", "Problem", "attention", "dispatch", "problem", "torch_inputs"]


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
    sinks: torch.Tensor | None = None,
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
        sinks=sinks,
    )
    choice = prep.choice
    if sinks is None and (
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
    sinks: torch.Tensor | None = None,
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
    sinks: torch.Tensor | None = None,
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
    sinks: torch.Tensor | None = None,
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
        sinks: attention sinks, a floating (H,) tensor: one logit per query head, a key with
            no value in every row's softmax (gpt-oss's learned sinks); or (B|1, H|1, T_q|1),
            one per row (sinks computed from the input). The weights then sum
            to less than 1 (``out`` shrinks by ``exp(lse₀ − lse)``), the log-sum-exp includes
            them, a fully masked row gives out 0 with lse = the sink, and gradients reach
            them (they must be differentiable: pass a parameter). In the units of the
            scaled, modified scores.

    Returns:
        ``out`` of shape (…, T_q, D_v), or ``(out, weights?, lse?)`` in that order when
        either is asked for. Fully masked rows give out 0, weights 0 and lse -inf (the
        sink's logit with sinks).

    Raises:
        ValueError, TypeError: bad input, naming the argument and its expected and actual
            shapes; or a backend that cannot provide what was asked.

    Example:
        >>> import torch, qkv
        >>> q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 3)
        >>> qkv.attention(q, k, v, mask=qkv.masks.causal()).shape
        torch.Size([2, 4, 5, 3])
    """
    listening, edits = listeners(), editors()
    if not listening and not edits and sinks is None:
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
        sinks=sinks,
    )
    p, choice = prep.p, prep.choice
    q, k, v = p.to4d(query), p.to4d(key), p.to4d(value)
    if p.T_k == 0:  # no keys at all: every row is fully masked
        result = with_sinks(
            Result(
                q.new_zeros(p.B, p.H, p.T_q, p.D_v),
                torch.full((p.B, p.H, p.T_q), float("-inf"), device=q.device),
                q.new_zeros(p.B, p.H, p.T_q, 0),
            ),
            sinks,
        )
    elif choice.compiled is not None:  # while tracing: the tiled kernel as one opaque op
        result = with_sinks(Result(*compiled.tiled_op(q, k, v, choice.compiled, p)), sinks)
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
    out = result.out
    for edit in edits:  # qkv.heads.ablate and other editors of the heads' outputs
        edited = edit(out)
        if edited.shape != out.shape:
            raise ValueError(
                f"an attention output editor returned shape {tuple(edited.shape)}; "
                f"it must keep the output's {tuple(out.shape)}"
            )
        out = edited
    extras = ([result.weights] if return_weights else []) + ([result.lse] if return_lse else [])
    if not extras:
        return p.restore(out)
    return tuple(p.restore(x) for x in [out, *extras])


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
