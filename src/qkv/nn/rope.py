"""Rotary position embedding (RoPE, Su et al. 2021).

Each pair of channels ``(x_i, x_{i + D/2})`` of a query or key at absolute position ``p`` is
rotated by the angle ``p · base^(-2i/D)``. A rotation preserves norms, and the dot product of
a rotated query at ``p`` and a rotated key at ``s`` depends only on ``p - s``: attention sees
relative positions although each vector was rotated by its own absolute one. The channel
pairing is the "rotate half" one of GPT-NeoX and Llama; ``interleaved=True`` pairs
neighbours ``(x_2i, x_2i+1)`` instead, as DeepSeek's checkpoints do.

Legend: B batch · H heads · T sequence length · D head dim.
"""

from __future__ import annotations

import torch
from torch import nn


class RoPE(nn.Module):
    """Rotary position embedding for heads of width ``head_dim`` (even).

    Args:
        head_dim: D, the width of each head.
        base: the wavelength base; 10000 as in the paper.
        interleaved: pair neighbouring channels (DeepSeek's layout); the output holds the
            rotated even channels, then the odd ones, so a query and a key rotated alike
            keep their dot product.
        inv_freq: the D/2 angular frequencies, where a scaled RoPE (YaRN, as DeepSeek V3
            uses) computes its own; None: ``base^(-2i/D)``.
        scaling: cos and sin multiplied by it (YaRN's attention factor); 1 for plain RoPE.

    Example:
        >>> import torch, qkv
        >>> rope = qkv.RoPE(8)
        >>> q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
        >>> a = rope(q, positions=5) @ rope(k, positions=3).transpose(-1, -2)
        >>> b = rope(q, positions=12) @ rope(k, positions=10).transpose(-1, -2)
        >>> torch.allclose(a, b, atol=1e-5)     # only the distance 2 matters
        True
    """

    inv_freq: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        interleaved: bool = False,
        inv_freq: torch.Tensor | None = None,
        scaling: float = 1.0,
    ) -> None:
        super().__init__()
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 2; got {head_dim}")
        if not base > 1:
            raise ValueError(f"base must be > 1; got {base}")
        if inv_freq is None:
            inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        elif inv_freq.shape != (head_dim // 2,):
            raise ValueError(
                f"inv_freq must have shape (head_dim / 2,) = ({head_dim // 2},); "
                f"got {tuple(inv_freq.shape)}"
            )
        self.head_dim, self.base = head_dim, base
        self.interleaved, self.scaling = interleaved, float(scaling)
        self.register_buffer("inv_freq", inv_freq.to(torch.float64), persistent=False)

    def forward(self, x: torch.Tensor, positions: int | torch.Tensor = 0) -> torch.Tensor:
        """Rotate x: (…, T, D). ``positions`` is the absolute position of x's first row (an
        int), one position per row: a (T,) integer tensor, or per batch row and row: a
        (B, T) integer tensor for x of shape (B, H, T, D) (sequences at their own places)."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must have shape (..., T, D) with D={self.head_dim}; got {tuple(x.shape)}"
            )
        T = x.shape[-2]
        if isinstance(positions, int):
            positions = torch.arange(positions, positions + T, device=x.device)
        elif positions.shape != (T,) and not (x.ndim == 4 and positions.shape == (x.shape[0], T)):
            raise ValueError(
                f"positions must have shape (T,) = ({T},) (or (B, T) for a (B, H, T, D) x); "
                f"got {tuple(positions.shape)}"
            )
        angles = positions.to(torch.float64)[..., None] * self.inv_freq.to(x.device)  # (…T, D/2)
        cos = torch.cat([torch.cos(angles) * self.scaling] * 2, dim=-1).to(x.dtype)  # (…T, D)
        sin = torch.cat([torch.sin(angles) * self.scaling] * 2, dim=-1).to(x.dtype)
        if self.interleaved:  # pairs (x_2i, x_2i+1) as (x_i, x_i+D/2)
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)

        if positions.ndim == 2:  # (B, T, D) -> (B, 1, T, D), across the heads
            cos, sin = cos[:, None], sin[:, None]
        half = self.head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def extra_repr(self) -> str:
        extra = ", interleaved=True" if self.interleaved else ""
        extra += f", scaling={self.scaling:g}" if self.scaling != 1.0 else ""
        return f"head_dim={self.head_dim}, base={self.base:g}{extra}"
