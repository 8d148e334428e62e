"""The score modifications qkv knows: ALiBi, soft-capping, T5's relative bias and an additive
float bias, each with its term, its gradient and its checks.

Legend: B batch · H query heads · T_q/T_k query/key length.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from .._checks import fmt_shape
from .._recipes import keep_int
from .base import ScoreMod, _index, _like, _numpy, _scatter


class _Alibi(ScoreMod):
    additive = shift_invariant = True

    def __init__(self, slopes: Any) -> None:
        slopes = torch.as_tensor(slopes)
        if slopes.ndim != 1 or not slopes.is_floating_point():
            raise TypeError(
                f"alibi slopes must be a 1-d float tensor, one per head (H,); "
                f"got {slopes.dtype} of shape {fmt_shape(slopes.shape)}"
            )
        self.slopes = self.alibi = slopes

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        if self.slopes.shape[0] != H:
            raise ValueError(
                f"alibi slopes must have shape (H,) = ({H},); got {fmt_shape(self.slopes.shape)}"
            )

    def term(self, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any, *, like: Any) -> Any:
        # -slope · distance: a key d positions back costs slope · d (positive for future keys).
        return _like(self.slopes, like)[h] * (kv_idx - q_idx)

    def _term_grads(
        self, ds: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any
    ) -> list[torch.Tensor]:
        per_head = (ds * (kv_idx - q_idx)).sum(dim=(0, 2, 3))  # (len(h),)
        return [_scatter(self.slopes, (h.reshape(-1),), per_head)]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.slopes,)

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        tensors.append(self.slopes)
        return [f"alibi:{len(tensors) - 1}"]

    def __repr__(self) -> str:
        return f"alibi({self.slopes.shape[0]} heads)"


class _SymmetricAlibi(ScoreMod):
    """FlashAttention's ALiBi: ``score − slopes[(b,) h] · |q_idx − kv_idx|``."""

    additive = shift_invariant = True

    def __init__(self, slopes: Any) -> None:
        slopes = torch.as_tensor(slopes)
        if slopes.ndim not in (1, 2) or not slopes.is_floating_point():
            raise TypeError(
                f"symmetric alibi slopes must be a float tensor (H,) or (B, H); "
                f"got {slopes.dtype} of shape {fmt_shape(slopes.shape)}"
            )
        self.slopes = slopes

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        want = (H,) if self.slopes.ndim == 1 else (B, H)
        if tuple(self.slopes.shape) != want:
            letters = "(H,)" if self.slopes.ndim == 1 else "(B, H)"
            raise ValueError(
                f"alibi slopes must have shape {letters} = {want}; "
                f"got {fmt_shape(self.slopes.shape)}"
            )

    @property
    def batch(self) -> int | None:
        return self.slopes.shape[0] if self.slopes.ndim == 2 else None

    def select(self, b: int) -> ScoreMod:
        return self if self.slopes.ndim == 1 else _SymmetricAlibi(self.slopes[b])

    def _slope(self, b: Any, h: Any, like: Any) -> Any:
        slopes = _like(self.slopes, like)
        return slopes[h] if self.slopes.ndim == 1 else slopes[b, h]

    def term(self, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any, *, like: Any) -> Any:
        return -self._slope(b, h, like) * abs(kv_idx - q_idx)

    def _term_grads(
        self, ds: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any
    ) -> list[torch.Tensor]:
        cost = -(ds * abs(kv_idx - q_idx))
        if self.slopes.ndim == 1:
            return [_scatter(self.slopes, (h.reshape(-1),), cost.sum(dim=(0, 2, 3)))]
        per = cost.sum(dim=(2, 3))  # (len(b), len(h))
        return [_scatter(self.slopes, (b.reshape(-1, 1), h.reshape(1, -1)), per)]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.slopes,)

    def __repr__(self) -> str:
        return f"alibi({tuple(self.slopes.shape)}, symmetric)"


class _Softcap(ScoreMod):
    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        return [f"softcap:{self.cap!r}"]

    def __init__(self, cap: float) -> None:
        if (
            isinstance(cap, bool)
            or not isinstance(cap, (int, float))
            or not (math.isfinite(cap) and cap > 0)
        ):
            raise ValueError(f"softcap cap must be a finite number > 0; got {cap!r}")
        self.cap = self.softcap = float(cap)

    def apply(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any) -> Any:
        xp = np if _numpy(score) else torch
        capped = self.cap * xp.tanh(score / self.cap)
        # A score a bias already masked (-inf) stays masked, not -cap.
        return xp.where(score == -math.inf, score, capped)

    def apply_(
        self, score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any
    ) -> torch.Tensor:
        if bool(score.amin() == -math.inf):  # a bias masked some: keep them -inf
            return self.apply(score, b, h, q_idx, kv_idx, row)
        # cap·tanh(x/cap) = 2·cap·sigmoid(2x/cap) - cap, in place: a quarter of torch.tanh's
        # cost on CPU, within a few units of cap's last place (the capped score's own rounding).
        return score.mul_(2.0 / self.cap).sigmoid_().mul_(2.0 * self.cap).sub_(self.cap)

    def vjp(
        self,
        ds: torch.Tensor,
        score: torch.Tensor,
        b: Any,
        h: Any,
        q_idx: Any,
        kv_idx: Any,
        row: Any,
        *,
        need: bool,
    ) -> tuple[torch.Tensor, list[Any]]:
        t = torch.tanh(score / self.cap)  # 1 - tanh² is 0 at a -inf score: no NaN
        return ds * (1 - t * t), []

    def __repr__(self) -> str:
        return f"softcap({self.cap!r})"


def relative_position_bucket(
    relative_position: Any,
    *,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Any:
    """T5's bucket of each relative position ``kv_idx - q_idx`` (NumPy or torch integers).

    Half the buckets (all of them if not ``bidirectional``, where future keys share bucket 0)
    hold exact distances up to ``num_buckets // 4`` (// 2). The rest grow logarithmically up
    to ``max_distance``. Farther keys share the last bucket. Computed from a table made once
    in float32, as T5 computes it, so NumPy and torch agree bucket for bucket.
    """
    # While compiling, the table's function itself: dynamo traces through the cache wrapper
    # anyway, and warns that it does.
    make = _bucket_table.__wrapped__ if torch.compiler.is_compiling() else _bucket_table
    table = make(bool(bidirectional), int(num_buckets), int(max_distance))
    idx = relative_position.clip(-max_distance, max_distance) + max_distance
    if _numpy(relative_position):
        return table[idx]
    return torch.as_tensor(table, device=relative_position.device)[idx]


@functools.lru_cache(maxsize=16)
def _bucket_table(bidirectional: bool, num_buckets: int, max_distance: int) -> np.ndarray:
    """Bucket of every relative position in [-max_distance, max_distance], computed in
    float32 torch arithmetic as T5 computes it."""
    rel = torch.arange(-max_distance, max_distance + 1)
    offset = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        offset = (rel > 0).long() * num_buckets
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)  # future keys: distance 0
    exact = num_buckets // 2
    # Logarithmic buckets past the exact ones (log(0) is never used: those are exact).
    far = (
        exact
        + (
            torch.log(dist.clamp(min=1).float() / exact)
            / math.log(max_distance / exact)
            * (num_buckets - exact)
        ).long()
    )
    table = offset + torch.where(dist < exact, dist, far.clamp(max=num_buckets - 1))
    return table.numpy()


class _RelativeBias(ScoreMod):
    additive = shift_invariant = True

    def __init__(self, table: torch.Tensor, bidirectional: bool, max_distance: int) -> None:
        if not isinstance(table, torch.Tensor) or table.ndim != 2 or not table.is_floating_point():
            raise TypeError(
                "relative_bias table must be a float tensor of shape "
                f"(num_buckets, H); got {getattr(table, 'shape', type(table))}"
            )
        self.table, self.bidirectional = table, bool(bidirectional)
        self.max_distance = int(max_distance)
        if self.table.shape[0] < (4 if self.bidirectional else 2) or self.max_distance < 1:
            raise ValueError(
                f"relative_bias needs at least {4 if bidirectional else 2} buckets "
                f"and max_distance >= 1; got {self.table.shape[0]} and "
                f"{max_distance}"
            )

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        if self.table.shape[1] != H:
            raise ValueError(
                f"relative_bias table must have shape (num_buckets, H) with H={H}; "
                f"got {fmt_shape(self.table.shape)}"
            )

    def term(self, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any, *, like: Any) -> Any:
        bucket = relative_position_bucket(
            kv_idx - q_idx,
            bidirectional=self.bidirectional,
            num_buckets=self.table.shape[0],
            max_distance=self.max_distance,
        )
        return _like(self.table, like)[bucket, h]  # (1, H, T_q, T_k)

    def _term_grads(
        self, ds: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any
    ) -> list[torch.Tensor]:
        bucket = relative_position_bucket(
            kv_idx - q_idx,
            bidirectional=self.bidirectional,
            num_buckets=self.table.shape[0],
            max_distance=self.max_distance,
        )
        return [_scatter(self.table, (bucket, h), ds.sum(dim=0, keepdim=True))]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.table,)

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        tensors.append(self.table)
        bidirectional = keep_int(ints, int(self.bidirectional))
        return [
            f"relative_bias:{len(tensors) - 1}:{bidirectional}:{keep_int(ints, self.max_distance)}"
        ]

    def __repr__(self) -> str:
        return (
            f"relative_bias({self.table.shape[0]} buckets, {self.table.shape[1]} heads, "
            f"bidirectional={self.bidirectional}, max_distance={self.max_distance})"
        )


class _Bias(ScoreMod):
    additive = True

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(
                f"bias must be a float tensor; got "
                f"{getattr(tensor, 'dtype', type(tensor).__name__)}"
            )
        if tensor.ndim not in (2, 4):
            raise ValueError(
                f"bias must have shape (T_q, T_k) or (B, H, T_q, T_k) (size-1 "
                f"dims broadcast); got {fmt_shape(tensor.shape)}"
            )
        self.tensor = tensor if tensor.ndim == 4 else tensor[None, None]

    def validate(self, B: int, H: int, T_q: int, T_k: int) -> None:
        want = (B, H, T_q, T_k)
        if any(n not in (1, w) for n, w in zip(self.tensor.shape, want)):
            raise ValueError(
                f"bias must broadcast to (B, H, T_q, T_k) = {fmt_shape(want)}; "
                f"got {fmt_shape(self.tensor.shape)}"
            )
        if not torch.compiler.is_compiling() and bool(
            (torch.isnan(self.tensor) | (self.tensor == math.inf)).any()
        ):
            raise ValueError("bias holds NaN or +inf; -inf (masked) and finite values only")

    def term(self, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any, *, like: Any) -> Any:
        t = _like(self.tensor, like)
        n = t.shape
        return t[_index(n[0], b), _index(n[1], h), _index(n[2], row), _index(n[3], kv_idx)]

    def _term_grads(
        self, ds: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, row: Any
    ) -> list[torch.Tensor]:
        n = self.tensor.shape
        # Sum over the dims the bias broadcasts along, then scatter onto the rest.
        ds = ds.sum(dim=[d for d in range(4) if n[d] == 1], keepdim=True)
        where = tuple(
            i if m != 1 else torch.zeros((), dtype=torch.long, device=ds.device)
            for m, i in zip(n, (b, h, row, kv_idx))
        )
        return [_scatter(self.tensor, where, ds)]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.tensor,)

    def recipe(self, tensors: list[Any], ints: list[Any]) -> list[str] | None:
        tensors.append(self.tensor)
        return [f"bias:{len(tensors) - 1}"]

    def __repr__(self) -> str:
        return f"bias(tensor{tuple(self.tensor.shape)})"


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's standard slopes for ``heads`` heads (Press et al., 2022): a geometric sequence
    starting at ``2^(-8/n)`` for the power of two ``n``. For other head counts, those of the
    largest power of two below, then every other slope of the next power of two. (H,) float32.
    """
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be an int >= 1; got {heads!r}")

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** math.floor(math.log2(heads))
    slopes = geometric(n) + geometric(2 * n)[0::2][: heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi(slopes: Any, *, symmetric: bool = False) -> ScoreMod:
    """ALiBi: ``score + slopes[h] · (kv_idx - q_idx)``, a linear penalty on distance.

    Args:
        slopes: (H,) float, one per query head; :func:`alibi_slopes` gives the standard ones.
        symmetric: FlashAttention's ALiBi instead: ``score − slopes · |q_idx − kv_idx|``
            (equal to the signed one on causal keys, a penalty on future keys too), with
            slopes (H,) or per batch row (B, H), as ``flash_attn_func(alibi_slopes=)``.

    BLOOM adds ``slopes[h] · kv_idx`` instead: the same weights and output (softmax ignores a
    per-row constant), a log-sum-exp larger by ``slopes[h] · q_idx``.
    """
    return _SymmetricAlibi(slopes) if symmetric else _Alibi(slopes)


def softcap(cap: float) -> ScoreMod:
    """Soft-capping (Gemma 2): ``cap · tanh(score / cap)``, scores squashed into (-cap, cap).
    A score already -inf stays -inf."""
    return _Softcap(cap)


def relative_bias(
    table: torch.Tensor, *, bidirectional: bool = True, max_distance: int = 128
) -> ScoreMod:
    """T5's learned relative-position bias: ``score + table[bucket(kv_idx - q_idx), h]``.

    Args:
        table: (num_buckets, H) float, e.g. ``nn.Embedding(32, H).weight``; its gradient
            flows on every backend.
        bidirectional: encoder (True) or decoder (False) buckets; see
            :func:`relative_position_bucket`.
        max_distance: distances from here on share the last bucket.
    """
    return _RelativeBias(table, bidirectional, max_distance)


def bias(tensor: torch.Tensor) -> ScoreMod:
    """An additive float bias of shape (T_q, T_k) or (B, H, T_q, T_k), size-1 dims
    broadcasting, indexed by the call's query rows (not absolute positions). ``-inf`` entries
    act as a mask, so SDPA's and Hugging Face's float masks work as they are; NaN and +inf
    are refused. Its gradient flows where it requires one."""
    return _Bias(tensor)
