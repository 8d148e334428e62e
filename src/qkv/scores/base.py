"""The score-modification base class, user functions and chains: what every modification
gives the kernels (``apply``, an additive ``term``, ``vjp``, the tensors it reads).

Legend: B batch · H query heads · T_q/T_k query/key length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .._checks import fmt_shape
from .._lift import lifted

ScoreFunction = Callable[[Any, Any, Any, Any, Any], Any]


def _numpy(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def _like(t: torch.Tensor, score: Any) -> Any:
    """A torch tensor of the modification as the score's array type: float64 NumPy for the
    oracle, or the score's dtype and device (gradients flow through the cast)."""
    if _numpy(score):
        return t.detach().cpu().double().numpy()
    return t.to(device=score.device, dtype=score.dtype)


def _index(n: int, i: Any) -> Any:
    """Index array ``i`` into a dim of size ``n``: size-1 dims broadcast (index 0)."""
    return i if n != 1 else 0


def _scatter(t: torch.Tensor, where: tuple, values: torch.Tensor) -> torch.Tensor:
    """The gradient of ``t[where]`` (broadcasting index arrays): ``values`` summed into a
    zero tensor of t's shape and dtype."""
    grad = torch.zeros(t.shape, dtype=values.dtype, device=values.device)
    where = torch.broadcast_tensors(*[torch.as_tensor(i, device=values.device) for i in where])
    values = values.expand(where[0].shape) if where[0].ndim >= values.ndim else values
    return grad.index_put_(where, values, accumulate=True).to(t.dtype)


def _refuse_undeclared(out: torch.Tensor, declared: list[torch.Tensor]) -> None:
    """A score function that reads a tensor requiring a gradient, not listed in its
    ``tensors``, would silently leave it without one: refused."""
    ids, stack, seen = {id(t) for t in declared}, [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if var is not None and id(var) not in ids:
            raise ValueError(
                f"the score function reads a tensor of shape {tuple(var.shape)} "
                "that requires a gradient but is not listed: pass it with "
                "qkv.scores.function(fn, tensors=[...])"
            )
        stack.extend(n for n, _ in node.next_functions)


class ScoreMod:
    """Base class: ``mod(score, b, h, q_idx, kv_idx) -> score``.

    Subclasses define :meth:`apply` (or :meth:`term`, when the modification adds a term to
    the score), list the tensors it depends on in :meth:`tensors` (gradients reach those),
    and say in :meth:`validate` which sizes it fits.
    """

    #: ``mod(s) == s + term(…)``: torch's fused kernel can take it as a float mask.
    additive = False
    #: The term depends on ``kv_idx - q_idx`` (and h) only: kernels may reuse it along a
    #: diagonal, as they do a shift-invariant mask.
    shift_invariant = False
    #: What qkv's native kernel applies itself, where the modification is ALiBi (``s +
    #: slopes[h] · (kv_idx − q_idx)``), a soft-cap (``cap · tanh(s / cap)``), or ALiBi then a
    #: soft-cap, and nothing else: the slopes (H,) and the cap; None both for every other.
    alibi: torch.Tensor | None = None
    softcap: float | None = None

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.apply(score, b, h, q_idx, kv_idx, q_idx)

    def apply(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any) -> Any:
        """The modified score. ``row`` is each query's index within the call (``q_idx`` minus
        the call's ``q_offset``): what a bias tensor of the call's shape is indexed by."""
        return score + self.term(b, h, q_idx, kv_idx, row, like=score)

    def term(self, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any, *, like: Any) -> Any:
        """The added term of an additive modification, in ``like``'s array type."""
        raise NotImplementedError(f"{self!r} is not additive")

    def apply_(
        self, score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any
    ) -> torch.Tensor:
        """:meth:`apply`, free to overwrite ``score`` (a kernel's own tile): no copy."""
        if self.additive:
            return score.add_(self.term(b, h, q_idx, kv_idx, row, like=score))
        return self.apply(score, b, h, q_idx, kv_idx, row)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the modification reads (a learnable table receives its gradient)."""
        return ()

    def vjp(
        self,
        ds: torch.Tensor,
        score: torch.Tensor,
        b: Any,
        h: Any,
        q_idx: Any,
        kv_idx: Any,
        row: Any,
        *,
        need: bool,
    ) -> tuple[torch.Tensor, list[Any]]:
        """Backward through the modification on one (B, H, r, c) tile of scores, whose
        index arrays are those of :meth:`apply`: given ``ds``, the gradient w.r.t. the
        modified scores, the gradient w.r.t. ``score`` and, if ``need``, one per tensor of
        :meth:`tensors` (else Nones). Written out rather than taken from autograd: the tiled
        kernel also runs inside a compiled custom op, where autograd does not record.
        This default is an additive modification's: ``ds`` passes through."""
        return ds, self._term_grads(ds, b, h, q_idx, kv_idx, row) if need else [None] * len(
            self.tensors()
        )

    def _term_grads(
        self, ds: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any
    ) -> list[torch.Tensor]:
        raise NotImplementedError(f"{self!r} has no backward")

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        """Raise ValueError if this modification cannot apply to these sizes."""

    def then(self, other: ScoreMod) -> ScoreMod:
        """This modification, then ``other`` on its result."""
        return chain(self, other)

    @property
    def batch(self) -> int | None:
        """The batch size B this modification is bound to (a tensor with one row per batch
        element, such as ALiBi slopes (B, H)), or None where it fits any batch."""
        return None

    def select(self, b: int) -> ScoreMod:
        """This modification for batch element ``b`` alone, as a batch of one: what
        :func:`qkv.varlen_attention` applies to sequence ``b``. Gradients still reach the
        full tensors. The default, for a modification bound to no batch, is itself."""
        return self

    def stages(self) -> list[ScoreMod]:
        """The modifications applied in order: a chain's, flattened, or this one alone."""
        return [self]

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        """Postfix tokens that rebuild this modification from ``tensors`` and ``ints``
        (appended to here), for the compiled tiled op (:mod:`qkv.core.compiled`); None for a
        user function, which data cannot rebuild."""
        return None


class _Function(ScoreMod):
    def __init__(
        self, fn: ScoreFunction, name: str | None, tensors: Sequence[torch.Tensor]
    ) -> None:
        if not callable(fn):
            raise TypeError(f"a score function must be callable; got {type(fn).__name__}")
        self.fn, self.name = fn, name or getattr(fn, "__name__", "function")
        self._tensors = tuple(tensors)

    def apply(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any) -> Any:
        out = self.fn(score, b, h, q_idx, kv_idx)
        shape = tuple(getattr(out, "shape", ()))
        if len(shape) > score.ndim or any(
            n not in (1, m) for n, m in zip(shape[::-1], tuple(score.shape)[::-1])
        ):
            raise ValueError(
                f"score function {self.name} must return the score's shape "
                f"{fmt_shape(score.shape)}; got "
                f"{fmt_shape(shape)}"
            )
        if isinstance(out, torch.Tensor) and isinstance(score, torch.Tensor):
            # Computed in the call's dtype on every backend: a float64 tensor the function
            # reads does not promote a float32 call's scores (the kernels add in place).
            out = out.to(score.dtype)
        return out

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self._tensors

    def vjp(
        self,
        ds: torch.Tensor,
        score: torch.Tensor,
        b: Any,
        h: Any,
        q_idx: Any,
        kv_idx: Any,
        row: Any,
        *,
        need: bool,
    ) -> tuple[torch.Tensor, list[Any]]:
        """By autograd (eager only: a user function never reaches the compiled op)."""
        with torch.enable_grad():
            raw = score.detach().requires_grad_()
            out = self.apply(raw, b, h, q_idx, kv_idx, row).expand(raw.shape)
        learn = [t for t in self._tensors if t.requires_grad] if need else []
        _refuse_undeclared(out, [raw, *learn])
        grads = torch.autograd.grad(out, [raw, *learn], ds, allow_unused=True)
        by_id = {id(t): g for t, g in zip(learn, grads[1:])}
        d_raw = grads[0] if grads[0] is not None else torch.zeros_like(raw)
        return d_raw, [by_id.get(id(t)) for t in self._tensors]

    def __repr__(self) -> str:
        return f"function({self.name})"


class _Chain(ScoreMod):
    def __init__(self, mods: Sequence[ScoreMod]) -> None:
        self.mods = tuple(mods)
        self.additive = all(m.additive for m in self.mods)
        self.shift_invariant = all(m.shift_invariant for m in self.mods)
        stages = self.stages()
        if len(stages) == 1:  # the native kernel's form, as ScoreMod.alibi says
            self.alibi, self.softcap = stages[0].alibi, stages[0].softcap
        elif (
            len(stages) == 2
            and (stages[0].alibi is not None and stages[0].softcap is None)
            and (stages[1].softcap is not None and stages[1].alibi is None)
        ):  # ALiBi, then a soft-cap
            self.alibi, self.softcap = stages[0].alibi, stages[1].softcap

    def apply(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any) -> Any:
        for m in self.mods:
            score = m.apply(score, b, h, q_idx, kv_idx, row)
        return score

    def stages(self) -> list[ScoreMod]:
        return [s for m in self.mods for s in m.stages()]

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        parts = [m.recipe(tensors, ints) for m in self.mods]
        if any(p is None for p in parts):
            return None
        return [t for p in parts for t in p or ()] + [f"chain:{len(self.mods)}"]

    def term(self, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any, *, like: Any) -> Any:
        return sum(m.term(b, h, q_idx, kv_idx, row, like=like) for m in self.mods)

    def apply_(
        self, score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any
    ) -> torch.Tensor:
        for m in self.mods:
            score = m.apply_(score, b, h, q_idx, kv_idx, row)
        return score

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for m in self.mods for t in m.tensors())

    def vjp(
        self,
        ds: torch.Tensor,
        score: torch.Tensor,
        b: Any,
        h: Any,
        q_idx: Any,
        kv_idx: Any,
        row: Any,
        *,
        need: bool,
    ) -> tuple[torch.Tensor, list[Any]]:
        inputs = [score]  # each modification's input, recomputed
        for m in self.mods[:-1]:
            inputs.append(m.apply(inputs[-1], b, h, q_idx, kv_idx, row).expand(score.shape))
        grads: list[Any] = []
        for m, x in zip(reversed(self.mods), reversed(inputs)):
            ds, g = m.vjp(ds, x, b, h, q_idx, kv_idx, row, need=need)
            grads = list(g) + grads
        return ds, grads

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        for m in self.mods:
            m.validate(B, H, T_q, T_k)

    @property
    def batch(self) -> int | None:
        return next((m.batch for m in self.mods if m.batch is not None), None)

    def select(self, b: int) -> ScoreMod:
        return _Chain([m.select(b) for m in self.mods])

    def __repr__(self) -> str:
        return f"chain({', '.join(map(repr, self.mods))})"


def function(
    fn: ScoreFunction,
    name: str | None = None,
    tensors: Sequence[torch.Tensor] = (),
    *,
    vmap: bool = False,
) -> ScoreMod:
    """Wrap ``fn(score, b, h, q_idx, kv_idx) -> score`` as a modification.

    ``fn`` must use operators (or functions of the score's own library) and return the
    score's shape. ``tensors`` lists the tensors it reads whose gradients you want: the tiled
    kernel differentiates ``fn`` with respect to those only, and refuses in the backward pass
    a tensor it reads that requires a gradient but is not listed. With ``vmap=True`` it is
    a FlexAttention ``score_mod`` instead, written for scalars, lifted with ``torch.vmap``.
    """
    named = name or getattr(fn, "__name__", None)
    return _Function(lifted(fn) if vmap else fn, named, tensors)


def chain(*mods: ScoreMod) -> ScoreMod:
    """Apply ``mods`` in order, each to the result of the one before."""
    for m in mods:
        if not isinstance(m, ScoreMod):
            raise TypeError(f"chain takes qkv.scores modifications; got {type(m).__name__}")
    if not mods:
        raise ValueError("chain needs at least one modification")
    return mods[0] if len(mods) == 1 else _Chain(mods)


def as_score_mod(mod: Any) -> ScoreMod | None:
    """``score_mod=`` as given to an attention call: None, a modification, or a plain
    callable (wrapped with :func:`function`)."""
    if mod is None or isinstance(mod, ScoreMod):
        return mod
    if callable(mod):
        return function(mod)
    raise TypeError(
        f"score_mod must be a qkv.scores modification or a callable "
        f"fn(score, b, h, q_idx, kv_idx); got {type(mod).__name__}"
    )
