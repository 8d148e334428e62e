"""The masks qkv knows by structure: each predicate beside its block rule (``_classify``: a
tile's code from its bounds; ``_reach``: the keys a query block can reach), so a tiled kernel
skips what a mask excludes without evaluating it.

Legend: B batch · H query heads · T_q/T_k query/key length.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._checks import fmt_shape
from .._recipes import keep_int
from .algebra import Mask, _int_arg, _ints, _like, _short
from .tiles import _FAR, FULL, _codes, _Tiles


class _Full(Mask):
    shift_invariant = True
    kind = "full"

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        return ["full"]

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx >= 0

    def _classify(self, t: _Tiles) -> np.ndarray:
        return np.full((), FULL, dtype=np.int8)

    def intervals(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        return _one_row(np.full(len(q), -_FAR), np.full(len(q), _FAR))

    def __repr__(self) -> str:
        return "full()"


class _Causal(Mask):
    shift_invariant = True
    kind = "causal"

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        return ["causal"]

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx <= q_idx

    def _classify(self, t: _Tiles) -> np.ndarray:
        return _codes(t.k_last <= t.q_first, t.k_first > t.q_last)

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        return np.full(len(t.qa), -_FAR), t.qb + 1

    def intervals(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        return _one_row(np.full(len(q), -_FAR), q + 1)

    def __repr__(self) -> str:
        return "causal()"


class _SlidingWindow(Mask):
    shift_invariant = True
    kind = "sliding_window"

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        return ["sliding_window:" + keep_int(ints, self.window)]

    def __init__(self, window: int) -> None:
        self.window = _int_arg("window", window, 1)

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (kv_idx > q_idx - self.window)

    def _classify(self, t: _Tiles) -> np.ndarray:
        w = self.window
        return _codes(
            (t.k_last <= t.q_first) & (t.k_first > t.q_last - w),
            (t.k_first > t.q_last) | (t.k_last <= t.q_first - w),
        )

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        return t.qa - self.window + 1, t.qb + 1

    def intervals(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        return _one_row(q - self.window + 1, q + 1)

    def __repr__(self) -> str:
        return f"sliding_window({self.window})"


class _Padding(Mask):
    kind = "padding"

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        tensors.append(torch.as_tensor(self.lengths))
        return [f"padding:{len(tensors) - 1}"]

    def __init__(self, lengths: Any) -> None:
        self.lengths = _ints("lengths", lengths, (1,))
        if (self.lengths < 0).any():
            raise ValueError(f"lengths must be >= 0; got {_short(self.lengths)}")

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        if self.lengths.shape != (B,):
            raise ValueError(
                f"padding lengths must have shape (B,) = ({B},); "
                f"got {fmt_shape(self.lengths.shape)}"
            )
        if (self.lengths > T_k).any():
            raise ValueError(f"padding lengths must be <= T_k={T_k}; got {_short(self.lengths)}")

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < _like(self.lengths, kv_idx)[b]

    def _classify(self, t: _Tiles) -> np.ndarray:
        return _codes(t.k_last < self.lengths.min(), t.k_first >= self.lengths.max())

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        return np.full(len(t.qa), -_FAR), np.full(len(t.qa), self.lengths.max(initial=0))

    def intervals(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        return np.full((len(self.lengths), len(q)), -_FAR), np.repeat(
            self.lengths[:, None], len(q), 1
        )

    def __repr__(self) -> str:
        return f"padding({_short(self.lengths)})"


class _Document(Mask):
    kind = "document"

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        tensors.append(torch.as_tensor(self.ids))
        return [f"document:{len(tensors) - 1}"]

    def __init__(self, ids: Any) -> None:
        self.ids = _ints("ids", ids, (1, 2))

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        want = (T_k,) if self.ids.ndim == 1 else (B, T_k)
        if self.ids.shape != want:
            letters = "(T_k,)" if self.ids.ndim == 1 else "(B, T_k)"
            raise ValueError(
                f"document ids must have shape {letters} = {fmt_shape(want)}; "
                f"got {fmt_shape(self.ids.shape)}"
            )

    @property
    def batch(self) -> int | None:
        return self.ids.shape[0] if self.ids.ndim == 2 else None

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        ids = _like(self.ids, kv_idx)
        n = ids.shape[-1]
        q_in = (q_idx >= 0) & (q_idx < n)  # a query before the first key has no document
        q_safe = q_idx.clip(0, n - 1)
        if ids.ndim == 1:
            return q_in & (ids[q_safe] == ids[kv_idx])
        return q_in & (ids[b, q_safe] == ids[b, kv_idx])

    def _rows(self) -> np.ndarray:
        return self.ids if self.ids.ndim == 2 else self.ids[None]  # (B or 1, T_k)

    def _classify(self, t: _Tiles) -> np.ndarray:
        ids = self._rows()
        n = ids.shape[-1]
        q_min, q_max = _spans(ids, t.qa, t.qb)  # (B, query blocks)
        k_min, k_max = _spans(ids, t.ka, t.kb)  # (B, key blocks)
        q_min, q_max = q_min[:, t.rows], q_max[:, t.rows]  # per tile
        k_min, k_max = k_min[:, t.cols], k_max[:, t.cols]
        inside = (t.q_first >= 0) & (t.q_last < n)  # every query of the block has an id
        full = inside & ((q_min == q_max) & (k_min == k_max) & (q_min == k_min)).all(0)
        q_out = (t.q_last < 0) | (t.q_first >= n)  # no query of the block has an id
        empty = q_out | ((q_max < k_min) | (k_max < q_min)).all(0)
        return _codes(full, empty)

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        ids = self._rows()
        if (np.diff(ids, axis=-1) < 0).any():  # ids out of order: any key may share an id
            return super()._reach(t)
        # Sorted ids: a query block's keys are those with ids between its first and last.
        n = ids.shape[-1]
        first, last = ids[:, np.clip(t.qa, 0, n - 1)], ids[:, np.clip(t.qb, 0, n - 1)]
        lo = [np.searchsorted(row, a, "left") for row, a in zip(ids, first)]
        hi = [np.searchsorted(row, b, "right") for row, b in zip(ids, last)]
        return np.min(lo, 0), np.max(hi, 0)

    def intervals(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        ids = self._rows()
        if ids.shape[-1] == 0:  # no ids: no query has a document
            return np.zeros((len(ids), len(q)), np.int64), np.zeros((len(ids), len(q)), np.int64)
        if not hasattr(self, "_runs"):  # computed once, when first asked for
            self._runs = _runs(ids)
        if self._runs is None:
            return None
        lo, hi = self._runs
        n = lo.shape[-1]
        inside = (q >= 0) & (q < n)  # a query outside the ids has no document, no key
        at = np.clip(q, 0, n - 1)
        return np.where(inside, lo[:, at], 0), np.where(inside, hi[:, at], 0)

    def __repr__(self) -> str:
        return f"document({_short(self.ids)})"


class _PrefixLM(Mask):
    kind = "prefix_lm"

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        return ["prefix_lm:" + keep_int(ints, self.prefix)]

    def __init__(self, prefix: int) -> None:
        self.prefix = _int_arg("prefix", prefix, 0)

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)

    def _classify(self, t: _Tiles) -> np.ndarray:
        n = self.prefix
        return _codes(
            (t.k_last < n) | (t.k_last <= t.q_first), (t.k_first >= n) & (t.k_first > t.q_last)
        )

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        return np.full(len(t.qa), -_FAR), np.maximum(t.qb + 1, self.prefix)

    def intervals(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        return _one_row(np.full(len(q), -_FAR), np.maximum(q + 1, self.prefix))

    def __repr__(self) -> str:
        return f"prefix_lm({self.prefix})"


class _KeyIndices(Mask):
    """Each query's own list of keys (token-level sparse attention)."""

    kind = "key_indices"

    def __init__(self, indices: Any, first: int, unused_from: int | None) -> None:
        self.indices = _ints("indices", indices, (3,))
        if unused_from is not None:  # FlashMLA's convention: any index past the keys
            self.indices[self.indices >= _int_arg("unused_from", unused_from, 0)] = -1
        self._indices = torch.from_numpy(self.indices)  # for the dense table (Flex only)
        self._table: torch.Tensor | None = None
        self.first = _int_arg("first", first, -_FAR)  # any position, as q_offset may be
        rows = self.indices.shape[1]
        # Every (batch, query, key) pair listed, as one sorted code: membership of a pair
        # is then one binary search, on any shape of index arrays (never tile × k).
        b, r = np.ogrid[: self.indices.shape[0], :rows]
        b, r = b[..., None], r[..., None]  # (B, 1, 1) and (1, T_rows, 1)
        listed = self.indices >= 0
        self.width = int(self.indices.max(initial=-1)) + 1  # keys 0..width-1 can be listed
        codes = ((b * rows + r) * self.width + self.indices)[listed]
        self.codes = np.unique(codes)
        self.pairs = (  # (query position, key) of every pair, for the block map
            (self.first + np.broadcast_to(r, self.indices.shape))[listed],
            self.indices[listed],
        )

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        if self.indices.shape[0] != B:
            raise ValueError(
                f"key indices must have shape (B, T_rows, k) with B = {B}; "
                f"got {fmt_shape(self.indices.shape)}"
            )
        if self.width > T_k:
            raise ValueError(
                f"key indices must be < T_k={T_k}; got {self.width - 1} (to mark unused "
                f"slots by any index >= T_k, as FlashMLA does, pass unused_from={T_k})"
            )

    @property
    def batch(self) -> int:
        return self.indices.shape[0]

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        rows, width = self.indices.shape[1], max(self.width, 1)
        row = q_idx - self.first
        inside = (row >= 0) & (row < rows) & (kv_idx >= 0) & (kv_idx < width)
        if isinstance(q_idx, torch.Tensor) and q_idx.ndim == 0:
            # One position at a time (FlexAttention's compiled mask_mod, which cannot
            # search): a dense (B, T_rows, width) table, built once, looked up.
            table = self._dense(q_idx.device)
            return inside & table[b, row.clamp(0, rows - 1), kv_idx.clamp(0, width - 1)]
        code = (b * rows + row) * width + kv_idx
        codes = _like(self.codes, code)
        if isinstance(code, torch.Tensor):
            at = torch.searchsorted(codes, code.contiguous()).clamp(max=max(len(codes) - 1, 0))
        else:
            at = np.minimum(np.searchsorted(codes, code), max(len(codes) - 1, 0))
        found = codes[at] == code if len(codes) else code < 0
        return inside & found

    def _dense(self, device: Any) -> torch.Tensor:
        if self._table is None or self._table.device != torch.device(device):
            B, rows, _ = self.indices.shape
            width = max(self.width, 1)
            idx = self._indices.to(device)
            table = torch.zeros(B, rows, width + 1, dtype=torch.bool, device=device)
            table.scatter_(2, torch.where(idx >= 0, idx, width), True)  # unused: a spare column
            self._table = table[..., :width]
        return self._table

    def _grid_of_blocks(self, t: _Tiles) -> np.ndarray:
        """Which (query block, key block) tiles hold a listed pair."""
        q, k = self.pairs
        qb = np.searchsorted(t.qa, q, "right") - 1
        kb = np.searchsorted(t.ka, k, "right") - 1
        keep = (
            (qb >= 0) & (q <= t.qb[np.maximum(qb, 0)]) & (kb >= 0) & (k <= t.kb[np.maximum(kb, 0)])
        )
        grid = np.zeros((len(t.qa), len(t.ka)), dtype=bool)
        grid[qb[keep], kb[keep]] = True
        return grid

    def _classify(self, t: _Tiles) -> np.ndarray:
        return _codes(False, ~self._grid_of_blocks(t)[t.rows, t.cols])

    def _reach(self, t: _Tiles) -> tuple[np.ndarray, np.ndarray]:
        grid = self._grid_of_blocks(t)
        any_ = grid.any(1)
        lo = np.where(any_, t.ka[grid.argmax(1)], 0)
        hi = np.where(any_, t.kb[len(t.ka) - 1 - grid[:, ::-1].argmax(1)] + 1, 0)
        return lo, hi

    def __repr__(self) -> str:
        B, rows, k = self.indices.shape
        at = f", first={self.first}" if self.first else ""
        return f"key_indices(({B}, {rows}, {k}){at})"


def _spans(ids: np.ndarray, first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Min and max of each row of ids (B, n) over positions first..last (clipped to the ids),
    for every block at once: one reduceat over the ids, not a loop over blocks."""
    n = ids.shape[-1]
    lo, hi = np.clip(first, 0, n - 1), np.clip(last, 0, n - 1)
    at = np.stack([lo, hi + 1], -1).ravel()  # [lo0, hi0 + 1, lo1, ...]; keep the even ones
    padded = np.concatenate([ids, ids[:, -1:]], -1)  # so that hi + 1 == n is an index
    return (
        np.minimum.reduceat(padded, at, -1)[:, ::2] if len(at) else ids[:, :0],
        np.maximum.reduceat(padded, at, -1)[:, ::2] if len(at) else ids[:, :0],
    )


def _runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """For ids (B|1, n), each position's run of equal ids as [first, end) (B|1, n) arrays;
    None if an id has two runs in a row (its keys are then not one interval)."""
    n = ids.shape[-1]
    starts = np.diff(ids, axis=-1, prepend=ids[:, :1] - 1) != 0  # a run begins
    if any(len(np.unique(row[s])) < s.sum() for row, s in zip(ids, starts)):
        return None
    run = np.cumsum(starts, -1) - 1  # each position's run
    first = [np.flatnonzero(s) for s in starts]  # each row's runs' first positions
    lo = np.stack([f[r] for f, r in zip(first, run)])
    hi = np.stack([np.append(f[1:], n)[r] for f, r in zip(first, run)])
    return lo, hi


def _one_row(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bounds the same for every batch row, as (1, n) arrays."""
    return lo[None], hi[None]


def full() -> Mask:
    """Every query may attend to every key (the encoder's bidirectional attention)."""
    return _Full()


def causal() -> Mask:
    """Query at absolute position ``p`` may attend to keys ``0..p`` (no peeking ahead)."""
    return _Causal()


def with_causal(
    mask: Mask | torch.Tensor | np.ndarray | None, is_causal: bool
) -> Mask | torch.Tensor | np.ndarray | None:
    """A module's mask: the caller's (a qkv mask, or a bool (T_q, T_k) / (B, T_q, T_k) /
    (B, H, T_q, T_k) tensor), and-ed with causal() for a causal module. A dense
    (B, T_q, T_k) mask gains a head dim to fit the (B, H, T_q, T_k) layout."""
    if isinstance(mask, torch.Tensor) and mask.ndim == 3:
        mask = mask[:, None]  # (B, 1, T_q, T_k)
    if not is_causal:
        return mask
    if mask is None or isinstance(mask, Mask):
        return _Causal() if mask is None else _Causal() & mask
    T_q, T_k = mask.shape[-2:]
    return mask & _Causal().dense(1, 1, T_q, T_k, device=mask.device)[0, 0]


def sliding_window(window: int) -> Mask:
    """Causal, limited to the last ``window`` keys: ``p - window < kv <= p``.

    ``sliding_window(T)`` equals :func:`causal` for sequences of length ``T``.
    """
    return _SlidingWindow(window)


def padding(lengths: Any) -> Mask:
    """Batch row ``b`` may attend only to its first ``lengths[b]`` keys. Shape (B,)."""
    return _Padding(lengths)


def document(ids: Any) -> Mask:
    """Packed sequences: attend only to keys of the same document.

    ``ids`` gives the document id of every key position, shape (T_k,) or (B, T_k).
    Bidirectional within a document. Combine with :func:`causal` for decoders.
    """
    return _Document(ids)


def key_indices(indices: Any, first: int = 0, *, unused_from: int | None = None) -> Mask:
    """Token-level sparse attention (DeepSeek's DSA, NSA's selection): each query attends
    only to the keys listed for it.

    Args:
        indices: integers (B, T_rows, k): ``indices[b, r]`` are the key positions that the
            query at absolute position ``first + r`` may attend to; negative entries are
            unused slots. Queries outside ``first .. first + T_rows - 1`` attend to nothing.
        first: the absolute position of the first row's query (0 for a prefill; the
            cache length when decoding).
        unused_from: every index >= this is an unused slot too (FlashMLA marks them with
            any index >= T_k, up to 2³¹ − 1: pass T_k). None: such an index is refused
            when the call's T_k is known.

    Compose it with the other masks (``causal() & key_indices(idx)``). The tiled kernel
    visits only the tiles that hold a listed key, and never builds T_q × T_k.
    """
    return _KeyIndices(indices, first, unused_from)


def prefix_lm(prefix: int) -> Mask:
    """Bidirectional over the first ``prefix`` positions, causal after them."""
    return _PrefixLM(prefix)
