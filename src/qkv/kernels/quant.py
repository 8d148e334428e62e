"""Quantized keys and values: int8 or float8 (e4m3) rows with one float32 scale each.

A KV cache spends its time reading its bytes: at long context a decode step is memory-bound.
Stored as int8 or float8 a row of keys or values takes a quarter of float32's bytes (half of
bfloat16's), plus one float32 scale per token and key/value head. The scale is symmetric,
computed when the row is appended: ``amax(|row|) / Q`` with Q = 127 (int8) or 448 (e4m3's
largest finite value), so the row's largest value maps to ±Q and 0 to 0. A row of zeros
keeps scale 0 and dequantizes to zeros (no 0 / 0).

Legend: … any leading dims · D a row's width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: The storage dtypes a cache can quantize to, and the largest magnitude each holds.
QUANTIZED: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a quantized storage dtype (:data:`QUANTIZED`)."""
    return dtype in QUANTIZED


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x (…, D) as ``dtype`` (int8: rounded to nearest; e4m3: rounded by the cast) and
    their float32 scales (…): x ≈ stored · scale. x must be finite (:func:`check_finite`)."""
    top = QUANTIZED[dtype]
    x32 = x.to(torch.float32)
    scale = x32.abs().amax(dim=-1) / top
    y = x32 / torch.where(scale > 0, scale, 1.0)[..., None]
    if dtype == torch.int8:
        y = y.round()
    return y.clamp(-top, top).to(dtype), scale


def dequantize(
    stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows (…, D) back from their storage and scales (…), in ``dtype``."""
    return (stored.to(torch.float32) * scale[..., None]).to(dtype)


def check_finite(
    x: torch.Tensor, name: str, where: Callable[[int, int], tuple[int, int]] | None = None
) -> None:
    """Raise, naming the sequence and position, unless keys or values x (B, H_kv, T, D) are
    finite: a NaN or infinite value has no scale, and would make its whole row NaN.
    ``where(b, t)``: the sequence and position of row b's token t (default: (b, t))."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        b, _, t, _ = (int(i) for i in bad.nonzero()[0])
        seq, at = (b, t) if where is None else where(b, t)
        raise ValueError(
            f"{name} of sequence {seq} at position {at} holds NaN or inf: a quantized "
            "cache cannot scale it; nothing was stored"
        )


def check_no_grad(*xs: torch.Tensor) -> None:
    """Raise where a gradient would be recorded through a quantized cache: rounding to
    int8 or float8 has none worth the name, and the cache keeps no graph."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        raise ValueError(
            "a quantized cache holds no gradient: append to it under torch.no_grad() "
            "(generation), or use a float32 or bfloat16 cache to train through"
        )
