"""PyTorch modules built on :func:`qkv.attention`: the seeds' attention classes, multi-head
attention with GQA, RoPE and a KV cache."""

from .cache import KVCache
from .mha import MultiHeadAttention
from .modules import CausalAttention, CrossAttention, MultiHeadAttentionWrapper, SelfAttention
from .rope import RoPE

__all__ = [
    "CausalAttention",
    "CrossAttention",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "RoPE",
    "SelfAttention",
]
