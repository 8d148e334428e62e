"""A paged cache's sequences as one batch's cache (:class:`PagedBatch`: what a layer of a
model reads and appends to) and every layer's pools under one page allocator
(:class:`PagedCaches`). The pools themselves: :mod:`qkv.serving.paged`.

Legend: B sequences in a batch · H query heads · H_kv key/value heads · R sequences sharing
a prefix · G = H / H_kv · T tokens (queries) of a step · D head dim · D_v value dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..functional import attention
from ..lse import merge_attention
from ..masks import Mask, MaskLike, padding, predicate
from ..masks import causal as causal_mask
from ..masks.library import with_causal
from ..varlen import paged_attention
from .packed import PackedBatch
from .pages import Pass

if TYPE_CHECKING:
    from .paged import PagedKVCache


def _like(data: Any, ref: Any) -> Any:
    return torch.as_tensor(data, device=ref.device) if isinstance(ref, torch.Tensor) else data


class PagedBatch:
    """Sequences of a :class:`PagedKVCache` seen as one batch's cache, as
    :class:`qkv.KVCache` is: ``append`` stores the new tokens and returns every cached key
    and value (padded to the longest sequence), ``length`` is the tokens cached when every
    sequence holds as many. Sequences of different lengths (a ragged batch) sit at their own
    positions: :meth:`positions` and :meth:`row_mask` say where, and
    :class:`qkv.MultiHeadAttention` and the GPT read them. A decode step stores its keys and
    values (:meth:`store`) and attends them where they lie (:meth:`attend`)."""

    def __init__(self, pool: PagedKVCache, seqs: list[int], plan: Pass) -> None:
        self.pool, self.seqs, self._plan = pool, seqs, plan
        self._appends = 0  # made through this batch (this layer)

    @property
    def row_lengths(self) -> torch.Tensor:
        """Tokens cached per sequence, (B,)."""
        return self._plan.held(self._appends)

    def positions(self, T: int) -> torch.Tensor:
        """The absolute positions of T new tokens per sequence, (B, T): after each one's
        own cached tokens."""
        return self.row_lengths[:, None] + torch.arange(T)[None, :]

    def row_mask(self, T_q: int, causal: bool) -> Mask | None:
        """After an append of T_q tokens, the mask that keeps each sequence to its own
        keys (and, ``causal``, to those up to each of its queries), for keys padded to the
        longest sequence and queries at the default bottom-right place; None when every
        sequence holds as many tokens (nothing to add)."""
        return _ragged_mask(self.row_lengths, T_q, causal)

    def store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append (B, H_kv, T, ·) keys and values to the sequences, with no gather."""
        self.pool._check(self.seqs, key, value)
        done = self._plan.append(self._appends, (key.shape[2],) * len(self.seqs))
        self.pool.write(done.slots.to(self.pool.keys.device), key, value)
        self._appends += 1

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
        """Store k and v, then attend q over each sequence's keys (:class:`qkv.nn.Cache`):
        read where they lie (:meth:`attend_stored`) without a mask or dropout, and gathered
        otherwise, with each row's own keys as a mask beside the caller's."""
        if mask is None and dropout_p == 0:  # stored, then attended where they lie
            self.store(k, v)
            return self.attend_stored(q, causal, sinks)
        keys, values = self.append(k, v)
        mask = with_causal(mask, causal)
        rows = self.row_mask(q.shape[2], causal)  # a ragged batch: each row to its own keys
        if rows is not None and mask is None:
            mask = rows
        elif rows is not None and isinstance(mask, Mask):
            mask = mask & rows
        elif rows is not None:
            raise ValueError("a ragged paged batch takes a qkv mask, not a tensor")
        return attention(q, keys, values, mask=mask, dropout_p=dropout_p, sinks=sinks)

    def attend_stored(
        self, q: torch.Tensor, causal: bool = True, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention after :meth:`store`: each sequence's T new queries (B, H, T, D), the
        last T of its tokens, over the keys it holds (``causal``: each up to itself), where
        they lie. A prefix of pages sequences share (:meth:`PagedKVCache.fork`; nested:
        a system prompt for all, more for some) is read once for all who share it, its part
        merged by log-sum-exp (cascade attention). The rest of each sequence's keys are read
        in place for a decode step (:func:`qkv.paged_attention`), gathered for T > 1.
        (B, H, T, D_v)."""
        if not self._appends:
            raise ValueError("attend reads what store wrote: store this step's keys first")
        done = self._plan.appends[self._appends - 1]
        nodes, starts = done.tree()
        tables, own = done.own()  # each sequence's pages past the nodes
        k_pages, v_pages = self.pool.pages()
        k_scale, v_scale = self.pool.scales()
        T = q.shape[2]
        # With shared prefixes the sinks join once, after the parts merge (merge_attention).
        own_sinks = None if nodes else sinks
        if T == 1:
            result = paged_attention(
                q[:, :, 0],
                k_pages,
                v_pages,
                tables,
                own,
                sinks=own_sinks,
                return_lse=bool(nodes),
                key_scale=k_scale,
                value_scale=v_scale,
            )
            if not nodes:
                assert isinstance(result, torch.Tensor)
                return result[:, :, None]
            out, lse = (x[:, :, None] for x in result)
        else:
            k, v, _ = self.pool.gather(self.seqs, starts, lengths=done.after)
            mask = _ragged_mask(own.long(), T, causal)
            if mask is None and causal:  # rows of one length: causal, bottom-right
                mask = causal_mask()
            out, lse = attention(q, k, v, mask=mask, sinks=own_sinks, return_lse=True)
        for rows, pages in nodes:  # each shared prefix, once for the rows that share it
            at = torch.tensor(rows)
            part, part_lse = _shared(q[at], self.pool, pages)
            merged, merged_lse = merge_attention([out[at], part], [lse[at], part_lse])
            out = out.index_copy(0, at, merged.to(out.dtype))
            lse = lse.index_copy(0, at, merged_lse.to(lse.dtype))
        if nodes and sinks is not None:
            out = merge_attention([out], [lse], sinks=sinks)[0].to(out.dtype)
        return out

    @property
    def length(self) -> int:
        lengths = set(self.row_lengths.tolist())
        if len(lengths) > 1:
            raise ValueError(
                f"the sequences of this batch hold different numbers of tokens "
                f"({sorted(lengths)}): a module's positions need one length"
            )
        return lengths.pop() if lengths else 0

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.store(key, value)
        k, v, _ = self.pool.gather(self.seqs, lengths=self.row_lengths)
        return k, v


class PagedCaches:
    """One :class:`PagedKVCache` per layer of a model, used in step: one page allocator for
    all of them (a sequence holds the same pages in every layer), so a sequence is created,
    forked and freed once, and a forward pass reserves its tokens' slots once for every
    layer (:meth:`qkv.models.GPT.new_paged_caches`). Use the pools through it, not apart."""

    def __init__(self, pools: Sequence[PagedKVCache]) -> None:
        self.pools = list(pools)
        if not self.pools:
            raise ValueError("PagedCaches needs at least one pool")
        first = self.pools[0]
        if any(
            (p.num_pages, p.page_size) != (first.num_pages, first.page_size) or p._allocator.tables
            for p in self.pools
        ):
            raise ValueError("PagedCaches takes empty pools of one number and size of pages")
        self._allocator = first._allocator
        for pool in self.pools:
            pool._allocator = self._allocator

    def new_sequence(self) -> int:
        return self._allocator.new_sequence()

    def free(self, seq: int) -> None:
        self._allocator.release(seq)

    def fork(self, seq: int) -> int:
        """A new sequence sharing ``seq``'s pages in every layer (:meth:`PagedKVCache.fork`)."""
        child, copy = self._allocator.fork(seq)
        if copy is not None:
            for pool in self.pools:
                pool._copy_page(*copy)
        return child

    def batch(self, seqs: Sequence[int]) -> list[PagedBatch]:
        """These sequences as a model's caches: one batch per layer, sharing one pass."""
        plan = Pass(self._allocator, list(seqs))
        return [PagedBatch(pool, list(seqs), plan) for pool in self.pools]

    def packed(self, seqs: Sequence[int], lengths: Sequence[int]) -> list[PackedBatch]:
        """New sequences of these lengths as a model's caches for one packed prefill: the
        model takes their prompts concatenated, (1, sum(lengths))."""
        plan = Pass(self._allocator, list(seqs))
        return [PackedBatch(pool, list(seqs), list(lengths), plan) for pool in self.pools]

    @property
    def pages_in_use(self) -> int:
        return sum(pool.pages_in_use for pool in self.pools)

    def __repr__(self) -> str:
        return f"PagedCaches({len(self.pools)} layers, {self.pools[0]!r} each)"


def _ragged_mask(lengths: torch.Tensor, T_q: int, causal: bool) -> Mask | None:
    """Rows of ``lengths`` keys each, padded to the longest, the last T_q of each row its
    queries (bottom-right): the mask keeping each to its own keys (``causal``: up to
    itself); None when every row is as long (nothing to add)."""
    longest = int(lengths.max())
    if bool((lengths == longest).all()):
        return None
    if not causal or T_q == 1:  # one query per row sees every key of its row
        return padding(lengths)
    shift = (longest - lengths).numpy()  # how far each row's queries sit before the last

    def ragged_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return kv + _like(shift, kv)[b] <= q

    return predicate(ragged_causal, "ragged_causal")


def _shared(
    q: torch.Tensor, pool: PagedKVCache, pages: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """R sequences' queries (R, H, T, D) over a prefix of pages they share, read once: one
    sequence of the pages whose query heads are all R·T queries, grouped by key/value head
    ((H_kv, R, G, T) in order: :func:`qkv.paged_attention` reads key/value head
    h // (R · G · T) for head h). Every query sees the whole prefix (it comes before them).
    (R, H, T, D_v) and the (R, H, T) log-sum-exp."""
    R, H, T, D = q.shape
    (k_pages, v_pages), (k_scale, v_scale) = pool.pages(), pool.scales()
    H_kv = k_pages.shape[2]
    G = H // H_kv
    rows = q.reshape(R, H_kv, G, T, D).transpose(0, 1).reshape(1, H_kv * R * G * T, D)
    table = torch.tensor([pages])
    length = torch.tensor([len(pages) * k_pages.shape[1]])
    out, lse = paged_attention(
        rows,
        k_pages,
        v_pages,
        table,
        length,
        return_lse=True,
        key_scale=k_scale,
        value_scale=v_scale,
    )

    def back(x: torch.Tensor) -> torch.Tensor:  # (1, H_kv·R·G·T, C) -> (R, H, T, C)
        return x.reshape(H_kv, R, G, T, -1).transpose(0, 1).reshape(R, H, T, -1)

    return back(out), back(lse[..., None])[..., 0]
