"""Run Hugging Face transformers (>= 5) models on qkv's attention.

    >>> from qkv.integrations import huggingface          # doctest: +SKIP
    >>> huggingface.register()                            # doctest: +SKIP
    >>> model = AutoModel.from_pretrained(path, attn_implementation="qkv")  # doctest: +SKIP

``register`` adds qkv to transformers' ``AttentionInterface`` *and* its mask builder to
``AttentionMaskInterface``: without the second, transformers would build no mask for an
unknown implementation, and padded batches would silently attend to padding.

transformers' masks are boolean with ``True`` = may attend (its ``sdpa_mask``), which is
qkv's polarity, so they pass through unchanged. The score modifications models pass to the
attention function become :mod:`qkv.scores` modifications: Gemma 2's ``softcap``, T5's
``position_bias``.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length · D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from ..functional import attention
from ..masks import causal
from ..masks import sliding_window as sliding_window_mask
from ..scores import bias, chain
from ..scores import softcap as scores_softcap

NAME = "qkv"


# Keyword arguments transformers passes that say nothing about the attention itself.
_IGNORED = frozenset({"position_ids", "use_cache", "cache_position", "past_key_values",
                      "past_key_value", "layer_idx", "output_attentions", "return_dict"})


def qkv_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, softcap: float | None = None,
                          sliding_window: int | None = None,
                          position_bias: torch.Tensor | None = None, **kwargs: Any
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function signature on top of :func:`qkv.attention`.

    Args:
        query: (B, H, T_q, D); key, value: (B, H_kv, T_k, D) — GQA is native in qkv.
        attention_mask: bool (B, 1, T_q, T_k), True = may attend, or None (transformers
            skipped it: plain causal, or a sliding window no longer than the keys).
        softcap: Gemma 2's soft-capping of the scaled scores (:func:`qkv.scores.softcap`).
        sliding_window: the layer's window; transformers has already built it into
            ``attention_mask`` when there is one, and qkv builds it structurally when not.
        position_bias: T5's relative-position bias, added to the (unscaled: ``scaling``
            is 1) scores (:func:`qkv.scores.bias`).

    Any other keyword with a value is refused: qkv would silently ignore it.

    Returns:
        ``(out (B, T_q, H, D), weights (B, H, T_q, T_k) or None)``; weights only when
        attentions are asked for (``output_attentions``).
    """
    unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED and v is not None)
    if unknown:
        raise ValueError(f"qkv cannot honour the attention argument(s) {', '.join(unknown)} "
                         f"that {type(module).__name__} passes; use another attn_implementation")
    T_q = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask = attention_mask
    if mask is None and is_causal and T_q > 1:
        # transformers skipped building a causal mask: it expects is_causal with keys aligned
        # to the queries, and drops cache slots past them (as its sdpa path does).
        key, value = key[:, :, :T_q], value[:, :, :T_q]
        mask = sliding_window_mask(sliding_window) if sliding_window else causal()
    mods = ([bias(position_bias)] if position_bias is not None else []) + (
        [scores_softcap(softcap)] if softcap is not None else [])
    config = getattr(module, "config", None)
    want_weights = bool(kwargs.get("output_attentions",
                                   getattr(config, "output_attentions", False)))
    result = attention(query, key, value, mask=mask, scale=scaling,
                       dropout_p=dropout if module.training else 0.0,
                       return_weights=want_weights, score_mod=chain(*mods) if mods else None)
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
