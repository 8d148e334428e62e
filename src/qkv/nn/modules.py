"""Attention modules: they own the weights, split and merge heads, and call
:func:`qkv.attention` for the rest. None re-implements softmax or masking.

Each creates its ``nn.Linear`` weights in the seeds' order (query, key, value, then the
output projection), so ``torch.manual_seed(s)`` followed by construction reproduces the
notebooks.

Every module has ``project(x) -> (q, k, v)`` in the (B, H, T, d_head) layout and
``merge(context) -> out``; ``forward`` is ``merge(attention(*project(x)))``. The two halves
are public so that :func:`qkv.explain` can show each step of the same computation. The
production :class:`qkv.MultiHeadAttention` lives in ``qkv.nn.mha``.

Legend: B batch · H heads · T sequence length · E = d_in model dim · d_head = d_out / H.
"""

from __future__ import annotations

import torch
from torch import nn

from ..functional import MaskLike, attention
from ..masks.library import with_causal


def check_input(name: str, x: torch.Tensor, d_in: int, weight: torch.Tensor | None = None) -> None:
    """A module input must be (T, E) or (B, T, E) with the module's E, and (outside
    autocast, which casts for the module) of the dtype and device of its ``weight``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.ndim not in (2, 3) or x.shape[-1] != d_in:
        raise ValueError(
            f"{name} must have shape (T, E) or (B, T, E) with E={d_in}; got {tuple(x.shape)}"
        )
    if weight is None or torch.is_autocast_enabled(x.device.type):
        return
    if x.dtype != weight.dtype:
        raise TypeError(
            f"{name} has dtype {str(x.dtype).replace('torch.', '')} but the module's weights "
            f"are {str(weight.dtype).replace('torch.', '')}: cast {name} (x.to(...)) or the "
            "module (module.to(...), .double(), .bfloat16())"
        )
    if x.device != weight.device:
        raise ValueError(
            f"{name} is on {x.device} but the module's weights are on {weight.device}: "
            "move one to the other"
        )


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, T, H * d_head) -> (B, H, T, d_head); (T, ·) inputs get B = 1."""
    x = x if x.ndim == 3 else x[None]
    B, T, _ = x.shape
    return x.view(B, T, num_heads, -1).transpose(1, 2)  # (B, H, T, d_head)


class AttentionModule(nn.Module):
    """What every qkv attention module shares: ``project`` to heads, the module's
    ``attention_mask``, and a forward that attends and ``merge``-s the heads back."""

    causal: bool
    dropout: float

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def merge(self, context: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attention_mask(self, mask: MaskLike = None) -> MaskLike:
        """The mask this module attends with: the user's (a qkv mask, or a bool (T_q, T_k) /
        (B, T_q, T_k) / (B, H, T_q, T_k) tensor), and-ed with causal() if the module is causal.
        Dense (B, T_q, T_k) masks gain a head dim to fit the (B, H, T_q, T_k) layout."""
        return with_causal(mask, self.causal)

    def forward(self, x: torch.Tensor, mask: MaskLike = None) -> torch.Tensor:
        """x: (T, E) or (B, T, E) -> (T, ·) or (B, T, ·). ``mask``: a qkv mask or a bool
        (T, T) / (B, T, T) tensor, True = may attend."""
        q, k, v = self.project(x)  # (B, H, T, d_head) each
        context = attention(
            q,
            k,
            v,
            mask=self.attention_mask(mask),
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.merge(context, like=x)


class SelfAttention(AttentionModule):
    """Single-head self-attention: queries, keys and values are linear maps of the same x.

    ``softmax(x W_q (x W_k)ᵀ / sqrt(d_out)) x W_v`` with ``nn.Linear`` weights (seed 004's
    ``SelfAttention_v2``): better initialised than ``torch.rand`` parameters.

    Args:
        d_in: input width E. d_out: width of queries, keys, values and the output.
        qkv_bias: give the three projections a bias.
        causal: each position attends only to itself and the past.
        dropout: dropout on the attention weights, in training mode only.

    Example:
        >>> import torch, qkv
        >>> _ = torch.manual_seed(789)
        >>> sa = qkv.learn.SelfAttention(3, 2)
        >>> sa(torch.rand(6, 3)).shape
        torch.Size([6, 2])
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        qkv_bias: bool = False,
        causal: bool = False,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.d_in, self.d_out, self.causal, self.dropout = d_in, d_out, causal, dropout
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_input("x", x, self.d_in, self.W_query.weight)
        q, k, v = (split_heads(W(x), 1) for W in (self.W_query, self.W_key, self.W_value))
        return q, k, v

    def merge(self, context: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        out = context[:, 0]  # (B, T, d_out)
        return out if like.ndim == 3 else out[0]


class CausalAttention(SelfAttention):
    """:class:`SelfAttention` with the causal mask always on (a decoder's attention)."""

    def __init__(
        self, d_in: int, d_out: int, *, dropout: float = 0.0, qkv_bias: bool = False
    ) -> None:
        super().__init__(d_in, d_out, qkv_bias=qkv_bias, causal=True, dropout=dropout)


class CrossAttention(nn.Module):
    """Encoder–decoder attention: queries from ``x_q``, keys from ``x_k`` and
    values from ``x_v`` (default ``x_k``).

    Args:
        d_in: width of x_q. d_out: width of queries, keys, values and output.
        d_kv: width of x_k and x_v; None means d_in.
        qkv_bias: give the three projections a bias.

    Example:
        >>> import torch, qkv
        >>> ca = qkv.learn.CrossAttention(4, 2, d_kv=3)
        >>> ca(torch.rand(5, 4), torch.rand(7, 3)).shape
        torch.Size([5, 2])
    """

    def __init__(
        self, d_in: int, d_out: int, *, d_kv: int | None = None, qkv_bias: bool = False
    ) -> None:
        super().__init__()
        self.d_in, self.d_kv = d_in, d_in if d_kv is None else d_kv
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(self.d_kv, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(self.d_kv, d_out, bias=qkv_bias)

    def forward(
        self,
        x_q: torch.Tensor,
        x_k: torch.Tensor,
        x_v: torch.Tensor | None = None,
        mask: MaskLike = None,
    ) -> torch.Tensor:
        """Queries from x_q, (T_q, d_in) or (B, T_q, d_in), keys and values from x_k and x_v,
        (T_k, d_kv) or (B, T_k, d_kv) in the layout of x_q. Returns (…, T_q, d_out)."""
        x_v = x_k if x_v is None else x_v
        check_input("x_q", x_q, self.d_in, self.W_query.weight)
        check_input("x_k", x_k, self.d_kv, self.W_key.weight)
        check_input("x_v", x_v, self.d_kv, self.W_value.weight)
        return attention(self.W_query(x_q), self.W_key(x_k), self.W_value(x_v), mask=mask)


class MultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` independent :class:`SelfAttention` heads, outputs concatenated
    (seed 002's ``MultiHeadAttention``): output width ``num_heads * d_out``, no output
    projection. Simple to read; :class:`MultiHeadAttention` is the efficient form."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        *,
        causal: bool = False,
        dropout: float = 0.0,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.heads = nn.ModuleList(
            SelfAttention(d_in, d_out, qkv_bias=qkv_bias, causal=causal, dropout=dropout)
            for _ in range(num_heads)
        )

    def forward(self, x: torch.Tensor, mask: MaskLike = None) -> torch.Tensor:
        """x: (T, E) or (B, T, E) -> (…, T, num_heads * d_out)."""
        return torch.cat([head(x, mask) for head in self.heads], dim=-1)
