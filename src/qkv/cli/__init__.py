"""The ``qkv`` command: ``explain``, ``mask``, ``train``, ``generate``, ``heads``, ``view`` and
``bench``."""

from .main import main

__all__ = ["main"]
