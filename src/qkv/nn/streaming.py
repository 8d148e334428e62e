"""A streaming cache (Xiao et al., *Efficient Streaming Language Models with Attention
Sinks*, 2023): the first ``sinks`` tokens and the last ``window`` ones, so that a model
reads a stream far longer than its context in fixed memory.

When the cache is full, each new token evicts the oldest token of the window. The first
tokens stay, because trained models park attention on them (the "attention sinks") and
lose their footing when they go. Positions are the paper's: a token's position is its slot
in the cache, not in the text — keys are kept before their rotary embedding and rotated
at their current slots on every step, so relative distances stay within what the model was
trained on.

Legend: B batch · H query heads · H_kv key/value heads · T tokens appended · D head dim.
"""

from __future__ import annotations

import torch

from .._checks import check_appended, check_sizes
from ..functional import MaskLike, attention
from ..masks import causal as causal_mask
from .rope import RoPE


class StreamingCache:
    """The first ``sinks`` tokens and the last ``window`` tokens of a stream, (B, H_kv,
    sinks + window, D) keys and (…, D_v) values: the :class:`qkv.nn.Cache` protocol, for
    :class:`qkv.MultiHeadAttention` and the GPT (:meth:`qkv.models.GPT.new_streaming_caches`).

    Args:
        batch, num_kv_heads, head_dim: B, H_kv, D; ``value_dim`` D_v (default D).
        window: the recent tokens kept (>= 1).
        sinks: the first tokens kept for good (0: a plain window, the paper's failing
            baseline; 4 in the paper).
        rope: the module's rotary embedding, if it has one: keys are stored unrotated and
            rotated at their slots each step (the paper's positions); None for a model
            with learned absolute positions, which then reads slots as positions too.
        dtype, device: of the buffers.

    Example:
        >>> import torch, qkv
        >>> mha = qkv.MultiHeadAttention(16, 16, 2, causal=True, rope=qkv.RoPE(8))
        >>> cache = qkv.nn.StreamingCache(1, 2, 8, window=3, sinks=1, rope=mha.rope)
        >>> for t in range(6):                           # a stream of 6 tokens, one at a time
        ...     _ = mha(torch.randn(1, 1, 16), cache=cache)
        >>> cache.length, cache.seen                     # 1 sink + 3 recent; 6 read
        (4, 6)
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        window: int,
        sinks: int = 4,
        value_dim: int | None = None,
        rope: RoPE | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        check_sizes(batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, window=window)
        if not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"sinks must be an int >= 0; got {sinks!r}")
        if rope is not None and rope.head_dim != head_dim:
            raise ValueError(f"rope must have head_dim = {head_dim}; got {rope.head_dim}")
        size = sinks + window
        value_dim = head_dim if value_dim is None else value_dim
        self.keys = torch.zeros(batch, num_kv_heads, size, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, num_kv_heads, size, value_dim, dtype=dtype, device=device)
        self.sinks, self.window, self.rope = sinks, window, rope
        self.length = 0  # tokens held (at most sinks + window)
        self.seen = 0  # tokens read from the stream

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    def positions(self, T: int) -> int:
        """The slot of the first of T new tokens once they are stored: its position."""
        return min(self.length + T, self.capacity) - T

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store (B, H_kv, T, D) keys (unrotated) and values, evicting the oldest tokens of
        the window as needed; T tokens at once only while none is evicted before the last of
        them is stored (a chunk's first queries would lose keys they see)."""
        B, H_kv, _, D = self.keys.shape
        check_appended(key, value, B, H_kv, D, self.values.shape[-1], self.keys, "the cache")
        T = key.shape[2]
        if T > 1 and self.length + T > self.capacity:
            raise ValueError(
                f"a StreamingCache holding {self.length} of {self.capacity} tokens takes a chunk "
                f"of {T} only if none is evicted: feed the stream one token at a time past "
                "its capacity"
            )
        if self.length + T > self.capacity:  # one token: the window's oldest makes room
            keep = slice(self.sinks + 1, self.capacity)
            for x in (self.keys, self.values):
                x[:, :, self.sinks : self.capacity - 1] = x[:, :, keep].clone()
            self.length -= 1
        at = self.length
        self.keys[:, :, at : at + T] = key
        self.values[:, :, at : at + T] = value
        self.length += T
        self.seen += T

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: MaskLike,
        causal: bool,
        dropout_p: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Store k and v, then attend q over the tokens kept (:class:`qkv.nn.Cache`). q and k
        arrive rotated at :meth:`positions`' slots. The keys are stored unrotated, and every
        kept key is rotated at its slot for this step. A mask of the caller's is refused: the kept
        tokens are not the text's positions."""
        if mask is not None:
            raise ValueError("a StreamingCache takes no mask: its tokens are not the text's")
        T = q.shape[2]
        first = self.positions(T)
        if self.rope is not None:  # back to unrotated: the slots move as tokens are evicted
            k = self.rope(k, torch.arange(-first, -first - T, -1, device=k.device))
        self.append(k, v)
        keys = self.keys[:, :, : self.length]
        if self.rope is not None:
            keys = self.rope(keys, 0)
        values = self.values[:, :, : self.length]
        step_mask = causal_mask() if causal and T > 1 else None
        return attention(q, keys, values, mask=step_mask, dropout_p=dropout_p, sinks=sinks)

    def reset(self) -> None:
        """Forget every token (the buffers are kept)."""
        self.length = self.seen = 0

    def __repr__(self) -> str:
        return (
            f"StreamingCache(sinks={self.sinks}, window={self.window}, length={self.length}, "
            f"seen={self.seen}, rope={self.rope is not None})"
        )
