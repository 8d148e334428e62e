"""Recording attention calls: who is listening. :func:`qkv.heads.record` opens a block;
:func:`qkv.attention` hands every call it makes inside one to each open block.

The open blocks live in a :class:`contextvars.ContextVar`: a block opened in one thread (or
asyncio task) records that thread's calls only, nested blocks each get every call, and a
block closed by an exception is closed all the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Protocol

import torch


class Listener(Protocol):
    """What a recording block receives for each call: its inputs as given and its (B, H, T_q)
    log-sum-exp in the caller's layout (None where the backend gives none)."""

    def add(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        lse: torch.Tensor | None,
        *,
        mask: Any,
        scale: float | None,
        q_offset: int | None,
        score_mod: Any,
    ) -> None: ...


_LISTENERS: ContextVar[tuple[Listener, ...]] = ContextVar("qkv_listeners", default=())


def listeners() -> tuple[Listener, ...]:
    """The open blocks here, outermost first (none while ``torch.compile`` traces: a graph
    has no side effects)."""
    return () if torch.compiler.is_compiling() else _LISTENERS.get()


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[Listener]:
    """Hand every attention call made in this block (this thread, this task) to
    ``listener``."""
    token = _LISTENERS.set((*_LISTENERS.get(), listener))
    try:
        yield listener
    finally:
        _LISTENERS.reset(token)
