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
which torch's fused kernel takes as a float mask. The others run on the kernels that apply
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

from .base import ScoreFunction, ScoreMod, as_score_mod, chain, function
from .library import alibi, alibi_slopes, bias, relative_bias, relative_position_bucket, softcap

__all__ = [
    "ScoreFunction",
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "as_score_mod",
    "bias",
    "chain",
    "function",
    "relative_bias",
    "relative_position_bucket",
    "softcap",
]
