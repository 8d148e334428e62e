"""Masks as predicates over absolute positions: ``mask(b, h, q_idx, kv_idx) -> bool``.

``True`` means *may attend*. Query ``i`` sits at absolute position ``q_offset + i`` and key
``j`` at position ``j``; the default ``q_offset`` is ``T_k - T_q`` (bottom-right, what a KV
cache needs), so for ``T_q == T_k`` :func:`causal` is the usual lower triangle.

Masks compose with ``&``, ``|`` and ``~`` and lower to a dense bool tensor for given shapes.
A predicate is evaluated on broadcastable index arrays (NumPy or torch), so it is written
with operators only: ``lambda b, h, q, kv: kv <= q``.

Legend: B batch · H query heads · T_q/T_k query/key length.

Example:
    >>> from qkv import masks
    >>> m = masks.causal() & masks.sliding_window(2)
    >>> m
    causal() & sliding_window(2)
    >>> print(m.picture(4))
    █ · · ·
    █ █ · ·
    · █ █ ·
    · · █ █
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ._checks import fmt_shape

Predicate = Callable[[Any, Any, Any, Any], Any]


class Mask:
    """Base class: a predicate ``(b, h, q_idx, kv_idx) -> bool`` with an algebra."""

    #: True if the mask depends only on ``q_idx - kv_idx`` (and b, h): a tile's pattern
    #: then depends only on its offset from the diagonal, and kernels may reuse it.
    shift_invariant = False

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        raise NotImplementedError

    def __and__(self, other: Mask) -> Mask:
        return _And(self, other) if isinstance(other, Mask) else NotImplemented

    def __or__(self, other: Mask) -> Mask:
        return _Or(self, other) if isinstance(other, Mask) else NotImplemented

    def __invert__(self) -> Mask:
        return _Not(self)

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        """Raise ValueError if this mask cannot apply to these sizes."""

    def block(self, B: int, H: int, q_start: int, q_stop: int, kv_start: int, kv_stop: int,
              *, device: torch.device | str | None = None) -> torch.Tensor:
        """Evaluate the predicate on queries at absolute positions ``q_start..q_stop-1`` and
        keys ``kv_start..kv_stop-1``: a bool tensor that broadcasts to
        (B, H, q_stop - q_start, kv_stop - kv_start), of only the dims the mask uses."""
        xp = _TorchIndex(device)
        return self._grid(xp, B, H, xp.arange(q_start, q_stop), xp.arange(kv_start, kv_stop))

    def at(self, B: int, H: int, q_positions: torch.Tensor, kv_positions: torch.Tensor
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
            raise TypeError(f"mask {self!r} must return bool; got {type(out).__name__} "
                            f"of dtype {getattr(out, 'dtype', None)}")
        if out.ndim > 4 or any(o not in (1, n) for o, n in zip(out.shape[::-1], shape[::-1])):
            raise ValueError(f"mask {self!r} returned shape {fmt_shape(out.shape)}, which does "
                             f"not broadcast to (B, H, T_q, T_k) = {fmt_shape(shape)}")
        return out

    def _evaluate(self, B: int, H: int, T_q: int, T_k: int, q_offset: int | None, xp: Any) -> Any:
        self.validate(B, H, T_q, T_k)
        q_offset = T_k - T_q if q_offset is None else q_offset
        out = self._grid(xp, B, H, xp.arange(q_offset, q_offset + T_q), xp.arange(0, T_k))
        return xp.broadcast_to(out, (B, H, T_q, T_k))

    def blocks(self, B: int, H: int, T_q: int, T_k: int, *, block_q: int, block_k: int,
               q_offset: int | None = None) -> np.ndarray:
        """Classify every (block_q × block_k) tile from the mask's structure alone, without
        evaluating it position by position: EMPTY (0, skip), PARTIAL (1, evaluate the
        predicate there) or FULL (2, attend everywhere). Shape (ceil(T_q / block_q),
        ceil(T_k / block_k)), int8. A mask of unknown structure (predicate) is PARTIAL."""
        t = self._tiles(B, H, T_q, T_k, block_q, block_k, q_offset)
        rows, cols = np.arange(len(t.qa))[:, None], np.arange(len(t.ka))[None, :]
        codes = self._classify(t.at(rows, cols))
        shape = (len(t.qa), len(t.ka))
        return codes if codes.shape == shape else np.broadcast_to(codes, shape).copy()

    def sparse_blocks(self, B: int, H: int, T_q: int, T_k: int, *, block_q: int, block_k: int,
                      q_offset: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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

    def _tiles(self, B: int, H: int, T_q: int, T_k: int, block_q: int, block_k: int,
               q_offset: int | None) -> _Tiles:
        self.validate(B, H, T_q, T_k)
        q_offset = T_k - T_q if q_offset is None else q_offset
        qa, ka = np.arange(0, T_q, block_q) + q_offset, np.arange(0, T_k, block_k)
        return _Tiles(qa, np.minimum(qa + block_q, q_offset + T_q) - 1,
                      ka, np.minimum(ka + block_k, T_k) - 1)

    def _classify(self, t: _Tiles) -> np.ndarray:
        return np.full((), PARTIAL, dtype=np.int8)

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        """Per query block, the keys [lo, hi) (absolute positions) outside which every tile is
        EMPTY; unknown structure reaches every key."""
        return np.full(len(t.qa), -_FAR), np.full(len(t.qa), _FAR)

    def dense(self, B: int, H: int, T_q: int, T_k: int, *, q_offset: int | None = None,
              device: torch.device | str | None = None) -> torch.Tensor:
        """Lower to a bool tensor of shape (B, H, T_q, T_k) (a broadcast view: no copy
        along the dimensions the mask does not depend on)."""
        return self._evaluate(B, H, T_q, T_k, q_offset, _TorchIndex(device))

    def to_numpy(self, B: int, H: int, T_q: int, T_k: int, *,
                 q_offset: int | None = None) -> np.ndarray:
        """Lower to a NumPy bool array of shape (B, H, T_q, T_k)."""
        return self._evaluate(B, H, T_q, T_k, q_offset, np)

    @property
    def batch(self) -> int | None:
        """The batch size B this mask is bound to (per-row lengths or ids), or None if it
        applies to any B."""
        return None

    def picture(self, T_q: int, T_k: int | None = None, *, q_offset: int | None = None,
                b: int = 0, h: int = 0) -> str:
        """A text picture for learners: one row per query of batch row ``b`` and head
        ``h``, █ = may attend, · = masked."""
        T_k = T_q if T_k is None else T_k
        B = self.batch if self.batch is not None else b + 1
        if not 0 <= b < B:
            raise ValueError(f"b must be in [0, {B}) for {self!r}; got {b}")
        grid = self.to_numpy(B, h + 1, T_q, T_k, q_offset=q_offset)[b, h]
        return "\n".join(" ".join("█" if x else "·" for x in row) for row in grid)


EMPTY, PARTIAL, FULL = 0, 1, 2


_FAR = 1 << 62  # beyond any position: the reach of a mask that bounds nothing


@dataclass(frozen=True)
class _Tiles:
    """Absolute positions bounding the tiles: first/last query of each query block (qa, qb)
    and first/last key of each key block (ka, kb), 1-d; ``rows`` and ``cols`` (broadcastable
    index arrays, set by :meth:`at`) pick the tiles to classify."""

    qa: np.ndarray
    qb: np.ndarray
    ka: np.ndarray
    kb: np.ndarray
    rows: Any = None
    cols: Any = None

    def at(self, rows: Any, cols: Any) -> _Tiles:
        return _Tiles(self.qa, self.qb, self.ka, self.kb, rows, cols)

    def shifted(self, dq: int, dk: int) -> _Tiles:
        return _Tiles(self.qa + dq, self.qb + dq, self.ka + dk, self.kb + dk, self.rows, self.cols)

    @property
    def q_first(self) -> np.ndarray:
        return self.qa[self.rows]

    @property
    def q_last(self) -> np.ndarray:
        return self.qb[self.rows]

    @property
    def k_first(self) -> np.ndarray:
        return self.ka[self.cols]

    @property
    def k_last(self) -> np.ndarray:
        return self.kb[self.cols]


def _codes(full: Any, empty: Any) -> np.ndarray:
    # A tile cannot be both FULL and EMPTY, so PARTIAL + full - empty is its code.
    return (PARTIAL + np.asarray(full, np.int8) - np.asarray(empty, np.int8)).astype(np.int8)


class _TorchIndex:
    """The three array functions a lowering needs, on one torch device."""

    def __init__(self, device: torch.device | str | None) -> None:
        self.device = device

    def arange(self, start: int, stop: int) -> torch.Tensor:
        return torch.arange(start, stop, device=self.device)

    def broadcast_to(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.broadcast_to(x, shape)


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
        raise TypeError(f"{name} must be integers of {' or '.join(f'{n} dims' for n in ndims)}; "
                        f"got {arr.dtype} of shape {fmt_shape(arr.shape)}")
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


class _Full(Mask):
    shift_invariant = True

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx >= 0

    def _classify(self, t):
        return np.full((), FULL, dtype=np.int8)

    def __repr__(self) -> str:
        return "full()"


class _Causal(Mask):
    shift_invariant = True

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def _classify(self, t):
        return _codes(t.k_last <= t.q_first, t.k_first > t.q_last)

    def _reach(self, t):
        return np.full(len(t.qa), -_FAR), t.qb + 1

    def __repr__(self) -> str:
        return "causal()"


class _SlidingWindow(Mask):
    shift_invariant = True

    def __init__(self, window: int) -> None:
        self.window = _int_arg("window", window, 1)

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - self.window)

    def _classify(self, t):
        w = self.window
        return _codes((t.k_last <= t.q_first) & (t.k_first > t.q_last - w),
                      (t.k_first > t.q_last) | (t.k_last <= t.q_first - w))

    def _reach(self, t):
        return t.qa - self.window + 1, t.qb + 1

    def __repr__(self) -> str:
        return f"sliding_window({self.window})"


class _Padding(Mask):
    def __init__(self, lengths: Any) -> None:
        self.lengths = _ints("lengths", lengths, (1,))
        if (self.lengths < 0).any():
            raise ValueError(f"lengths must be >= 0; got {_short(self.lengths)}")

    def validate(self, B, H, T_q, T_k):
        if self.lengths.shape != (B,):
            raise ValueError(f"padding lengths must have shape (B,) = ({B},); "
                             f"got {fmt_shape(self.lengths.shape)}")
        if (self.lengths > T_k).any():
            raise ValueError(f"padding lengths must be <= T_k={T_k}; got {_short(self.lengths)}")

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx < _like(self.lengths, kv_idx)[b]

    def _classify(self, t):
        return _codes(t.k_last < self.lengths.min(), t.k_first >= self.lengths.max())

    def _reach(self, t):
        return np.full(len(t.qa), -_FAR), np.full(len(t.qa), self.lengths.max(initial=0))

    def __repr__(self) -> str:
        return f"padding({_short(self.lengths)})"


class _Document(Mask):
    def __init__(self, ids: Any) -> None:
        self.ids = _ints("ids", ids, (1, 2))

    def validate(self, B, H, T_q, T_k):
        want = (T_k,) if self.ids.ndim == 1 else (B, T_k)
        if self.ids.shape != want:
            letters = "(T_k,)" if self.ids.ndim == 1 else "(B, T_k)"
            raise ValueError(f"document ids must have shape {letters} = {fmt_shape(want)}; "
                             f"got {fmt_shape(self.ids.shape)}")

    @property
    def batch(self) -> int | None:
        return self.ids.shape[0] if self.ids.ndim == 2 else None

    def __call__(self, b, h, q_idx, kv_idx):
        ids = _like(self.ids, kv_idx)
        n = ids.shape[-1]
        q_in = (q_idx >= 0) & (q_idx < n)  # a query before the first key has no document
        q_safe = q_idx.clip(0, n - 1)
        if ids.ndim == 1:
            return q_in & (ids[q_safe] == ids[kv_idx])
        return q_in & (ids[b, q_safe] == ids[b, kv_idx])

    def _rows(self) -> np.ndarray:
        return self.ids if self.ids.ndim == 2 else self.ids[None]  # (B or 1, T_k)

    def _classify(self, t):
        ids = self._rows()
        n = ids.shape[-1]
        q_min, q_max = _spans(ids, t.qa, t.qb)  # (B, query blocks)
        k_min, k_max = _spans(ids, t.ka, t.kb)  # (B, key blocks)
        q_min, q_max = q_min[:, t.rows], q_max[:, t.rows]  # per tile
        k_min, k_max = k_min[:, t.cols], k_max[:, t.cols]
        inside = ((t.q_first >= 0) & (t.q_last < n))  # every query of the block has an id
        full = inside & ((q_min == q_max) & (k_min == k_max) & (q_min == k_min)).all(0)
        q_out = (t.q_last < 0) | (t.q_first >= n)  # no query of the block has an id
        empty = q_out | ((q_max < k_min) | (k_max < q_min)).all(0)
        return _codes(full, empty)

    def _reach(self, t):
        ids = self._rows()
        if (np.diff(ids, axis=-1) < 0).any():  # ids out of order: any key may share an id
            return super()._reach(t)
        # Sorted ids: a query block's keys are those with ids between its first and last.
        n = ids.shape[-1]
        first, last = ids[:, np.clip(t.qa, 0, n - 1)], ids[:, np.clip(t.qb, 0, n - 1)]
        lo = [np.searchsorted(row, a, "left") for row, a in zip(ids, first)]
        hi = [np.searchsorted(row, b, "right") for row, b in zip(ids, last)]
        return np.min(lo, 0), np.max(hi, 0)

    def __repr__(self) -> str:
        return f"document({_short(self.ids)})"


class _PrefixLM(Mask):
    def __init__(self, prefix: int) -> None:
        self.prefix = _int_arg("prefix", prefix, 0)

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)

    def _classify(self, t):
        n = self.prefix
        return _codes((t.k_last < n) | (t.k_last <= t.q_first), (t.k_first >= n) & (t.k_first > t.q_last))

    def _reach(self, t):
        return np.full(len(t.qa), -_FAR), np.maximum(t.qb + 1, self.prefix)

    def __repr__(self) -> str:
        return f"prefix_lm({self.prefix})"


def _spans(ids: np.ndarray, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Min and max of each row of ids (B, n) over positions first..last (clipped to the ids),
    for every block at once: one reduceat over the ids, not a loop over blocks."""
    n = ids.shape[-1]
    lo, hi = np.clip(first, 0, n - 1), np.clip(last, 0, n - 1)
    at = np.stack([lo, hi + 1], -1).ravel()  # [lo0, hi0 + 1, lo1, ...]; keep the even ones
    padded = np.concatenate([ids, ids[:, -1:]], -1)  # so that hi + 1 == n is an index
    return (np.minimum.reduceat(padded, at, -1)[:, ::2] if len(at) else ids[:, :0],
            np.maximum.reduceat(padded, at, -1)[:, ::2] if len(at) else ids[:, :0])


class _Predicate(Mask):
    def __init__(self, fn: Predicate, name: str | None) -> None:
        if not callable(fn):
            raise TypeError(f"predicate must be callable; got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "predicate")

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"predicate({self.name})"


class _Binary(Mask):
    def __init__(self, left: Mask, right: Mask) -> None:
        self.left, self.right = left, right
        self.shift_invariant = left.shift_invariant and right.shift_invariant

    def validate(self, B, H, T_q, T_k):
        self.left.validate(B, H, T_q, T_k)
        self.right.validate(B, H, T_q, T_k)

    @property
    def batch(self) -> int | None:
        return self.left.batch if self.left.batch is not None else self.right.batch


class _And(_Binary):
    def _classify(self, t):
        return np.minimum(self.left._classify(t), self.right._classify(t))

    def _reach(self, t):
        (a, b), (c, d) = self.left._reach(t), self.right._reach(t)
        return np.maximum(a, c), np.minimum(b, d)

    def __call__(self, b, h, q_idx, kv_idx):
        return self.left(b, h, q_idx, kv_idx) & self.right(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        wrap = lambda m: f"({m!r})" if isinstance(m, _Or) else repr(m)  # noqa: E731
        return f"{wrap(self.left)} & {wrap(self.right)}"


class _Or(_Binary):
    def _classify(self, t):
        return np.maximum(self.left._classify(t), self.right._classify(t))

    def _reach(self, t):
        (a, b), (c, d) = self.left._reach(t), self.right._reach(t)
        return np.minimum(a, c), np.maximum(b, d)

    def __call__(self, b, h, q_idx, kv_idx):
        return self.left(b, h, q_idx, kv_idx) | self.right(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"{self.left!r} | {self.right!r}"


class _Not(Mask):
    def __init__(self, inner: Mask) -> None:
        self.inner = inner
        self.shift_invariant = inner.shift_invariant

    def validate(self, B, H, T_q, T_k):
        self.inner.validate(B, H, T_q, T_k)

    @property
    def batch(self) -> int | None:
        return self.inner.batch

    def _classify(self, t):
        return (FULL - self.inner._classify(t)).astype(np.int8)

    def __call__(self, b, h, q_idx, kv_idx):
        return ~self.inner(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        inner = repr(self.inner)
        return f"~({inner})" if isinstance(self.inner, (_Binary, _Not)) else f"~{inner}"


class _Shifted(Mask):
    """``inner`` seen by a call whose queries and keys sit ``dq`` and ``dk`` positions further
    on than the call places them: a part of a longer sequence of length T (context-parallel
    attention over one shard pair). Structure, block map and shift-invariance carry over."""

    def __init__(self, inner: Mask, dq: int, dk: int, T: int) -> None:
        self.inner, self.dq, self.dk, self.T = inner, dq, dk, T
        self.shift_invariant = inner.shift_invariant

    @property
    def batch(self) -> int | None:
        return self.inner.batch

    def validate(self, B, H, T_q, T_k):
        self.inner.validate(B, H, self.T, self.T)

    def __call__(self, b, h, q_idx, kv_idx):
        return self.inner(b, h, q_idx + self.dq, kv_idx + self.dk)

    def _classify(self, t):
        return self.inner._classify(t.shifted(self.dq, self.dk))

    def _reach(self, t):
        lo, hi = self.inner._reach(t.shifted(self.dq, self.dk))
        return lo - self.dk, hi - self.dk

    def __repr__(self) -> str:
        return f"({self.inner!r} at queries +{self.dq}, keys +{self.dk})"


def full() -> Mask:
    """Every query may attend to every key (the encoder's bidirectional attention)."""
    return _Full()


def causal() -> Mask:
    """Query at absolute position ``p`` may attend to keys ``0..p`` (no peeking ahead)."""
    return _Causal()


def sliding_window(window: int) -> Mask:
    """Causal, limited to the last ``window`` keys: ``p - window < kv <= p``.

    ``sliding_window(T)`` equals :func:`causal` for sequences of length ``T``.
    """
    return _SlidingWindow(window)


def padding(lengths: Any) -> Mask:
    """Batch row ``b`` may attend only to its first ``lengths[b]`` keys; shape (B,)."""
    return _Padding(lengths)


def document(ids: Any) -> Mask:
    """Packed sequences: attend only to keys of the same document.

    ``ids`` gives the document id of every key position, shape (T_k,) or (B, T_k).
    Bidirectional within a document; combine with :func:`causal` for decoders.
    """
    return _Document(ids)


def prefix_lm(prefix: int) -> Mask:
    """Bidirectional over the first ``prefix`` positions, causal after them."""
    return _PrefixLM(prefix)


def predicate(fn: Predicate, name: str | None = None) -> Mask:
    """Wrap any ``fn(b, h, q_idx, kv_idx) -> bool array`` as a composable mask.

    ``fn`` receives broadcastable integer index arrays of shapes (B, 1, 1, 1), (1, H, 1, 1),
    (1, 1, T_q, 1) and (1, 1, 1, T_k) holding absolute positions, and must use operators only.
    """
    return _Predicate(fn, name)


def _torch_allowed(name: str, m: torch.Tensor) -> torch.Tensor:
    """A torch-style mask (bool True = blocked, or additive 0 / -inf) as True = may attend."""
    if m.dtype == torch.bool:
        return ~m
    if m.is_floating_point():
        if not ((m == 0) | (m == float("-inf"))).all():
            raise ValueError(f"{name} holds additive biases other than 0 and -inf; qkv masks "
                             "are boolean (True = may attend)")
        return m == 0
    raise TypeError(f"{name} must be bool or floating point; got {m.dtype}")


def from_torch(key_padding_mask: torch.Tensor | None = None,
               attn_mask: torch.Tensor | None = None, *,
               num_heads: int | None = None) -> torch.Tensor | None:
    """Translate ``nn.MultiheadAttention``'s masks, where bool ``True`` means *blocked*
    (or additive floats 0 / -inf), into one qkv bool mask where ``True`` means *may attend*.

    Args:
        key_padding_mask: (B, T_k), True = padding to ignore.
        attn_mask: (T_q, T_k) or (B·H, T_q, T_k), True = blocked.
        num_heads: H, needed for a (B·H, T_q, T_k) attn_mask.

    Returns:
        A bool tensor broadcastable to (B, H, T_q, T_k), or None if both are None.
    """
    allowed = None
    if key_padding_mask is not None:
        if key_padding_mask.ndim != 2:
            raise ValueError(f"key_padding_mask must have shape (B, T_k); "
                             f"got {fmt_shape(key_padding_mask.shape)}")
        allowed = _torch_allowed("key_padding_mask", key_padding_mask)[:, None, None, :]
    if attn_mask is not None:
        a = _torch_allowed("attn_mask", attn_mask)
        if a.ndim == 3:
            if num_heads is None or a.shape[0] % num_heads:
                raise ValueError(f"a (B·H, T_q, T_k) attn_mask needs num_heads dividing "
                                 f"{a.shape[0]}; got num_heads={num_heads}")
            a = a.view(-1, num_heads, *a.shape[1:])  # (B, H, T_q, T_k)
        elif a.ndim != 2:
            raise ValueError(f"attn_mask must have shape (T_q, T_k) or (B·H, T_q, T_k); "
                             f"got {fmt_shape(a.shape)}")
        allowed = a if allowed is None else allowed & a
    return allowed


__all__ = ["EMPTY", "FULL", "Mask", "PARTIAL", "causal", "from_torch", "document", "full", "padding", "predicate", "prefix_lm",
           "sliding_window"]
