"""The serving runtime: paged KV caches and what schedules requests over them.

A :class:`PageAllocator` holds each sequence's block table and the free pages. A
:class:`PagedKVCache` is one layer's pool of pages, :class:`PagedCaches` every layer's pools
under one allocator, and :class:`PagedLatentCache` the same for multi-head latent attention.
A pool's :meth:`~PagedKVCache.batch` (decode) and :meth:`~PagedKVCache.packed` (prefill)
are the caches attention reads. :class:`Batcher` is the scheduler of continuous batching,
and :func:`sample` draws the next token.
"""

from .batch import PagedBatch, PagedCaches
from .latent import PagedLatentBatch, PagedLatentCache
from .packed import PackedBatch
from .paged import PagedKVCache
from .pages import PageAllocator
from .sampling import sample
from .scheduler import Batcher, Decoder

__all__ = [
    "Batcher",
    "Decoder",
    "PackedBatch",
    "PageAllocator",
    "PagedBatch",
    "PagedCaches",
    "PagedKVCache",
    "PagedLatentBatch",
    "PagedLatentCache",
    "sample",
]
