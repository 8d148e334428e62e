"""One attention call from its arguments to its kernel: validated (:mod:`qkv._checks`),
dispatched (:mod:`qkv.core.dispatch`), and lowered (:mod:`qkv.core.lowering`). The public
functions of :mod:`qkv.functional` and the context-parallel layer both start here.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length · D head
dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._checks import Problem, check_attention
from ..kernels import Lowered
from ..masks import Mask, MaskLike
from ..scores import ScoreMod, as_score_mod
from ..tuning import Tuning, tuning
from . import compiled
from .dispatch import Ask, Dispatch, choose
from .lowering import lower


def torch_inputs(mask: Any, **tensors: Any) -> MaskLike:
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


@dataclass(frozen=True, eq=False)
class Prepared:
    """A validated call and the dispatch's choice for it."""

    p: Problem
    mask: MaskLike
    mod: ScoreMod | None
    choice: Dispatch
    tuning: Tuning
    sinks: torch.Tensor | None = None


def prepare(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any,
    scale: float | None,
    q_offset: int | None,
    dropout_p: float,
    score_mod: Any = None,
    generator: Any = None,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str = "auto",
    sinks: Any = None,
) -> Prepared:
    """Validate one call (the torch side of it, then the shared checks) and choose its
    kernel and code: by the eager rules, or, while ``torch.compile`` traces, by those that
    read no values."""
    mask = torch_inputs(mask, query=query, key=key, value=value)
    mod = as_score_mod(score_mod)
    tracing = torch.compiler.is_compiling()
    p = check_attention(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        q_offset=q_offset,
        dropout_p=dropout_p,
        validate_mask=not tracing,
    )
    if mod is not None:
        mod.validate(p.B, p.H, p.T_q, p.T_k)
    check_sinks(sinks, p, query)
    if tracing and backend == "flex":
        raise ValueError(
            "backend='flex' plans its BlockMask from the mask's values, "
            "which a torch.compile trace cannot read: call it outside the "
            "compiled function, or use backend='auto' inside"
        )
    # While tracing, the rules that read knobs are skipped, and the compiled op reads the
    # knobs in force when it runs (a graph cannot read a ContextVar).
    knobs = Tuning() if tracing else tuning()
    q, k, v = p.to4d(query), p.to4d(key), p.to4d(value)
    ask = Ask(
        p,
        mask,
        mod,
        q,
        k,
        v,
        dropout_p,
        generator,
        return_weights,
        return_lse,
        tracing,
        knobs,
        compiled.recipe(mask, mod, p, query.device) if tracing else None,
        sinks,
    )
    return Prepared(p, mask, mod, choose(ask, backend), knobs, sinks)


def check_sinks(sinks: Any, p: Problem, query: torch.Tensor) -> None:
    """Sinks are a floating tensor on the query's device: (H,), one logit per query head,
    or (B|1, H|1, T_q|1), one per row."""
    if sinks is None:
        return
    want = f"(H,) = ({p.H},) or (B|1, H|1, T_q|1) = ({p.B}|1, {p.H}|1, {p.T_q}|1)"
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        got = type(sinks).__name__ + (
            f" of {sinks.dtype}" if isinstance(sinks, torch.Tensor) else ""
        )
        raise TypeError(f"sinks must be a floating torch.Tensor of shape {want}; got {got}")
    shape = tuple(sinks.shape)
    fits = shape == (p.H,) or (
        len(shape) == 3 and all(n in (1, full) for n, full in zip(shape, (p.B, p.H, p.T_q)))
    )
    if not fits:
        raise ValueError(f"sinks must have shape {want}; got {shape}")
    if sinks.device != query.device:
        raise ValueError(f"sinks are on {sinks.device}, the query on {query.device}")


def lowered(
    prep: Prepared,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    need_lse: bool = False,
) -> Lowered:
    """The prepared call lowered for its kernel, on (B, H|H_kv, T, D) tensors."""
    return lower(
        prep.choice,
        prep.p,
        q,
        k,
        v,
        prep.mask,
        prep.mod,
        tuning=prep.tuning,
        dropout_p=dropout_p,
        generator=generator,
        need_lse=need_lse,
        sinks=prep.sinks,
    )


def tiled_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: MaskLike, scale: float | None
) -> Lowered:
    """A (B, H, T_q, D) call validated, planned and lowered for the tiled kernel, to run its
    :func:`~qkv.kernels.tiled.forward` and :func:`~qkv.kernels.tiled.backward` directly
    (context parallelism calls them per pair of shards)."""
    prep = prepare(
        q,
        k,
        v,
        mask=mask,
        scale=scale,
        q_offset=None,
        dropout_p=0.0,
        return_lse=True,
        backend="tiled",
    )
    return lowered(prep, q, k, v, need_lse=True)
