"""The caches of incremental decoding: the tokens seen so far, for a module to attend over.

Explicit objects with preallocated buffers (no global state): a module appends the new
tokens' keys and values and attends over everything cached. Queries then sit at absolute
positions ``length - T_q .. length - 1``, which is exactly the bottom-right alignment of
qkv's causal mask. :class:`KVCache` holds keys and values per head; :class:`LatentCache`
holds multi-head latent attention's one row per token (:mod:`qkv.nn.mla`), keys and values
both.

Legend: B batch · H_kv key/value heads · T tokens appended · D head dim · D_v value dim.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .._checks import check_appended, check_sizes
from ..functional import MaskLike, attention
from ..kernels.quant import check_finite, check_no_grad, dequantize, is_quantized, quantize
from ..masks.library import with_causal
from ..serving.latent import attend_in_place, check_rows, check_values_view
from ..varlen import paged_attention


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


class KVCache:
    """Preallocated key/value buffers of shape (B, H_kv, max_len, D) and (…, D_v).

    Args:
        batch, num_kv_heads, max_len, head_dim: B, H_kv, capacity in tokens, D.
        value_dim: D_v (default D).
        dtype, device: of the buffers; appended tensors must match. ``torch.int8`` or
            ``torch.float8_e4m3fn`` quantize: each appended row (a token's key or value for
            one head) is stored in that dtype with a float32 scale (``key_scale``,
            ``value_scale``: (B, H_kv, max_len)), a quarter of float32's bytes
            (:mod:`qkv.kernels.quant`); appended tensors are then ``compute_dtype``, and
            what :meth:`append` returns is dequantized to it. No gradient flows through a
            quantized cache.
        compute_dtype: the dtype a quantized cache takes and gives back (float32).

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
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        check_sizes(batch=batch, num_kv_heads=num_kv_heads, max_len=max_len, head_dim=head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        self.keys = torch.zeros(batch, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(
            batch, num_kv_heads, max_len, value_dim, dtype=dtype, device=device
        )
        self.key_scale: torch.Tensor | None = None
        self.value_scale: torch.Tensor | None = None
        self._like = self.keys  # what appended tensors must be (dtype, device)
        if is_quantized(dtype):
            scales = torch.zeros(2, batch, num_kv_heads, max_len, device=device)
            self.key_scale, self.value_scale = scales[0], scales[1]
            self._like = torch.empty(0, dtype=compute_dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, H_kv, T, D) keys and (B, H_kv, T, D_v) values after the cached ones;
        return all cached keys and values, (B, H_kv, length, ·): views, or a quantized
        cache's rows dequantized."""
        self.store(key, value)
        end = self.length
        if self.key_scale is None or self.value_scale is None:
            return self.keys[:, :, :end], self.values[:, :, :end]
        dtype = self._like.dtype
        return (
            dequantize(self.keys[:, :, :end], self.key_scale[:, :, :end], dtype),
            dequantize(self.values[:, :, :end], self.value_scale[:, :, :end], dtype),
        )

    def store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store (B, H_kv, T, D) keys and (B, H_kv, T, D_v) values after the cached ones
        (quantized, in a quantized cache), returning nothing: :meth:`append` without the
        read."""
        B, H_kv, _, D = self.keys.shape
        check_appended(key, value, B, H_kv, D, self.values.shape[-1], self._like, "the cache")
        T = key.shape[2]
        if self.length + T > self.max_len:
            raise ValueError(
                f"KVCache overflow: appending T={T} tokens to {self.length} "
                f"cached would exceed max_len={self.max_len}"
            )
        at, end = self.length, self.length + T
        if self.key_scale is None or self.value_scale is None:
            self.keys[:, :, at:end] = key
            self.values[:, :, at:end] = value
            self.length = end
            return
        check_no_grad(key, value)
        for name, x in (("key", key), ("value", value)):
            check_finite(x, name, lambda b, t: (b, at + t))
        self.keys[:, :, at:end], self.key_scale[:, :, at:end] = quantize(key, self.keys.dtype)
        self.values[:, :, at:end], self.value_scale[:, :, at:end] = quantize(
            value, self.values.dtype
        )
        self.length = end

    def as_pages(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The cache as :func:`qkv.paged_attention` reads it, no copy: each sequence one
        page of max_len slots — keys (B, max_len, H_kv, D) and values (…, D_v) views —
        its block table (B, 1) and the lengths (B,)."""
        B = self.keys.shape[0]
        table = torch.arange(B, device=self.keys.device)[:, None]
        lengths = torch.full((B,), self.length, device=self.keys.device)
        return self.keys.transpose(1, 2), self.values.transpose(1, 2), table, lengths

    def tensors(self) -> dict[str, torch.Tensor]:
        """What the cache stores, by name: keys and values, and a quantized cache's scales."""
        held = {"keys": self.keys, "values": self.values}
        if self.key_scale is not None and self.value_scale is not None:
            held |= {"key_scale": self.key_scale, "value_scale": self.value_scale}
        return held

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
        """Append k and v, then attend q over every cached key (:class:`Cache`). A quantized
        cache's decode step (one query, no mask or dropout) reads the stored rows in place
        (:func:`qkv.paged_attention`, each sequence one page). Anything else attends over
        the rows :meth:`append` gives back."""
        ks, vs = self.key_scale, self.value_scale
        if ks is not None and vs is not None and q.shape[2] == 1 and mask is None and not dropout_p:
            self.store(k, v)
            keys, values, table, lengths = self.as_pages()
            out = paged_attention(
                q[:, :, 0],
                keys,
                values,
                table,
                lengths,
                sinks=sinks,
                key_scale=ks.transpose(1, 2),
                value_scale=vs.transpose(1, 2),
            )
            assert isinstance(out, torch.Tensor)
            return out[:, :, None]
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


class LatentCache:
    """The cache of a :class:`MultiHeadLatentAttention` layer: one row per token of its
    latent (``kv_lora_rank`` values) followed by its rotary key (``rope_dim`` values),
    (B, 1, max_len, r + rope). The absorbed form attends over these rows as they are: one
    key/value head whose values are the first r columns of its keys (a view, no copy).

    ``dtype=torch.int8`` or ``torch.float8_e4m3fn`` quantizes each row with a float32 scale
    (``scales``, (B, 1, max_len)); :meth:`append` then gives the rows back dequantized to
    ``compute_dtype``.

    Example:
        >>> import torch, qkv
        >>> mla = qkv.nn.MultiHeadLatentAttention(
        ...     64, 4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        >>> cache = mla.new_cache(batch=1, max_len=10)
        >>> _ = mla(torch.randn(1, 3, 64), cache=cache)
        >>> cache.length, {n: tuple(t.shape) for n, t in cache.tensors().items()}
        (3, {'rows': (1, 1, 10, 40)})
    """

    def __init__(
        self,
        batch: int,
        max_len: int,
        kv_lora_rank: int,
        rope_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        check_sizes(batch=batch, max_len=max_len, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
        self.kv_lora_rank = kv_lora_rank
        self.rows = torch.zeros(
            batch, 1, max_len, kv_lora_rank + rope_dim, dtype=dtype, device=device
        )
        self.scales: torch.Tensor | None = None
        self._like = self.rows  # what appended rows must be (dtype, device)
        if is_quantized(dtype):
            self.scales = torch.zeros(batch, 1, max_len, device=device)
            self._like = torch.empty(0, dtype=compute_dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.rows.shape[2]

    def tensors(self) -> dict[str, torch.Tensor]:
        """What the cache stores, by name: its rows (B, 1, max_len, r + rope), and a
        quantized cache's scales (B, 1, max_len)."""
        return {"rows": self.rows} | ({} if self.scales is None else {"scales": self.scales})

    def bytes_per_token(self) -> int:
        """Bytes the cache holds per token of one sequence (one layer)."""
        return sum(t[0, :, 0].numel() * t.element_size() for t in self.tensors().values())

    def held(self) -> torch.Tensor:
        """The cached rows (B, 1, length, r + rope), dequantized where quantized."""
        rows = self.rows[:, :, : self.length]
        if self.scales is None:
            return rows
        return dequantize(rows, self.scales[:, :, : self.length], self._like.dtype)

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Store rows (B, 1, T, r + rope) after the cached ones, and return all cached rows
        (B, 1, length, r + rope): a view, or dequantized."""
        self.store(rows)
        return self.held()

    def store(self, rows: torch.Tensor) -> None:
        """Store rows (B, 1, T, r + rope) after the cached ones (quantized, in a quantized
        cache), returning nothing: :meth:`append` without the read."""
        B, _, max_len, width = self.rows.shape
        check_rows(rows, B, width, self._like, "the cache")
        T = rows.shape[2]
        if self.length + T > max_len:
            raise ValueError(
                f"LatentCache overflow: appending T={T} tokens to {self.length} cached would "
                f"exceed max_len={max_len}"
            )
        at, end = self.length, self.length + T
        if self.scales is None:
            self.rows[:, :, at:end] = rows
        else:
            check_no_grad(rows)
            check_finite(rows, "latent row", lambda b, t: (b, at + t))
            self.rows[:, :, at:end], self.scales[:, :, at:end] = quantize(rows, self.rows.dtype)
        self.length = end

    def positions(self, T: int) -> int:
        """New tokens follow the cached ones: the first sits at ``length``."""
        return self.length

    def reads_in_place(self, T_q: int, mask: MaskLike, dropout_p: float) -> bool:
        """Whether :meth:`attend` reads the stored rows where they lie (a quantized cache's
        decode step) rather than attending over the rows :meth:`held` gives."""
        return self.scales is not None and T_q == 1 and mask is None and not dropout_p

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
        scale: float | None = None,
    ) -> torch.Tensor:
        """Append the new rows k (B, 1, T, r + rope), then attend the absorbed queries q
        (B, H, T, r + rope) over every cached row, its first r columns the values:
        (B, H, T, r) (:class:`qkv.nn.Cache`). v must be k's first r columns (a view): the
        values are part of the rows, never stored apart. A quantized cache's decode step
        (one query, no mask or dropout) reads the stored rows in place
        (:func:`qkv.paged_attention`, each sequence one page, keys and values one row)."""
        r = self.kv_lora_rank
        check_values_view(k, v, r, "LatentCache.attend")
        if self.scales is not None and self.reads_in_place(q.shape[2], mask, dropout_p):
            self.store(k)
            B = self.rows.shape[0]  # each sequence one page of max_len rows
            table = torch.arange(B, device=q.device)[:, None]
            lengths = torch.full((B,), self.length, device=q.device)
            pages, scales = self.rows.transpose(1, 2), self.scales.transpose(1, 2)
            return attend_in_place(q, pages, scales, table, lengths, r, scale, sinks)
        rows = self.append(k)
        return attention(
            q,
            rows,
            rows[..., :r],
            mask=with_causal(mask, causal),
            dropout_p=dropout_p,
            sinks=sinks,
            scale=scale,
        )

    def reset(self) -> None:
        """Forget every cached token (the buffer is kept)."""
        self.length = 0

    def __repr__(self) -> str:
        B, _, max_len, width = self.rows.shape
        return (
            f"LatentCache(batch={B}, length={self.length}, max_len={max_len}, "
            f"kv_lora_rank={self.kv_lora_rank}, rope_dim={width - self.kv_lora_rank}, "
            f"dtype={self.rows.dtype})"
        )
