"""A guard against a race in the MKL that torch's x86 CPU wheels link (oneMKL 2024.2).

torch computes contiguous float32 and float64 ``exp``, ``log``, ``tanh``, ``sqrt``, ``sin``
and ``cos`` with MKL's vector math (VML), each intra-op thread on its own chunk, and MKL
picks each function's kernel on that function's first call. Where the first call runs on
several threads at once, one thread can run a low-accuracy kernel over its whole chunk of
that one call (pytorch/pytorch#188792, reported fixed from oneMKL 2025.0). Measured here
(Intel Xeon, 2 threads, torch 2.13): in a fresh process the first ``torch.exp`` of 10,952
float64 values put half of them off by up to 3.3e-9 relative in one process of four
(float64's rounding is 1.1e-16), and ``log``, ``tanh`` and ``sqrt`` likewise in float32 and
float64; the next call is right. qkv's float64 oracle and the tiled kernel's merges run on
these functions, so a context-parallel test that holds float64 ranks to one process within
1e-10 failed about one run in ten.

:func:`settle` calls each function once on one value of each dtype: one thread, so MKL's
choice is made before any call can race. ``import qkv`` runs it (its cost:
docs/benchmarks.md, "measurements behind code choices")."""

from __future__ import annotations

import torch

FUNCTIONS = (torch.exp, torch.log, torch.tanh, torch.sqrt, torch.sin, torch.cos)
"""The functions qkv computes that torch hands to MKL's vector math."""


def settle() -> None:
    """Each of :data:`FUNCTIONS` once in float32 and in float64, on one value."""
    for dtype in (torch.float32, torch.float64):
        one = torch.ones(1, dtype=dtype)
        for fn in FUNCTIONS:
            fn(one)
