"""A paged KV cache: keys and values in fixed-size pages taken from one pool per layer.

A contiguous :class:`qkv.KVCache` reserves ``batch × max_len`` tokens up front. A paged cache
reserves a pool of pages. A sequence takes a page when its last one is full and gives all of
them back when it ends, so the memory held follows the tokens actually cached. Each sequence
has a block table (its pages, in order). Its sequences as one batch's cache, and every
layer's pools under one allocator: :mod:`qkv.serving.batch`.

Legend: B sequences in a batch · H_kv key/value heads · P page size · T tokens appended ·
D head dim · D_v value dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._checks import check_appended, check_sizes
from .._memory import zeros
from ..kernels.quant import check_finite, check_no_grad, dequantize, is_quantized, quantize
from .batch import PagedBatch
from .packed import PackedBatch
from .pages import PageAllocator, Pass


class PagedKVCache:
    """One layer's pool of pages, shared by any number of sequences.

    Args:
        num_pages: pages in the pool.
        page_size: tokens per page (P).
        num_kv_heads, head_dim: H_kv, D; ``value_dim`` D_v (default D).
        dtype, device: of the pool; appended tensors must match. ``torch.int8`` or
            ``torch.float8_e4m3fn`` quantize each appended row with a float32 scale, as
            :class:`qkv.KVCache` does (:meth:`scales`); appended tensors are then
            ``compute_dtype`` (float32), the native decode kernel reads the pages in place,
            and :meth:`gather` dequantizes.

    Example:
        >>> import torch, qkv
        >>> pool = qkv.PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)
        >>> a, b = pool.new_sequence(), pool.new_sequence()
        >>> pool.append([a, b], torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8))
        >>> pool.lengths([a, b]).tolist(), pool.pages_in_use
        ([5, 5], 4)
        >>> pool.free(a); pool.pages_in_use     # a's two pages go back to the pool
        2
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        check_sizes(
            num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim
        )
        value_dim = head_dim if value_dim is None else value_dim
        # (H_kv, pages, P, ·): a batch's pages gathered along dim 1 are, viewed, its
        # (B, H_kv, L, ·) keys: one copy per gather, no transpose copy.
        shape = (num_kv_heads, num_pages, page_size)
        self.keys = zeros((*shape, head_dim), dtype, device)  # (huge pages: qkv._memory)
        self.values = zeros((*shape, value_dim), dtype, device)
        # A quantized pool's scales, (H_kv, pages, P) each; None for a float pool.
        self.key_scale: torch.Tensor | None = None
        self.value_scale: torch.Tensor | None = None
        self._like = self.keys  # what appended tensors must be (dtype, device)
        if is_quantized(dtype):
            scales = zeros((2, *shape), torch.float32, device)
            self.key_scale, self.value_scale = scales[0], scales[1]
            self._like = torch.empty(0, dtype=compute_dtype, device=device)
        self._scratch: dict[str, torch.Tensor] = {}  # gather's buffers, reused (inference)
        self._allocator = PageAllocator(num_pages, page_size)

    @property
    def page_size(self) -> int:
        return self.keys.shape[2]

    @property
    def num_pages(self) -> int:
        return self.keys.shape[1]

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - self._allocator.free_pages

    @property
    def tokens(self) -> int:
        """Tokens held by every live sequence together."""
        return sum(self._allocator.lengths.values())

    def new_sequence(self) -> int:
        """A new, empty sequence's id (it holds no page until it holds a token)."""
        return self._allocator.new_sequence()

    def free(self, seq: int) -> None:
        """End a sequence: each of its pages goes back to the pool, to be reused, once no
        other sequence holds it (pages shared by :meth:`fork` are counted)."""
        self._allocator.release(seq)

    def fork(self, seq: int) -> int:
        """A new sequence that starts as a copy of ``seq`` (a shared prompt): its full pages
        are shared, not copied (counted, freed with the last holder). A partly filled last
        page is copied, so that each sequence appends to a page of its own."""
        child, copy = self._allocator.fork(seq)
        if copy is not None:
            self._copy_page(*copy)
        return child

    def _copy_page(self, source: int, target: int) -> None:
        for x in (self.keys, self.values, self.key_scale, self.value_scale):
            if x is not None:
                x[:, target] = x[:, source]

    def shared_prefix(self, seqs: Sequence[int]) -> int:
        """How many leading pages every one of these sequences holds in common (each full)."""
        return self._allocator.shared_prefix(seqs)

    def block_table(self, seq: int) -> list[int]:
        """The pages of a sequence, in order."""
        return list(self._allocator.table(seq))

    def lengths(self, seqs: Sequence[int]) -> torch.Tensor:
        """Tokens held by each sequence, (B,)."""
        return torch.tensor([self._allocator.length(s) for s in seqs], dtype=torch.long)

    def append(self, seqs: Sequence[int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Store (B, H_kv, T, D) keys and (B, H_kv, T, D_v) values after each sequence's
        cached tokens, row b for sequence ``seqs[b]``. Pages are taken from the pool as
        needed. A pool too small raises (nothing is stored), never truncates."""
        self._check(seqs, key, value)
        slots = self._allocator.reserve(seqs, [key.shape[2]] * len(seqs))
        self.write(torch.tensor(slots, dtype=torch.long, device=self.keys.device), key, value)

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """(B, H_kv, T, ·) keys and values into the slots (page · P + offset, (B · T,),
        row-major) reserved for them. A quantized pool stores them quantized, with their
        scales (checked finite and gradient-free first, by :meth:`_check`)."""
        H_kv, pages, P = self.keys.shape[:3]
        rows = [(self.keys, self.key_scale, key), (self.values, self.value_scale, value)]
        for pool, scales, x in rows:
            flat = x.transpose(0, 1).reshape(H_kv, -1, x.shape[3])
            if scales is not None:
                flat, scale = quantize(flat, pool.dtype)
                scales.view(H_kv, pages * P).index_copy_(1, slots, scale)
            _raw(pool).view(H_kv, pages * P, pool.shape[3]).index_copy_(1, slots, _raw(flat))

    def gather(
        self,
        seqs: Sequence[int],
        skip: int | Sequence[int] = 0,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequences' keys and values as (B, H_kv, L, D) and (…, D_v) tensors, L the
        longest length, and ``lengths`` (B,): past its own length a row holds whatever its
        pages (or page 0) hold — attend with ``qkv.masks.padding(lengths)``, as
        :class:`PagedBatch` does. One gather from the pool per call, nothing more: zeroing
        the padding would cost time in every decode step. Without autograd the gather
        writes into a buffer the pool keeps and reuses, since a fresh buffer each step
        faults in every page of its memory. The tensors returned are then valid until the
        pool's next gather. ``skip`` leaves out each sequence's first pages (a
        shared prefix read apart; one number, or one per sequence): lengths then count what
        is left. ``lengths`` (what each sequence holds, by default all of it) reads fewer
        tokens."""
        held = self.lengths(seqs) if lengths is None else lengths
        skips = [skip] * len(seqs) if isinstance(skip, int) else list(skip)
        lengths = held - torch.tensor(skips, dtype=torch.long) * self.page_size
        L, P, B = (int(lengths.max()) if len(seqs) else 0), self.page_size, len(seqs)
        n = -(-L // P)
        # Each sequence's pages, padded with page 0 (read past its length, masked there).
        index = [(t + [0] * n)[:n] for t in self._allocator.block_tables(seqs, skips)]
        flat = torch.tensor(index, dtype=torch.long, device=self.keys.device).reshape(-1)

        def pages(pool: torch.Tensor, scales: torch.Tensor | None, name: str) -> torch.Tensor:
            H_kv, width = pool.shape[0], pool.shape[3]
            x = self._select(pool, flat, name)
            if scales is not None:  # quantized: widened and scaled
                x = dequantize(x, scales.index_select(1, flat), self._like.dtype)
            x = x.view(H_kv, B, n * P, width)[:, :, :L]
            return x.transpose(0, 1)  # (B, H_kv, L, ·)

        keys = pages(self.keys, self.key_scale, "keys")
        return keys, pages(self.values, self.value_scale, "values"), lengths

    def pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's keys and values as (num_pages, P, H_kv, D) and (…, D_v) views (the
        layout :func:`qkv.paged_attention` and torch's ``block_table`` take), no copy."""
        return self.keys.permute(1, 2, 0, 3), self.values.permute(1, 2, 0, 3)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """A quantized pool's scales as (num_pages, P, H_kv) views (the layout
        :func:`qkv.paged_attention`'s ``key_scale`` and ``value_scale`` take); (None, None)
        for a float pool."""
        if self.key_scale is None or self.value_scale is None:
            return None, None
        return self.key_scale.permute(1, 2, 0), self.value_scale.permute(1, 2, 0)

    def block_tables(self, seqs: Sequence[int], skip: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences' block tables as one (B, max_pages) tensor (short tables padded
        with page 0, never read) and their lengths (B,); ``skip`` leaves out each
        sequence's first pages, as in :meth:`gather`."""
        index = self._allocator.block_tables(seqs, skip)
        table = torch.tensor(index, dtype=torch.long, device=self.keys.device)
        return table.view(len(seqs), -1), self.lengths(seqs) - skip * self.page_size

    def _select(self, pool: torch.Tensor, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The pool's pages ``flat``, (H_kv, len(flat), P, ·), in a reused buffer when no
        gradient is recorded."""
        if torch.is_grad_enabled():
            return pool.index_select(1, flat)
        H_kv, _, P, width = pool.shape
        size = H_kv * len(flat) * P * width
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < size:
            buf = self._scratch[name] = pool.new_empty(size)
        out = buf[:size].view(H_kv, len(flat), P, width)
        torch.index_select(_raw(pool), 1, flat, out=_raw(out))
        return out

    def batch(self, seqs: Sequence[int]) -> PagedBatch:
        """These sequences as one cache of a batch, the interface of :class:`qkv.KVCache`
        (``length``, ``append``): what :class:`qkv.MultiHeadAttention` and the GPT take."""
        return PagedBatch(self, list(seqs), Pass(self._allocator, list(seqs)))

    def packed(self, seqs: Sequence[int], lengths: Sequence[int]) -> PackedBatch:
        """New sequences of these lengths as one packed prefill's cache
        (:class:`PackedBatch`): :class:`qkv.MultiHeadAttention` takes their tokens one
        after another, (1, sum(lengths), E)."""
        return PackedBatch(self, list(seqs), list(lengths), Pass(self._allocator, list(seqs)))

    def _check(self, seqs: Sequence[int], key: torch.Tensor, value: torch.Tensor) -> None:
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a sequence appears twice in {list(seqs)}")
        for s in seqs:
            self._allocator.table(s)

        def where(b: int, t: int) -> tuple[int, int]:
            return seqs[b], self._allocator.length(seqs[b]) + t

        self.check_rows(key, value, len(seqs), where, " sequences")

    def check_rows(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        rows: int,
        where: Callable[[int, int], tuple[int, int]],
        what: str,
    ) -> None:
        """Keys (rows, H_kv, T, D) and values (…, D_v) the pool can store, or an error
        saying why (``what`` qualifies the rows in it). A quantized pool also takes no
        gradient to record and finite values only: an error names the sequence and
        position (``where(row, t)``) before anything is stored."""
        H_kv, D, D_v = self.keys.shape[0], self.keys.shape[3], self.values.shape[3]
        check_appended(key, value, rows, H_kv, D, D_v, self._like, "the pool", what)
        if self.key_scale is None:
            return
        check_no_grad(key, value)
        check_finite(key, "key", where)
        check_finite(value, "value", where)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(pages={self.pages_in_use}/{self.num_pages} in use, "
            f"page_size={self.page_size}, sequences={len(self._allocator.tables)}, "
            f"tokens={self.tokens})"
        )


def _raw(x: torch.Tensor) -> torch.Tensor:
    """x as torch copies it: float8 viewed as its bytes (torch's CPU index_copy_ and
    index_select take no float8), any other dtype as it is."""
    return x.view(torch.uint8) if x.element_size() == 1 and x.is_floating_point() else x
