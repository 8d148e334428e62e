"""FlashAttention 2's API on a CPU: its function names, signatures and (batch, seqlen, nheads,
headdim) layout, computed by qkv. Code written for ``flash_attn`` runs unchanged, on windows,
soft-capping, ALiBi, varlen, a KV cache and pages, forward and backward.
:func:`install` makes ``import flash_attn`` resolve here.

Semantics are FlashAttention's. ``causal`` is bottom-right (query ``i`` sits at
``i + seqlen_k − seqlen_q``). ``window_size=(left, right)`` lets that query see keys
``p − left .. p + right``, with -1 unbounded (``causal`` sets ``right`` to 0). ``softcap``
squashes the scaled scores (``softcap · tanh(s / softcap)``), then ALiBi adds
``−slope · |p − j|``. Inputs of any floating dtype (FlashAttention itself takes float16 and
bfloat16 only). ``docs/flash-attn.md`` maps every argument.

Legend: B batch · T_q/T_k query/key length · H query heads · H_kv key/value heads ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from ..functional import attention
from ..varlen import varlen_attention, window_mask
from ._common import check_heads, check_layout, check_packed, fa_window, score_mod
from ._kvcache import flash_attn_with_kvcache
from ._modules import install, uninstall

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install",
    "uninstall",
]

#: the FlashAttention release whose API this follows
__version__ = "2.8.3"


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Any:
    """``flash_attn.flash_attn_func``: attention of q (B, T_q, H, D) over k (B, T_k, H_kv, D)
    and v (B, T_k, H_kv, D_v); H_kv divides H (GQA, MQA).

    Args:
        dropout_p: dropout on the attention weights (pass 0 in evaluation, as with FA);
            ``generator`` makes it reproducible.
        softmax_scale: default 1/sqrt(D).
        causal, window_size, softcap: FlashAttention's (module docstring).
        alibi_slopes: (H,) or (B, H), FlashAttention's symmetric ALiBi; differentiable.
        deterministic: accepted: qkv's forward and backward are deterministic always.
        return_attn_probs: also return the (B, H, T_q) log-sum-exp and the (B, H, T_q, T_k)
            attention weights (materialised, for tests; FA returns its dropout pattern).
        learnable_sink: (H,) sink logits (FlashAttention 4's), gpt-oss's attention sinks.

    Returns:
        out (B, T_q, H, D_v); with ``return_attn_probs``, ``(out, softmax_lse, weights)``.
    """
    check_layout("q", q, "(B, T_q, H, D)")
    check_layout("k", k, "(B, T_k, H_kv, D)")
    check_layout("v", v, "(B, T_k, H_kv, D_v)")
    check_heads(q.shape[2], k.shape[2], v.shape[2])
    mask = window_mask(fa_window(causal, window_size))
    result = attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask=mask,
        scale=softmax_scale,
        dropout_p=dropout_p,
        generator=generator,
        score_mod=score_mod(softcap, alibi_slopes),
        sinks=learnable_sink,
        return_weights=return_attn_probs,
        return_lse=return_attn_probs,
    )
    if not return_attn_probs:
        assert isinstance(result, torch.Tensor)
        return result.transpose(1, 2)
    out, weights, lse = result
    return out.transpose(1, 2), lse, weights


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    **extra: Any,
) -> Any:
    """:func:`flash_attn_func` on qkv (B, T, 3, H, D) packed. Gradients reach ``qkv``."""
    check_packed("qkv", qkv, 5, 3, "(B, T, 3, H, D)")
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, **extra,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    **extra: Any,
) -> Any:
    """:func:`flash_attn_func` with kv (B, T_k, 2, H_kv, D) packed."""
    check_packed("kv", kv, 5, 2, "(B, T_k, 2, H_kv, D)")
    k, v = kv.unbind(dim=2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        deterministic, return_attn_probs, **extra,
    )  # fmt: skip


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    learnable_sink: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Any:
    """``flash_attn.flash_attn_varlen_func``: sequences packed one after the other, q
    (total_q, H, D), k (total_k, H_kv, D), v (total_k, H_kv, D_v), sequence ``s`` from
    ``cu_seqlens[s]`` to ``cu_seqlens[s + 1]``. Each attends within itself at its own
    bottom-right positions (:func:`qkv.varlen_attention` underneath).

    ``alibi_slopes`` (H,) or (N, H): one row per sequence. With ``block_table``
    (N, max_pages), k and v are pages (num_pages, page_size, H_kv, ·) and ``cu_seqlens_k``
    gives each sequence's length in them.

    Returns:
        out (total_q, H, D_v); with ``return_attn_probs``, ``(out, softmax_lse, None)``,
        softmax_lse (H, total_q) as FA's (weights are not materialised for varlen).
    """
    seqused_k = None
    if block_table is not None:  # FA's paged varlen: the lengths come from cu_seqlens_k
        seqused_k = cu_seqlens_k.diff()
        cu_seqlens_k = None  # type: ignore[assignment]
    result = varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        return_aux=_Aux(return_attn_probs),
        scale=softmax_scale,
        window_size=fa_window(causal, window_size),
        enable_gqa=True,
        seqused_k=seqused_k,
        block_table=block_table,
        dropout_p=dropout_p,
        generator=generator,
        score_mod=score_mod(softcap, alibi_slopes),
        sinks=learnable_sink,
    )
    if not return_attn_probs:
        return result
    out, lse = result
    return out, lse.transpose(0, 1), None


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    **extra: Any,
) -> Any:
    """:func:`flash_attn_varlen_func` on qkv (total, 3, H, D) packed."""
    check_packed("qkv", qkv, 4, 3, "(total, 3, H, D)")
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, **extra,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    **extra: Any,
) -> Any:
    """:func:`flash_attn_varlen_func` with kv (total_k, 2, H_kv, D) packed."""
    check_packed("kv", kv, 4, 2, "(total_k, 2, H_kv, D)")
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, **extra,
    )  # fmt: skip


class _Aux:
    """What ``varlen_attention(return_aux=)`` reads: whether to return the log-sum-exp."""

    def __init__(self, lse: bool) -> None:
        self.lse = lse
