"""qkv's native bfloat16 step (``_bf16.c``, built at install): one call of the fused
forward or backward with Q, K and V kept in bfloat16 — the matmuls as bfloat16 dot products
accumulated in float32, the softmax state in float32, P (and dS) entering their matmul as
bfloat16 hi + lo parts (about 16 bits). docs/kernels.md#native-bfloat16 gives its
measurements; where it is not built or the CPU lacks AVX512-BF16, the fused calls run in
float32 instead.

Legend: B batch · H_kv key/value heads · G = H / H_kv · R query rows · N keys · D head dim.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import NamedTuple

import torch

from ..reference import all_finite

try:
    from . import _bf16  # type: ignore[attr-defined]
except ImportError:  # not built (no C compiler at install): the float32 path runs
    _bf16 = None


@functools.cache
def available() -> bool:
    """Whether the native kernel is built and this CPU runs it (asked once, when first
    needed)."""
    return _bf16 is not None and bool(_bf16.available())


class Probe(NamedTuple):
    """One measurement, made once per process: the native kernel's bfloat16 call against
    the float32 path's (torch's flash kernel on float32 upcasts, what bfloat16 runs
    otherwise) on the same call — 4 heads, 256 queries over 1,024 keys, D = 64 — medians
    of 7 interleaved runs each. ``faster``: native takes under 0.9× float32's time (a
    margin, so that noise does not pick a kernel that is not faster)."""

    native_ms: float
    float32_ms: float

    @property
    def faster(self) -> bool:
        return self.native_ms < 0.9 * self.float32_ms


@functools.cache
def probe() -> Probe:
    """Measure whether this CPU runs the native bfloat16 kernel faster than float32 (see
    :class:`Probe`); asked by the dispatch the first time a bfloat16 call could run it.
    On one Intel Xeon with AVX512-BF16 but no AMX, the native path ran at 0.71× float32's
    speed; on the AMD EPYC of this project's sessions at ~1.5–2×: the instruction-set
    flag alone does not say which wins."""
    from .flash import FLASH  # (flash imports this module)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 64, generator=g) for n in (256, 1024, 1024))
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    packed, q5 = pack(kb, vb), qb.view(1, 4, 1, 256, 64)
    runs: dict[str, list[float]] = {"native": [], "float32": []}
    calls = {
        "native": lambda: attend(q5, packed, 0, 1024, None, 0.125),
        "float32": lambda: FLASH(q, k, v, 0.0, False, scale=0.125),
    }
    for i in range(8):
        for name in calls if i % 2 else reversed(list(calls)):
            t0 = time.perf_counter()
            calls[name]()
            if i:  # the first round warms up
                runs[name].append(time.perf_counter() - t0)
    return Probe(*(statistics.median(runs[n]) * 1e3 for n in ("native", "float32")))


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the native kernel can run the flash calls of this call: bfloat16 Q, K, V on
    the CPU, the kernel built and this CPU able to run it, each with its head dim
    contiguous, D = D_v a multiple of 32 (the kernel's vectors) up to 256, and finite Q and
    V (the dispatch has checked K) — the kernel's max would pass over a NaN score, and
    0 · inf in ·V would reach rows that mask the key out. Reads Q and V: the dispatch asks
    once per call."""
    return (
        shapes_fit(q.dtype, q.device, q.shape[-1], v.shape[-1])
        and q.dtype == k.dtype == v.dtype
        and all(x.stride(-1) == 1 for x in (q, k, v))
        and all_finite(q)
        and all_finite(v)
    )


def shapes_fit(dtype: torch.dtype, device: torch.device, D: int, D_v: int) -> bool:
    """The part of :func:`supports` that reads no values: bfloat16 on a CPU that runs the
    kernel, D = D_v a multiple of 32 up to 256."""
    return (
        dtype == torch.bfloat16
        and device.type == "cpu"
        and D_v == D
        and D % 32 == 0
        and D <= 256
        and available()
    )


class Packed(NamedTuple):
    """K and V in the pairs the kernel multiplies, packed once per forward pass: k (B, H_kv,
    Nt/32, D/2, 32, 2) — each 32 keys the score loop takes together — and v (B, H_kv, Nt/2,
    D, 2), bfloat16, zero past the last key; Nt covers every key a call reads (from its
    first key's 32-key block, rounded up to 32)."""

    k: torch.Tensor
    v: torch.Tensor
    Nt: int


def pack(k: torch.Tensor, v: torch.Tensor) -> Packed:
    """K and V (B, H_kv, T_k, D), bfloat16 with D contiguous, packed for :func:`attend`."""
    B, H_kv, T_k, D = k.shape
    Nt = (T_k + 31) // 32 * 32 + 32
    kp = torch.empty(B, H_kv, Nt // 32, D // 2, 32, 2, dtype=torch.bfloat16)
    vp = torch.empty(B, H_kv, Nt // 2, D, 2, dtype=torch.bfloat16)
    if k.stride(-1) != 1 or v.stride(-1) != 1 or v.shape != k.shape:
        raise ValueError("native.pack: K and V of one shape, each with D contiguous")
    _bf16.pack(
        (k.data_ptr(), *k.stride()[:3]),
        (v.data_ptr(), *v.stride()[:3]),
        kp.data_ptr(),
        vp.data_ptr(),
        (B, H_kv, T_k, D, Nt),
        torch.get_num_threads(),
    )
    return Packed(kp, vp, Nt)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scale + bias) V over keys k0..k1-1 and its log-sum-exp, both float32:
    q5 (B, H_kv, G, R, D) with its last dim contiguous; bias float32 (B|1, H_kv|1, G·R,
    k1 - k0) or None. A row with no allowed key: out 0, lse -inf. P enters ·V as ``p_parts``
    bfloat16 parts (:attr:`qkv.Tuning.p_parts`). Written into ``out`` (B, H_kv, G, R, D) and
    ``lse`` (B, H_kv, G, R), float32 views, where given."""
    job = Job(q5, k0, k1, bias, out, lse)
    attend_many([job], packed, scale, p_parts)
    return job.out, job.lse


class Job:
    """One call of :func:`attend_many`: queries q5 over keys k0..k1-1 with ``bias``, into
    ``out`` and ``lse`` (made when None), as in :func:`attend`."""

    def __init__(
        self,
        q5: torch.Tensor,
        k0: int,
        k1: int,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> None:
        B, H_kv, G, R, D = q5.shape
        self.q5, self.k0, self.k1, self.bias = q5, k0, k1, bias
        self.out = torch.empty(B, H_kv, G, R, D) if out is None else out
        self.lse = torch.empty(B, H_kv, G, R) if lse is None else lse


def attend_many(jobs: list[Job], packed: Packed, scale: float, p_parts: int = 2) -> None:
    """Every call of a forward pass (:func:`attend`'s, over one packed K and V) in one native
    call: one parallel region whose threads take the calls' work items from one counter, so
    a thread descheduled on a busy machine holds up only the item it is on, and the pass
    waits at one barrier, not one per call (docs/kernels.md#native-bfloat16)."""
    args = []
    for job in jobs:
        _check_call("attend", job.q5, packed, job.k0, job.k1, job.bias)
        B, H_kv, G, R, D = job.q5.shape
        out, lse = job.out, job.lse
        if (
            out.shape != (B, H_kv, G, R, D)
            or lse.shape != (B, H_kv, G, R)
            or out.stride(-1) != 1
            or out.dtype != torch.float32
            or lse.dtype != torch.float32
        ):
            raise ValueError(
                "native.attend: out (B, H_kv, G, R, D) and lse (B, H_kv, G, R), "
                "float32, out's last dim contiguous"
            )
        args.append(
            (
                (job.q5.data_ptr(), *job.q5.stride()[:4]),
                (packed.k.data_ptr(), *packed.k.stride()[:2]),
                (packed.v.data_ptr(), *packed.v.stride()[:2]),
                _bias_at(job.bias),
                (out.data_ptr(), *out.stride()[:4]),
                (lse.data_ptr(), *lse.stride()),
                (B, H_kv, G, R, D),
                (packed.Nt, job.k0, job.k1 - job.k0),
                scale,
                p_parts,
            )
        )
    _bf16.attend_many(args, torch.get_num_threads())


def _check_call(
    name: str, q5: torch.Tensor, packed: Packed, k0: int, k1: int, bias: torch.Tensor | None
) -> None:
    """Raise unless one call's rows, keys and bias fit each other: the kernel reads raw
    memory, and a wrong shape would read past the tensors."""
    B, H_kv, G, R, D = q5.shape
    if (
        packed.k.shape[:2] != (B, H_kv)
        or packed.k.shape[3] != D // 2
        or q5.stride(-1) != 1
        or R < 1
        or not 0 <= k0 < k1
        or (
            bias is not None
            and (
                bias.shape[0] not in (1, B)
                or bias.shape[1] not in (1, H_kv)
                or tuple(bias.shape[2:]) != (G * R, k1 - k0)
            )
        )
    ):
        raise ValueError(
            f"native.{name}: mismatched shapes q {tuple(q5.shape)}, packed k "
            f"{tuple(packed.k.shape)}, keys {k0}..{k1}, bias "
            f"{None if bias is None else tuple(bias.shape)}"
        )


def _bias_at(bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    """The kernel's view of a float32, contiguous bias: its address and strides over B and
    H (0 where broadcast) and rows; all 0 for no bias."""
    if bias is None:
        return (0, 0, 0, 0)
    if bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError("native: the bias must be a contiguous float32 tensor")
    (sb, sh), (nb, nh) = bias.stride()[:2], bias.shape[:2]
    return bias.data_ptr(), sb if nb > 1 else 0, sh if nh > 1 else 0, bias.stride(2)


def pack_backward(k: torch.Tensor, v: torch.Tensor) -> tuple[Packed, torch.Tensor]:
    """What :func:`backward` reads: K in both layouts (``Packed(k=scores, v=values)``: Q Kᵀ
    and dS K), and V in the score layout (dO Vᵀ)."""
    kv, vk = pack(k, v), pack(v, k)
    return Packed(kv.k, vk.v, kv.Nt), vk.k


def backward(
    q5: torch.Tensor,
    do5: torch.Tensor,
    packed: Packed,
    vk: torch.Tensor,
    k0: int,
    k1: int,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """One call's gradients, given the whole rows' lse and Delta = rowsum(dO ∘ O) (float32,
    (B, H_kv, G, R)), added in float32 to ``dq`` ((B, H_kv, G, R, D)) and to ``dk``, ``dv``
    for keys k0..k1-1 ((B, H_kv, k1 - k0, D)). q5 and do5 (B, H_kv, G, R, D), bfloat16;
    ``packed`` and ``vk`` from :func:`pack_backward`; bias as for :func:`attend`."""
    job = BackwardJob(q5, do5, k0, k1, bias, lse, delta, dq, dk, dv)
    backward_many([job], packed, vk, scale)


class BackwardJob(NamedTuple):
    """One call of :func:`backward_many`, its arguments as :func:`backward` takes them."""

    q5: torch.Tensor
    do5: torch.Tensor
    k0: int
    k1: int
    bias: torch.Tensor | None
    lse: torch.Tensor
    delta: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def backward_many(jobs: list[BackwardJob], packed: Packed, vk: torch.Tensor, scale: float) -> None:
    """Every call of a backward pass (one B and H_kv) in one native call: one parallel region
    whose threads take the calls' work items (a key block of one head each) from one
    counter; each item's shares of dQ, dK and dV are added in one fixed order (call by
    call, block by block) by whichever thread holds the lock when the share before is in.
    Calls whose keys overlap never race, no thread waits for a slower one, and the bits do
    not depend on the threads."""
    args = []
    for job in jobs:
        _check_call("backward", job.q5, packed, job.k0, job.k1, job.bias)
        B, H_kv, G, R, D = job.q5.shape
        N = job.k1 - job.k0
        floats = (job.lse, job.delta, job.dq, job.dk, job.dv)
        if (
            job.do5.shape != job.q5.shape
            or job.lse.shape != (B, H_kv, G, R)
            or job.delta.shape != job.lse.shape
            or job.dq.shape != job.q5.shape
            or job.dk.shape != (B, H_kv, N, D)
            or job.dv.shape != job.dk.shape
            or any(x.dtype != torch.float32 for x in floats)
            or any(x.stride(-1) != 1 for x in (job.do5, job.dq, job.dk, job.dv))
        ):
            raise ValueError(
                f"native.backward: mismatched shapes q {tuple(job.q5.shape)}, dO "
                f"{tuple(job.do5.shape)}, lse {tuple(job.lse.shape)}, dq "
                f"{tuple(job.dq.shape)}, dk {tuple(job.dk.shape)}, keys {job.k0}..{job.k1}"
            )
        args.append(
            (
                (job.q5.data_ptr(), *job.q5.stride()[:4]),
                (job.do5.data_ptr(), *job.do5.stride()[:4]),
                (packed.k.data_ptr(), *packed.k.stride()[:2]),
                (packed.v.data_ptr(), *packed.v.stride()[:2]),
                (vk.data_ptr(), *vk.stride()[:2]),
                _bias_at(job.bias),
                (job.lse.data_ptr(), *job.lse.stride()),
                (job.delta.data_ptr(), *job.delta.stride()),
                (job.dq.data_ptr(), *job.dq.stride()[:4]),
                (job.dk.data_ptr(), *job.dk.stride()[:3]),
                (job.dv.data_ptr(), *job.dv.stride()[:3]),
                (B, H_kv, G, R, D),
                (packed.Nt, job.k0, N),
                scale,
            )
        )
    _bf16.backward_many(args, torch.get_num_threads())
