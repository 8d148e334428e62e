"""PyTorch modules built on :func:`qkv.attention`: the seeds' attention classes, multi-head
attention with GQA, RoPE and a KV cache, multi-head latent attention and its cache. The
paged caches a server uses are in :mod:`qkv.serving`."""

from .cache import Cache, KVCache, LatentCache
from .mha import MultiHeadAttention
from .mla import MultiHeadLatentAttention
from .modules import CausalAttention, CrossAttention, MultiHeadAttentionWrapper, SelfAttention
from .rope import RoPE
from .streaming import StreamingCache

__all__ = [
    "Cache",
    "CausalAttention",
    "CrossAttention",
    "KVCache",
    "LatentCache",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "RoPE",
    "SelfAttention",
    "StreamingCache",
]
