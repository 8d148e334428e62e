"""One buffer per thread for what a kernel call makes and drops before it returns, kept
from call to call where it is large: the packed K and V of a native forward, a
half-precision forward's float32 output before it is rounded, the float32 gradients of a
half-precision backward on torch's kernel before they are (the native backward rounds its
own).

Why: glibc's malloc hands every block of :data:`SCRATCH_BYTES` or more fresh pages from
the system (its largest mmap threshold) and gives them back on free, so each call faulted
every page of them in again. At D = 512 (T = 4,096, 8 heads) that took about a quarter of
bfloat16's forward + backward (docs/head-shapes.md#time-per-flop). Smaller blocks come back
from malloc's own free lists at no such cost and are not taken from here.

A call opens a scope (:func:`start`) and takes its pieces one after the other from the same
buffer (:func:`take`); the next scope on the thread reuses the memory, so a piece must be
dead (copied out, dropped) before its thread's next :func:`start`. One buffer serves the
forward's pieces and the backward's in turn, so what it holds between calls is the
largest one call took, no more than that call had at its peak."""

from __future__ import annotations

import threading

import torch

SCRATCH_BYTES = 32 << 20
"""The size from which a piece comes from the buffer (32 MiB: glibc's largest mmap threshold)."""

_ALIGN = 64  # each piece starts on a cache line


class _Arena(threading.local):
    """This thread's buffer (bytes), how much of it the open scope has taken, and the most
    a scope has asked for."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.used = 0
        self.want = 0


_arena = _Arena()


def start() -> None:
    """Opens a scope: what earlier scopes of this thread took may be handed out again. The
    buffer grows here to the most one scope has asked for."""
    a = _arena
    a.used = 0
    if a.buffer is not None and a.buffer.numel() >= a.want:
        return
    a.buffer = None  # the old buffer freed before the new one is made
    if a.want:  # a normal tensor even under inference_mode: later calls update it in place
        with torch.inference_mode(False):
            a.buffer = torch.empty(a.want, dtype=torch.uint8)


def take(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """n uninitialised elements of ``dtype``, valid until this thread's next :func:`start`:
    from the buffer where they take :data:`SCRATCH_BYTES` or more, a new tensor otherwise
    (or where the buffer has no room yet: the next scope's buffer will)."""
    nbytes = n * dtype.itemsize
    if nbytes < SCRATCH_BYTES or torch.device(device).type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    a = _arena
    at = -(-a.used // _ALIGN) * _ALIGN
    a.used = at + nbytes
    a.want = max(a.want, a.used)
    if a.buffer is None or a.used > a.buffer.numel():
        return torch.empty(n, dtype=dtype, device=device)
    return a.buffer[at : at + nbytes].view(dtype)


def held_bytes() -> int:
    """The bytes this thread's buffer holds."""
    return 0 if _arena.buffer is None else _arena.buffer.numel()


def release() -> None:
    """Frees this thread's buffer; the next large call makes it again."""
    _arena.buffer, _arena.used, _arena.want = None, 0, 0
