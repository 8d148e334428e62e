"""A packed prefill: the prompts of new sequences one after another in one forward pass,
each attending its own tokens, their keys and values written to each one's pages.

Legend: H query heads · H_kv key/value heads · D head dim · D_v value dim.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Protocol

import torch

from ..masks import MaskLike
from ..varlen import varlen_attention
from .pages import Pass


class Pool(Protocol):
    """What a packed prefill reads of :class:`qkv.PagedKVCache`: its key and value pools
    (H_kv, slots, ·) and how it writes tokens into slots."""

    keys: torch.Tensor
    values: torch.Tensor

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None: ...

    def check_rows(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        rows: int,
        where: Callable[[int, int], tuple[int, int]],
        what: str,
    ) -> None: ...


class PackedBatch:
    """New sequences prefilled together, packed: their prompts one after another in one row
    (1, total), each token at its own sequence's position, each sequence attending its own
    tokens only (:func:`qkv.varlen_attention`, causal per sequence) and its keys and values
    stored in its own pages. What :class:`qkv.MultiHeadAttention` and the GPT take for a
    prefill of many prompts in one forward pass (:meth:`PagedCaches.packed`)."""

    def __init__(self, pool: Pool, seqs: list[int], lengths: list[int], plan: Pass) -> None:
        held = [plan.allocator.length(s) for s in seqs]
        if any(held):
            raise ValueError(
                f"a packed prefill starts new sequences; these already hold {held} tokens"
            )
        if any(n < 1 for n in lengths) or len(lengths) != len(seqs):
            raise ValueError(f"a packed prefill takes one length >= 1 per sequence; got {lengths}")
        self.pool, self.seqs, self.lengths, self._plan = pool, seqs, lengths, plan
        self._appends = 0
        self.cu = torch.tensor([0, *itertools.accumulate(lengths)])
        self.total, self.longest = int(self.cu[-1]), max(lengths)

    def positions(self, T: int) -> torch.Tensor:
        """Each packed token's position in its own sequence, (1, total)."""
        if self.total != T:
            raise ValueError(
                f"a packed prefill of {self.lengths} takes {self.total} tokens; got {T}"
            )
        return torch.cat([torch.arange(n) for n in self.lengths])[None]

    def store(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The packed (1, H_kv, total, ·) keys and values into each sequence's pages."""
        starts = self.cu[:-1].tolist()

        def where(_: int, t: int) -> tuple[int, int]:  # packed token t's sequence, position
            i = max(i for i, s in enumerate(starts) if s <= t)
            return self.seqs[i], t - starts[i]

        self.pool.check_rows(key, value, 1, where, " (packed)")
        done = self._plan.append(self._appends, tuple(self.lengths))
        self.pool.write(done.slots.to(self.pool.keys.device), key, value)
        self._appends += 1

    @property
    def length(self) -> int:
        return 0  # new sequences: nothing cached before the prefill

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(
            "a packed prefill is attended per sequence (PackedBatch.attend, as "
            "qkv.MultiHeadAttention does), not as one batch's cache"
        )

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
        """Store the packed (1, H_kv, total, ·) keys and values in each sequence's pages,
        then attend the packed (1, H, total, D) queries, each sequence to its own:
        (1, H, total, D_v). A packed prefill takes no mask or dropout."""
        if mask is not None or dropout_p:
            raise ValueError(
                "a packed prefill (PackedBatch) takes no layout, context, mask or dropout"
            )
        self.store(k, v)

        def packed(x: torch.Tensor) -> torch.Tensor:
            return x[0].transpose(0, 1)  # (total, heads, ·)

        cu = self.cu.to(q.device)
        out = varlen_attention(
            packed(q),
            packed(k),
            packed(v),
            cu,
            cu,
            self.longest,
            self.longest,
            window_size=(-1, 0) if causal else (-1, -1),
            enable_gqa=True,
            sinks=sinks,
        )
        assert isinstance(out, torch.Tensor)
        return out.transpose(0, 1)[None]
