"""Models built from qkv's public modules: a GPT (:class:`GPT`, :class:`GPTConfig`)."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
