"""Which of the native kernel's compiled steps runs on this machine: the instruction sets
this CPU and this build have (:func:`available`, :func:`isa`, :func:`isas`, :func:`openmp`),
a pin to a narrower one, to test and measure it on a wider CPU (:func:`use_isa`,
``QKV_NATIVE_ISA``), and each step's blocking (:data:`BLOCKINGS`, :func:`blocking`,
:func:`set_blocking`, :func:`use_blocking`, :func:`blocking_name`), which the machine's
profile (:mod:`qkv.kernels.tiled.profile`) chooses by measurement. The calls themselves
are :mod:`qkv.kernels.tiled.native`'s.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from ..built import warn_if_failed
from .args import DTYPES

try:
    from . import _native  # type: ignore[attr-defined]
except ImportError:  # not built (no C compiler at install): nothing runs natively
    _native = None


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the native kernel is built and this CPU runs it in ``dtype`` (float32:
    AVX-512, AVX2 + FMA, SVE or NEON; bfloat16: AVX512-BF16, not while :func:`use_isa` pins
    AVX2, or BFDOT on ARM64)."""
    if _native is None:
        warn_if_failed()
        return False
    _pin_from_environment()
    return dtype in DTYPES and bool(_native.available(dtype == torch.float32))


def isa(dtype: torch.dtype = torch.float32) -> str:
    """The instruction set the native kernel runs ``dtype`` on here: "avx512", "avx2",
    "sve" (256-bit vectors), "neon", or "" where it cannot run it (not built, another CPU,
    another dtype)."""
    if _native is None or dtype not in DTYPES:
        return ""
    _pin_from_environment()
    return str(_native.isa(dtype == torch.float32))


def openmp() -> bool:
    """Whether the native kernel was built with OpenMP, its passes on torch's thread pool
    (else, built by a compiler without it, in one thread); False where it is not built."""
    return _native is not None and bool(_native.openmp())


def isas() -> tuple[str, ...]:
    """The instruction sets this CPU can run the float32 step on, of those it is compiled
    for: ("avx512", "avx2") on a CPU with AVX-512 (where AVX2 runs only when pinned,
    :func:`use_isa`), "avx2" alone on one with AVX2 + FMA + F16C only; on ARM64 ("sve",
    "neon") where SVE's vectors are 256 bits and the SVE step is built (NEON only when
    pinned), else "neon"; or none. (bfloat16 dot products run on AVX-512 with AVX512-BF16
    and on ARM64 with BFDOT.)"""
    if not available(torch.float32):
        return ()
    found = []
    for name in ("", "avx2", "neon"):
        with use_isa(name):
            found.append(isa())
    return tuple(dict.fromkeys(found))


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Within the block, the kernel runs as on an AVX2-only CPU (``name`` "avx2": float32 on
    the AVX2 step, half precision widened to it, no bfloat16 dot products) even where the
    CPU has AVX-512, as on an ARM64 CPU without SVE ("neon") where it has SVE, or on the
    CPU's choice (""): to test and measure the narrower step on any machine. A name of the
    other architecture changes nothing (:func:`isa` says what runs). Process-wide (every
    thread's calls), as ``QKV_NATIVE_ISA`` in the environment is from the first call. The
    machine's profile keys its measurements by the pin."""
    if _native is None:
        raise RuntimeError("use_isa: the native kernel is not built")
    before = _native.use_isa(name)
    try:
        yield
    finally:
        _native.use_isa(before)


#: each step's blockings, compiled both ways: 0, the first (the default), and 1, the second —
#: AVX-512 tiles of 8 query rows or 16 (each key block a tile loads serving twice the rows);
#: AVX2, NEON and SVE 3 query rows in registers or 2. Which runs faster depends on the core,
#: and differs between the forward and the backward: the machine's profile measures each
#: (docs/kernels.md). The same bits either way: no two rows share a sum, and a row's sums
#: run in the same order.
BLOCKINGS = (0, 1)


def blocking(backward: bool = False) -> int:
    """The blocking the forward's steps (or the backward's) run in this process
    (:data:`BLOCKINGS`)."""
    if _native is None:
        return BLOCKINGS[0]
    before = _native.use_blocking(BLOCKINGS[0], backward)
    _native.use_blocking(before, backward)
    return int(before)


def blocking_name(isa_name: str, n: int) -> str:
    """Blocking ``n`` of the step of instruction set ``isa_name`` (:func:`isa`), in words."""
    if isa_name == "avx512":
        return f"tiles of {(8, 16)[n]} query rows"
    return f"{(3, 2)[n]} query rows in registers"


def set_blocking(n: int, backward: bool = False) -> None:
    """Runs the forward's steps (or the backward's) in blocking ``n`` (:data:`BLOCKINGS`) in
    this process, as the machine's profile chose."""
    if n not in BLOCKINGS:
        raise ValueError(f"set_blocking: one of {BLOCKINGS}, not {n!r}")
    if _native is not None:
        _native.use_blocking(n, backward)


@contextlib.contextmanager
def use_blocking(n: int, backward: bool | None = None) -> Iterator[None]:
    """Within the block, the steps run in blocking ``n`` — the forward's (``backward``
    False), the backward's (True) or both (None): to test and measure each. Process-wide, as
    :func:`use_isa`."""
    sides = (False, True) if backward is None else (backward,)
    before = [blocking(side) for side in sides]
    for side in sides:
        set_blocking(n, side)
    try:
        yield
    finally:
        for side, n_before in zip(sides, before, strict=True):
            set_blocking(n_before, side)


@functools.cache
def _pin_from_environment() -> None:
    """``QKV_NATIVE_ISA=avx2`` pins float32 to the AVX2 step for the process (``neon``: to
    the NEON step on an ARM64 CPU with SVE), read the first time the kernel is asked for
    (not at import). A name this build or CPU cannot run is an error."""
    name = os.environ.get("QKV_NATIVE_ISA")
    if _native is None or not name:
        return
    try:
        _native.use_isa(name)
    except ValueError:
        raise ValueError(
            f'QKV_NATIVE_ISA={name!r}: "avx2" pins float32 to the AVX2 step, "neon" to the '
            "NEON step; unset it to let the CPU choose"
        ) from None
    if str(_native.isa(True)) != name:
        raise ValueError(f"QKV_NATIVE_ISA={name!r} names an instruction set this CPU lacks")
