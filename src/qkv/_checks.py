"""The one validation helper behind every public attention entry point.

It reads shapes, dtypes and devices only, so it serves the NumPy oracle and the
torch core alike. Every error names the argument, the expected shape in legend
letters and the actual shape.

Legend: B batch · H query heads · H_kv key/value heads · T_q/T_k query/key length ·
D head dim · D_v value head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

_LAYOUT = {
    2: ("T_q", "D"),
    3: ("B", "T_q", "D"),
    4: ("B", "H", "T_q", "D"),
}


@dataclass(frozen=True)
class Problem:
    """The sizes of one attention call, in the canonical (B, H, T, D) layout."""

    rank: int  # 2, 3 or 4: the layout the caller used
    B: int
    H: int
    H_kv: int
    T_q: int
    T_k: int
    D: int
    D_v: int
    q_offset: int
    scale: float

    @property
    def mask_shape(self) -> tuple[int, ...]:
        """The shape a dense mask broadcasts to in the caller's layout, e.g. (B, T_q, T_k)."""
        full = dict(B=self.B, H=self.H, T_q=self.T_q, T_k=self.T_k)
        return tuple(full[c] for c in self.mask_letters)

    def to4d(self, x: Any) -> Any:
        """View a (T, ·) or (B, T, ·) array as (B, H, T, ·); 4-d arrays pass through."""
        return {2: lambda: x[None, None], 3: lambda: x[:, None], 4: lambda: x}[self.rank]()

    def restore(self, x: Any) -> Any:
        """Undo :meth:`to4d` on a (B, H, ...) result: out, weights or lse."""
        return {2: lambda: x[0, 0], 3: lambda: x[:, 0], 4: lambda: x}[self.rank]()

    @property
    def mask_letters(self) -> tuple[str, ...]:
        """Legend letters of the mask shape for this layout, e.g. (B, H, T_q, T_k)."""
        return (*_LAYOUT[self.rank][:-1], "T_k")


def fmt_shape(shape: Any) -> str:
    dims = tuple(int(d) for d in shape)
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


def _letters(*names: str) -> str:
    return "(" + ", ".join(names) + ")"


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def _is_float(x: Any) -> bool:
    torch_flag = getattr(x.dtype, "is_floating_point", None)
    if torch_flag is not None:
        return bool(torch_flag)
    return bool(np.issubdtype(x.dtype, np.floating))


def _library(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def _device(x: Any) -> Any:
    return getattr(x, "device", "cpu")  # compared only between tensors of one library


def _is_bool(x: Any) -> bool:
    return _dtype_name(x) == "bool"


def _symbolic(n: Any) -> bool:
    """Whether n is a symbolic size of ``torch.compile(dynamic=True)`` (torch.SymInt)."""
    return type(n).__name__ == "SymInt"


def _dim(letter: str, n: Any) -> Any:
    """A dim's size as an int. A symbolic length stays symbolic (one graph for all lengths),
    the other dims are specialised."""
    return n if letter in ("T_q", "T_k") and _symbolic(n) else int(n)


def _check_tensor(name: str, x: Any) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a tensor or array; got {type(x).__name__}")
    if x.ndim not in _LAYOUT:
        raise ValueError(
            f"{name} must have shape (T, D), (B, T, D) or (B, H, T, D); got {fmt_shape(x.shape)}"
        )
    if not _is_float(x):
        raise TypeError(
            f"{name} must be floating point (float16, bfloat16, float32 or float64); "
            f"got {_dtype_name(x)}"
        )


def _expect(name: str, x: Any, letters: tuple[str, ...], want: dict[str, int], why: str) -> None:
    """Raise unless the named dims of ``x`` equal ``want``."""
    got = dict(zip(letters, (_dim(c, d) for c, d in zip(letters, x.shape))))
    bad = {k: v for k, v in want.items() if got[k] != v}
    if bad:
        pins = ", ".join(f"{k}={v}" for k, v in want.items())
        raise ValueError(
            f"{name} must have shape {_letters(*letters)} with {pins} {why}; "
            f"got {fmt_shape(x.shape)}"
        )


def _sizes(query: Any, key: Any, value: Any) -> tuple[int, int, int, int, int, int, int]:
    """(B, H, H_kv, T_q, T_k, D, D_v) of three inputs of one layout, checked to agree."""
    q_letters = _LAYOUT[query.ndim]
    qd = dict(zip(q_letters, (_dim(c, d) for c, d in zip(q_letters, query.shape))))
    B, H, T_q, D = qd.get("B", 1), qd.get("H", 1), qd["T_q"], qd["D"]
    k_letters = tuple({"H": "H_kv", "T_q": "T_k"}.get(c, c) for c in q_letters)
    kd = dict(zip(k_letters, (_dim(c, d) for c, d in zip(k_letters, key.shape))))
    _expect("key", key, k_letters, {**({"B": B} if "B" in kd else {}), "D": D}, "to match query")
    H_kv, T_k = kd.get("H_kv", 1), kd["T_k"]
    v_letters = (*k_letters[:-1], "D_v")
    want_v = {k: v for k, v in kd.items() if k in ("B", "H_kv", "T_k")}
    _expect("value", value, v_letters, want_v, "to match key")
    D_v = int(value.shape[-1])
    if H % H_kv != 0:
        raise ValueError(
            f"query heads H={H} must be a multiple of key/value heads H_kv={H_kv}; "
            f"got query {fmt_shape(query.shape)} and key {fmt_shape(key.shape)}"
        )
    return B, H, H_kv, T_q, T_k, D, D_v


def _looks_bthd(query: Any, key: Any, value: Any) -> bool:
    """Whether three 4-d inputs agree when read as (B, T, H, D): one B and D, key and value
    of one length and head count, H_kv dividing H."""
    (B, _, H, D), (B_k, T_k, H_kv, D_k), (B_v, T_v, H_v, _) = (
        tuple(x.shape) for x in (query, key, value)
    )
    return (
        B == B_k == B_v and D_k == D and T_k == T_v and H_kv == H_v and H_kv > 0 and H % H_kv == 0
    )


def check_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    scale: float | None = None,
    q_offset: int | None = None,
    dropout_p: float = 0.0,
    validate_mask: bool = True,
) -> Problem:
    """Validate one attention call and return its sizes.

    Under ``torch.compile(dynamic=True)`` the lengths T_q and T_k (and q_offset) stay
    symbolic, so one graph serves every length; ``validate_mask=False`` skips a qkv mask's
    own checks, which read its arrays (the compiled tiled op runs them at run time).

    Raises:
        TypeError: a non-tensor, an integer or bool input, mixed dtypes, a non-bool dense mask.
        ValueError: a wrong rank or mismatched sizes, mixed devices, a mask that does not
            broadcast, a bad scale, dropout_p or q_offset.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, x)
    rank = query.ndim
    for name, x in (("key", key), ("value", value)):
        if _library(x) != _library(query):
            raise TypeError(
                f"{name} is a {type(x).__name__} but query is a {type(query).__name__}; "
                "pass tensors of one library"
            )
        if x.ndim != rank:
            raise ValueError(
                f"{name} must have the same layout as query {_letters(*_LAYOUT[rank])}; "
                f"got {fmt_shape(x.shape)} for query {fmt_shape(query.shape)}"
            )
        if x.dtype != query.dtype:
            raise TypeError(
                f"{name} has dtype {_dtype_name(x)} but query has {_dtype_name(query)}; "
                "cast them to one dtype"
            )
        if _device(x) != _device(query):
            raise ValueError(f"{name} is on {x.device} but query is on {query.device}")

    try:
        B, H, H_kv, T_q, T_k, D, D_v = _sizes(query, key, value)
    except ValueError as err:
        if rank == 4 and _looks_bthd(query, key, value):
            raise ValueError(
                f"{err}. These fit as (B, T, H, D) tensors: qkv takes (B, H, T, D), so pass "
                "query.transpose(1, 2) and the same for key and value (qkv.flash_attn takes "
                "FlashAttention's (B, T, H, D) as it is)"
            ) from None
        raise

    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    elif not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0; got {scale!r}")

    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")

    if q_offset is None:
        q_offset = T_k - T_q  # bottom-right: the last query sits on the last key
    elif isinstance(q_offset, bool) or not (
        isinstance(q_offset, (int, np.integer)) or _symbolic(q_offset)
    ):
        raise TypeError(f"q_offset must be an int; got {type(q_offset).__name__}")
    # Any offset: positions are only numbers to a mask (queries before key 0 see nothing
    # under causal; top-left alignment with T_q > T_k is q_offset=0, as FlexAttention counts).

    q_offset = q_offset if _symbolic(q_offset) else int(q_offset)
    problem = Problem(rank, B, H, H_kv, T_q, T_k, D, D_v, q_offset, float(scale))
    if hasattr(mask, "validate") and validate_mask:  # a qkv.masks.Mask
        mask.validate(B, H, T_q, T_k)
    elif mask is not None and hasattr(mask, "shape"):
        check_dense_mask(mask, problem, like=query)
    return problem


def check_dense_mask(mask: Any, p: Problem, *, like: Any, additive: bool = False) -> None:
    """A dense mask must be bool (or float, if ``additive``) and broadcast to the
    layout's (..., T_q, T_k)."""
    letters, target = p.mask_letters, p.mask_shape
    if not (_is_bool(mask) or (additive and _is_float(mask))):
        raise TypeError(
            f"mask must be bool (True = may attend) or a qkv mask; got dtype {_dtype_name(mask)}"
            + (
                " (an additive float mask, 0 / -inf as SDPA and Hugging Face take it, goes in "
                "as score_mod=qkv.scores.bias(mask))"
                if _is_float(mask)
                else ""
            )
        )
    # (T_q, T_k) or the full rank of the layout: a (3, T_q, T_k) mask for 4-d inputs could
    # mean (B, …) or (H, …), so it is refused rather than broadcast one way silently.
    ok = mask.ndim in (2, len(target)) and all(
        m in (1, t) for m, t in zip(reversed(tuple(mask.shape)), reversed(target))
    )
    if not ok:
        shapes = " or ".join(dict.fromkeys([_letters("T_q", "T_k"), _letters(*letters)]))
        raise ValueError(
            f"mask must have shape {shapes} (size-1 dims broadcast) with "
            f"{_letters(*letters)} = {fmt_shape(target)}; got {fmt_shape(mask.shape)}"
        )
    if _device(mask) != _device(like):
        raise ValueError(f"mask is on {mask.device} but query is on {like.device}")


def check_sizes(**sizes: object) -> None:
    """Every size an int >= 1, or a ValueError naming it."""
    for name, n in sizes.items():
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1; got {n!r}")


def check_appended(
    key: Any,
    value: Any,
    B: int,
    H_kv: int,
    D: int,
    D_v: int,
    like: Any,
    holder: str,
    what: str = "",
) -> None:
    """Keys (B, H_kv, T, D) and values (B, H_kv, T, D_v) of ``like``'s dtype and device, or
    a ValueError/TypeError saying which and why (``what`` qualifies B in the message)."""
    for name, x, last, letter in (("key", key, D, "D"), ("value", value, D_v, "D_v")):
        if x.ndim != 4 or (x.shape[0], x.shape[1], x.shape[3]) != (B, H_kv, last):
            raise ValueError(
                f"{name} must have shape (B, H_kv, T, {letter}) with B={B}{what}, "
                f"H_kv={H_kv}, {letter}={last}; got {tuple(x.shape)}"
            )
        if x.dtype != like.dtype or x.device != like.device:
            raise TypeError(
                f"{name} is {x.dtype} on {x.device} but {holder} holds "
                f"{like.dtype} on {like.device}"
            )
    if value.shape[2] != key.shape[2]:
        raise ValueError(f"value must have T={key.shape[2]} tokens like key; got {value.shape[2]}")
