"""Score modifications: ``mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled
scores before the mask.

Attention computes ``softmax(mask(mod(Q Kᵀ · scale))) V``: a modification sees each score
already multiplied by ``scale`` (pass ``scale=1.0`` for models that do not scale, like T5),
and a masked position is ``-inf`` whatever the modification made of it. Positions are
absolute, like the masks' predicates: query ``i`` sits at ``q_offset + i``, key ``j`` at
``j``. Index arguments arrive as broadcastable integer arrays of shapes (B, 1, 1, 1),
(1, H, 1, 1), (1, 1, T_q, 1) and (1, 1, 1, T_k) (a kernel passes only the tile it computes),
NumPy in :mod:`qkv.numpy` and torch in :func:`qkv.attention`.

Modifications compose in order with :func:`chain` (or ``first.then(second)``):
``chain(alibi(s), softcap(50.0))`` adds the ALiBi bias, then caps. An additive modification
(:func:`alibi`, :func:`relative_bias`, :func:`bias`) is ``score + term(b, h, q_idx, kv_idx)``,
which torch's fused kernel takes as a float mask; the others run on the kernels that apply
them tile by tile.

Legend: B batch · H query heads · T_q/T_k query/key length.

Example:
    >>> import torch, qkv
    >>> from qkv import scores
    >>> q = k = v = torch.randn(1, 4, 6, 8)
    >>> mod = scores.alibi(scores.alibi_slopes(4)).then(scores.softcap(20.0))
    >>> mod
    chain(alibi(4 heads), softcap(20.0))
    >>> qkv.attention(q, k, v, mask=qkv.masks.causal(), score_mod=mod).shape
    torch.Size([1, 4, 6, 8])
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ._checks import fmt_shape

ScoreFunction = Callable[[Any, Any, Any, Any, Any], Any]

__all__ = ["ScoreMod", "alibi", "alibi_slopes", "bias", "chain", "function", "relative_bias",
           "relative_position_bucket", "softcap"]


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
            raise ValueError(f"the score function reads a tensor of shape {tuple(var.shape)} "
                             "that requires a gradient but is not listed: pass it with "
                             "qkv.scores.function(fn, tensors=[...])")
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

    def __call__(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.apply(score, b, h, q_idx, kv_idx, q_idx)

    def apply(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any) -> Any:
        """The modified score. ``row`` is each query's index within the call (``q_idx`` minus
        the call's ``q_offset``): what a bias tensor of the call's shape is indexed by."""
        return score + self.term(b, h, q_idx, kv_idx, row, like=score)

    def term(self, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any, *, like: Any) -> Any:
        """The added term of an additive modification, in ``like``'s array type."""
        raise NotImplementedError(f"{self!r} is not additive")

    def apply_(self, score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any
               ) -> torch.Tensor:
        """:meth:`apply`, free to overwrite ``score`` (a kernel's own tile): no copy."""
        if self.additive:
            return score.add_(self.term(b, h, q_idx, kv_idx, row, like=score))
        return self.apply(score, b, h, q_idx, kv_idx, row)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the modification reads (a learnable table receives its gradient)."""
        return ()

    def vjp(self, ds: torch.Tensor, score: torch.Tensor, b: Any, h: Any, q_idx: Any,
            kv_idx: Any, row: Any, *, need: bool) -> tuple[torch.Tensor, list[Any]]:
        """Backward through the modification on one (B, H, r, c) tile of scores, whose
        index arrays are those of :meth:`apply`: given ``ds``, the gradient w.r.t. the
        modified scores, the gradient w.r.t. ``score`` and, if ``need``, one per tensor of
        :meth:`tensors` (else Nones). Written out rather than taken from autograd: the tiled
        kernel also runs inside a compiled custom op, where autograd does not record.
        This default is an additive modification's: ``ds`` passes through."""
        return ds, self._term_grads(ds, b, h, q_idx, kv_idx, row) if need else [
            None] * len(self.tensors())

    def _term_grads(self, ds, b, h, q_idx, kv_idx, row) -> list[torch.Tensor]:
        raise NotImplementedError(f"{self!r} has no backward")

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        """Raise ValueError if this modification cannot apply to these sizes."""

    def then(self, other: ScoreMod) -> ScoreMod:
        """This modification, then ``other`` on its result."""
        return chain(self, other)


class _Alibi(ScoreMod):
    additive = shift_invariant = True

    def __init__(self, slopes: Any) -> None:
        slopes = torch.as_tensor(slopes)
        if slopes.ndim != 1 or not slopes.is_floating_point():
            raise TypeError(f"alibi slopes must be a 1-d float tensor, one per head (H,); "
                            f"got {slopes.dtype} of shape {fmt_shape(slopes.shape)}")
        self.slopes = slopes

    def validate(self, B, H, T_q, T_k):
        if self.slopes.shape[0] != H:
            raise ValueError(f"alibi slopes must have shape (H,) = ({H},); "
                             f"got {fmt_shape(self.slopes.shape)}")

    def term(self, b, h, q_idx, kv_idx, row, *, like):
        # -slope · distance: a key d positions back costs slope · d (positive for future keys).
        return _like(self.slopes, like)[h] * (kv_idx - q_idx)

    def _term_grads(self, ds, b, h, q_idx, kv_idx, row):
        per_head = (ds * (kv_idx - q_idx)).sum(dim=(0, 2, 3))  # (len(h),)
        return [_scatter(self.slopes, (h.reshape(-1),), per_head)]

    def tensors(self):
        return (self.slopes,)


    def __repr__(self) -> str:
        return f"alibi({self.slopes.shape[0]} heads)"


class _Softcap(ScoreMod):
    def __init__(self, cap: float) -> None:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (
                math.isfinite(cap) and cap > 0):
            raise ValueError(f"softcap cap must be a finite number > 0; got {cap!r}")
        self.cap = float(cap)

    def apply(self, score, b, h, q_idx, kv_idx, row):
        xp = np if _numpy(score) else torch
        capped = self.cap * xp.tanh(score / self.cap)
        # A score a bias already masked (-inf) stays masked, not -cap.
        return xp.where(score == -math.inf, score, capped)

    def apply_(self, score, b, h, q_idx, kv_idx, row):
        if bool(score.amin() == -math.inf):  # a bias masked some: keep them -inf
            return self.apply(score, b, h, q_idx, kv_idx, row)
        # cap·tanh(x/cap) = 2·cap·sigmoid(2x/cap) - cap, in place: a quarter of torch.tanh's
        # cost on CPU, within a few units of cap's last place (the capped score's own rounding).
        return score.mul_(2.0 / self.cap).sigmoid_().mul_(2.0 * self.cap).sub_(self.cap)

    def vjp(self, ds, score, b, h, q_idx, kv_idx, row, *, need):
        t = torch.tanh(score / self.cap)  # 1 - tanh² is 0 at a -inf score: no NaN
        return ds * (1 - t * t), []


    def __repr__(self) -> str:
        return f"softcap({self.cap!r})"


def relative_position_bucket(relative_position: Any, *, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> Any:
    """T5's bucket of each relative position ``kv_idx - q_idx`` (NumPy or torch integers).

    Half the buckets (all of them if not ``bidirectional``, where future keys share bucket 0)
    hold exact distances up to ``num_buckets // 4`` (// 2); the rest grow logarithmically up
    to ``max_distance``; farther keys share the last bucket. Computed from a table made once
    in float32, as T5 computes it, so NumPy and torch agree bucket for bucket.
    """
    table = _bucket_table(bool(bidirectional), int(num_buckets), int(max_distance))
    idx = relative_position.clip(-max_distance, max_distance) + max_distance
    if _numpy(relative_position):
        return table[idx]
    return torch.as_tensor(table, device=relative_position.device)[idx]


@functools.lru_cache(maxsize=16)
def _bucket_table(bidirectional: bool, num_buckets: int, max_distance: int) -> np.ndarray:
    """Bucket of every relative position in [-max_distance, max_distance], computed in
    float32 torch arithmetic as T5 computes it."""
    rel = torch.arange(-max_distance, max_distance + 1)
    offset = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        offset = (rel > 0).long() * num_buckets
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)  # future keys: distance 0
    exact = num_buckets // 2
    # Logarithmic buckets past the exact ones (log(0) is never used: those are exact).
    far = exact + (torch.log(dist.clamp(min=1).float() / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).long()
    table = offset + torch.where(dist < exact, dist, far.clamp(max=num_buckets - 1))
    table = table.numpy()
    return table


class _RelativeBias(ScoreMod):
    additive = shift_invariant = True

    def __init__(self, table: torch.Tensor, bidirectional: bool, max_distance: int) -> None:
        if not isinstance(table, torch.Tensor) or table.ndim != 2 or not table.is_floating_point():
            raise TypeError("relative_bias table must be a float tensor of shape "
                            f"(num_buckets, H); got {getattr(table, 'shape', type(table))}")
        self.table, self.bidirectional = table, bool(bidirectional)
        self.max_distance = int(max_distance)
        if self.table.shape[0] < (4 if self.bidirectional else 2) or self.max_distance < 1:
            raise ValueError(f"relative_bias needs at least {4 if bidirectional else 2} buckets "
                             f"and max_distance >= 1; got {self.table.shape[0]} and "
                             f"{max_distance}")

    def validate(self, B, H, T_q, T_k):
        if self.table.shape[1] != H:
            raise ValueError(f"relative_bias table must have shape (num_buckets, H) with H={H}; "
                             f"got {fmt_shape(self.table.shape)}")

    def term(self, b, h, q_idx, kv_idx, row, *, like):
        bucket = relative_position_bucket(kv_idx - q_idx, bidirectional=self.bidirectional,
                                          num_buckets=self.table.shape[0],
                                          max_distance=self.max_distance)
        return _like(self.table, like)[bucket, h]  # (1, H, T_q, T_k)

    def _term_grads(self, ds, b, h, q_idx, kv_idx, row):
        bucket = relative_position_bucket(kv_idx - q_idx, bidirectional=self.bidirectional,
                                          num_buckets=self.table.shape[0],
                                          max_distance=self.max_distance)
        return [_scatter(self.table, (bucket, h), ds.sum(dim=0, keepdim=True))]

    def tensors(self):
        return (self.table,)


    def __repr__(self) -> str:
        return (f"relative_bias({self.table.shape[0]} buckets, {self.table.shape[1]} heads, "
                f"bidirectional={self.bidirectional}, max_distance={self.max_distance})")


class _Bias(ScoreMod):
    additive = True

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"bias must be a float tensor; got "
                            f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        if tensor.ndim not in (2, 4):
            raise ValueError(f"bias must have shape (T_q, T_k) or (B, H, T_q, T_k) (size-1 "
                             f"dims broadcast); got {fmt_shape(tensor.shape)}")
        self.tensor = tensor if tensor.ndim == 4 else tensor[None, None]

    def validate(self, B, H, T_q, T_k):
        want = (B, H, T_q, T_k)
        if any(n not in (1, w) for n, w in zip(self.tensor.shape, want)):
            raise ValueError(f"bias must broadcast to (B, H, T_q, T_k) = {fmt_shape(want)}; "
                             f"got {fmt_shape(self.tensor.shape)}")
        if not torch.compiler.is_compiling() and bool(
                (torch.isnan(self.tensor) | (self.tensor == math.inf)).any()):
            raise ValueError("bias holds NaN or +inf; -inf (masked) and finite values only")

    def term(self, b, h, q_idx, kv_idx, row, *, like):
        t = _like(self.tensor, like)
        n = t.shape
        return t[_index(n[0], b), _index(n[1], h), _index(n[2], row), _index(n[3], kv_idx)]

    def _term_grads(self, ds, b, h, q_idx, kv_idx, row):
        n = self.tensor.shape
        # Sum over the dims the bias broadcasts along, then scatter onto the rest.
        ds = ds.sum(dim=[d for d in range(4) if n[d] == 1], keepdim=True)
        where = tuple(i if m != 1 else torch.zeros((), dtype=torch.long, device=ds.device)
                      for m, i in zip(n, (b, h, row, kv_idx)))
        return [_scatter(self.tensor, where, ds)]

    def tensors(self):
        return (self.tensor,)


    def __repr__(self) -> str:
        return f"bias(tensor{tuple(self.tensor.shape)})"


class _Function(ScoreMod):
    def __init__(self, fn: ScoreFunction, name: str | None, tensors: Sequence[torch.Tensor]
                 ) -> None:
        if not callable(fn):
            raise TypeError(f"a score function must be callable; got {type(fn).__name__}")
        self.fn, self.name = fn, name or getattr(fn, "__name__", "function")
        self._tensors = tuple(tensors)

    def apply(self, score, b, h, q_idx, kv_idx, row):
        out = self.fn(score, b, h, q_idx, kv_idx)
        shape = tuple(getattr(out, "shape", ()))
        if len(shape) > score.ndim or any(
                n not in (1, m) for n, m in zip(shape[::-1], tuple(score.shape)[::-1])):
            raise ValueError(f"score function {self.name} must return the score's shape "
                             f"{fmt_shape(score.shape)}; got "
                             f"{fmt_shape(shape)}")
        return out

    def tensors(self):
        return self._tensors

    def vjp(self, ds, score, b, h, q_idx, kv_idx, row, *, need):
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

    def apply(self, score, b, h, q_idx, kv_idx, row):
        for m in self.mods:
            score = m.apply(score, b, h, q_idx, kv_idx, row)
        return score

    def term(self, b, h, q_idx, kv_idx, row, *, like):
        return sum(m.term(b, h, q_idx, kv_idx, row, like=like) for m in self.mods)

    def apply_(self, score, b, h, q_idx, kv_idx, row):
        for m in self.mods:
            score = m.apply_(score, b, h, q_idx, kv_idx, row)
        return score

    def tensors(self):
        return tuple(t for m in self.mods for t in m.tensors())

    def vjp(self, ds, score, b, h, q_idx, kv_idx, row, *, need):
        inputs = [score]  # each modification's input, recomputed
        for m in self.mods[:-1]:
            inputs.append(m.apply(inputs[-1], b, h, q_idx, kv_idx, row).expand(score.shape))
        grads: list[Any] = []
        for m, x in zip(reversed(self.mods), reversed(inputs)):
            ds, g = m.vjp(ds, x, b, h, q_idx, kv_idx, row, need=need)
            grads = list(g) + grads
        return ds, grads

    def validate(self, B, H, T_q, T_k):
        for m in self.mods:
            m.validate(B, H, T_q, T_k)


    def __repr__(self) -> str:
        return f"chain({', '.join(map(repr, self.mods))})"


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's standard slopes for ``heads`` heads (Press et al., 2022): a geometric sequence
    starting at ``2^(-8/n)`` for the power of two ``n``; for other head counts, those of the
    largest power of two below, then every other slope of the next power of two. (H,) float32.
    """
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be an int >= 1; got {heads!r}")

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** int(math.floor(math.log2(heads)))
    slopes = geometric(n) + geometric(2 * n)[0::2][:heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(slopes: Any) -> ScoreMod:
    """ALiBi: ``score + slopes[h] · (kv_idx - q_idx)``, a linear penalty on distance.

    Args:
        slopes: (H,) float, one per query head; :func:`alibi_slopes` gives the standard ones.

    BLOOM adds ``slopes[h] · kv_idx`` instead: the same weights and output (softmax ignores a
    per-row constant), a log-sum-exp larger by ``slopes[h] · q_idx``.
    """
    return _Alibi(slopes)


def softcap(cap: float) -> ScoreMod:
    """Soft-capping (Gemma 2): ``cap · tanh(score / cap)``, scores squashed into (-cap, cap).
    A score already -inf stays -inf."""
    return _Softcap(cap)


def relative_bias(table: torch.Tensor, *, bidirectional: bool = True,
                  max_distance: int = 128) -> ScoreMod:
    """T5's learned relative-position bias: ``score + table[bucket(kv_idx - q_idx), h]``.

    Args:
        table: (num_buckets, H) float, e.g. ``nn.Embedding(32, H).weight``; its gradient
            flows on every backend.
        bidirectional: encoder (True) or decoder (False) buckets; see
            :func:`relative_position_bucket`.
        max_distance: distances from here on share the last bucket.
    """
    return _RelativeBias(table, bidirectional, max_distance)


def bias(tensor: torch.Tensor) -> ScoreMod:
    """An additive float bias of shape (T_q, T_k) or (B, H, T_q, T_k), size-1 dims
    broadcasting, indexed by the call's query rows (not absolute positions). ``-inf`` entries
    act as a mask, so SDPA's and Hugging Face's float masks work as they are; NaN and +inf
    are refused. Its gradient flows where it requires one."""
    return _Bias(tensor)


def function(fn: ScoreFunction, name: str | None = None,
             tensors: Sequence[torch.Tensor] = ()) -> ScoreMod:
    """Wrap ``fn(score, b, h, q_idx, kv_idx) -> score`` as a modification.

    ``fn`` must use operators (or functions of the score's own library) and return the
    score's shape. ``tensors`` lists the tensors it reads whose gradients you want: the tiled
    kernel differentiates ``fn`` with respect to those only, and refuses in the backward pass
    a tensor it reads that requires a gradient but is not listed.
    """
    return _Function(fn, name, tensors)


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
    raise TypeError(f"score_mod must be a qkv.scores modification or a callable "
                    f"fn(score, b, h, q_idx, kv_idx); got {type(mod).__name__}")
