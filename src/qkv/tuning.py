"""Every knob of qkv's dispatch and kernels in one frozen, documented value.

Each attention call reads the current :class:`Tuning` once (:func:`tuning`) and passes it to
what it runs: the dispatch rules, the tiled kernel's plan, its flash calls and its native
kernel. Nothing reads a module global. :func:`tuned` changes some knobs for a block (for a
test that shrinks the tiles, a benchmark that turns a path off, or a user pinning a choice)
and restores them on the way out. The value lives in a :class:`contextvars.ContextVar`, so
threads and asyncio tasks each see their own.

The defaults were measured on the 2-core CPUs this project runs on (docs/kernels.md).

Example:
    >>> import qkv
    >>> qkv.tuning().block_q
    128
    >>> with qkv.tuned(block_q=16, block_k=8):
    ...     qkv.tuning().block_q
    16
    >>> qkv.tuning().block_q
    128
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

__all__ = ["Tuning", "tuned", "tuning"]


@dataclass(frozen=True)
class Tuning:
    """The knobs, with what each decides. Sizes are per (batch, head) unless said otherwise.

    Dispatch (``backend="auto"``, docs/kernels.md#how-auto-chooses):

    Attributes:
        small_scores: below this many scores (T_q·T_k), a mask goes to SDPA densely:
            planning blocks would cost more than skipping them saves.
        sparse_density: a qkv mask leaving less than this fraction of the scores goes to the
            tiled kernel.
        long_scores: from this many scores on, the tiled kernel runs any qkv mask (a dense
            mask would cost more than tiling saves).
        native_scores: from this many scores on, bfloat16 runs the native kernel where the
            machine runs it faster than float32 (dispatch rule "native bfloat16").
        unequal_scores: from this many scores on, a masked call whose value head dim
            differs from the query's runs the native kernel on the CPU (dispatch rule
            "head dims differ"): torch's fused CPU kernel cannot take D_v != D, and its
            math path builds the T_q × T_k weights.
        block_q: queries per block of the tiled kernel's plan.
        block_k: keys per block: a mask is classified EMPTY/PARTIAL/FULL at this size.
        chunk_k: the most keys one matmul of the loop covers.
        fused: whether the tiled kernel may run torch's fused flash kernel per call (off:
            the PyTorch loop runs everything).
        group: query blocks taken together, so that a key stretch FULL for all of them runs
            as one call.
        shared_min: the fewest keys such a shared stretch must have.
        fused_span: the longest key span one masked call covers; longer spans are cut into
            FULL stretches and masked stretches.
        backward_span: the most keys one backward call covers (its dK/dV are that long).
        native: whether the tiled kernel's calls may run qkv's native kernel, float32 and
            bfloat16 (off: torch's flash kernel call by call, half precision on float32
            copies).
        native_probe: run the native kernel only where a measurement on this CPU says it
            is worth it (float32: within 1.1× of torch's flash kernel; bfloat16: faster than
            the path it takes otherwise; ``qkv.kernels.tiled.profile.probe``: measured once per
            machine and stored, ``qkv doctor`` shows it; ``qkv.dispatch`` reports it);
            off: wherever the CPU has the instructions (pinned, as the tests do).
        p_parts: P enters ·V as this many bfloat16 parts in the native kernel: 2 (hi + lo,
            ~16 bits: qkv's accuracy promise) or 1 (rounded once, as torch does: faster, up
            to 1.64× the output's own rounding; docs/kernels.md#the-native-kernel).
    """

    small_scores: int = 512 * 512
    sparse_density: float = 0.5
    long_scores: int = 4096 * 4096
    native_scores: int = 1024 * 1024
    unequal_scores: int = 256 * 256
    block_q: int = 128
    block_k: int = 64
    chunk_k: int = 1024
    fused: bool = True
    group: int = 8
    shared_min: int = 256
    fused_span: int = 1024
    backward_span: int = 4096
    native: bool = True
    native_probe: bool = True
    p_parts: int = 2

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), f.default
            if isinstance(default, bool):
                ok, want = isinstance(value, bool), "a bool"
            elif isinstance(default, float):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok, want = ok and 0.0 <= value <= 1.0, "a number in [0, 1]"
            else:
                low = 1 if f.name in _AT_LEAST_ONE else 0
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
                want = f"an int >= {low}"
            if not ok:
                raise ValueError(f"Tuning.{f.name} must be {want}; got {value!r}")
        if self.p_parts not in (1, 2):
            raise ValueError(f"Tuning.p_parts must be 1 or 2; got {self.p_parts}")


_AT_LEAST_ONE = frozenset({"block_q", "block_k", "chunk_k", "group", "backward_span", "p_parts"})
_CURRENT: ContextVar[Tuning] = ContextVar("qkv_tuning", default=Tuning())  # noqa: B039 (frozen)


def tuning() -> Tuning:
    """The :class:`Tuning` in force here (the defaults unless a :func:`tuned` block set one)."""
    return _CURRENT.get()


@contextlib.contextmanager
def tuned(tuning: Tuning | None = None, **changes: Any) -> Iterator[Tuning]:
    """Run a block with some knobs changed (or with a whole :class:`Tuning`), restoring the
    previous ones on exit. Unknown knobs raise ``TypeError``. Nested blocks stack."""
    base = _CURRENT.get() if tuning is None else tuning
    token = _CURRENT.set(dataclasses.replace(base, **changes))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
