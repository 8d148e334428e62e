"""qkv: the attention mechanism of transformers, to learn and to use.

Legend used in every docstring and error: B batch · H query heads · H_kv key/value heads ·
T_q/T_k query/key length · D head dim · D_v value head dim · E model dim.
"""

from importlib import metadata as _metadata

from . import distributed, heads, masks, models, numpy, scores
from .cascade import cascade_attention
from .functional import Dispatch, attention, dispatch
from .learn import tutorial
from .learn.explain import Trace, explain
from .lse import attention_weights, merge_attention
from .nn import (
    CausalAttention,
    CrossAttention,
    KVCache,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    PagedKVCache,
    RoPE,
    SelfAttention,
)
from .tuning import Tuning, tuned, tuning
from .varlen import paged_attention, varlen_attention

try:  # pyproject.toml holds the one source, read from the installed package's metadata
    __version__ = _metadata.version("qkv")
except _metadata.PackageNotFoundError:  # imported from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "CausalAttention",
    "CrossAttention",
    "Dispatch",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "PagedKVCache",
    "RoPE",
    "SelfAttention",
    "Trace",
    "Tuning",
    "attention",
    "attention_weights",
    "cascade_attention",
    "dispatch",
    "distributed",
    "explain",
    "heads",
    "masks",
    "merge_attention",
    "models",
    "numpy",
    "paged_attention",
    "scores",
    "tuned",
    "tuning",
    "tutorial",
    "varlen_attention",
]
