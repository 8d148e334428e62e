"""Models built from qkv's public modules: a GPT (:class:`GPT`, :class:`GPTConfig`). Its
continuous batching is :class:`qkv.serving.Batcher`."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
