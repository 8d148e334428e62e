"""qkv's native step (``_native.c``, built at install): the fused forward and backward calls
of a pass in one native call each, in float32 (AVX-512 FMAs; AVX2 + FMA where the CPU has
no AVX-512; NEON on ARM64) or bfloat16 (Q, K and V kept in bfloat16 — the matmuls as bfloat16
dot products accumulated in float32, AVX512-BF16's or ARM's BFDOT, P and dS entering their
matmul as bfloat16 hi + lo parts, about 16 bits). The softmax state in float32 either way.
The float32 step also takes bfloat16 and float16 inputs as they are, widening them as it
loads them (no float32 copies of Q, K or dO; V is widened once, as K is packed).
docs/kernels.md#the-native-kernel gives its measurements. Where it is not built or the CPU
lacks the instructions, the fused calls run torch's flash kernel in float32 instead. Which
step runs here (the instruction set, a pin, the register blocking):
:mod:`qkv.kernels.tiled.steps`. The backward's calls: :mod:`qkv.kernels.tiled.native_backward`.

Legend: B batch · H_kv key/value heads · G = H / H_kv · R query rows · T_k keys · D head dim
of Q and K · D_v of V.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..reference import all_finite
from . import scratch
from .args import DTYPES, SOURCES, alibi_at, bias_at, bounds_at, check_call, check_keys, source
from .steps import available

try:
    from . import _native  # type: ignore[attr-defined]
except ImportError:  # not built (no C compiler at install): torch's flash kernel runs
    _native = None


def supports(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None
) -> bool:
    """Whether the native kernel can run the flash calls of this call in ``dtype`` — the
    inputs' (the default), or float32 on half-precision inputs (widened as the kernel loads
    them): Q, K, V of one
    dtype on the CPU, the kernel built and this CPU able to run it, each with its head dim
    contiguous, head dims it takes (:func:`shapes_fit`), and finite Q and
    V (the dispatch has checked K) — the kernel's max would pass over a NaN score, and
    0 · inf in ·V would reach rows that mask the key out. Reads Q and V: the dispatch asks
    once per call."""
    return fits(q, k, v, dtype) and finite(q) and finite(v)


def fits(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None
) -> bool:
    """The part of :func:`supports` that reads no values: the dtypes, head dims and strides
    (the dispatch asks it before anything that measures or reads)."""
    dtype = q.dtype if dtype is None else dtype
    widen = dtype == torch.float32 and q.dtype in (torch.bfloat16, torch.float16)
    return (
        (dtype == q.dtype or widen)
        and shapes_fit(dtype, q.device, q.shape[-1], v.shape[-1])
        and q.dtype == k.dtype == v.dtype
        and all(x.stride(-1) == 1 for x in (q, k, v))
    )


def finite(x: torch.Tensor) -> bool:
    """Whether x holds no NaN or inf. A contiguous float32 or half tensor on the CPU is
    checked by the native module in one thread, so that no parallel region waits on a
    descheduled thread of a busy machine: a parallel reduction over Q, K and V stalled the
    whole dispatch (docs/benchmarks.md, "measurements behind code choices"). Any other
    tensor is checked by one reduction (:func:`qkv.kernels.reference.all_finite`)."""
    if _native is None or x.dtype not in SOURCES or x.device.type != "cpu" or not x.is_contiguous():
        return all_finite(x)
    return bool(_native.finite(x=x.data_ptr(), n=x.numel(), source=source(x.dtype)))


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """rowsum(a ∘ b) over the last dim in float32 — the backward's Delta = rowsum(dO ∘ O) —
    reading bfloat16 or float16 a and b as they are, with no float32 copies of them, in one
    thread (as :func:`finite`). None where the kernel cannot take them (not built, no step
    on this CPU, float32 or another dtype, not both contiguous CPU tensors of one shape and
    dtype): the caller computes it otherwise."""
    if (
        a.dtype not in (torch.bfloat16, torch.float16)
        or b.dtype != a.dtype
        or a.shape != b.shape
        or a.device.type != "cpu"
        or b.device.type != "cpu"
        or not (a.is_contiguous() and b.is_contiguous())
        or a.numel() == 0
        or not available(torch.float32)
    ):
        return None
    out = torch.empty(a.shape[:-1], dtype=torch.float32)
    n, D = out.numel(), a.shape[-1]
    _native.row_dots(
        a=a.data_ptr(), b=b.data_ptr(), out=out.data_ptr(), n=n, D=D, source=source(a.dtype)
    )
    return out


MAX_D = 576
"""The widest head dim the kernel takes, of Q and K (D) or of V (D_v): DeepSeek's absorbed
multi-head latent attention reads 576-wide keys and 512-wide values."""


def shapes_fit(dtype: torch.dtype, device: torch.device, D: int, D_v: int) -> bool:
    """The part of :func:`supports` that reads no values: float32 or bfloat16 on a CPU that
    runs the kernel in it, D and D_v from 1 to :data:`MAX_D` (D_v may differ from D; in
    bfloat16 both even, for the pairs the bfloat16 dot product multiplies)."""
    return (
        device.type == "cpu"
        and 0 < D <= MAX_D
        and 0 < D_v <= MAX_D
        and (dtype != torch.bfloat16 or D % 2 == D_v % 2 == 0)
        and available(dtype)
    )


class Packed(NamedTuple):
    """K and V as the kernel reads them, packed once per forward pass: K with each 32 keys
    the score loop takes together side by side, zero past the last key; Nt covers every key
    a call reads (from its first key's 32-key block, rounded up to 32). bfloat16, in the
    pairs the kernel multiplies: k (B, H_kv, Nt/32, D/2, 32, 2), v (B, H_kv, Nt/2, D_v, 2);
    float32: k (B, H_kv, Nt/32, D, 32), and v (B, H_kv, T_k, D_v) — float32 V itself (its
    rows read in place), or half-precision V widened once, here, so that the P·V loop runs
    float32's code (widening inside it cost the AVX2 step 7%, docs/kernels.md). k's and v's
    dtype is the one the kernel computes in; ``source`` is what the inputs held."""

    k: torch.Tensor
    v: torch.Tensor
    Nt: int
    source: torch.dtype

    @property
    def D_v(self) -> int:
        """V's head dim."""
        return self.v.shape[-1] if self.k.dtype == torch.float32 else self.v.shape[-2]

    def values(self) -> tuple[int, int, int, int]:
        """v as the kernel takes it: its address, its strides over B and H, and from one
        key to the next (elements)."""
        v = self.v
        row = v.stride(2) if self.k.dtype == torch.float32 else v.shape[3]
        return v.data_ptr(), v.stride(0), v.stride(1), row


def pack(
    k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None, transient: bool = False
) -> Packed:
    """K (B, H_kv, T_k, D) and V (B, H_kv, T_k, D_v), float32, bfloat16 or float16 with the
    head dim contiguous, packed for :func:`attend` computing in ``dtype`` (the inputs', the
    default; float32 for half-precision inputs, widened as they are packed), in one
    parallel region (and, for widened V, one copy). ``transient`` (the caller drops the
    packs before its thread's next :func:`qkv.kernels.tiled.scratch.start`): in the
    thread's scratch buffer."""
    check_keys(k, v)
    dtype = k.dtype if dtype is None else dtype
    if dtype not in DTYPES or (dtype == torch.bfloat16 and k.dtype != dtype):
        raise ValueError(f"native.pack: {k.dtype} keys cannot be computed in {dtype}")
    B, H_kv, T_k, D = k.shape
    D_v = v.shape[-1]
    Nt = (T_k + 31) // 32 * 32 + 32  # a call from inside a 32-key block reads into the next
    n_k = B * H_kv * Nt * D
    if dtype != torch.float32:
        n_v = B * H_kv * Nt * D_v
    else:
        n_v = 0 if v.dtype == torch.float32 else B * H_kv * T_k * D_v
    if transient:
        whole = scratch.take(n_k + n_v, dtype, k.device)
    else:
        whole = torch.empty(n_k + n_v, dtype=dtype, device=k.device)
    if dtype == torch.float32:  # V read in place, or widened into float32 rows
        kp = whole[:n_k].view(B, H_kv, Nt // 32, D, 32)
        vp = v if n_v == 0 else whole[n_k:].view(B, H_kv, T_k, D_v).copy_(v)
    else:
        kp = whole[:n_k].view(B, H_kv, Nt // 32, D // 2, 32, 2)
        vp = whole[n_k:].view(B, H_kv, Nt // 2, D_v, 2)
    todo = [dict(x=(k.data_ptr(), *k.stride()[:3]), dst=kp.data_ptr(), values=False, D=D)]
    if dtype != torch.float32:
        todo.append(dict(x=(v.data_ptr(), *v.stride()[:3]), dst=vp.data_ptr(), values=True, D=D_v))
    _native.pack(
        packs=todo,
        sizes=(B, H_kv, T_k, Nt),
        threads=torch.get_num_threads(),
        float32=dtype == torch.float32,
        source=source(k.dtype),
    )
    return Packed(kp, vp, Nt, k.dtype)


def attend(
    q5: torch.Tensor,
    packed: Packed,
    k0: int,
    k1: int,
    bias: torch.Tensor | None,
    scale: float,
    p_parts: int = 2,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    bounds: torch.Tensor | None = None,
    softcap: float = 0.0,
    slopes: torch.Tensor | None = None,
    qpos: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scale + bias) V over keys k0..k1-1 and its log-sum-exp (out float32 unless
    given in half precision; with ALiBi ``slopes`` — float32 (H_kv · G,), a slope per query
    head — the scaled scores plus slope · (kv_idx − q_idx) first, kv_idx a key's index in K
    and q_idx = ``qpos`` + the row's; then, with ``softcap`` > 0, soft-capped, cap · tanh(s
    / cap)): q5 (B, H_kv, G, R, D) with its last dim contiguous, and a float32 bias (B|1,
    H_kv|1, G·R, k1 - k0), or None, or instead ``bounds`` as a :class:`Range`'s. A row with
    no allowed key: out 0, lse -inf. P enters ·V as ``p_parts`` bfloat16 parts
    (:attr:`qkv.Tuning.p_parts`). Written into ``out`` (B, H_kv, G, R, D_v; float32, or the
    inputs' half precision, each value rounded as it is written: :class:`Job`) and ``lse``
    (B, H_kv, G, R; float32), where given."""
    B, H_kv, G, R, _ = q5.shape
    out = torch.empty(B, H_kv, G, R, packed.D_v) if out is None else out
    job = Job(q5, [Range(k0, k1, bias, bounds)], out, lse, qpos)
    attend_many([job], packed, scale, p_parts, softcap, slopes)
    return job.out, job.lse


class Range(NamedTuple):
    """Keys k0..k1-1 of a :class:`Job`, with their bias (float32, (B|1, H_kv|1, G·R,
    k1 - k0)), or their rows' ``bounds`` (a mask whose every row sees one interval of keys:
    int32 (B|1, R, 2), each query position's keys [lo, hi) counted from k0, clamped to the
    range), or neither."""

    k0: int
    k1: int
    bias: torch.Tensor | None
    bounds: torch.Tensor | None = None


class Job:
    """One call of :func:`attend_many`: queries q5 over the keys of ``ranges`` (disjoint),
    one online softmax across them, into ``out`` (B, H_kv, G, R, D_v) and ``lse`` (made
    when None), as in :func:`attend` (``qpos``: its first query's position, for ALiBi). No
    ranges: every row has no key (out 0, lse -inf). ``out`` is float32, or the inputs'
    half precision: each value then rounded once, as ``.to()`` rounds float32, and written
    by the kernel (no float32 output to round in a second pass)."""

    def __init__(
        self,
        q5: torch.Tensor,
        ranges: Sequence[Range],
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        qpos: int = 0,
    ) -> None:
        B, H_kv, G, R, _ = q5.shape
        self.q5, self.ranges, self.qpos = q5, list(ranges), qpos
        self.out = out
        self.lse = torch.empty(B, H_kv, G, R) if lse is None else lse


def attend_many(
    jobs: list[Job],
    packed: Packed,
    scale: float,
    p_parts: int = 2,
    softcap: float = 0.0,
    slopes: torch.Tensor | None = None,
) -> None:
    """Every call of a forward pass (:func:`attend`'s, over one packed K and V) in one native
    call: one parallel region whose threads take the calls' work items from one counter, so
    a thread descheduled on a busy machine holds up only the item it is on, and the pass
    waits at one barrier, not one per call (docs/kernels.md#the-native-kernel)."""
    args = []
    for job in jobs:
        for r in job.ranges:
            check_call("attend", job.q5, _keys_of(packed), r.k0, r.k1, r.bias, r.bounds)
        alibi = alibi_at(slopes, job.q5, job.qpos)
        B, H_kv, G, R, D = job.q5.shape
        D_v = packed.D_v
        out, lse = job.out, job.lse
        if (
            out.shape != (B, H_kv, G, R, D_v)
            or lse.shape != (B, H_kv, G, R)
            or out.stride(-1) != 1
            or out.dtype not in (torch.float32, packed.source)
            or lse.dtype != torch.float32
        ):
            raise ValueError(
                "native.attend: out (B, H_kv, G, R, D_v), float32 or the inputs' dtype, "
                "its last dim contiguous, and lse (B, H_kv, G, R), float32"
            )
        ranges = [
            dict(k0=r.k0, N=r.k1 - r.k0, bias=bias_at(r.bias), bounds=bounds_at(r.bounds))
            for r in job.ranges
        ]
        args.append(
            dict(
                q=(job.q5.data_ptr(), *job.q5.stride()[:4]),
                k=(packed.k.data_ptr(), *packed.k.stride()[:2]),
                v=packed.values(),
                ranges=ranges,
                out=(out.data_ptr(), *out.stride()[:4]),
                lse=(lse.data_ptr(), *lse.stride()),
                sizes=(B, H_kv, G, R, D, D_v),
                Nt=packed.Nt,
                scale=scale,
                softcap=softcap,
                alibi=alibi,
                p_parts=p_parts,
                float32=packed.k.dtype == torch.float32,
                source=source(packed.source),
                out_dtype=source(out.dtype),
            )
        )
    _native.attend_many(calls=args, threads=torch.get_num_threads())


def _keys_of(packed: Packed) -> tuple[int, int, int, torch.dtype]:
    """(B, H_kv, D, dtype) of packed keys, dtype what the inputs held."""
    B, H_kv, _, d = packed.k.shape[:4]
    return B, H_kv, d if packed.k.dtype == torch.float32 else 2 * d, packed.source
