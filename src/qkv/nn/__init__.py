"""PyTorch modules built on :func:`qkv.attention`: the seeds' attention classes, multi-head
attention with GQA, RoPE and a KV cache."""

from .cache import Cache, KVCache
from .mha import MultiHeadAttention
from .modules import CausalAttention, CrossAttention, MultiHeadAttentionWrapper, SelfAttention
from .paged import PackedBatch, PagedBatch, PagedCaches, PagedKVCache
from .rope import RoPE

__all__ = [
    "Cache",
    "CausalAttention",
    "CrossAttention",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "PackedBatch",
    "PagedBatch",
    "PagedCaches",
    "PagedKVCache",
    "RoPE",
    "SelfAttention",
]
