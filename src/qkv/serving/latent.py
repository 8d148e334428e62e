"""A paged latent cache: multi-head latent attention's rows in fixed-size pages taken from one
pool per layer, as :class:`qkv.PagedKVCache` holds keys and values.

Each token holds one row of ``kv_lora_rank + rope_dim`` values (its latent, then its rotary
key): the absorbed form attends over the rows as keys and over their first ``kv_lora_rank``
columns as values, one key/value head. A sequence takes a page when its last one is full,
gives them back when it ends, and a fork shares its full pages.

Legend: B sequences · P page size · T tokens appended · w = kv_lora_rank + rope_dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import check_sizes
from .._memory import zeros
from ..functional import MaskLike, attention
from ..kernels.quant import check_finite, check_no_grad, dequantize, is_quantized, quantize
from ..masks import Mask
from ..masks.library import with_causal
from ..varlen import paged_attention
from .batch import _ragged_mask
from .paged import _raw
from .pages import PageAllocator, Pass


def check_rows(rows: torch.Tensor, B: int, width: int, like: torch.Tensor, holder: str) -> None:
    """Latent rows (B, 1, T, w) of ``like``'s dtype and device, or a ValueError/TypeError
    saying which (``holder``: the cache or the pool, in the message)."""
    if rows.ndim != 4 or (rows.shape[0], rows.shape[1], rows.shape[3]) != (B, 1, width):
        raise ValueError(
            f"rows must have shape (B, 1, T, r + rope) with B={B}, r + rope={width}; got "
            f"{tuple(rows.shape)}"
        )
    if rows.dtype != like.dtype or rows.device != like.device:
        raise TypeError(
            f"rows are {rows.dtype} on {rows.device} but {holder} holds "
            f"{like.dtype} on {like.device}"
        )


def check_values_view(k: torch.Tensor, v: torch.Tensor, r: int, who: str) -> None:
    """Raise unless v is k's first r columns, a view: a latent cache stores the rows once,
    the values being their latent part."""
    if v.shape[-1] != r or v.data_ptr() != k.data_ptr() or v.stride() != k.stride():
        raise ValueError(
            f"{who}: v must be k[..., :kv_lora_rank], a view of the rows (the values are the "
            "latent part of each row)"
        )


def attend_in_place(
    q: torch.Tensor,
    pages: torch.Tensor,
    scales: torch.Tensor | None,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    r: int,
    scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One absorbed query per sequence, q (B, H, 1, w), over latent rows where they lie:
    pages (num_pages, P, 1, w) read as keys and their first r columns as values (one
    scale per row for both, when quantized), through the block tables. (B, H, 1, r)."""
    out = paged_attention(
        q[:, :, 0],
        pages,
        pages[..., :r],
        tables,
        lengths,
        scale=scale,
        sinks=sinks,
        key_scale=scales,
        value_scale=scales,
    )
    assert isinstance(out, torch.Tensor)
    return out[:, :, None]


class PagedLatentCache:
    """One layer's pool of pages of latent rows, (num_pages, P, 1, w) — the page layout
    :func:`qkv.paged_attention` reads, keys and values in one row — shared by any number of
    sequences.

    Args:
        num_pages: pages in the pool.
        page_size: tokens per page (P).
        kv_lora_rank, rope_dim: a row's latent and rotary widths.
        dtype, device: of the pool; ``torch.int8`` or ``torch.float8_e4m3fn`` quantize
            each row with a float32 scale (:meth:`tensors`), appended rows then
            ``compute_dtype``.

    Example:
        >>> import torch, qkv
        >>> mla = qkv.nn.MultiHeadLatentAttention(
        ...     64, 4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        >>> pool = qkv.serving.PagedLatentCache(
        ...     num_pages=8, page_size=4, kv_lora_rank=32, rope_dim=8)
        >>> a, b = pool.new_sequence(), pool.new_sequence()
        >>> _ = mla(torch.randn(2, 3, 64), cache=pool.batch([a, b]))   # a prompt each
        >>> _ = mla(torch.randn(2, 1, 64), cache=pool.batch([a, b]))   # one step each
        >>> pool.lengths([a, b]).tolist(), pool.pages_in_use
        ([4, 4], 2)
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        rope_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        check_sizes(
            num_pages=num_pages, page_size=page_size, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim
        )
        self.kv_lora_rank = kv_lora_rank
        width = kv_lora_rank + rope_dim
        self.rows = zeros((num_pages, page_size, 1, width), dtype, device)
        self.scales: torch.Tensor | None = None
        self._like = self.rows  # what appended rows must be (dtype, device)
        if is_quantized(dtype):
            self.scales = zeros((num_pages, page_size, 1), torch.float32, device)
            self._like = torch.empty(0, dtype=compute_dtype, device=device)
        self._allocator = PageAllocator(num_pages, page_size)

    @property
    def page_size(self) -> int:
        return self.rows.shape[1]

    @property
    def pages_in_use(self) -> int:
        return self.rows.shape[0] - self._allocator.free_pages

    def tensors(self) -> dict[str, torch.Tensor]:
        """What the pool stores, by name: its rows, and a quantized pool's scales."""
        return {"rows": self.rows} | ({} if self.scales is None else {"scales": self.scales})

    def new_sequence(self) -> int:
        """A new, empty sequence's id."""
        return self._allocator.new_sequence()

    def free(self, seq: int) -> None:
        """End a sequence: its pages go back to the pool once no fork holds them."""
        self._allocator.release(seq)

    def fork(self, seq: int) -> int:
        """A new sequence starting as a copy of ``seq``: full pages shared, the last copied."""
        child, copy = self._allocator.fork(seq)
        if copy is not None:
            source, target = copy
            for x in (self.rows, self.scales):
                if x is not None:
                    x[target] = x[source]
        return child

    def lengths(self, seqs: Sequence[int]) -> torch.Tensor:
        """Tokens held by each sequence, (B,)."""
        return torch.tensor([self._allocator.length(s) for s in seqs], dtype=torch.long)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows (B, 1, T, w) into their reserved slots (page · P + offset, (B · T,))."""
        width = self.rows.shape[3]
        flat = rows.reshape(-1, width)
        if self.scales is not None:
            flat, scale = quantize(flat, self.rows.dtype)
            self.scales.view(-1).index_copy_(0, slots, scale)
        _raw(self.rows).view(-1, width).index_copy_(0, slots, _raw(flat))

    def gather(self, seqs: Sequence[int], lengths: torch.Tensor) -> torch.Tensor:
        """The sequences' first ``lengths`` rows, (B, 1, L, w) (L the longest; a shorter
        row padded with page 0's), dequantized where quantized."""
        P, L = self.page_size, int(lengths.max()) if len(seqs) else 0
        n = -(-L // P)
        index = [(t + [0] * n)[:n] for t in self._allocator.block_tables(seqs, 0)]
        pages = torch.tensor(index, dtype=torch.long, device=self.rows.device)
        rows = self.rows[pages]  # (B, n, P, 1, w)
        if self.scales is not None:
            rows = dequantize(rows, self.scales[pages], self._like.dtype)
        return rows.reshape(len(seqs), n * P, 1, -1)[:, :L].transpose(1, 2)

    def batch(self, seqs: Sequence[int]) -> PagedLatentBatch:
        """These sequences as one batch's cache for :class:`MultiHeadLatentAttention`."""
        return PagedLatentBatch(self, list(seqs), Pass(self._allocator, list(seqs)))

    def __repr__(self) -> str:
        return (
            f"PagedLatentCache(pages={self.pages_in_use}/{self.rows.shape[0]} in use, "
            f"page_size={self.page_size}, kv_lora_rank={self.kv_lora_rank}, "
            f"dtype={self.rows.dtype})"
        )


class PagedLatentBatch:
    """Sequences of a :class:`PagedLatentCache` seen as one batch's cache: each at its own
    positions (:meth:`positions`). A decode step (one query each, no mask or dropout) is
    attended where the rows lie (:func:`qkv.paged_attention`), longer steps over the
    gathered rows with each sequence kept to its own."""

    def __init__(self, pool: PagedLatentCache, seqs: list[int], plan: Pass) -> None:
        self.pool, self.seqs, self._plan = pool, seqs, plan
        self._appends = 0

    @property
    def row_lengths(self) -> torch.Tensor:
        """Rows cached per sequence, (B,)."""
        return self._plan.held(self._appends)

    def positions(self, T: int) -> torch.Tensor:
        """The absolute positions of T new tokens per sequence, (B, T)."""
        return self.row_lengths[:, None] + torch.arange(T)[None, :]

    def store(self, rows: torch.Tensor) -> None:
        """Append rows (B, 1, T, w) to the sequences."""
        pool, B = self.pool, len(self.seqs)
        check_rows(rows, B, pool.rows.shape[3], pool._like, "the pool")
        if pool.scales is not None:
            held = self.row_lengths
            check_no_grad(rows)
            check_finite(rows, "latent row", lambda b, t: (self.seqs[b], int(held[b]) + t))
        done = self._plan.append(self._appends, (rows.shape[2],) * B)
        pool.write(done.slots.to(pool.rows.device), rows)
        self._appends += 1

    def append(self, rows: torch.Tensor) -> torch.Tensor:
        """Store rows, then every cached row (B, 1, L, w): for sequences of one length (the
        expanded form's prefill). A ragged batch attends through :meth:`attend`."""
        self.store(rows)
        lengths = self.row_lengths
        if bool((lengths != lengths[0]).any()):
            raise ValueError(
                "the sequences of this batch hold different numbers of rows "
                f"({sorted(set(lengths.tolist()))}): decode them absorbed (form=None or "
                "'absorbed'), each kept to its own rows"
            )
        return self.pool.gather(self.seqs, lengths)

    def held(self) -> torch.Tensor:
        """Every cached row, (B, 1, L, w), padded to the longest sequence, dequantized."""
        return self.pool.gather(self.seqs, self.row_lengths)

    def reads_in_place(self, T_q: int, mask: MaskLike, dropout_p: float) -> bool:
        """Whether a step of T_q queries is attended where the rows lie."""
        return T_q == 1 and mask is None and not dropout_p

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
        """Store the new rows k (B, 1, T, w), then attend the absorbed queries q (B, H, T, w)
        over each sequence's rows, their first kv_lora_rank columns the values:
        (B, H, T, kv_lora_rank). v must be k's first kv_lora_rank columns (a view)."""
        r = self.pool.kv_lora_rank
        check_values_view(k, v, r, "PagedLatentBatch.attend")
        self.store(k)
        lengths = self.row_lengths
        if self.reads_in_place(q.shape[2], mask, dropout_p):
            tables = torch.tensor(self.pool._allocator.block_tables(self.seqs), dtype=torch.int32)
            pool = self.pool
            return attend_in_place(q, pool.rows, pool.scales, tables, lengths, r, scale, sinks)
        rows = self.pool.gather(self.seqs, lengths)
        ragged = _ragged_mask(lengths, q.shape[2], causal)
        mask = with_causal(mask, causal)
        if ragged is not None and (mask is None or isinstance(mask, Mask)):
            mask = ragged if mask is None else mask & ragged
        elif ragged is not None:
            raise ValueError("a ragged paged batch takes a qkv mask, not a tensor")
        return attention(
            q, rows, rows[..., :r], mask=mask, dropout_p=dropout_p, sinks=sinks, scale=scale
        )
