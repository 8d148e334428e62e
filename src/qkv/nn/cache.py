"""A KV cache: keys and values of the tokens seen so far, for incremental decoding.

An explicit object with preallocated buffers (no global state): a module appends the new
tokens' keys and values and attends over everything cached. Queries then sit at absolute
positions ``length - T_q .. length - 1``, which is exactly the bottom-right alignment of
qkv's causal mask.

Legend: B batch · H_kv key/value heads · T tokens appended · D head dim · D_v value dim.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..functional import MaskLike, attention
from ..masks import Mask, causal


class Cache(Protocol):
    """A KV cache as an attention module uses it, whatever its kind: where the new tokens
    sit (``positions``), and attention of their queries over every key it holds, after
    storing their keys and values (``attend``). :class:`KVCache`, a
    :class:`qkv.PagedKVCache`'s batch and its packed prefill each attend in their own way."""

    @property
    def length(self) -> int: ...

    def positions(self, T: int) -> torch.Tensor | int:
        """The absolute positions of T new tokens: one start for every row, or (B, T)."""
        ...

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
        """Store k (B, H_kv, T, D) and v (…, D_v), then attend q (B, H, T, D) over every key
        held: (B, H, T, D_v). ``mask`` is the caller's (or None), ``causal`` the module's."""
        ...


def with_causal(mask: MaskLike, is_causal: bool) -> MaskLike:
    """A module's mask: the caller's (a qkv mask, or a bool (T_q, T_k) / (B, T_q, T_k) /
    (B, H, T_q, T_k) tensor), and-ed with causal() for a causal module. A dense
    (B, T_q, T_k) mask gains a head dim to fit the (B, H, T_q, T_k) layout."""
    if isinstance(mask, torch.Tensor) and mask.ndim == 3:
        mask = mask[:, None]  # (B, 1, T_q, T_k)
    if not is_causal:
        return mask
    if mask is None or isinstance(mask, Mask):
        return causal() if mask is None else causal() & mask
    T_q, T_k = mask.shape[-2:]
    return mask & causal().dense(1, 1, T_q, T_k, device=mask.device)[0, 0]


class KVCache:
    """Preallocated key/value buffers of shape (B, H_kv, max_len, D) and (…, D_v).

    Args:
        batch, num_kv_heads, max_len, head_dim: B, H_kv, capacity in tokens, D.
        value_dim: D_v (default D).
        dtype, device: of the buffers; appended tensors must match.

    Example:
        >>> import torch, qkv
        >>> cache = qkv.KVCache(1, 2, max_len=4, head_dim=8)
        >>> k, v = cache.append(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
        >>> cache.length, k.shape
        (3, torch.Size([1, 2, 3, 8]))
        >>> cache.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
        Traceback (most recent call last):
        ...
        ValueError: KVCache overflow: appending T=2 tokens to 3 cached would exceed max_len=4
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        check_sizes(batch=batch, num_kv_heads=num_kv_heads, max_len=max_len, head_dim=head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        self.keys = torch.zeros(batch, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(
            batch, num_kv_heads, max_len, value_dim, dtype=dtype, device=device
        )
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, H_kv, T, D) keys and (B, H_kv, T, D_v) values after the cached ones;
        return views of all cached keys and values, (B, H_kv, length, ·)."""
        B, H_kv, _, D = self.keys.shape
        check_appended(key, value, B, H_kv, D, self.values.shape[-1], self.keys, "the cache")
        T = key.shape[2]
        if self.length + T > self.max_len:
            raise ValueError(
                f"KVCache overflow: appending T={T} tokens to {self.length} "
                f"cached would exceed max_len={self.max_len}"
            )
        self.keys[:, :, self.length : self.length + T] = key
        self.values[:, :, self.length : self.length + T] = value
        self.length += T
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def positions(self, T: int) -> int:
        """New tokens follow the cached ones: the first sits at ``length``."""
        return self.length

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
        """Append k and v, then attend q over every cached key (:class:`Cache`)."""
        keys, values = self.append(k, v)  # (B, H_kv, length, ·)
        mask = with_causal(mask, causal)
        return attention(q, keys, values, mask=mask, dropout_p=dropout_p, sinks=sinks)

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept)."""
        self.length = 0

    def __repr__(self) -> str:
        B, H_kv, max_len, D = self.keys.shape
        return (
            f"KVCache(batch={B}, num_kv_heads={H_kv}, length={self.length}, "
            f"max_len={max_len}, head_dim={D}, dtype={self.keys.dtype})"
        )


def check_sizes(**sizes: object) -> None:
    """Every size an int >= 1, or a ValueError naming it."""
    for name, n in sizes.items():
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1; got {n!r}")


def check_appended(
    key: torch.Tensor,
    value: torch.Tensor,
    B: int,
    H_kv: int,
    D: int,
    D_v: int,
    like: torch.Tensor,
    holder: str,
    what: str = "",
) -> None:
    """Keys (B, H_kv, T, D) and values (B, H_kv, T, D_v) of ``like``'s dtype and device, or
    a ValueError/TypeError saying which and why (``what`` qualifies B in the message)."""
    for name, x, last, letter in (("key", key, D, "D"), ("value", value, D_v, "D_v")):
        if x.ndim != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (B, H_kv, last):
            raise ValueError(
                f"{name} must have shape (B, H_kv, T, {letter}) with B={B}{what}, "
                f"H_kv={H_kv}, {letter}={last}; got {tuple(x.shape)}"
            )
        if x.dtype != like.dtype or x.device != like.device:
            raise TypeError(
                f"{name} is {x.dtype} on {x.device} but {holder} holds "
                f"{like.dtype} on {like.device}"
            )
    if value.shape[2] != key.shape[2]:
        raise ValueError(f"value must have T={key.shape[2]} tokens like key; got {value.shape[2]}")
