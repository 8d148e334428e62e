"""Run Hugging Face transformers (>= 5) models on qkv's attention.

    >>> from qkv.integrations import huggingface          # doctest: +SKIP
    >>> huggingface.register()                            # doctest: +SKIP
    >>> model = AutoModel.from_pretrained(path, attn_implementation="qkv")  # doctest: +SKIP

``register`` adds qkv to transformers' ``AttentionInterface`` *and* its mask builder to
``AttentionMaskInterface``: without the second, transformers would build no mask for an
unknown implementation, and padded batches would silently attend to padding.

transformers' masks are boolean with ``True`` = may attend (its ``sdpa_mask``), which is
qkv's polarity, so they pass through unchanged.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length · D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from ..functional import attention
from ..masks import causal

NAME = "qkv"


def qkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs: Any
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function signature on top of :func:`qkv.attention`.

    Args:
        query: (B, H, T_q, D); key, value: (B, H_kv, T_k, D) — GQA is native in qkv.
        attention_mask: bool (B, 1, T_q, T_k), True = may attend, or None.

    Returns:
        ``(out (B, T_q, H, D), weights (B, H, T_q, T_k) or None)``; weights only when
        attentions are asked for (``output_attentions``).
    """
    T_q = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = attention_mask
    if mask is None and is_causal and T_q > 1:
        # transformers skipped building a causal mask: it expects is_causal with keys aligned
        # to the queries, and drops cache slots past them (as its sdpa path does).
        key, value, mask = key[:, :, :T_q], value[:, :, :T_q], causal()
    config = getattr(module, "config", None)
    want_weights = bool(kwargs.get("output_attentions",
                                   getattr(config, "output_attentions", False)))
    result = attention(query, key, value, mask=mask, scale=scaling,
                       dropout_p=dropout if module.training else 0.0,
                       return_weights=want_weights)
    out, weights = result if want_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def register(name: str = NAME) -> None:
    """Make ``attn_implementation=name`` run on qkv in every transformers model."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:  # transformers is an optional extra
        raise ImportError('the Hugging Face integration needs transformers >= 5: '
                          'pip install "qkv[huggingface]"') from err
    AttentionInterface.register(name, qkv_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
