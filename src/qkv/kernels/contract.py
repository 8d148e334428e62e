"""The one contract every kernel keeps: it takes a :class:`Lowered` call and returns a
:class:`Result`.

A :class:`Lowered` call is one validated attention problem in the canonical layout, with the
mask and the score modification already in the form the chosen kernel eats (a dense bool
mask, a float mask, SDPA's ``is_causal``, a function over whole score matrices, tile objects
and a plan, or FlexAttention's block mask and ``score_mod``), made in one stage by
:func:`qkv.core.lowering.lower`. A kernel reads only the fields of its form. It neither
validates, nor chooses between paths, nor lowers.

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length · D head dim · D_v value head dim · bq a block's queries · bk a block's keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..masks import Mask
from ..tuning import Tuning

#: The code that runs a call, as :func:`qkv.dispatch` names it.
PATHS = (
    "reference",
    "sdpa",
    "sdpa-float32",
    "flex",
    "tiled-loop",
    "tiled-flash",
    "tiled-native",
    "tiled-native-widen",
    "tiled-op",
    "paged-native",
)


class MaskTiles(Protocol):
    """A mask as the tiled kernel reads it, one tile at a time:
    ``tiles(q0, q1, k0, k1)`` is a bool tensor broadcastable to (B, H, q1 - q0, k1 - k0)
    (True = may attend) for queries q0..q1-1 and keys k0..k1-1 of the call, counted from
    the start of its query and key sequences."""

    #: the pattern of a tile depends only on its offset from the diagonal (kernels may
    #: reuse one tile's pattern for every tile at that offset)
    shift_invariant: bool

    def __call__(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor: ...

    def bounds(self, q0: int, q1: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Where every query's allowed keys are one interval: for queries q0..q1-1, the keys
        [lo, hi) of each, (B|1, q1 - q0) arrays in the call's key positions (the native
        kernel masks by them, no tile evaluated); None where they are not."""
        ...


class PredicateTiles:
    """A qkv mask evaluated on one tile at a time (a :class:`MaskTiles`), for a call of B
    batches and H heads whose query 0 sits at ``q_offset``. A shift-invariant mask's tile is
    evaluated once per offset from the diagonal."""

    def __init__(self, mask: Mask, B: int, H: int, q_offset: int, device: torch.device) -> None:
        self.mask, self.B, self.H, self.q_offset, self.device = mask, B, H, q_offset, device
        self.shift_invariant = mask.shift_invariant
        self._seen: dict[tuple[int, int, int], torch.Tensor] = {}

    def __call__(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        o, B, H = self.q_offset, self.B, self.H
        if not self.shift_invariant:
            return self.mask.block(B, H, o + q0, o + q1, k0, k1, device=self.device)
        # The same pattern recurs along each diagonal: evaluate it once per call.
        key = (q1 - q0, k1 - k0, o + q0 - k0)
        if key not in self._seen:
            self._seen[key] = self.mask.block(B, H, o + q0, o + q1, k0, k1, device=self.device)
        return self._seen[key]

    def bounds(self, q0: int, q1: int) -> tuple[np.ndarray, np.ndarray] | None:
        return self.mask.intervals(np.arange(q0, q1) + self.q_offset)


class DenseTiles:
    """A dense bool mask read one tile at a time (a :class:`MaskTiles`; its size-1,
    broadcast dims kept whole)."""

    shift_invariant = False

    def __init__(self, dense: torch.Tensor) -> None:
        self.dense = dense

    def __call__(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        rows = slice(q0, q1) if self.dense.shape[-2] > 1 else slice(None)
        cols = slice(k0, k1) if self.dense.shape[-1] > 1 else slice(None)
        return self.dense[..., rows, cols]

    def bounds(self, q0: int, q1: int) -> None:
        return None  # a tensor's mask is not known to be intervals


class ModTiles(Protocol):
    """A score modification on (B, H_kv, G·bq, bk) tiles of scaled scores for queries q0..q1-1
    and keys k0..k1-1, and its backward (see :meth:`qkv.scores.ScoreMod.vjp`); ``alibi``
    and ``softcap``: its ALiBi slopes (H,) and its cap where it is ALiBi, a soft-cap, or
    ALiBi then a soft-cap, which the native kernel applies itself (else None; see
    :attr:`qkv.scores.ScoreMod.alibi`)."""

    softcap: float | None
    alibi: torch.Tensor | None

    def __call__(self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor: ...

    def vjp(
        self, ds: torch.Tensor, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int, *, need: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]: ...


@dataclass(frozen=True, eq=False)
class Lowered:
    """One call, lowered for its kernel. q (B, H, T_q, D), k (B, H_kv, T_k, D) and
    v (B, H_kv, T_k, D_v), T_k >= 1; ``path`` names the code that runs (one of
    :data:`PATHS`). The mask and modification fields hold only the chosen kernel's form;
    the others stay None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    q_offset: int
    path: str
    tuning: Tuning
    dropout_p: float = 0.0
    generator: torch.Generator | None = None
    need_lse: bool = False
    #: reference and sdpa: the mask as bool, broadcastable to (B, H, T_q, T_k)
    dense: torch.Tensor | None = None
    #: sdpa with an additive modification: its term and the mask as one float mask
    bias: torch.Tensor | None = None
    #: sdpa: its own top-left causal mask (equal to qkv's causal when T_q == T_k)
    is_causal: bool = False
    #: reference: the modification over a whole (B, H, T_q, T_k) score matrix
    modify: Callable[[torch.Tensor], torch.Tensor] | None = None
    #: tiled: what to compute (a :class:`qkv.kernels.tiled.plan.Plan`), the mask and the
    #: modification per tile, and the tensors the modification reads (gradients reach them)
    plan: Any = None
    tiles: MaskTiles | None = None
    mod_tiles: ModTiles | None = None
    mod_tensors: tuple[torch.Tensor, ...] = ()
    #: flex: FlexAttention's BlockMask and score_mod
    block_mask: Any = None
    score_mod: Callable[..., Any] | None = None
    #: attention sinks: a logit per query head (H,) or per row (B|1, H|1, T_q|1), a key
    #: with no value in every row's softmax (every kernel applies them; :func:`with_sinks`)
    sinks: torch.Tensor | None = None


@dataclass(frozen=True)
class Result:
    """What a kernel returns: out (B, H, T_q, D_v) in q's dtype, with the (B, H, T_q)
    log-sum-exp (accumulation dtype) and the (B, H, T_q, T_k) weights where the kernel
    gives them, else None. Fully masked rows give out 0, weights 0 and lse -inf (with
    sinks, the sink's logit)."""

    out: torch.Tensor
    lse: torch.Tensor | None = None
    weights: torch.Tensor | None = None


def sink_factor(lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention sinks do to a row, from its log-sum-exp alone.

    A sink is a key with logit ``sinks[h]`` and no value: it joins each row's softmax
    denominator and adds nothing to the output. So, exactly, ``lse' = logaddexp(lse, sink)``
    and every weight (hence the output) is multiplied by ``exp(lse - lse')``. A fully
    masked row (lse -inf) keeps out 0 and gets lse' = sink. A sink of +inf takes the whole
    row (factor 0, lse' +inf). Both hold with their gradients: never ``inf - inf``.

    Args:
        lse: (B, H, T_q) log-sum-exp without the sinks.
        sinks: (H,) or (B|1, H|1, T_q|1) logits, in the units of the scaled (and
            modified) scores.

    Returns:
        ``(factor, lse')``, both (B, H, T_q) in lse's dtype.
    """
    rows = sink_rows(sinks, lse.dtype)
    takes_all = rows == float("inf")  # the sink takes the row: factor 0, lse' +inf
    empty = (lse == float("-inf")) & (rows == float("-inf"))  # nothing at all: lse' -inf
    # The formula on safe stand-ins where it would compute inf - inf, and the stated
    # answers selected there, so no NaN reaches the values or their gradients.
    safe_rows = rows.masked_fill(takes_all | empty, 0.0)
    safe_lse = lse.masked_fill(empty, 0.0)
    total = torch.logaddexp(safe_lse, safe_rows)
    factor = torch.exp(safe_lse - total).masked_fill(takes_all | empty, 0.0)
    # where() passes the gradient of lse' to the sink where it takes the row (d lse'/d sink = 1)
    total = torch.where(takes_all, rows, total).masked_fill(empty, float("-inf"))
    return factor, total


def sink_rows(sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sinks as a tensor broadcastable to (B, H, T_q): (H,) becomes (1, H, 1)."""
    return sinks.to(dtype).view(1, -1, 1) if sinks.ndim == 1 else sinks.to(dtype)


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, d_lse: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient, from the log-sum-exp that includes them: each row's sink weight
    ``exp(sink − lse)`` times what reaches that row's lse through the sink
    (``d_lse`` = dlse − rowsum(dout ∘ out)), summed to the sinks' shape. A row whose lse and
    sink are both -inf contributes 0. A sink of +inf has weight 1 (it is the whole row)."""
    rows = sink_rows(sinks, lse.dtype)
    takes_all = rows == float("inf")
    weight = torch.exp(rows - lse).masked_fill(lse == float("-inf"), 0.0)
    weight = weight.masked_fill(takes_all, 1.0)
    return (weight * d_lse).sum_to_size(rows.shape).reshape(sinks.shape).to(sinks.dtype)


def with_sinks(result: Result, sinks: torch.Tensor | None) -> Result:
    """A kernel's result with the sinks applied (:func:`sink_factor`), differentiably: the
    form for kernels whose log-sum-exp autograd can carry (reference, flex)."""
    if sinks is None:
        return result
    assert result.lse is not None, "sinks need the kernel's log-sum-exp"
    factor, lse = sink_factor(result.lse, sinks)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return (x.to(factor.dtype) * factor[..., None]).to(x.dtype)

    weights = None if result.weights is None else scaled(result.weights)
    return Result(scaled(result.out), lse, weights)
