"""Plans and tiles, shared by the tiled kernel's loop (:mod:`qkv.kernels.tiled`) and its fused
steps (:mod:`qkv.kernels.fused`): a plan is, per query block, its chunks of non-empty keys.

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length · D head dim.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from ...masks import EMPTY, PARTIAL
from . import native


class Chunk(NamedTuple):
    """Keys k0..k1-1 for one query block, and the key range (from the first PARTIAL block
    to the last) where the mask must be evaluated, or None if every block is FULL."""

    k0: int
    k1: int
    masked: tuple[int, int] | None


@dataclass(frozen=True, eq=False)
class Plan:
    """What to compute, as arrays: query block i covers queries q0[i]..q1[i]-1 and owns the
    chunks at[i]..at[i+1]-1, each keys k0..k1-1 with the mask evaluated over keys
    m0..m1-1 (m1 = -1: every block of the chunk is FULL). :attr:`rows` gives the same as
    tuples, made when a kernel first iterates them."""

    T_q: int
    T_k: int
    q0: np.ndarray
    q1: np.ndarray
    at: np.ndarray
    k0: np.ndarray
    k1: np.ndarray
    m0: np.ndarray
    m1: np.ndarray

    def __post_init__(self) -> None:
        for name in ("q0", "q1", "at", "k0", "k1", "m0", "m1"):
            getattr(self, name).flags.writeable = False

    @cached_property
    def rows(self) -> tuple[tuple[int, int, tuple[Chunk, ...]], ...]:
        """Per query block (q0, q1, its chunks)."""
        masked: list = list(zip(self.m0.tolist(), self.m1.tolist()))
        for i in np.flatnonzero(self.m1 < 0).tolist():  # chunks of FULL blocks only
            masked[i] = None
        chunks = list(map(Chunk._make, zip(self.k0.tolist(), self.k1.tolist(), masked)))
        at = self.at.tolist()
        return tuple(
            zip(
                self.q0.tolist(),
                self.q1.tolist(),
                [tuple(chunks[a:b]) for a, b in itertools.pairwise(at)],
            )
        )

    @property
    def density(self) -> float:
        """Fraction of the T_q × T_k scores the plan computes (1.0 = dense)."""
        per_row = np.add.reduceat(np.append(self.k1 - self.k0, 0), self.at[:-1])
        per_row[self.at[:-1] == self.at[1:]] = 0  # reduceat reads one chunk for empty rows
        done = int(((self.q1 - self.q0) * per_row).sum())
        return done / (self.T_q * self.T_k) if self.T_q * self.T_k else 0.0


def make_plan(
    rows: np.ndarray,
    cols: np.ndarray,
    codes: np.ndarray,
    T_q: int,
    T_k: int,
    *,
    block_q: int,
    block_k: int,
    chunk_k: int,
) -> Plan:
    """Turn the non-EMPTY tiles of a block map (``Mask.sparse_blocks``: rows, cols, codes,
    sorted by row then column) into chunks of consecutive key blocks, at most ``chunk_k``
    keys each: a run of n blocks splits into ceil(n / per_chunk) near-equal chunks. Array
    operations over the tiles, so planning costs what the mask attends, not T_q × T_k."""
    per_chunk = max(1, chunk_k // block_k)
    n = len(rows)
    first = np.ones(n, bool)  # where a run of consecutive blocks in one row starts
    first[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1] + 1)
    starts = np.flatnonzero(first)
    run = np.cumsum(first) - 1
    length = np.diff(np.append(starts, n))[run]
    at = np.arange(n) - starts[run]  # position within the run
    pieces = -(-length // per_chunk)
    size, big = length // np.maximum(pieces, 1), length % np.maximum(pieces, 1)
    # np.array_split's rule: the first `big` pieces hold size + 1 blocks, the others size.
    piece = np.where(
        at < big * (size + 1),
        at // (size + 1),
        big + (at - big * (size + 1)) // np.maximum(size, 1),
    )
    first[1:] |= piece[1:] != piece[:-1]
    c0 = np.flatnonzero(first)
    c1 = np.append(c0[1:] - 1, n - 1) if n else c0  # each chunk's last tile
    partial = codes == PARTIAL
    m0 = np.minimum.reduceat(np.where(partial, cols, np.iinfo(np.int64).max), c0) if n else c0
    m1 = np.maximum.reduceat(np.where(partial, cols, -1), c0) if n else c0
    q0 = np.arange(0, T_q, block_q)
    return Plan(
        T_q,
        T_k,
        q0,
        np.minimum(q0 + block_q, T_q),
        np.searchsorted(rows[c0], np.arange(len(q0) + 1)),
        cols[c0] * block_k,
        np.minimum((cols[c1] + 1) * block_k, T_k),
        np.where(m1 >= 0, m0 * block_k, -1),
        np.where(m1 >= 0, np.minimum((m1 + 1) * block_k, T_k), -1),
    )


def dense_to_sparse(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dense block map's non-EMPTY tiles as (rows, cols, codes), sorted."""
    rows, cols = np.nonzero(codes != EMPTY)
    return rows, cols, codes[rows, cols]


def _fit(m: torch.Tensor, H_kv: int, G: int) -> torch.Tensor:
    """A (B|1, H|1, r, c) mask tile in the kernel's (B|1, H_kv|1, G·r, c) layout."""
    b, h, r, c = m.shape
    m = m.view(b, H_kv, G, r, c) if h != 1 else m[:, :, None].expand(b, 1, G, r, c)
    return m.reshape(b, m.shape[1], G * r, c)


def row_dot(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rowsum(a ∘ b) over the last dim in ``dtype`` (the backward's Delta). In float32 from
    bfloat16 or float16 rows, summed by the native kernel as they are (:func:`native.row_dot`:
    no float32 copies of them) where it can take them; otherwise as one batched matmul: no
    product of a's size is held, which the elementwise form allocates and then reduces
    (docs/benchmarks.md, "measurements behind code choices")."""
    if dtype == torch.float32:
        found = native.row_dot(a, b)
        if found is not None:
            return found
    *lead, D = a.shape
    return torch.bmm(a.reshape(-1, 1, D).to(dtype), b.reshape(-1, D, 1).to(dtype)).view(*lead)


def _blocked(x: torch.Tensor, H_kv: int) -> torch.Tensor:
    """(B, H, T, ·) -> (B, H_kv, G, T, ·): query head h = kv_head * G + g."""
    B, H, T, D = x.shape
    return x.view(B, H_kv, H // H_kv, T, D)


def _rows(x5: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
    """Rows q0..q1-1 of a (B, H_kv, G, T, ·) tensor as (B, H_kv, G·bq, ·)."""
    B, H_kv, G, _, D = x5.shape
    return x5[:, :, :, q0:q1].reshape(B, H_kv, G * (q1 - q0), D)
