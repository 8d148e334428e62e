"""The paged KV pools' storage, on transparent huge pages where Linux allows them.

Why: a decode step reads every cached key and value once, hundreds of megabytes at long
context. On 4 KiB pages each 4 KiB of that costs the CPU a translation (its TLB's few
thousand entries cover about 12 MB), and on a virtual machine every translation missed walks
two page tables. Linux backs memory with 2 MiB pages where a program asks for them
(``madvise(MADV_HUGEPAGE)``; ``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``madvise``, the common default, gives them to no one else). A paged decode step gains
from it; a contiguous ``KVCache``, read in long runs, did not and does not use this
(docs/benchmarks.md, "Paged pools on huge pages").

The memory comes from an anonymous private mapping of its own, zero until written, and
pages are only taken as they are written: a large pool costs what its sequences use."""

from __future__ import annotations

import contextlib
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
"""Linux's transparent huge page on x86-64 and on ARM64 with 4 KiB base pages (2 MiB)."""

HUGE_FROM = 8 << 20
"""The size from which a buffer is asked for on huge pages (8 MiB): below it, a cache fits
the TLB's reach anyway, and the alignment's up to 2 MiB of slack would be a large share."""


def zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None
) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)`` — on transparent huge pages where it
    is a CPU tensor of :data:`HUGE_FROM` bytes or more on Linux: a view, aligned to a huge
    page, into a mapping up to :data:`HUGE_PAGE` larger, freed with the tensor. Elsewhere,
    and where the kernel has no huge pages (``madvise`` refused), the same zeros on ordinary
    pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # (Linux only)
    on_cpu = device is None or torch.device(device).type == "cpu"
    if not on_cpu or nbytes < HUGE_FROM or advice is None or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # no transparent huge pages in this kernel: 4 KiB ones
        mapping.madvise(advice)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    at = -whole.data_ptr() % HUGE_PAGE
    return whole[at : at + nbytes].view(dtype).view(shape)
