"""Plans and tiles, shared by the tiled kernel's loop (:mod:`qkv.kernels.tiled`) and its fused
steps (:mod:`qkv.kernels.fused`): a plan is, per query block, its chunks of non-empty keys.

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length · D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from ..masks import EMPTY, PARTIAL

# Measured on the 2-core CPU this project targets (docs/kernels.md): 128-query blocks make
# the matmuls larger, 64-key blocks keep the work wasted at a mask's ragged edge small, and
# chunks of up to 1024 keys make each matmul large enough to run near peak.
BLOCK_Q = 128
BLOCK_K = 64
CHUNK_K = 1024

# mask_tile(q0, q1, k0, k1) -> bool tensor broadcastable to (B, H, q1 - q0, k1 - k0),
# positions relative to the start of the query and key sequences.
MaskTile = Callable[[int, int, int, int], torch.Tensor]


class ModTile(Protocol):
    """A score modification on (B, H_kv, G·bq, L) tiles of scaled scores for queries
    q0..q1-1 and keys k0..k1-1, and its backward (see ``qkv.scores.ScoreMod.vjp``)."""

    def __call__(self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor: ...

    def vjp(self, ds: torch.Tensor, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int, *,
            need: bool) -> tuple[torch.Tensor, list]: ...


@dataclass(frozen=True)
class Chunk:
    """Keys k0..k1-1 for one query block, and the key range (from the first PARTIAL block
    to the last) where the mask must be evaluated, or None if every block is FULL."""

    k0: int
    k1: int
    masked: tuple[int, int] | None


@dataclass(frozen=True)
class Plan:
    """What to compute: for each query block (q0, q1), its chunks of keys."""

    T_q: int
    T_k: int
    rows: tuple[tuple[int, int, tuple[Chunk, ...]], ...]

    @property
    def density(self) -> float:
        """Fraction of the T_q × T_k scores the plan computes (1.0 = dense)."""
        done = sum((q1 - q0) * (c.k1 - c.k0) for q0, q1, chunks in self.rows for c in chunks)
        return done / (self.T_q * self.T_k) if self.T_q * self.T_k else 0.0


def make_plan(codes: np.ndarray, T_q: int, T_k: int, *, block_q: int = BLOCK_Q,
              block_k: int = BLOCK_K, chunk_k: int = CHUNK_K) -> Plan:
    """Turn a block map (codes from ``Mask.blocks``) into chunks of consecutive
    non-empty key blocks, at most ``chunk_k`` keys each."""
    per_chunk = max(1, chunk_k // block_k)
    rows = []
    for i, row in enumerate(codes):
        blocks = np.flatnonzero(row != EMPTY)
        runs = np.split(blocks, np.flatnonzero(np.diff(blocks) != 1) + 1) if len(blocks) else []
        chunks = []
        for run in runs:
            for piece in np.array_split(run, -(-len(run) // per_chunk)):
                partial = piece[row[piece] == PARTIAL]
                masked = (int(partial[0]) * block_k, min((int(partial[-1]) + 1) * block_k, T_k)
                          ) if len(partial) else None
                chunks.append(Chunk(int(piece[0]) * block_k,
                                    min((int(piece[-1]) + 1) * block_k, T_k), masked))
        rows.append((i * block_q, min((i + 1) * block_q, T_q), tuple(chunks)))
    return Plan(T_q, T_k, tuple(rows))


def _fit(m: torch.Tensor, H_kv: int, G: int) -> torch.Tensor:
    """A (B|1, H|1, r, c) mask tile in the kernel's (B|1, H_kv|1, G·r, c) layout."""
    b, h, r, c = m.shape
    m = m.view(b, H_kv, G, r, c) if h != 1 else m[:, :, None].expand(b, 1, G, r, c)
    return m.reshape(b, m.shape[1], G * r, c)




def _blocked(x: torch.Tensor, H_kv: int) -> torch.Tensor:
    """(B, H, T, ·) -> (B, H_kv, G, T, ·): query head h = kv_head * G + g."""
    B, H, T, D = x.shape
    return x.view(B, H_kv, H // H_kv, T, D)


def _rows(x5: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
    """Rows q0..q1-1 of a (B, H_kv, G, T, ·) tensor as (B, H_kv, G·bq, ·)."""
    B, H_kv, G, _, D = x5.shape
    return x5[:, :, :, q0:q1].reshape(B, H_kv, G * (q1 - q0), D)
