"""Attention kernels, one contract (:mod:`qkv.kernels.contract`): each takes a lowered call
and returns a result. They are ``reference`` (materialised, the seeds' math), ``sdpa``
(torch's fused kernel), ``tiled`` (block-sparse, its own backward, with its loop, flash
calls and native kernel) and ``flex`` (torch's FlexAttention). Which runs is decided in
:mod:`qkv.core.dispatch`."""

from . import mkl
from .contract import PATHS, Lowered, MaskTiles, ModTiles, Result

mkl.settle()  # before any kernel runs: MKL's first call of a function can race (mkl.py)

__all__ = ["PATHS", "Lowered", "MaskTiles", "ModTiles", "Result"]
