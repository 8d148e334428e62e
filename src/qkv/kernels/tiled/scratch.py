"""Buffers a kernel call makes and drops before it returns, kept from call to call where
they are large: the packed K and V of a native forward, and the float32 gradients of a
half-precision backward before they are rounded to the inputs' dtype.

Why: glibc's malloc hands every block of :data:`SCRATCH_BYTES` or more fresh pages from
the system (its largest mmap threshold) and gives them back on free, so each call faulted
every page of them in again. At D = 512 (T = 4,096, 8 heads) that took about a quarter of
bfloat16's forward + backward (docs/head-shapes.md#time-per-flop). Smaller blocks come back
from malloc's own free lists at no such cost, and are not held here.

Each buffer belongs to one thread and one use (a ``slot``): what :func:`take` returns is
valid until the same thread takes the same slot again. Held: the largest of each slot so
far, until :func:`release`."""

from __future__ import annotations

import threading

import torch

SCRATCH_BYTES = 32 << 20
"""The size from which a slot's buffer is kept (32 MiB: glibc's largest mmap threshold)."""


class _Held(threading.local):
    """This thread's buffers, by slot."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}


_held = _Held()


def take(slot: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """n uninitialised elements of ``dtype``: this thread's ``slot`` buffer where they take
    :data:`SCRATCH_BYTES` or more (grown to hold them), a new tensor otherwise. The caller
    must be done with the slot's last buffer: it is the same memory."""
    if n * dtype.itemsize < SCRATCH_BYTES:
        return torch.empty(n, dtype=dtype, device=device)
    held = _held.buffers.get(slot)
    if held is None or held.numel() < n or held.dtype != dtype or held.device != device:
        _held.buffers.pop(slot, None)  # the old buffer freed before the new one is made
        held = _held.buffers[slot] = torch.empty(n, dtype=dtype, device=device)
    return held[:n]


def held_bytes() -> int:
    """The bytes this thread's buffers hold."""
    return sum(x.numel() * x.element_size() for x in _held.buffers.values())


def release() -> None:
    """Frees this thread's buffers (the next large call makes them again)."""
    _held.buffers.clear()
