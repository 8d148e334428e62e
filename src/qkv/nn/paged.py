"""A paged KV cache: keys and values in fixed-size pages taken from one pool per layer.

A contiguous :class:`qkv.KVCache` reserves ``batch × max_len`` tokens up front. A paged cache
reserves a pool of pages; a sequence takes a page when its last one is full and gives all of
them back when it ends, so the memory held follows the tokens actually cached. Each sequence
has a block table (its pages, in order).

Legend: B sequences in a batch · H_kv key/value heads · P page size · T tokens appended ·
D head dim · D_v value dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..masks import Mask, padding, predicate
from .cache import check_appended, check_sizes


def _like(data: Any, ref: Any) -> Any:
    return torch.as_tensor(data, device=ref.device) if isinstance(ref, torch.Tensor) else data


class PagedKVCache:
    """One layer's pool of pages, shared by any number of sequences.

    Args:
        num_pages: pages in the pool.
        page_size: tokens per page (P).
        num_kv_heads, head_dim: H_kv, D; ``value_dim`` D_v (default D).
        dtype, device: of the pool; appended tensors must match.

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
    ) -> None:
        check_sizes(
            num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim
        )
        value_dim = head_dim if value_dim is None else value_dim
        # (H_kv, pages, P, ·): a batch's pages gathered along dim 1 are, viewed, its
        # (B, H_kv, L, ·) keys: one copy per gather, no transpose copy.
        shape = (num_kv_heads, num_pages, page_size)
        self.keys = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros(*shape, value_dim, dtype=dtype, device=device)
        self._scratch: dict[str, torch.Tensor] = {}  # gather's buffers, reused (inference)
        self._refs: dict[int, int] = {}  # page -> how many sequences hold it
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest page first
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next = 0

    @property
    def page_size(self) -> int:
        return self.keys.shape[2]

    @property
    def num_pages(self) -> int:
        return self.keys.shape[1]

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def tokens(self) -> int:
        """Tokens held by every live sequence together."""
        return sum(self._lengths.values())

    def new_sequence(self) -> int:
        """A new, empty sequence's id (it holds no page until it holds a token)."""
        seq, self._next = self._next, self._next + 1
        self._tables[seq], self._lengths[seq] = [], 0
        return seq

    def free(self, seq: int) -> None:
        """End a sequence: each of its pages goes back to the pool, to be reused, once no
        other sequence holds it (pages shared by :meth:`fork` are counted)."""
        for page in reversed(self._table(seq)):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                del self._refs[page]
                self._free.append(page)
        del self._tables[seq], self._lengths[seq]

    def fork(self, seq: int) -> int:
        """A new sequence that starts as a copy of ``seq`` (a shared prompt): its full pages
        are shared, not copied (counted, freed with the last holder); a partly filled last
        page is copied, so that each sequence appends to a page of its own."""
        table, length = self._table(seq), self._length(seq)
        full = length // self.page_size
        if len(table) > full and not self._free:
            raise ValueError("PagedKVCache full: no page free to copy the forked last page into")
        child = self.new_sequence()
        self._tables[child] = list(table[:full])
        for page in table[:full]:
            self._refs[page] += 1
        if len(table) > full:  # the partly filled last page: a copy of its own
            page = self._take()
            self.keys[:, page] = self.keys[:, table[full]]
            self.values[:, page] = self.values[:, table[full]]
            self._tables[child].append(page)
        self._lengths[child] = length
        return child

    def shared_prefix(self, seqs: Sequence[int]) -> int:
        """How many leading pages every one of these sequences holds in common (each full)."""
        tables = [self._table(s) for s in seqs]
        n = 0
        while (
            tables
            and all(len(t) > n and t[n] == tables[0][n] for t in tables)
            and all(self._length(s) >= (n + 1) * self.page_size for s in seqs)
        ):
            n += 1
        return n

    def _take(self) -> int:
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def block_table(self, seq: int) -> list[int]:
        """The pages of a sequence, in order."""
        return list(self._table(seq))

    def lengths(self, seqs: Sequence[int]) -> torch.Tensor:
        """Tokens held by each sequence, (B,)."""
        return torch.tensor([self._length(s) for s in seqs], dtype=torch.long)

    def append(self, seqs: Sequence[int], key: torch.Tensor, value: torch.Tensor) -> None:
        """Store (B, H_kv, T, D) keys and (B, H_kv, T, D_v) values after each sequence's
        cached tokens, row b for sequence ``seqs[b]``; pages are taken from the pool as
        needed. A pool too small raises (nothing is stored), never truncates."""
        self._check(seqs, key, value)
        T, P = key.shape[2], self.page_size
        needed = sum(-(-(self._length(s) + T) // P) - len(self._table(s)) for s in seqs)
        if needed > len(self._free):
            raise ValueError(
                f"PagedKVCache full: appending {T} tokens to {len(seqs)} sequences needs "
                f"{needed} more pages of {P} tokens; {len(self._free)} of "
                f"{self.num_pages} are free (free finished sequences, or make the pool larger)"
            )
        pages, slots = [], []
        for s in seqs:
            table, start = self._table(s), self._length(s)
            while len(table) * P < start + T:
                table.append(self._take())
            pages += [table[i // P] for i in range(start, start + T)]
            slots += [i % P for i in range(start, start + T)]
            self._lengths[s] = start + T
        at = [torch.tensor(x, dtype=torch.long, device=self.keys.device) for x in (pages, slots)]
        H_kv = self.keys.shape[0]
        self.keys[:, at[0], at[1]] = key.transpose(0, 1).reshape(H_kv, -1, key.shape[3])
        self.values[:, at[0], at[1]] = value.transpose(0, 1).reshape(H_kv, -1, value.shape[3])

    def gather(
        self, seqs: Sequence[int], skip: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequences' keys and values as (B, H_kv, L, D) and (…, D_v) tensors, L the
        longest length, and ``lengths`` (B,): past its own length a row holds whatever its
        pages (or page 0) hold — attend with ``qkv.masks.padding(lengths)``, as
        :class:`PagedBatch` does. One gather from the pool per call, nothing more (zeroing
        the padding cost a tenth of a ragged decode step). Without autograd the gather
        writes into a buffer the pool keeps and reuses (a fresh 10 MB each step was a page
        fault per 4 KB: a decode step took 4× as long): the tensors returned are then valid
        until the pool's next gather. ``skip`` leaves out each sequence's first pages (a
        shared prefix read apart): lengths then count what is left."""
        lengths = self.lengths(seqs) - skip * self.page_size
        L, P, B = (int(lengths.max()) if len(seqs) else 0), self.page_size, len(seqs)
        n = -(-L // P)
        # Each sequence's pages, padded with page 0 (read past its length, masked there).
        index = [(self._table(s)[skip:] + [0] * n)[:n] for s in seqs]
        flat = torch.tensor(index, dtype=torch.long, device=self.keys.device).reshape(-1)

        def pages(pool: torch.Tensor, name: str) -> torch.Tensor:
            H_kv, width = pool.shape[0], pool.shape[3]
            x = self._select(pool, flat, name).view(H_kv, B, n * P, width)[:, :, :L]
            return x.transpose(0, 1)  # (B, H_kv, L, ·)

        return pages(self.keys, "keys"), pages(self.values, "values"), lengths

    def prefix(self, seq: int, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of a sequence's first ``pages`` pages, (H_kv, pages·P, ·):
        a shared prefix, gathered once for every sequence that holds it."""
        table = self._table(seq)[:pages]
        flat = torch.tensor(table, dtype=torch.long, device=self.keys.device)

        def part(pool: torch.Tensor, name: str) -> torch.Tensor:
            H_kv, width = pool.shape[0], pool.shape[3]
            return self._select(pool, flat, name).view(H_kv, pages * self.page_size, width)

        return part(self.keys, "prefix_keys"), part(self.values, "prefix_values")

    def _select(self, pool: torch.Tensor, flat: torch.Tensor, name: str) -> torch.Tensor:
        """pool's pages ``flat``, (H_kv, len(flat), P, ·); into a reused buffer when no
        gradient is recorded."""
        if torch.is_grad_enabled():
            return pool.index_select(1, flat)
        H_kv, _, P, width = pool.shape
        size = H_kv * len(flat) * P * width
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < size:
            buf = self._scratch[name] = pool.new_empty(size)
        out = buf[:size].view(H_kv, len(flat), P, width)
        return torch.index_select(pool, 1, flat, out=out)

    def batch(self, seqs: Sequence[int]) -> PagedBatch:
        """These sequences as one cache of a batch, the interface of :class:`qkv.KVCache`
        (``length``, ``append``): what :class:`qkv.MultiHeadAttention` and the GPT take."""
        return PagedBatch(self, list(seqs))

    def _table(self, seq: int) -> list[int]:
        if seq not in self._tables:
            raise KeyError(f"no live sequence {seq} in this PagedKVCache")
        return self._tables[seq]

    def _length(self, seq: int) -> int:
        self._table(seq)
        return self._lengths[seq]

    def _check(self, seqs: Sequence[int], key: torch.Tensor, value: torch.Tensor) -> None:
        H_kv, D, D_v = self.keys.shape[0], self.keys.shape[3], self.values.shape[3]
        check_appended(key, value, len(seqs), H_kv, D, D_v, self.keys, "the pool", " sequences")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a sequence appears twice in {list(seqs)}")
        for s in seqs:
            self._table(s)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(pages={self.pages_in_use}/{self.num_pages} in use, "
            f"page_size={self.page_size}, sequences={len(self._tables)}, tokens={self.tokens})"
        )


class PagedBatch:
    """Sequences of a :class:`PagedKVCache` seen as one batch's cache, as
    :class:`qkv.KVCache` is: ``append`` stores the new tokens and returns every cached key
    and value (padded to the longest sequence), ``length`` is the tokens cached when every
    sequence holds as many. Sequences of different lengths (a ragged batch) sit at their own
    positions: :meth:`positions` and :meth:`row_mask` say where, and
    :class:`qkv.MultiHeadAttention` and the GPT read them."""

    def __init__(self, pool: PagedKVCache, seqs: list[int]) -> None:
        self.pool, self.seqs = pool, seqs

    @property
    def row_lengths(self) -> torch.Tensor:
        """Tokens cached per sequence, (B,)."""
        return self.pool.lengths(self.seqs)

    def positions(self, T: int) -> torch.Tensor:
        """The absolute positions of T new tokens per sequence, (B, T): after each one's
        own cached tokens."""
        return self.row_lengths[:, None] + torch.arange(T)[None, :]

    def shared_pages(self) -> int:
        """Leading pages every sequence of this batch shares (:meth:`PagedKVCache.fork`)."""
        return self.pool.shared_prefix(self.seqs) if len(self.seqs) > 1 else 0

    def row_mask(self, T_q: int, causal: bool) -> Mask | None:
        """After an append of T_q tokens, the mask that keeps each sequence to its own
        keys (and, ``causal``, to those up to each of its queries), for keys padded to the
        longest sequence and queries at the default bottom-right place; None when every
        sequence holds as many tokens (nothing to add)."""
        lengths = self.row_lengths
        longest = int(lengths.max())
        if bool((lengths == longest).all()):
            return None
        if not causal or T_q == 1:  # one query per row sees every key of its row
            return padding(lengths)
        shift = (longest - lengths).numpy()  # how far each row's queries sit before the last

        def ragged_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return kv + _like(shift, kv)[b] <= q

        return predicate(ragged_causal, "ragged_causal")

    @property
    def length(self) -> int:
        lengths = set(self.pool.lengths(self.seqs).tolist())
        if len(lengths) > 1:
            raise ValueError(
                f"the sequences of this batch hold different numbers of tokens "
                f"({sorted(lengths)}): a module's positions need one length"
            )
        return lengths.pop() if lengths else 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.pool.append(self.seqs, key, value)
        k, v, _ = self.pool.gather(self.seqs)
        return k, v


class PagedCaches:
    """One :class:`PagedKVCache` per layer of a model, used in step: a sequence is created,
    appended to and freed in every layer at once (:meth:`qkv.models.GPT.new_paged_caches`)."""

    def __init__(self, pools: Sequence[PagedKVCache]) -> None:
        self.pools = list(pools)

    def new_sequence(self) -> int:
        ids = {pool.new_sequence() for pool in self.pools}
        assert len(ids) == 1, "the layers' pools went out of step"
        return ids.pop()

    def free(self, seq: int) -> None:
        for pool in self.pools:
            pool.free(seq)

    def batch(self, seqs: Sequence[int]) -> list[PagedBatch]:
        """These sequences as a model's caches: one batch per layer."""
        return [pool.batch(seqs) for pool in self.pools]

    @property
    def pages_in_use(self) -> int:
        return sum(pool.pages_in_use for pool in self.pools)

    def __repr__(self) -> str:
        return f"PagedCaches({len(self.pools)} layers, {self.pools[0]!r} each)"
