"""The tiled kernel: block-sparse attention with its own backward, O(T·D) memory.

``plan`` turns a mask's block map into chunks of keys per query block; ``loop`` is the
readable PyTorch kernel over them and the fallback; ``flash`` runs the same plan as calls of
torch's fused CPU flash kernel; ``native`` runs those calls in qkv's own C kernel for
bfloat16. This module decides between them once per call and holds the autograd function.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import flash as fused
from .loop import loop_forward, tiled_backward
from .plan import MaskTile, ModTile, Plan


def tiled_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    mask_tile: MaskTile | None,
    scale: float,
    mod_tile: ModTile | None = None,
    fuse: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, T_q, D_v) and lse (B, H, T_q) in the accumulation dtype: the fused step
    (:func:`qkv.kernels.fused.fused_forward`) where it applies, else the loop over tiles
    (:func:`loop_forward`). ``fuse``: whether the fused step may run, if the caller has
    decided it already (:func:`_fusable`)."""
    if fuse is None:
        fuse = _fusable(q, k, v, mod_tile)
    if fuse:
        return fused.fused_forward(q, k, v, plan, mask_tile, scale)
    return loop_forward(q, k, v, plan, mask_tile, scale, mod_tile)


def _fusable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod_tile: ModTile | None) -> bool:
    """Whether the fused steps may run: no score modification (the loop applies those) and
    what :func:`qkv.kernels.fused.fusable` asks of the tensors."""
    return mod_tile is None and fused.fusable(q, k, v)


def plain_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    plan: Plan,
    mask_tile: MaskTile | None,
    scale: float,
    *,
    fuse: bool | None = None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv when no gradient reaches the log-sum-exp and there is no score
    modification: the fused backward where it may run (``fuse``: as the forward decided, or
    decided here), else the loop (``delta`` as for :func:`tiled_backward`)."""
    if fuse is None:
        fuse = _fusable(q, k, v, None)
    if fuse and fused.FLASH_BACKWARD is not None:
        return fused.fused_backward(q, k, v, out, lse, dout, plan, mask_tile, scale)
    return tiled_backward(q, k, v, out, lse, dout, None, plan, mask_tile, scale, delta=delta)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, mask_tile, scale, mod_tile, *mod_tensors):  # type: ignore[override]
        # Decided once (it reads all of K): the backward reuses it, on the same saved tensors.
        ctx.fuse = _fusable(q, k, v, mod_tile)
        out, lse = tiled_forward(q, k, v, plan, mask_tile, scale, mod_tile, fuse=ctx.fuse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *mod_tensors)
        ctx.plan, ctx.mask_tile, ctx.scale, ctx.mod_tile = plan, mask_tile, scale, mod_tile
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        q, k, v, out, lse, *mod_tensors = ctx.saved_tensors
        no_dlse = dlse is None or not bool(dlse.any())
        if no_dlse and ctx.mod_tile is None:
            dq, dk, dv = plain_backward(
                q, k, v, out, lse, dout, ctx.plan, ctx.mask_tile, ctx.scale, fuse=ctx.fuse
            )
            return dq, dk, dv, None, None, None, None
        dq, dk, dv, *dmod = tiled_backward(
            q,
            k,
            v,
            out,
            lse,
            dout,
            dlse,
            ctx.plan,
            ctx.mask_tile,
            ctx.scale,
            ctx.mod_tile,
            mod_tensors,
            need=any(ctx.needs_input_grad[7:]),
        )
        return (dq, dk, dv, None, None, None, None, *dmod)


def tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    plan: Plan,
    mask_tile: MaskTile | None,
    scale: float,
    mod_tile: ModTile | None = None,
    mod_tensors: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention with its own backward.

    Args:
        q: (B, H, T_q, D). k: (B, H_kv, T_k, D). v: (B, H_kv, T_k, D_v), T_k >= 1.
        plan: from :func:`make_plan`. mask_tile: evaluates the mask on a PARTIAL tile.
        scale: multiplies the scores.
        mod_tile: applies a score modification to every computed tile, before the mask.
        mod_tensors: the tensors the modification reads; gradients reach them.

    Returns:
        out (B, H, T_q, D_v) in q's dtype and lse (B, H, T_q) in the accumulation dtype;
        gradients flow through both.
    """
    return _TiledAttention.apply(q, k, v, plan, mask_tile, scale, mod_tile, *mod_tensors)
