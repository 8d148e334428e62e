"""Lowering, in one stage: a mask and a score modification become what the chosen kernel
eats. That is a dense bool mask (reference, sdpa), a float mask (sdpa with an additive
modification), SDPA's ``is_causal``, a function over whole score matrices (reference), tile
objects that evaluate them one tile at a time (tiled: never the whole T_q × T_k), or
FlexAttention's ``BlockMask`` and ``score_mod`` (flex). :func:`lower` makes a
:class:`qkv.kernels.Lowered` call holding just the chosen kernel's forms.

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length · bq a block's queries · bk a block's keys.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from .._checks import Problem
from ..kernels import Lowered
from ..kernels.contract import DenseTiles, PredicateTiles
from ..kernels.flex import BLOCK
from ..masks import FULL, PARTIAL, Mask, MaskLike
from ..scores import ScoreMod
from .call import Call, Dispatch
from .dispatch import choose
from .recipe import dense_mask


def lower(call: Call, choice: Dispatch) -> Lowered:
    """The call as the kernel ``choice`` names receives it: q, k, v in (B, H|H_kv, T, D)
    layout, the mask and modification in that kernel's forms only, and the sinks as given
    (every kernel applies them)."""
    p, q, k, v, mask, mod = call.p, call.q, call.k, call.v, call.mask, call.mod
    base = Lowered(
        q,
        k,
        v,
        p.scale,
        p.q_offset,
        choice.path,
        call.tuning,
        dropout_p=call.dropout_p,
        generator=call.generator,
        need_lse=call.return_lse,
        sinks=call.sinks,
    )
    if choice.backend == "sdpa":
        if mod is not None:  # additive: its term and the mask as one float mask
            return replace(base, bias=float_mask(mask, mod, p, q))
        dense = dense_mask(mask, p, q.device) if choice.sdpa_mask == "dense" else None
        return replace(base, dense=dense, is_causal=choice.sdpa_mask == "is_causal")
    if choice.backend == "tiled":
        return replace(
            base,
            plan=choice.plan,
            tiles=mask_tiles(mask, p, q.device),
            mod_tiles=None if mod is None else ScoreTiles(mod, p, q.device),
            mod_tensors=() if mod is None else tuple(mod.tensors()),
        )
    if choice.backend == "flex":
        return replace(
            base,
            block_mask=flex_block_mask(
                _qkv_mask(mask), p.B, p.H, p.T_q, p.T_k, p.q_offset, q.device
            ),
            score_mod=flex_score_mod(mod, p.q_offset),
        )
    return replace(base, dense=dense_mask(mask, p, q.device), modify=modify(mod, p, q.device))


def _qkv_mask(mask: MaskLike) -> Mask | None:
    """A mask the flex kernel takes (the dispatch refused dense ones for it)."""
    assert mask is None or isinstance(mask, Mask)
    return mask


def mask_tiles(
    mask: MaskLike, p: Problem, device: torch.device
) -> PredicateTiles | DenseTiles | None:
    """The tiled kernel's view of a mask: evaluated on one tile only (None: no mask)."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        return PredicateTiles(mask, p.B, p.H, p.q_offset, device)
    dense = dense_mask(mask, p, device)
    assert dense is not None
    return DenseTiles(dense)


def indices(
    p: Problem, device: torch.device, rows: torch.Tensor, heads: torch.Tensor, k0: int, k1: int
) -> tuple[torch.Tensor, ...]:
    """(b, h, q_idx, kv_idx, row) index tensors of a score tile, broadcastable to
    (B, len(heads), len(rows), k1 - k0): what a score modification receives."""
    b = torch.arange(p.B, device=device).view(-1, 1, 1, 1)
    row = rows.to(device).view(1, 1, -1, 1)
    kv = torch.arange(k0, k1, device=device).view(1, 1, 1, -1)
    return b, heads.to(device).view(1, -1, 1, 1), row + p.q_offset, kv, row


def modify(
    mod: ScoreMod | None, p: Problem, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The score modification over a whole (B, H, T_q, T_k) score matrix (or None)."""
    if mod is None:
        return None
    idx = indices(p, device, torch.arange(p.T_q), torch.arange(p.H), 0, p.T_k)
    return lambda s: mod.apply(s, *idx).expand(s.shape)


class ScoreTiles:
    """The score modification on tiles of the tiled kernel, whose scores are laid out
    (B, H_kv, G·bq, bk): query head h = kv_head·G + g, so a tile is a (B, H, bq, bk) view."""

    def __init__(self, mod: ScoreMod, p: Problem, device: torch.device) -> None:
        self.mod, self.p, self.device, self.heads = mod, p, device, torch.arange(p.H)
        self.softcap, self.alibi = mod.softcap, mod.alibi
        self.stages = mod.stages()
        self.terms: dict[tuple[int, int, int, int], torch.Tensor] = {}

    def _view(
        self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int
    ) -> tuple[torch.Tensor, Any]:
        idx = indices(self.p, self.device, torch.arange(q0, q1), self.heads, k0, k1)
        return s.view(self.p.B, self.p.H, q1 - q0, k1 - k0), idx  # (B, H, bq, bk)

    def __call__(self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """The modified tile; ``s`` (the kernel's own) may be overwritten. A shift-invariant
        additive term is computed once per diagonal offset and reused."""
        s4, idx = self._view(s, q0, q1, k0, k1)
        for i, stage in enumerate(self.stages):
            if stage.additive and stage.shift_invariant:
                key = (i, q1 - q0, k1 - k0, self.p.q_offset + q0 - k0)
                if key not in self.terms:
                    self.terms[key] = stage.term(*idx, like=s4)
                s4 = s4.add_(self.terms[key])
            else:
                s4 = stage.apply_(s4, *idx).expand(s4.shape)
        return s4.reshape(s.shape)

    def vjp(
        self, ds: torch.Tensor, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int, *, need: bool
    ) -> tuple[torch.Tensor, list]:
        s4, idx = self._view(s, q0, q1, k0, k1)
        d4, grads = self.mod.vjp(ds.view(s4.shape), s4, *idx, need=need)
        return d4.reshape(s.shape), grads


def float_mask(mask: MaskLike, mod: ScoreMod, p: Problem, like: torch.Tensor) -> torch.Tensor:
    """An additive modification and a mask as one float mask for torch's fused kernel:
    the modification's term, -inf where the mask blocks."""
    idx = indices(p, like.device, torch.arange(p.T_q), torch.arange(p.H), 0, p.T_k)
    term = mod.term(*idx, like=like)  # broadcastable to (B, H, T_q, T_k)
    term = term.reshape((1,) * (4 - term.ndim) + tuple(term.shape))
    allowed = dense_mask(mask, p, like.device)
    return term if allowed is None else term.masked_fill(~allowed, float("-inf"))


# FlexAttention's forms


def flex_block_mask(
    mask: Mask | None, B: int, H: int, T_q: int, T_k: int, q_offset: int, device: torch.device
) -> Any:
    """The ``BlockMask`` of a qkv mask (None: every block FULL), from its block map."""
    from torch.nn.attention.flex_attention import BlockMask

    if mask is None:
        codes = np.full((-(-T_q // BLOCK), -(-T_k // BLOCK)), FULL, dtype=np.int8)
    else:
        codes = mask.blocks(B, H, T_q, T_k, block_q=BLOCK, block_k=BLOCK, q_offset=q_offset)

    def pack(chosen: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # per query block: how many key blocks, and their indices first (stable: in order)
        count = chosen.sum(-1).astype(np.int32)
        order = np.argsort(~chosen, axis=-1, kind="stable").astype(np.int32)
        return (
            torch.from_numpy(count).to(device)[None, None],
            torch.from_numpy(order).to(device)[None, None],
        )

    partial, partial_idx = pack(codes == PARTIAL)
    full, full_idx = pack(codes == FULL)
    return BlockMask.from_kv_blocks(
        partial,
        partial_idx,
        full,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=flex_mask_mod(mask, q_offset, device),
        seq_lengths=(T_q, T_k),
    )


def flex_mask_mod(mask: Mask | None, q_offset: int, device: torch.device) -> Any:
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` for a qkv mask: its predicate at
    absolute query positions, reading its arrays as tensors on ``device``."""
    if mask is None:
        return lambda b, h, q_idx, kv_idx: kv_idx >= 0
    on_device = _tensors(mask, device)

    def fn(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return on_device(b, h, q_idx + q_offset, kv_idx)

    return fn


def flex_score_mod(mod: Any, q_offset: int) -> Any:
    """FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` for a qkv modification."""
    if mod is None:
        return None

    def fn(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mod.apply(score, b, h, q_idx + q_offset, kv_idx, q_idx)

    return fn


def _tensors(mask: Mask, device: torch.device) -> Mask:
    """A copy of the mask tree whose NumPy arrays are torch tensors on ``device`` (the
    predicates index them either way)."""
    out = copy.copy(mask)
    for name, value in vars(mask).items():
        if isinstance(value, np.ndarray):
            setattr(out, name, torch.from_numpy(value).to(device))
        elif isinstance(value, Mask):
            setattr(out, name, _tensors(value, device))
    return out


def tiled_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: MaskLike, scale: float | None
) -> Lowered:
    """A (B, H, T_q, D) call validated, planned and lowered for the tiled kernel, to run its
    :func:`~qkv.kernels.tiled.forward` and :func:`~qkv.kernels.tiled.backward` directly
    (context parallelism calls them per pair of shards)."""
    call = Call.of(q, k, v, mask=mask, scale=scale, return_lse=True, backend="tiled")
    return lower(call, choose(call))
