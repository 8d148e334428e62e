"""Masks from torch's conventions: ``nn.MultiheadAttention``'s ``key_padding_mask`` and
``attn_mask`` (True = blocked, or additive 0 / -inf) as one qkv bool mask (True = may attend).

Legend: B batch · H query heads · T_q/T_k query/key length.
"""

from __future__ import annotations

import torch

from .._checks import fmt_shape


def _torch_allowed(name: str, m: torch.Tensor) -> torch.Tensor:
    """A torch-style mask (bool True = blocked, or additive 0 / -inf) as True = may attend."""
    if m.dtype == torch.bool:
        return ~m
    if m.is_floating_point():
        if not ((m == 0) | (m == float("-inf"))).all():
            raise ValueError(
                f"{name} holds additive biases other than 0 and -inf; qkv masks "
                "are boolean (True = may attend)"
            )
        return m == 0
    raise TypeError(f"{name} must be bool or floating point; got {m.dtype}")


def from_torch(
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    *,
    num_heads: int | None = None,
) -> torch.Tensor | None:
    """Translate ``nn.MultiheadAttention``'s masks, where bool ``True`` means *blocked*
    (or additive floats 0 / -inf), into one qkv bool mask where ``True`` means *may attend*.

    Args:
        key_padding_mask: (B, T_k), True = padding to ignore.
        attn_mask: (T_q, T_k) or (B·H, T_q, T_k), True = blocked.
        num_heads: H, needed for a (B·H, T_q, T_k) attn_mask.

    Returns:
        A bool tensor broadcastable to (B, H, T_q, T_k), or None if both are None.
    """
    allowed = None
    if key_padding_mask is not None:
        if key_padding_mask.ndim != 2:
            raise ValueError(
                f"key_padding_mask must have shape (B, T_k); "
                f"got {fmt_shape(key_padding_mask.shape)}"
            )
        allowed = _torch_allowed("key_padding_mask", key_padding_mask)[:, None, None, :]
    if attn_mask is not None:
        a = _torch_allowed("attn_mask", attn_mask)
        if a.ndim == 3:
            if num_heads is None or a.shape[0] % num_heads:
                raise ValueError(
                    f"a (B·H, T_q, T_k) attn_mask needs num_heads dividing "
                    f"{a.shape[0]}; got num_heads={num_heads}"
                )
            a = a.view(-1, num_heads, *a.shape[1:])  # (B, H, T_q, T_k)
        elif a.ndim != 2:
            raise ValueError(
                f"attn_mask must have shape (T_q, T_k) or (B·H, T_q, T_k); got {fmt_shape(a.shape)}"
            )
        allowed = a if allowed is None else allowed & a
    return allowed
