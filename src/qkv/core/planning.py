"""The tiled kernel's plan of a call: a mask's block map (from its structure, or reduced from
a dense mask tile by tile) turned into chunks of keys per query block, at the sizes the
knobs in force give.

Legend: T_q/T_k query/key length.
"""

from __future__ import annotations

import numpy as np
import torch

from .._checks import Problem
from ..kernels.tiled.plan import Plan, dense_to_sparse, make_plan
from ..masks import FULL, Mask, MaskLike
from ..tuning import Tuning


def block_codes(mask: MaskLike, p: Problem, block_q: int, block_k: int) -> np.ndarray:
    """The (ceil(T_q / block_q), ceil(T_k / block_k)) block map of any mask."""
    nq, nk = -(-p.T_q // block_q), -(-p.T_k // block_k)
    if nq == 0 or nk == 0:  # no queries or no keys: nothing to plan
        return np.zeros((nq, nk), dtype=np.int8)
    if mask is None:
        return np.full((nq, nk), FULL, dtype=np.int8)
    if isinstance(mask, Mask):
        return mask.blocks(
            p.B, p.H, p.T_q, p.T_k, block_q=block_q, block_k=block_k, q_offset=p.q_offset
        )
    # A dense mask is already materialised: reduce it tile by tile.
    m = torch.as_tensor(mask)
    m = m.reshape((1,) * (4 - m.ndim) + tuple(m.shape)).flatten(0, 1)  # (·, T_q|1, T_k|1)
    m = m.expand(m.shape[0], p.T_q, p.T_k)
    pad = torch.nn.functional.pad
    pad_q, pad_k = nq * block_q - p.T_q, nk * block_k - p.T_k

    def tiles(x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, nq, block_q, nk, block_k)

    any_ = tiles(pad(m, (0, pad_k, 0, pad_q), value=False)).any(4).any(2).any(0)
    all_ = tiles(pad(m, (0, pad_k, 0, pad_q), value=True)).all(4).all(2).all(0)
    codes = any_.to(torch.int8) + all_.to(torch.int8)  # 0 empty, 1 partial, 2 full
    return codes.cpu().numpy()


def make_tiled_plan(mask: MaskLike, p: Problem, tuning: Tuning) -> Plan:
    """The tiled kernel's plan of this call: the mask's non-EMPTY tiles in chunks."""
    bq, bk = tuning.block_q, tuning.block_k
    if isinstance(mask, Mask) and p.T_q and p.T_k:
        tiles = mask.sparse_blocks(
            p.B, p.H, p.T_q, p.T_k, block_q=bq, block_k=bk, q_offset=p.q_offset
        )
    else:
        tiles = dense_to_sparse(block_codes(mask, p, bq, bk))
    return make_plan(*tiles, p.T_q, p.T_k, block_q=bq, block_k=bk, chunk_k=tuning.chunk_k)
