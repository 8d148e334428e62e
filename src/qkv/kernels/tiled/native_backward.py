"""The native kernel's backward calls (``_native.c``'s ``backward_many``): every call of a
backward pass in one native call, in float32 or bfloat16 as :mod:`qkv.kernels.tiled.native`'s
forward, half-precision inputs widened as they are loaded; half-precision gradients rounded
by the kernel itself where the pass is given them. The checks of what the kernel can take
(``supports``, ``fits``) and the forward: :mod:`qkv.kernels.tiled.native`.

Legend: B batch · H_kv key/value heads · G = H / H_kv · R query rows · T_k keys · D head dim
of Q and K · D_v of V.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .args import alibi_at, bias_at, bounds_at, check_call, check_keys, source
from .native import _native  # the built module (None where not built: never called then)


def backward(
    q5: torch.Tensor,
    do5: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k0: int,
    k1: int,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    bounds: torch.Tensor | None = None,
    softcap: float = 0.0,
    slopes: torch.Tensor | None = None,
    qpos: int = 0,
    dtype: torch.dtype | None = None,
) -> None:
    """One call's gradients, given the whole rows' lse and Delta = rowsum(dO ∘ O) (float32,
    (B, H_kv, G, R)), added in float32 to ``dq`` ((B, H_kv, G, R, D)) and to ``dk``, ``dv``
    for keys k0..k1-1 ((B, H_kv, k1 - k0, D) and (…, D_v)). q5 (B, H_kv, G, R, D) and do5
    (…, D_v), K (B, H_kv, T_k, D) and V (…, D_v) as they are (each work item packs its own
    keys), all float32, all bfloat16 or all float16 (half precision computed in float32,
    widened as it is loaded, unless ``dtype`` is bfloat16). The bias or bounds are a
    :class:`~qkv.kernels.tiled.native.Range`'s, and ``softcap``, ``slopes`` and ``qpos`` are
    :func:`~qkv.kernels.tiled.native.attend`'s."""
    job = BackwardJob(q5, do5, k0, k1, bias, lse, delta, dq, dk, dv, bounds, qpos)
    backward_many([job], k, v, scale, softcap, slopes, dtype)


class BackwardJob(NamedTuple):
    """One call of :func:`backward_many`, its arguments as :func:`backward` takes them.
    Where the pass is given ``grads``, dq, dk and dv are None and ``q0`` is the call's first
    row of grads' dQ (its keys k0..k1-1 of dK and dV)."""

    q5: torch.Tensor
    do5: torch.Tensor
    k0: int
    k1: int
    bias: torch.Tensor | None
    lse: torch.Tensor
    delta: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    bounds: torch.Tensor | None = None
    qpos: int = 0
    q0: int = 0


def backward_many(
    jobs: list[BackwardJob],
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    slopes: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Every call of a backward pass (one B and H_kv) in one native call: one parallel region
    whose threads take the calls' work items (a key block of one head each) from one
    counter. Each item's shares of dQ, dK and dV are added in one fixed order (call by
    call, block by block) by whichever thread holds the lock when the share before is in.
    Calls whose keys overlap never race, no thread waits for a slower one, and the bits do
    not depend on the threads. Each item packs its own keys of K and V (no packed copy of
    them for the pass). Computed in ``dtype`` as :func:`~qkv.kernels.tiled.native.pack`'s.

    ``grads``: dQ (B, H_kv, G, T_q, D), dK and dV (B, H_kv, T_k, D|D_v) in the inputs' half
    precision, which the pass fills: each head's sums are kept in float32 (one head per
    thread at a time) and rounded into them as the head's last share is in, the bits
    ``.to()`` of the float32 sums would give, with no float32 gradients of the whole pass
    and no pass over them after. The jobs' dq, dk and dv are then None."""
    check_keys(k, v)
    dtype = k.dtype if dtype is None else dtype
    B_k, H_k, T_k, D_k = k.shape
    D_v = v.shape[-1]
    keys, args = (B_k, H_k, D_k, k.dtype), []
    rounded = None if grads is None else _rounded(grads, k, v)
    for job in jobs:
        check_call("backward", job.q5, keys, job.k0, job.k1, job.bias, job.bounds)
        alibi = alibi_at(slopes, job.q5, job.qpos)
        if job.k1 > T_k:
            raise ValueError(f"native.backward: keys {job.k0}..{job.k1} past T_k = {T_k}")
        B, H_kv, G, R, D = job.q5.shape
        N = job.k1 - job.k0
        sums = _sums_of(job, (B, H_kv, N, D, D_v), grads)
        if (
            job.do5.shape != (B, H_kv, G, R, D_v)
            or job.do5.dtype != job.q5.dtype
            or job.lse.shape != (B, H_kv, G, R)
            or job.delta.shape != job.lse.shape
            or any(x.shape != shape for x, shape in sums)
            or any(x.dtype != torch.float32 for x in [job.lse, job.delta, *(x for x, _ in sums)])
            or any(x.stride(-1) != 1 for x in [job.do5, *(x for x, _ in sums)])
        ):
            raise ValueError(
                f"native.backward: mismatched shapes q {tuple(job.q5.shape)}, dO "
                f"{tuple(job.do5.shape)}, lse {tuple(job.lse.shape)}, dq and dk "
                f"{[tuple(x.shape) for x, _ in sums[:2]]}, keys {job.k0}..{job.k1}"
            )
        args.append(
            dict(
                q=(job.q5.data_ptr(), *job.q5.stride()[:4]),
                dout=(job.do5.data_ptr(), *job.do5.stride()[:4]),
                k=(k.data_ptr(), *k.stride()[:3]),
                v=(v.data_ptr(), *v.stride()[:3]),
                bias=bias_at(job.bias),
                bounds=bounds_at(job.bounds),
                lse=(job.lse.data_ptr(), *job.lse.stride()),
                delta=(job.delta.data_ptr(), *job.delta.stride()),
                dq=_pointer(job.dq, 4),
                dk=_pointer(job.dk, 3),
                dv=_pointer(job.dv, 3),
                sizes=(B, H_kv, G, R, D, D_v),
                keys=(T_k, job.k0, N),
                q0=job.q0,
                scale=scale,
                softcap=softcap,
                alibi=alibi,
                float32=dtype == torch.float32,
                source=source(k.dtype),
            )
        )
    _native.backward_many(calls=args, threads=torch.get_num_threads(), grads=rounded)


def _sums_of(
    job: BackwardJob,
    sizes: tuple[int, int, int, int, int],
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """A job's own float32 dq, dk and dv, each with the shape it must have; none where the
    pass has ``grads``, whose dQ must then hold the job's rows."""
    B, H_kv, N, D, D_v = sizes
    if grads is None:
        if job.dq is None or job.dk is None or job.dv is None:
            raise ValueError("native.backward: each job needs dq, dk and dv (or grads)")
        return [
            (job.dq, tuple(job.q5.shape)),
            (job.dk, (B, H_kv, N, D)),
            (job.dv, (B, H_kv, N, D_v)),
        ]
    if not (job.dq is None and job.dk is None and job.dv is None):
        raise ValueError("native.backward: with grads, the jobs' dq, dk and dv are None")
    R, dq = job.q5.shape[3], grads[0]
    if not 0 <= job.q0 <= dq.shape[3] - R or dq.shape[:3] != job.q5.shape[:3]:
        raise ValueError(
            f"native.backward: job rows {job.q0}..{job.q0 + R} of q {tuple(job.q5.shape)} "
            f"past grads' dq {tuple(dq.shape)}"
        )
    return []


def _pointer(x: torch.Tensor | None, strides: int) -> tuple[int, ...]:
    """A tensor as the kernel reads it: its address and its first strides (0s for None)."""
    return (0,) * (1 + strides) if x is None else (x.data_ptr(), *x.stride()[:strides])


def _rounded(
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor
) -> dict:
    """``grads`` of :func:`backward_many` as the kernel takes them, checked against K and V."""
    dq, dk, dv = grads
    B, H_kv, T_k, D = k.shape
    if (
        dq.dim() != 5
        or dq.shape[:2] != (B, H_kv)
        or dq.shape[-1] != D
        or dk.shape != k.shape
        or dv.shape != v.shape
        or any(x.dtype != k.dtype or x.stride(-1) != 1 for x in grads)
        or k.dtype not in (torch.bfloat16, torch.float16)
    ):
        raise ValueError(
            f"native.backward: grads dq {tuple(dq.shape)}, dk {tuple(dk.shape)}, dv "
            f"{tuple(dv.shape)} ({dq.dtype}) do not fit K {tuple(k.shape)} and V "
            f"{tuple(v.shape)} ({k.dtype}; grads are half precision, D contiguous)"
        )
    return dict(
        dq=_pointer(dq, 4),
        dk=_pointer(dk, 3),
        dv=_pointer(dv, 3),
        sizes=(B, H_kv, dq.shape[2], dq.shape[3], T_k, D, v.shape[-1]),
        dtype=source(k.dtype),
    )
