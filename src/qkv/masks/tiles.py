"""How a mask meets a tiled kernel: the codes of a tile (EMPTY, PARTIAL, FULL), the absolute
positions bounding a grid of tiles, and the index functions a lowering evaluates a predicate
with.

Legend: T_q/T_k query/key length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: A tile's code: skip it, evaluate the mask on it, or attend everywhere in it.
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
