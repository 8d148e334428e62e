"""The mask base class and its algebra: a predicate over absolute positions, evaluated on a
tile, a block map or a dense tensor; ``&``, ``|``, ``~``, user predicates, and a mask seen
from a shifted window of a longer sequence.

Legend: B batch · H query heads · T_q/T_k query/key length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._checks import fmt_shape
from .._lift import lifted
from .tiles import _FAR, EMPTY, FULL, PARTIAL, _Tiles, _TorchIndex

Predicate = Callable[[Any, Any, Any, Any], Any]


class Mask:
    """Base class: a predicate ``(b, h, q_idx, kv_idx) -> bool`` with an algebra."""

    #: True if the mask depends only on ``q_idx - kv_idx`` (and b, h): a tile's pattern
    #: then depends only on its offset from the diagonal, and kernels may reuse it.
    shift_invariant = False
    #: What the mask is, by structure: "full", "causal", "sliding_window", "padding",
    #: "document", "prefix_lm", "key_indices", "predicate", "and", "or", "not" or
    #: "shifted". The dispatch reads it where a kernel has a mask built in (SDPA's
    #: ``is_causal``).
    kind = "predicate"

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        """Postfix tokens that rebuild this mask from ``tensors`` and ``ints`` (appended to
        here): how a mask crosses into the compiled tiled op (:mod:`qkv.core.compiled`), whose
        arguments are tensors, ints and strings. None for a mask data cannot rebuild (a
        user predicate)."""
        return None

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        raise NotImplementedError

    def __and__(self, other: Mask) -> Mask:
        return _And(self, other) if isinstance(other, Mask) else NotImplemented

    def __or__(self, other: Mask) -> Mask:
        return _Or(self, other) if isinstance(other, Mask) else NotImplemented

    def __invert__(self) -> Mask:
        return _Not(self)

    def shifted(self, dq: int, dk: int, T: int) -> Mask:
        """This mask as a call over a part of a longer sequence of length ``T`` sees it: its
        queries and keys sit ``dq`` and ``dk`` positions further on than the call places
        them (context-parallel attention over one shard pair). Structure, block map and
        shift-invariance carry over."""
        return _Shifted(self, dq, dk, T)

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        """Raise ValueError if this mask cannot apply to these sizes."""

    def block(
        self,
        B: int,
        H: int,
        q_start: int,
        q_stop: int,
        kv_start: int,
        kv_stop: int,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Evaluate the predicate on queries at absolute positions ``q_start..q_stop-1`` and
        keys ``kv_start..kv_stop-1``: a bool tensor that broadcasts to
        (B, H, q_stop - q_start, kv_stop - kv_start), of only the dims the mask uses."""
        xp = _TorchIndex(device)
        return self._grid(xp, B, H, xp.arange(q_start, q_stop), xp.arange(kv_start, kv_stop))

    def at(
        self, B: int, H: int, q_positions: torch.Tensor, kv_positions: torch.Tensor
    ) -> torch.Tensor:
        """Evaluate the predicate at any absolute query and key positions (1-d integer
        tensors): a bool tensor broadcastable to (B, H, len(q_positions), len(kv_positions))."""
        return self._grid(_TorchIndex(q_positions.device), B, H, q_positions, kv_positions)

    def _grid(self, xp: Any, B: int, H: int, q_positions: Any, kv_positions: Any) -> Any:
        b = xp.arange(0, B).reshape(B, 1, 1, 1)
        h = xp.arange(0, H).reshape(1, H, 1, 1)
        q = q_positions.reshape(1, 1, -1, 1)
        kv = kv_positions.reshape(1, 1, 1, -1)
        out = self(b, h, q, kv)
        shape = (B, H, q.shape[2], kv.shape[3])
        if str(getattr(out, "dtype", None)).replace("torch.", "") != "bool":
            raise TypeError(
                f"mask {self!r} must return bool; got {type(out).__name__} "
                f"of dtype {getattr(out, 'dtype', None)}"
            )
        if out.ndim > 4 or any(o not in (1, n) for o, n in zip(out.shape[::-1], shape[::-1])):
            raise ValueError(
                f"mask {self!r} returned shape {fmt_shape(out.shape)}, which does "
                f"not broadcast to (B, H, T_q, T_k) = {fmt_shape(shape)}"
            )
        return out

    def _evaluate(self, B: int, H: int, T_q: int, T_k: int, q_offset: int | None, xp: Any) -> Any:
        self.validate(B, H, T_q, T_k)
        q_offset = T_k - T_q if q_offset is None else q_offset
        out = self._grid(xp, B, H, xp.arange(q_offset, q_offset + T_q), xp.arange(0, T_k))
        return xp.broadcast_to(out, (B, H, T_q, T_k))

    def blocks(
        self,
        B: int,
        H: int,
        T_q: int,
        T_k: int,
        *,
        block_q: int,
        block_k: int,
        q_offset: int | None = None,
    ) -> np.ndarray:
        """Classify every (block_q × block_k) tile from the mask's structure alone, without
        evaluating it position by position: EMPTY (0, skip), PARTIAL (1, evaluate the
        predicate there) or FULL (2, attend everywhere). Shape (ceil(T_q / block_q),
        ceil(T_k / block_k)), int8. A mask of unknown structure (predicate) is PARTIAL."""
        t = self._tiles(B, H, T_q, T_k, block_q, block_k, q_offset)
        rows, cols = np.arange(len(t.qa))[:, None], np.arange(len(t.ka))[None, :]
        codes = self._classify(t.at(rows, cols))
        shape = (len(t.qa), len(t.ka))
        return codes if codes.shape == shape else np.broadcast_to(codes, shape).copy()

    def sparse_blocks(
        self,
        B: int,
        H: int,
        T_q: int,
        T_k: int,
        *,
        block_q: int,
        block_k: int,
        q_offset: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The non-EMPTY tiles of :meth:`blocks` as (rows, cols, codes), sorted by row and
        then column, in time and memory that grow with the tiles the mask's structure may
        leave non-empty, not with T_q × T_k: a window's band, causal's triangle, the
        documents' squares. A mask of unknown structure considers every tile."""
        t = self._tiles(B, H, T_q, T_k, block_q, block_k, q_offset)
        lo, hi = self._reach(t)
        c_lo = np.clip(lo // block_k, 0, len(t.ka))
        c_hi = np.maximum(np.clip(-(-hi // block_k), 0, len(t.ka)), c_lo)
        count = c_hi - c_lo
        rows = np.repeat(np.arange(len(t.qa)), count)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(count) - count - c_lo, count)
        codes = np.broadcast_to(self._classify(t.at(rows, cols)), rows.shape)
        keep = codes != EMPTY
        return rows[keep], cols[keep], codes[keep]

    def _tiles(
        self, B: int, H: int, T_q: int, T_k: int, block_q: int, block_k: int, q_offset: int | None
    ) -> _Tiles:
        self.validate(B, H, T_q, T_k)
        q_offset = T_k - T_q if q_offset is None else q_offset
        qa, ka = np.arange(0, T_q, block_q) + q_offset, np.arange(0, T_k, block_k)
        return _Tiles(
            qa, np.minimum(qa + block_q, q_offset + T_q) - 1, ka, np.minimum(ka + block_k, T_k) - 1
        )

    def _classify(self, t: _Tiles) -> np.ndarray:
        return np.full((), PARTIAL, dtype=np.int8)

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        """Per query block, the keys [lo, hi) (absolute positions) outside which every tile is
        EMPTY. Unknown structure reaches every key."""
        return np.full(len(t.qa), -_FAR), np.full(len(t.qa), _FAR)

    def intervals(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The keys [lo, hi) each query position of ``q`` (absolute) may attend to, as two
        (B|1, len(q)) integer arrays, when that is exactly the mask — every query's keys one
        interval: the library's masks but key_indices, ands of them, documents whose ids
        each form one run. None where it is not (or is unknown: predicates, ors, nots).
        qkv's native kernel masks a row by its interval instead of evaluating a tile."""
        return None

    def dense(
        self,
        B: int,
        H: int,
        T_q: int,
        T_k: int,
        *,
        q_offset: int | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Lower to a bool tensor of shape (B, H, T_q, T_k) (a broadcast view: no copy
        along the dimensions the mask does not depend on)."""
        return self._evaluate(B, H, T_q, T_k, q_offset, _TorchIndex(device))

    def to_numpy(
        self, B: int, H: int, T_q: int, T_k: int, *, q_offset: int | None = None
    ) -> np.ndarray:
        """Lower to a NumPy bool array of shape (B, H, T_q, T_k)."""
        return self._evaluate(B, H, T_q, T_k, q_offset, np)

    @property
    def batch(self) -> int | None:
        """The batch size B this mask is bound to (per-row lengths or ids), or None if it
        applies to any B."""
        return None

    def picture(
        self,
        T_q: int,
        T_k: int | None = None,
        *,
        q_offset: int | None = None,
        b: int = 0,
        h: int = 0,
    ) -> str:
        """A text picture for learners: one row per query of batch row ``b`` and head
        ``h``, █ = may attend, · = masked."""
        T_k = T_q if T_k is None else T_k
        B = self.batch if self.batch is not None else b + 1
        if not 0 <= b < B:
            raise ValueError(f"b must be in [0, {B}) for {self!r}; got {b}")
        grid = self.to_numpy(B, h + 1, T_q, T_k, q_offset=q_offset)[b, h]
        return "\n".join(" ".join("█" if x else "·" for x in row) for row in grid)


def _like(data: np.ndarray, ref: Any) -> Any:
    """``data`` as the array type (and device) of the index array ``ref``."""
    if isinstance(ref, torch.Tensor):
        return torch.as_tensor(data, device=ref.device)
    return data


def _ints(name: str, values: Any, ndims: tuple[int, ...]) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer) or arr.ndim not in ndims:
        raise TypeError(
            f"{name} must be integers of {' or '.join(f'{n} dims' for n in ndims)}; "
            f"got {arr.dtype} of shape {fmt_shape(arr.shape)}"
        )
    return arr.astype(np.int64)


def _short(arr: np.ndarray) -> str:
    text = np.array2string(arr, separator=", ", threshold=8, edgeitems=3)
    return text.replace("\n", "")


def _int_arg(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    return int(value)


class _Predicate(Mask):
    def __init__(self, fn: Predicate, name: str | None) -> None:
        if not callable(fn):
            raise TypeError(f"predicate must be callable; got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "predicate")

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.fn(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"predicate({self.name})"


class _Binary(Mask):
    def __init__(self, left: Mask, right: Mask) -> None:
        self.left, self.right = left, right
        self.shift_invariant = left.shift_invariant and right.shift_invariant

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        left, right = self.left.recipe(tensors, ints), self.right.recipe(tensors, ints)
        return None if left is None or right is None else [*left, *right, self.kind]

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        self.left.validate(B, H, T_q, T_k)
        self.right.validate(B, H, T_q, T_k)

    @property
    def batch(self) -> int | None:
        return self.left.batch if self.left.batch is not None else self.right.batch


class _And(_Binary):
    kind = "and"

    def _classify(self, t: _Tiles) -> np.ndarray:
        return np.minimum(self.left._classify(t), self.right._classify(t))

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        (a, b), (c, d) = self.left._reach(t), self.right._reach(t)
        return np.maximum(a, c), np.minimum(b, d)

    def intervals(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        left, right = self.left.intervals(q), self.right.intervals(q)
        if left is None or right is None:
            return None
        return np.maximum(left[0], right[0]), np.minimum(left[1], right[1])

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.left(b, h, q_idx, kv_idx) & self.right(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        wrap = lambda m: f"({m!r})" if isinstance(m, _Or) else repr(m)  # noqa: E731
        return f"{wrap(self.left)} & {wrap(self.right)}"


class _Or(_Binary):
    kind = "or"

    def _classify(self, t: _Tiles) -> np.ndarray:
        return np.maximum(self.left._classify(t), self.right._classify(t))

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        (a, b), (c, d) = self.left._reach(t), self.right._reach(t)
        return np.minimum(a, c), np.maximum(b, d)

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.left(b, h, q_idx, kv_idx) | self.right(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"{self.left!r} | {self.right!r}"


class _Not(Mask):
    kind = "not"

    def __init__(self, inner: Mask) -> None:
        self.inner = inner
        self.shift_invariant = inner.shift_invariant

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        inner = self.inner.recipe(tensors, ints)
        return None if inner is None else [*inner, "not"]

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        self.inner.validate(B, H, T_q, T_k)

    @property
    def batch(self) -> int | None:
        return self.inner.batch

    def _classify(self, t: _Tiles) -> np.ndarray:
        return (FULL - self.inner._classify(t)).astype(np.int8)

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ~self.inner(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        inner = repr(self.inner)
        return f"~({inner})" if isinstance(self.inner, (_Binary, _Not)) else f"~{inner}"


class _Shifted(Mask):
    """``inner`` seen by a call whose queries and keys sit ``dq`` and ``dk`` positions further
    on than the call places them: a part of a longer sequence of length T (context-parallel
    attention over one shard pair). Structure, block map and shift-invariance carry over."""

    kind = "shifted"

    def __init__(self, inner: Mask, dq: int, dk: int, T: int) -> None:
        self.inner, self.dq, self.dk, self.T = inner, dq, dk, T
        self.shift_invariant = inner.shift_invariant

    @property
    def batch(self) -> int | None:
        return self.inner.batch

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        self.inner.validate(B, H, self.T, self.T)

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return self.inner(b, h, q_idx + self.dq, kv_idx + self.dk)

    def _classify(self, t: _Tiles) -> np.ndarray:
        return self.inner._classify(t.shifted(self.dq, self.dk))

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.inner._reach(t.shifted(self.dq, self.dk))
        return lo - self.dk, hi - self.dk

    def intervals(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        inner = self.inner.intervals(q + self.dq)
        return None if inner is None else (inner[0] - self.dk, inner[1] - self.dk)

    def __repr__(self) -> str:
        return f"({self.inner!r} at queries +{self.dq}, keys +{self.dk})"


def predicate(fn: Predicate, name: str | None = None, *, vmap: bool = False) -> Mask:
    """Wrap any ``fn(b, h, q_idx, kv_idx) -> bool array`` as a composable mask.

    ``fn`` receives broadcastable integer index arrays of shapes (B, 1, 1, 1), (1, H, 1, 1),
    (1, 1, T_q, 1) and (1, 1, 1, T_k) holding absolute positions, and must use operators only.
    With ``vmap=True`` it is a FlexAttention ``mask_mod`` instead, written for scalar
    indices (``table[q_idx][kv_idx]``, no data-dependent ``if``): qkv lifts it with
    ``torch.vmap`` over the positions, so code written for Flex runs unchanged.
    """
    return _Predicate(lifted(fn) if vmap else fn, name or getattr(fn, "__name__", None))
