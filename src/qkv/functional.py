"""The functional core. :func:`attention` validates, dispatches to a kernel and restores
the caller's layout, and :func:`dispatch` says which kernel would run, and why.
:func:`problem` gives a call's validated sizes. The tools that work from the log-sum-exp
(exact weights, merging) are in :mod:`qkv.lse`.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal, ParamSpec, TypeVar, overload

import torch

from ._checks import Problem, check_attention
from .core import compiled
from .core.call import Backend, Call, torch_inputs
from .core.dispatch import Dispatch, choose
from .core.lowering import lower
from .core.record import editors, listeners, served
from .kernels import Lowered, Result, flex, paged, reference, sdpa, tiled
from .kernels.contract import with_sinks
from .masks import MaskLike
from .scores import ScoreMod

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "Dispatch",
    "MaskLike",
    "Problem",
    "attention",
    "dispatch",
    "problem",
    "run",
    "torch_inputs",
]


def _arguments_of(f: Callable[P, object]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Give the decorated function ``f``'s parameters: to type checkers (a ParamSpec) and
    to ``help()`` (its ``__signature__``, with the decorated function's own return type)."""

    def take(g: Callable[..., R]) -> Callable[P, R]:
        signature = inspect.signature(f)
        returns = inspect.signature(g).return_annotation
        g.__signature__ = signature.replace(return_annotation=returns)  # type: ignore[attr-defined]
        return g

    return take


def _call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """``Call.of(*args, **kwargs)``, where arguments that do not bind (an unknown keyword, a
    missing tensor) are a TypeError naming the public function ``name``, not ``Call.of``."""
    try:
        return Call.of(*args, **kwargs)
    except TypeError as e:
        if e.__traceback__ is not None and e.__traceback__.tb_next is None:  # did not bind
            raise TypeError(str(e).replace("Call.of()", f"qkv.{name}()")) from None
        raise


@_arguments_of(Call.of)
def dispatch(*args: Any, **kwargs: Any) -> Dispatch:
    """Which kernel :func:`attention` would run on these arguments, and why.

    Takes the same arguments as :func:`attention` (written once, in
    :meth:`qkv.core.call.Call.of`) and validates them the same way. The
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
    return choose(_call("dispatch", args, kwargs))


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


@_arguments_of(Call.of)
def attention(*args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
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
    weights, lse = kwargs.get("return_weights", False), kwargs.get("return_lse", False)
    if listening and kwargs.get("backend", "auto") == "auto" and not kwargs.get("dropout_p"):
        # A qkv.heads.record() block keeps every call's log-sum-exp: there "auto" picks a
        # backend that returns it (the tiled kernel: no T_q × T_k).
        kwargs["return_lse"] = True
    call = _call("attention", args, kwargs)
    result = run(call, choose(call))
    out = result.out
    if listening or edits:
        given = inspect.signature(Call.of).bind(*args, **kwargs)
        given.apply_defaults()
        out = served(out, result.lse, given.arguments, call.p.restore)
    extras = ([result.weights] if weights else []) + ([result.lse] if lse else [])
    if not extras:
        return call.p.restore(out)
    return tuple(call.p.restore(x) for x in [out, *extras])


def run(call: Call, choice: Dispatch) -> Result:
    """Run the chosen kernel on a call. The decode fast path is one call of torch's fused
    kernel (or, for a bfloat16 step over many keys, of qkv's paged decode kernel), a call
    with no key gives zeros (every row is fully masked), and while tracing the compiled
    tiled op runs. Any other call is lowered for its kernel
    (:func:`qkv.core.lowering.lower`)."""
    q, k, v, p = call.q, call.k, call.v, call.p
    if call.fast_scale is not None:  # rule "plain"
        if choice.backend == "paged":
            return Result(paged.decode_rows(q, k, v, call.fast_scale))
        return Result(sdpa.sdpa(q, k, v, mask=None, is_causal=False, scale=call.fast_scale))
    if p.T_k == 0:
        empty = Result(
            q.new_zeros(p.B, p.H, p.T_q, p.D_v),
            torch.full((p.B, p.H, p.T_q), float("-inf"), device=q.device),
            q.new_zeros(p.B, p.H, p.T_q, 0),
        )
        return with_sinks(empty, call.sinks)
    if choice.compiled is not None:  # while tracing: the tiled kernel as one opaque op
        return with_sinks(Result(*compiled.tiled_op(q, k, v, choice.compiled, p)), call.sinks)
    return KERNELS[choice.backend](lower(call, choice))


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
