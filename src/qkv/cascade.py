"""Cascade attention: a batch whose sequences share a prefix, the prefix read once.

Legend: B batch · H query heads · H_kv key/value heads · T_q queries · L_p prefix keys ·
L_s suffix keys · D head dim · D_v value head dim.
"""

from __future__ import annotations

import torch

from .functional import attention
from .lse import merge_attention
from .masks import MaskLike

__all__ = ["cascade_attention"]


def cascade_attention(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: MaskLike = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a batch whose sequences share a prefix, reading the prefix once.

    Every sequence's keys are the shared prefix followed by its own suffix. The prefix part
    is one call for the whole batch (the B sequences' queries stacked as rows of one
    sequence against the prefix's keys, which are read once, not B times). The suffix part
    is a batched call. The two are merged exactly by their log-sum-exps
    (:func:`qkv.merge_attention`), gradients included (FlashInfer's cascade attention).

    Args:
        query: (B, H, T_q, D), the queries, the last T_q positions of each sequence.
        prefix_key, prefix_value: (H_kv, L_p, D) and (H_kv, L_p, D_v), shared by all.
        key, value: (B, H_kv, L_s, D) and (…, D_v), each sequence's suffix (L_s may be 0).
        mask: over the suffix keys only, (B, H, T_q, L_s) broadcastable or a qkv mask at the
            suffix's positions (e.g. ``padding(lengths)`` for suffixes of different lengths);
            every query sees the whole prefix.
        scale, sinks: as in :func:`qkv.attention` (a sink counts once, joined when the parts merge).

    Returns:
        out (B, H, T_q, D_v), and the (B, H, T_q) log-sum-exp with ``return_lse``.

    Example:
        >>> import torch, qkv
        >>> q = torch.randn(3, 4, 1, 8)
        >>> pk, pv = torch.randn(4, 100, 8), torch.randn(4, 100, 8)
        >>> k, v = torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5, 8)
        >>> whole = qkv.attention(q, torch.cat([pk.expand(3, -1, -1, -1), k], 2),
        ...                       torch.cat([pv.expand(3, -1, -1, -1), v], 2))
        >>> torch.allclose(qkv.cascade_attention(q, pk, pv, k, v), whole, atol=1e-5)
        True
    """
    if query.ndim != 4 or prefix_key.ndim != 3 or key.ndim != 4:
        raise ValueError(
            "cascade_attention takes query (B, H, T_q, D), prefix_key (H_kv, L_p, D) and key "
            f"(B, H_kv, L_s, D); got {tuple(query.shape)}, {tuple(prefix_key.shape)} and "
            f"{tuple(key.shape)}"
        )
    B, H, T_q, D = query.shape
    # The prefix, once: the batch's queries as B·T_q rows of one sequence (query head h of
    # batch b is row b·T_q + t of head h), no mask: every query sees the whole prefix.
    rows = query.transpose(0, 1).reshape(1, H, B * T_q, D)
    out_p, lse_p = attention(
        rows, prefix_key[None], prefix_value[None], scale=scale, return_lse=True
    )
    out_p = out_p.reshape(H, B, T_q, -1).transpose(0, 1)  # (B, H, T_q, D_v)
    lse_p = lse_p.reshape(H, B, T_q).transpose(0, 1)
    if key.shape[2] == 0 and sinks is None:
        out, lse = out_p, lse_p
    else:
        # The suffix keys sit after the prefix: bottom-right alignment of the suffix alone
        # is the same relation between each query and its suffix keys.
        out_s, lse_s = attention(query, key, value, mask=mask, scale=scale, return_lse=True)
        out, lse = merge_attention([out_p, out_s], [lse_p, lse_s], sinks=sinks)
    return (out, lse) if return_lse else out
