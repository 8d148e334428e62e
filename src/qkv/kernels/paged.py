"""qkv's native decode step over a paged KV cache (``_paged.c``, built at install): one query
per sequence attends its keys in their pages, read through the block table, with no gather
into a contiguous copy. float32 and bfloat16 (accumulated in float32), and pages quantized
to int8 or float8 e4m3 with a float32 scale per row (:mod:`.quant`), read in place. Where
it is not built,
:func:`qkv.paged_attention` gathers the pages and calls :func:`qkv.attention` instead
(docs/ragged.md#attention-over-pages).

Legend: B sequences · H query heads · H_kv key/value heads · D head dim · D_v value dim ·
P page size.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from .built import warn_if_failed
from .quant import is_quantized

try:
    from . import _paged  # type: ignore[attr-defined]
except ImportError:  # not built (no C compiler at install): the gather path runs
    _paged = None


def available() -> bool:
    """Whether the native paged decode kernel is built."""
    if _paged is None:
        warn_if_failed()
        return False
    return True


def isa() -> str:
    """The vector code the kernel runs here for head dims that are multiples of 16: "avx512",
    "avx2" or "neon" ("": plain C alone, which takes any head dims)."""
    if _paged is None:
        return ""
    _pin_from_environment()
    return str(_paged.isa())


def dots() -> bool:
    """Whether bfloat16 queries are scored here with bfloat16 dot products (AVX512-BF16):
    over bfloat16, int8 and float8 pages, for D a multiple of 32 and two or more query heads
    per key/value head. Those keys and the queries are bfloat16 values exactly, so the dot
    products take the same sums (to float32 rounding) with half the FMAs."""
    if _paged is None:
        return False
    _pin_from_environment()
    return bool(_paged.dots())


def isas() -> tuple[str, ...]:
    """The vector code this CPU can run: ("avx512", "avx2") on one with AVX-512 (AVX2 only
    when pinned, :func:`use_isa`), ("avx2",); on ARM64 ("sve", "neon") where SVE's vectors
    are 256 bits and the SVE item is built (NEON only when pinned), ("neon",); or none."""
    if _paged is None:
        return ()
    found = []
    for name in ("", "avx2", "neon"):
        with use_isa(name):
            found.append(isa())
    return tuple(n for n in dict.fromkeys(found) if n)


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Within the block, the kernel runs its AVX2 code ("avx2") even where the CPU has
    AVX-512, its NEON code ("neon") where the CPU has SVE, or the CPU's choice (""): to
    test and measure it on any machine. Process-wide, as ``QKV_NATIVE_ISA`` is from the
    first call."""
    if _paged is None:
        raise RuntimeError("use_isa: the native paged kernel is not built")
    _pin_from_environment()
    before = _paged.use_isa(name)
    try:
        yield
    finally:
        _paged.use_isa(before)


@functools.cache
def _pin_from_environment() -> None:
    """``QKV_NATIVE_ISA=avx2`` (or ``neon``) pins the kernel to its AVX2 (NEON) code, read
    at the first call (the tiled kernel reads it too, and names a wrong value)."""
    name = os.environ.get("QKV_NATIVE_ISA")
    if _paged is not None and name in ("avx2", "neon"):
        _paged.use_isa(name)


#: How the kernel is told the pages' storage (its kv_storage field).
STORAGE = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3}


def supports(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
) -> bool:
    """Whether :func:`decode` runs these tensors: built, on the CPU, q float32 or bfloat16
    and the pages of its dtype or both quantized to one of int8 and float8 e4m3, each row
    (the last dim) contiguous, and no gradient to record (the kernel has no backward)."""
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    return (
        _paged is not None
        and q.device.type == k.device.type == v.device.type == "cpu"
        and k.dtype == v.dtype
        and (k.dtype == q.dtype or is_quantized(k.dtype))
        and q.dtype in (torch.float32, torch.bfloat16)
        and all(x.stride(-1) == 1 for x in (q, k, v))
        and not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs))
    )


def decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over its keys held in rows, not pages: q (B, H, 1, D) over
    k (B, H_kv, T, D) and v (B, H_kv, T, D_v), each sequence's T rows read in place as one
    page of T tokens (a KV cache's buffer, or a view of it). out (B, H, 1, D_v) in q's
    dtype. The caller has checked :func:`supports`."""
    table, lengths = _one_page_each(k.shape[0], k.shape[2])
    got = decode(q[:, :, 0], k.transpose(1, 2), v.transpose(1, 2), table, lengths, scale)
    assert got is not None  # (every length fits its one page)
    return got[0][:, :, None]


@functools.lru_cache(maxsize=64)
def _one_page_each(B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table and lengths of B sequences of T tokens, each its own page (int32;
    kept: every layer of a model asks for the same ones in a decode step)."""
    return torch.arange(B, dtype=torch.int32)[:, None], torch.full((B,), T, dtype=torch.int32)


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    quantized_dots: bool = True,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One query per sequence over its pages: ``out`` (B, H, D_v) in q's dtype and ``lse``
    (B, H) float32; None, having read nothing, where a length is past its table or a page
    it needs is outside the pool (the caller says which).

    Args:
        q: (B, H, D).
        k, v: pages as (pages, P, H_kv, D) and (…, D_v) views: any strides with the last
            dim contiguous (qkv's pool (H_kv, pages, P, D) permuted, or torch's layout).
        table: (B, max_pages) integers: sequence b's pages in order.
        lengths: (B,) integers: the tokens sequence b holds.
        scale: multiplies the scores.
        sinks: (H,) logits of a key with no value in every row's softmax, or None.
        key_scale, value_scale: quantized pages' scales, float32 (pages, P, H_kv) (any
            strides): row (page, slot, head) is its stored values times its scale.
        quantized_dots: where the CPU has them (:func:`dots`), score bfloat16 queries
            against int8 and float8 keys with bfloat16 dot products (False: widened keys and
            float32 FMAs, the same sums to float32 rounding; which is the faster depends on
            the CPU: the machine's profile measures it). bfloat16 keys take them either way.
    """
    assert _paged is not None and supports(q, k, v, sinks), "check paged.supports first"
    _pin_from_environment()
    scales = []
    for s in (key_scale, value_scale):
        if is_quantized(k.dtype) != (s is not None):
            raise ValueError("paged decode: quantized pages take their scales, others none")
        if s is not None and (s.dtype != torch.float32 or s.shape != k.shape[:3]):
            raise ValueError(
                f"paged decode: scales float32 (pages, P, H_kv) = {tuple(k.shape[:3])}; got "
                f"{s.dtype} {tuple(s.shape)}"
            )
        scales.append((0, 0, 0, 0) if s is None else (s.data_ptr(), *s.stride()))
    B, H, D = q.shape
    num_pages, P, H_kv, D_v = k.shape[0], k.shape[1], k.shape[2], v.shape[3]
    table32 = table.to(torch.int32).contiguous()
    lengths32 = lengths.to(torch.int32).contiguous()
    out = torch.empty(B, H, D_v)
    lse = torch.empty(B, H)
    sink = None if sinks is None else sinks.float().contiguous()
    fine = _paged.decode(
        q=(q.data_ptr(), q.stride(0), q.stride(1)),
        k=(k.data_ptr(), k.stride(0), k.stride(1), k.stride(2)),
        v=(v.data_ptr(), v.stride(0), v.stride(1), v.stride(2)),
        table=(table32.data_ptr(), table32.shape[1], num_pages),
        lengths=lengths32.data_ptr(),
        sinks=0 if sink is None else sink.data_ptr(),
        out=out.data_ptr(),
        lse=lse.data_ptr(),
        sizes=(B, H, H_kv, D, D_v, P),
        scale=float(scale),
        bfloat16=int(q.dtype == torch.bfloat16),
        kv_storage=STORAGE[k.dtype],
        key_scale=scales[0],
        value_scale=scales[1],
        threads=torch.get_num_threads(),
        quantized_dots=int(quantized_dots),
    )
    return (out.to(q.dtype), lse) if fine else None
