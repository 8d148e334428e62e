"""How masks and score modifications reach each kernel: a dense bool mask (reference, sdpa),
a float mask (sdpa with an additive modification), or functions that evaluate them on one
tile of the tiled kernel, never on the whole T_q × T_k.

Legend: B batch · H query heads · H_kv key/value heads · G = H / H_kv · T_q/T_k query/key
length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._checks import Problem
from ..kernels.tiled.plan import MaskTile, ModTile
from ..masks import Mask
from ..scores import ScoreMod
from .dispatch import MaskLike


def dense_mask(mask: MaskLike, p: Problem, device: torch.device) -> torch.Tensor | None:
    """The mask as a 4-d bool tensor broadcastable to (B, H, T_q, T_k), or None. It keeps
    size 1 on the dims the mask does not use: kernels broadcast it, and SDPA runs slower
    on an expanded (B, H, T_q, T_k) view than on the compact mask."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        out = mask.block(p.B, p.H, p.q_offset, p.q_offset + p.T_q, 0, p.T_k, device=device)
        return out.reshape((1,) * (4 - out.ndim) + tuple(out.shape))
    return mask[None, None] if mask.ndim == 2 else p.to4d(mask)


def mask_tile(mask: MaskLike, p: Problem, device: torch.device) -> MaskTile | None:
    """Evaluate the mask on one tile only: the tiled kernel's view of a mask."""
    if mask is None:
        return None
    if isinstance(mask, Mask):
        o, cache = p.q_offset, {}

        def tile(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
            if not mask.shift_invariant:
                return mask.block(p.B, p.H, o + q0, o + q1, k0, k1, device=device)
            # The same pattern recurs along each diagonal: evaluate it once per call.
            key = (q1 - q0, k1 - k0, o + q0 - k0)
            if key not in cache:
                cache[key] = mask.block(p.B, p.H, o + q0, o + q1, k0, k1, device=device)
            return cache[key]

        tile.shift_invariant = mask.shift_invariant  # type: ignore[attr-defined]
        tile.q_offset = o  # type: ignore[attr-defined]
        return tile
    dense = dense_mask(mask, p, device)

    def dense_tile(q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        # Size-1 (broadcast) dims are kept whole, not sliced.
        rows = slice(q0, q1) if dense.shape[-2] > 1 else slice(None)
        cols = slice(k0, k1) if dense.shape[-1] > 1 else slice(None)
        return dense[..., rows, cols]

    return dense_tile


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


class _ModTile:
    """The score modification on tiles of the tiled kernel, whose scores are laid out
    (B, H_kv, G·bq, L): query head h = kv_head·G + g, so a tile is a (B, H, bq, L) view."""

    def __init__(self, mod: ScoreMod, p: Problem, device: torch.device) -> None:
        self.mod, self.p, self.device, self.heads = mod, p, device, torch.arange(p.H)
        self.stages, self.terms = _stages(mod), {}

    def _view(self, s: torch.Tensor, q0: int, q1: int, k0: int, k1: int):
        idx = indices(self.p, self.device, torch.arange(q0, q1), self.heads, k0, k1)
        return s.view(self.p.B, self.p.H, q1 - q0, k1 - k0), idx  # (B, H, bq, L)

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


def _stages(mod: ScoreMod) -> list[ScoreMod]:
    """A chain's modifications in order (nested chains flattened); else [mod]."""
    inner = getattr(mod, "mods", None)
    return [s for m in inner for s in _stages(m)] if inner is not None else [mod]


def mod_tile(mod: ScoreMod | None, p: Problem, device: torch.device) -> ModTile | None:
    """The score modification as the tiled kernel applies it, tile by tile (or None)."""
    return None if mod is None else _ModTile(mod, p, device)


def float_mask(mask: MaskLike, mod: ScoreMod, p: Problem, like: torch.Tensor) -> torch.Tensor:
    """An additive modification and a mask as one float mask for torch's fused kernel:
    the modification's term, -inf where the mask blocks."""
    idx = indices(p, like.device, torch.arange(p.T_q), torch.arange(p.H), 0, p.T_k)
    term = mod.term(*idx, like=like)  # broadcastable to (B, H, T_q, T_k)
    term = term.reshape((1,) * (4 - term.ndim) + tuple(term.shape))
    allowed = dense_mask(mask, p, like.device)
    return term if allowed is None else term.masked_fill(~allowed, float("-inf"))
