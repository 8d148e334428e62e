"""What a call of qkv's native kernel reads, checked and addressed: the rows, keys, bias,
row bounds and ALiBi slopes as the kernel takes them (addresses and strides), raising a
clear error where a wrong shape or dtype would make it read past a tensor. Used by
:mod:`qkv.kernels.tiled.native` for every call it makes.

Legend: B batch · H_kv key/value heads · G = H / H_kv · R query rows · T_k keys · D head dim.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the kernel computes in."""

SOURCES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes its inputs may hold: float32 steps widen half precision as they load it."""


def source(dtype: torch.dtype) -> str:
    """The kernel's name for what its inputs hold ("float32", "bfloat16", "float16")."""
    if dtype not in SOURCES:
        raise ValueError(f"native: inputs float32, bfloat16 or float16, not {dtype}")
    return str(dtype).removeprefix("torch.")


def check_keys(k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise unless K and V are what the kernel reads in place: one batch, head count and
    length (their head dims may differ), one dtype it reads, the head dim contiguous."""
    if (
        k.stride(-1) != 1
        or v.stride(-1) != 1
        or v.shape[:3] != k.shape[:3]
        or k.dtype != v.dtype
        or k.dtype not in SOURCES
    ):
        raise ValueError(
            "native: K and V of one batch, head count, length and dtype (float32, bfloat16 or "
            "float16), each with its head dim contiguous"
        )


def alibi_at(slopes: torch.Tensor | None, q5: torch.Tensor, qpos: int) -> tuple[int, int]:
    """ALiBi's (slopes' address, qpos) as the kernel takes them ((0, qpos): none), checked:
    float32, contiguous, one slope per query head (H_kv · G)."""
    if slopes is None:
        return (0, qpos)
    H_kv, G = q5.shape[1], q5.shape[2]
    if slopes.dtype != torch.float32 or slopes.shape != (H_kv * G,) or not slopes.is_contiguous():
        raise ValueError(
            f"native: ALiBi slopes float32 and contiguous, one per query head ({H_kv * G},); "
            f"got {slopes.dtype} {tuple(slopes.shape)}"
        )
    return (slopes.data_ptr(), qpos)


def check_call(
    name: str,
    q5: torch.Tensor,
    keys: tuple[int, int, int, torch.dtype],
    k0: int,
    k1: int,
    bias: torch.Tensor | None,
    bounds: torch.Tensor | None,
) -> None:
    """Raise unless one call's rows, keys and bias fit each other: the kernel reads raw
    memory, and a wrong shape would read past the tensors."""
    B, H_kv, G, R, D = q5.shape
    if (
        keys != (B, H_kv, D, q5.dtype)
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
        or (
            bounds is not None
            and (
                bias is not None
                or bounds.dtype != torch.int32
                or not bounds.is_contiguous()
                or bounds.ndim != 3
                or bounds.shape[0] not in (1, B)
                or tuple(bounds.shape[1:]) != (R, 2)
            )
        )
    ):
        raise ValueError(
            f"native.{name}: mismatched shapes q {tuple(q5.shape)}, keys (B, H_kv, D, dtype) "
            f"{keys}, keys {k0}..{k1}, bias "
            f"{None if bias is None else tuple(bias.shape)}, bounds "
            f"{None if bounds is None else (tuple(bounds.shape), bounds.dtype)} (a bias or "
            "int32 bounds (B|1, R, 2), not both)"
        )


def bias_at(bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    """The kernel's view of a float32, contiguous bias: its address and strides over B and
    H (0 where broadcast) and rows. All 0 for no bias."""
    if bias is None:
        return (0, 0, 0, 0)
    if bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError("native: the bias must be a contiguous float32 tensor")
    (sb, sh), (nb, nh) = bias.stride()[:2], bias.shape[:2]
    return bias.data_ptr(), sb if nb > 1 else 0, sh if nh > 1 else 0, bias.stride(2)


def bounds_at(bounds: torch.Tensor | None) -> tuple[int, int]:
    """The kernel's view of checked bounds: their address and stride over B (0 where
    broadcast); (0, 0) for none."""
    if bounds is None:
        return (0, 0)
    return bounds.data_ptr(), bounds.stride(0) if bounds.shape[0] > 1 else 0
