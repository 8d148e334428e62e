"""Models built from qkv's public modules: a GPT (:class:`GPT`, :class:`GPTConfig`), and
continuous batching of prompts of different lengths on it (:class:`Batcher`)."""

from .batching import Batcher
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "Batcher", "GPTConfig"]
