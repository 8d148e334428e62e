"""``flash_attn_with_kvcache`` on a CPU: the new keys and values rotated and written into the
cache in place, then each sequence's queries attend its filled cache.

Legend: B batch · T_q new queries · T_new new keys · S cache slots per sequence · P page size ·
H query heads · H_kv key/value heads · D head dim · D_v value head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from ..functional import attention
from ..varlen import paged_attention, pages_needed, window_mask
from ._common import fa_window, score_mod


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
) -> Any:
    """``flash_attn.flash_attn_with_kvcache``: a decode or chunked-prefill step over a KV cache.

    Args:
        q: (B, T_q, H, D), the new queries.
        k_cache, v_cache: (B_cache, S, H_kv, D) and (…, D_v); or, with ``block_table``,
            pages (num_pages, P, H_kv, ·). Written in place where ``k``/``v`` are given.
        k, v: (B, T_new, H_kv, ·) new keys and values, written at slots
            ``cache_seqlens[b] ..`` of sequence b before attending.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2): rotary embedding applied to the
            first rotary_dim dims of ``k`` at positions ``cache_seqlens − cache_leftpad + t``
            and of ``q`` at those positions (causal or windowed) or all at
            ``cache_seqlens − cache_leftpad`` (otherwise), as FA does.
        cache_seqlens: an int or (B,) integers, the tokens each sequence holds before this
            step; None: every slot (S) is filled.
        cache_batch_idx: (B,) the cache row of each sequence (contiguous caches only).
        cache_leftpad: (B,) the first slot each sequence uses; slots before it are not read.
        block_table: (B, max_pages) the pages of each sequence, in order.
        softmax_scale, causal, window_size, softcap, alibi_slopes, learnable_sink: as in
            :func:`qkv.flash_attn.flash_attn_func`, with query ``i`` at position
            ``L − T_q + i`` over the sequence's L filled keys.
        rotary_interleaved: rotate pairs of adjacent dims (GPT-J) rather than the two halves
            (GPT-NeoX).
        num_splits: FA's split-KV knob for GPUs: accepted, changes nothing.
        return_softmax_lse: also return the (B, H, T_q) log-sum-exp.

    Returns:
        out (B, T_q, H, D_v), and softmax_lse with ``return_softmax_lse``. Like FA's, this
        call has no backward: the cache is written without recording gradients.
    """
    if not (isinstance(q, torch.Tensor) and q.ndim == 4):
        raise ValueError(f"q must have shape (B, T_q, H, D); got {tuple(getattr(q, 'shape', ()))}")
    B, T_q, H, D = q.shape
    cache = _Cache(k_cache, v_cache, block_table, cache_batch_idx, B, H, D)
    lengths = cache.lengths(cache_seqlens)
    T_new = cache.check_new(k, v)
    leftpad = _per_sequence("cache_leftpad", cache_leftpad, B, 0)
    if bool((leftpad > lengths).any()) or bool((leftpad < 0).any()):
        raise ValueError(
            f"cache_leftpad must be 0 .. cache_seqlens per sequence; got {leftpad.tolist()} "
            f"for cache_seqlens {lengths.tolist()}"
        )
    if bool((lengths + T_new > cache.capacity).any()):
        raise ValueError(
            f"cache_seqlens + the {T_new} new tokens must fit the cache's {cache.capacity} "
            f"slots per sequence; got cache_seqlens {lengths.tolist()}"
        )
    total = lengths + T_new
    cache.check_pages(total)
    window = fa_window(causal, window_size)
    if rotary_cos is not None or rotary_sin is not None:
        first = lengths - leftpad  # the rotary position of slot cache_seqlens
        steps = torch.arange(T_q) if window != (-1, -1) else torch.zeros(T_q, dtype=torch.long)
        interleaved = rotary_interleaved
        q = _rotate(q, rotary_cos, rotary_sin, first[:, None] + steps, interleaved)
        if k is not None:
            k = _rotate(
                k, rotary_cos, rotary_sin, first[:, None] + torch.arange(T_new), interleaved
            )
    if k is not None and v is not None:
        cache.write(lengths, k, v)
    mod = score_mod(softcap, alibi_slopes)
    plain = mod is None and window[0] == -1 and not bool(leftpad.any())
    if plain and T_q == 1 and not q.requires_grad:  # a decode step: pages read in place
        out, lse = paged_attention(
            q[:, 0],
            cache.k,
            cache.v,
            cache.block_table,
            total,
            scale=softmax_scale,
            sinks=learnable_sink,
            return_lse=True,
        )
        out, lse = out[:, None], lse[:, :, None]
    else:
        outs, lses = [], []
        mask = window_mask(window)
        for b in range(B):
            # Keys before the lowest query's window are never seen: not gathered. Relative
            # positions (all the mask and ALiBi read) are unchanged by the cut.
            start = int(leftpad[b])
            if window[0] >= 0:
                start = max(start, int(total[b]) - T_q - window[0])
            keys, values = cache.sequence(b, start, int(total[b]))
            o, lse_b = attention(
                q[b : b + 1].transpose(1, 2),
                keys,
                values,
                mask=mask,
                scale=softmax_scale,
                score_mod=None if mod is None else mod.select(b),
                sinks=learnable_sink,
                return_lse=True,
            )
            outs.append(o.transpose(1, 2))
            lses.append(lse_b)
        out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_softmax_lse else out


class _Cache:
    """A contiguous or paged KV cache as this call reads and writes it, its shapes checked."""

    def __init__(
        self, k_cache: Any, v_cache: Any, table: Any, batch_idx: Any, B: int, H: int, D: int
    ) -> None:
        letters = "(num_pages, P, H_kv, D)" if table is not None else "(B_cache, S, H_kv, D)"
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not (isinstance(x, torch.Tensor) and x.ndim == 4):
                raise ValueError(
                    f"{name} must have shape {letters}; got {tuple(getattr(x, 'shape', ()))}"
                )
        H_kv = k_cache.shape[2]
        if k_cache.shape[3] != D or v_cache.shape[:3] != k_cache.shape[:3] or H % H_kv:
            raise ValueError(
                f"k_cache must have shape {letters} with D = {D} and H_kv dividing H = {H}, "
                f"v_cache the same but D_v; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
            )
        self.k, self.v, self.B = k_cache, v_cache, B
        if table is not None:
            if batch_idx is not None:
                raise ValueError(
                    "cache_batch_idx applies to a contiguous cache, not with block_table"
                )
            table = torch.as_tensor(table)
            if table.ndim != 2 or table.shape[0] != B or table.is_floating_point():
                raise ValueError(
                    f"block_table must be (B, max_pages) integers with B = {B}; got "
                    f"{tuple(table.shape)} {table.dtype}"
                )
            self.P = k_cache.shape[1]
            self.capacity = table.shape[1] * self.P
            self.rows = None
            self.block_table = table.long()
        else:
            self.P = self.capacity = k_cache.shape[1]
            self.rows = _per_sequence("cache_batch_idx", batch_idx, B, None)
            if bool((self.rows < 0).any()) or bool((self.rows >= k_cache.shape[0]).any()):
                raise ValueError(
                    f"cache_batch_idx must name rows 0 .. {k_cache.shape[0] - 1} of the cache; "
                    f"got {self.rows.tolist()}"
                )
            self.block_table = self.rows[:, None]  # each row is one page of S slots

    def lengths(self, cache_seqlens: Any) -> torch.Tensor:
        if cache_seqlens is None:
            if self.rows is None:
                raise ValueError(
                    "a paged cache needs cache_seqlens: the tokens each sequence holds"
                )
            return torch.full((self.B,), self.capacity, dtype=torch.long)
        return _per_sequence("cache_seqlens", cache_seqlens, self.B, None)

    def check_new(self, k: Any, v: Any) -> int:
        if (k is None) != (v is None):
            raise ValueError("k and v are appended together: give both or neither")
        if k is None:
            return 0
        want = (self.B, k.shape[1] if k.ndim == 4 else -1, *self.k.shape[2:])
        if k.ndim != 4 or tuple(k.shape) != want or tuple(v.shape) != (*want[:3], self.v.shape[3]):
            raise ValueError(
                f"k must have shape (B, T_new, H_kv, D) = {want} and v (B, T_new, H_kv, D_v) "
                f"to match the cache; got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        return int(k.shape[1])

    def check_pages(self, total: torch.Tensor) -> None:
        """Every page a sequence's tokens need is one of the cache's (paged caches)."""
        if self.rows is None:
            pages_needed(self.block_table, total, self.k.shape[0], self.P, "cache_seqlens")

    def slots(self, b: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of sequence b's slots start .. stop − 1."""
        pos = torch.arange(start, stop)
        return self.block_table[b, pos // self.P], pos % self.P

    @torch.no_grad()
    def write(self, lengths: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for b in range(self.B):
            page, offset = self.slots(b, int(lengths[b]), int(lengths[b]) + k.shape[1])
            self.k[page, offset] = k[b].to(self.k.dtype)
            self.v[page, offset] = v[b].to(self.v.dtype)

    def sequence(self, b: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's keys and values of slots start .. stop − 1, (1, H_kv, L, ·)."""
        page, offset = self.slots(b, start, stop)
        keys = self.k[page, offset].transpose(0, 1)[None]  # (1, H_kv, L, D)
        values = self.v[page, offset].transpose(0, 1)[None]  # (1, H_kv, L, D_v)
        return keys, values


def _per_sequence(name: str, x: Any, B: int, default: int | None) -> torch.Tensor:
    """An int or (B,) integers as a (B,) long tensor; ``default`` where x is None."""
    if x is None:
        return (
            torch.full((B,), default, dtype=torch.long) if default is not None else torch.arange(B)
        )
    if isinstance(x, int) and not isinstance(x, bool):
        return torch.full((B,), x, dtype=torch.long)
    t = torch.as_tensor(x)
    if t.shape != (B,) or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(
            f"{name} must be an int or (B,) = ({B},) integers; got {t.dtype} {tuple(t.shape)}"
        )
    return t.long().cpu()


def _rotate(
    x: torch.Tensor, cos: Any, sin: Any, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding on the first rotary_dim dims of x (B, T, heads, D) at positions
    (B, T): pairs of adjacent dims (interleaved) or the two halves rotated by the angle
    whose cosine and sine are ``cos[p]``, ``sin[p]`` (seqlen_ro, rotary_dim / 2)."""
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        raise ValueError("rotary_cos and rotary_sin go together: give both or neither")
    half = cos.shape[-1] if cos.ndim == 2 else -1
    if cos.ndim != 2 or sin.shape != cos.shape or 2 * half > x.shape[-1]:
        raise ValueError(
            f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with "
            f"rotary_dim <= D = {x.shape[-1]}; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if int(positions.max()) >= cos.shape[0]:
        raise ValueError(
            f"rotary_cos has {cos.shape[0]} positions; this step needs position "
            f"{int(positions.max())}"
        )
    c = cos[positions][:, :, None].to(x.dtype)  # (B, T, 1, rotary_dim / 2)
    s = sin[positions][:, :, None].to(x.dtype)
    r = 2 * half
    if interleaved:
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        turned = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :half], x[..., half:r]
        turned = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([turned, x[..., r:]], dim=-1)
