"""qkv: the attention mechanism of transformers, to learn and to use.

Legend used in every docstring and error: B batch · H query heads · H_kv key/value heads ·
T_q/T_k query/key length · D head dim · D_v value head dim · E model dim.
"""

from importlib import metadata as _metadata

# The subpackages are attributes (qkv.masks, qkv.numpy, ...), not names of __all__: a star
# import binds functions and classes only, never a module name such as ``numpy``.
from . import distributed as distributed
from . import flash_attn as flash_attn
from . import heads as heads
from . import learn as learn
from . import masks as masks
from . import models as models
from . import numpy as numpy
from . import scores as scores
from . import serving as serving
from .cascade import cascade_attention
from .functional import Dispatch, attention, dispatch
from .learn import Trace, explain
from .learn import tutorial as tutorial
from .lse import attention_weights, merge_attention
from .nn import KVCache, MultiHeadAttention, RoPE
from .serving import PagedKVCache
from .tuning import Tuning, tuned, tuning
from .varlen import paged_attention, varlen_attention

try:  # pyproject.toml holds the one source, read from the installed package's metadata
    __version__ = _metadata.version("qkv")
except _metadata.PackageNotFoundError:  # imported from a source tree that was not installed
    __version__ = "0+unknown"

#: The production API. The seeds' teaching classes are in :mod:`qkv.learn`.
__all__ = [
    "Dispatch",
    "KVCache",
    "MultiHeadAttention",
    "PagedKVCache",
    "RoPE",
    "Trace",
    "Tuning",
    "attention",
    "attention_weights",
    "cascade_attention",
    "dispatch",
    "explain",
    "merge_attention",
    "paged_attention",
    "tuned",
    "tuning",
    "varlen_attention",
]
