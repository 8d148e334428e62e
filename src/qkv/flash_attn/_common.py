"""What FlashAttention's calls share: its score changes as one qkv modification, its window
with ``causal`` folded in, and the checks of its layouts.

Legend: B batch · T_q/T_k query/key length · H query heads · H_kv key/value heads · D head dim.
"""

from __future__ import annotations

from typing import Any

import torch

from ..scores import ScoreMod, alibi
from ..scores import softcap as softcap_mod


def score_mod(softcap: float, alibi_slopes: torch.Tensor | None) -> ScoreMod | None:
    """FlashAttention's score changes as one qkv modification: the soft-cap on the scaled
    scores, then the symmetric ALiBi term (FA's order). None when neither is asked for."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"softcap must be a number >= 0 (0: off); got {softcap!r}")
    mods = [softcap_mod(float(softcap))] if softcap > 0 else []
    if alibi_slopes is not None:
        mods.append(alibi(alibi_slopes, symmetric=True))
    if not mods:
        return None
    return mods[0] if len(mods) == 1 else mods[0].then(mods[1])


def fa_window(causal: bool, window_size: Any) -> tuple[int, int]:
    """The window as (left, right), ``causal`` folded in as FA does (right = 0)."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be (left, right) ints; got {window_size!r}") from None
    return (left, 0) if causal else (left, right)


def check_layout(name: str, x: Any, letters: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 4:
        raise ValueError(
            f"{name} must have shape {letters}, FlashAttention's layout; "
            f"got {tuple(getattr(x, 'shape', ())) or type(x).__name__}"
        )


def check_heads(H: int, H_kv: int, H_v: int) -> None:
    if H_kv != H_v or H_kv == 0 or H % H_kv:
        raise ValueError(
            f"k and v must have the same number of heads H_kv, dividing q's H = {H} "
            f"(GQA/MQA); got H_kv = {H_kv} for k and {H_v} for v"
        )


def check_packed(name: str, x: Any, ndim: int, n: int, letters: str) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != ndim or x.shape[ndim - 3] != n:
        raise ValueError(f"{name} must have shape {letters}; got {tuple(getattr(x, 'shape', ()))}")
