"""The learning wing: the seeds' stages (``tutorial``), every step of one call printed
(``explain``), heatmaps (``viz``), a trained model to look at (:func:`pretrained`), and the
seeds' attention classes by the names the seeds use: :class:`SelfAttention`,
:class:`CausalAttention`, :class:`CrossAttention` and :class:`MultiHeadAttentionWrapper`
(defined in :mod:`qkv.nn`, where models find them too)."""

from ..nn import CausalAttention, CrossAttention, MultiHeadAttentionWrapper, SelfAttention
from . import tutorial
from .explain import Trace, explain
from .trained import pretrained, pretrained_run

__all__ = [
    "CausalAttention",
    "CrossAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention",
    "Trace",
    "explain",
    "pretrained",
    "pretrained_run",
    "tutorial",
]
