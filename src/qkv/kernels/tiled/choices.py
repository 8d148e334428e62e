"""What a measurement of this machine decides: the lines each ratio is held against, and
:class:`Probe`, one measurement's times with the choices they imply — which kernel float32
and half precision run, the step's blockings, causal calls, the paged decode step. Where the
measurement is made and kept, once per machine: :mod:`qkv.kernels.tiled.profile`.

Legend: none (no tensors).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

#: torch's half-precision kernel ÷ its time on float32 copies past which half precision runs
#: on copies: the faster of the two, so that half precision is never the slower (near the
#: line, :data:`profile.MARGIN` keeps a stored choice and a first one is a median of three). It was
#: 1.1, a margin for the copies' memory: torch's bfloat16 causal forward held to AVX2 then
#: ran at 1.078× its time on copies and 1.07× float32's in the headline rows
WIDEN_AT = 1.0

#: the native float32 step ÷ torch's flash kernel at most which float32 runs natively: a
#: margin toward it (quiet, the two are close; beside other work, the native one call per
#: pass slows far less)
FLOAT32_AT = 1.1

#: the native bfloat16 step ÷ the path bfloat16 takes otherwise under which bfloat16 runs
#: the bfloat16 step: the faster of the two, a tie going to the bfloat16 step (near the line,
#: :data:`profile.MARGIN` keeps a stored choice and a first one is a median of three). The probe's
#: short forward pass understates that step's lead: on a Zen 4 it measured 0.90-1.00× the
#: widened step's time, where the workloads it decides took 0.83-0.89× float32's time in
#: bfloat16 against 0.93-1.00× widened (window(256), T = 8,192 and 16,384), and the step is
#: also what runs causal and unmasked bfloat16 calls natively (0.71× against SDPA's 1.02×)
BFLOAT16_AT = 1.05

#: the float32 step in its second blocking ÷ in its first (:data:`steps.BLOCKINGS`), under
#: which the steps run the second: the faster (the two give the same bits; near the line, as
#: :data:`BFLOAT16_AT`). The forward's and the backward's apart: on an Intel Xeon (family 6
#: model 207, 2026-11-29) tiles of 16 rows took 1.03–1.05× the forward's time of tiles of 8
#: and 0.93–0.995× the backward's (median 0.97; causal T = 4,096; held to AVX2, its 2 rows
#: in registers 1.06–1.12× the backward's time of 3)
BLOCKING_AT = 1.0

#: the native kernel's causal pass ÷ torch's fused kernel's with is_causal (over
#: :data:`~qkv.kernels.tiled.measurement.CAUSAL` queries) under which a causal call with
#: T_q == T_k runs natively. Under 1.0, because the pass overstates the native kernel's
#: lead at longer sequences: on a Zen 4 held to AVX2 a pass of 1,024 queries measured 0.84
#: (forward and backward) and 0.77 (forward) where causal T = 4,096 through qkv.attention
#: took 0.97× and 0.94× torch's time; on AVX-512 0.77 and 0.74 where it took 0.83× and
#: 0.82× (2026-11-27). The pass is now of 2,048 queries, which overstates it less
CAUSAL_AT = 0.9

#: the native kernel's causal pass ÷ torch's, as a share of the time half precision takes
#: otherwise (:meth:`Probe.causal_at`), under which a half-precision causal call with
#: T_q == T_k runs natively. 1.0, not :data:`CAUSAL_AT`: where torch runs half precision on
#: float32 copies, the native kernel only needs to beat torch's float32 time, copies aside.
#: On an Intel Xeon (family 6 model 207, 2026-11-29) the pass measured 0.90 forward where
#: causal T = 4,096 took 0.98× float32 SDPA's time in bfloat16 natively and 1.05–1.07×
#: through SDPA on copies (float16 through torch's float16 kernel: 0.96–0.99 against 1.07)
CAUSAL_HALF_AT = 1.0

#: the paged decode step over int8 pages with bfloat16 dot products ÷ with widened keys and
#: float32 FMAs, under which quantized (int8, float8) keys take the dot products: the faster
#: (the same sums to float32 rounding). On a Zen 4 they made the int8 step 0.86–0.92× its
#: time; on an Intel Xeon (family 6 model 207) 1.12× (docs/kernels.md#the-paged-decode-kernel)
PAGED_DOTS_AT = 1.0

#: a bfloat16 decode step through the paged kernel ÷ through torch's fused kernel, under
#: which rule "plain" sends bfloat16 decode steps to the paged kernel (path "paged-native"):
#: the faster. torch's bfloat16 decode took several times its float32 time on a Zen 4, and
#: half of it on an Intel Xeon (family 6 model 207) with one key/value head per query head
#: (docs/kernels.md#how-auto-chooses), so it is measured, with and without GQA
PAGED_DECODE_AT = 1.0


def causal_field(dtype: torch.dtype, backward: bool) -> str:
    """The field of :class:`Probe` that stores the causal choice for ``dtype``, with a
    gradient or forward alone: ``use_causal`` (float32), ``use_causal_bfloat16_fwd``, ..."""
    half = "" if dtype == torch.float32 else "_" + str(dtype).removeprefix("torch.")
    return f"use_causal{half}{'' if backward else '_fwd'}"


class Probe(NamedTuple):
    """One measurement, made once per machine (:func:`profile.load`), medians of 7 interleaved
    runs each (:mod:`qkv.kernels.tiled.measurement`). One forward pass of the tiled kernel over
    :data:`~qkv.kernels.tiled.measurement.BANDED` — 4 heads, D = 64, 2,048 queries, each over
    the 256 keys before it, in the kernel's tiles: the many small calls of the masked calls it
    decides, where the native kernel's one parallel region per pass tells as much as its
    arithmetic — four ways: the native kernel in bfloat16 (``native_ms``), torch's flash kernel
    in float32 (``float32_ms``: what float32 runs without the native kernel), and the native
    kernel in float32 (``native32_ms``; nan where this CPU cannot run it), and on the bfloat16
    inputs widened as it loads them (``native_widen_ms``). The float32 step is timed in each of
    its blockings (:data:`steps.BLOCKINGS`): the first (``native32_ms``) and the second
    (``native32_second_ms``). And torch's fused kernel (SDPA) forward and backward
    (``sdpa_*_ms``), and forward alone (``sdpa_*_fwd_ms``), causal over 512 queries, in bfloat16
    and float16 and on float32 copies of bfloat16 inputs: where the CPU has no bfloat16 dot
    product, torch's half-precision backward runs several times slower than float32's, and
    without AVX512-FP16 float16's forward does too. And a causal pass over
    :data:`~qkv.kernels.tiled.measurement.CAUSAL` queries (4 heads, D = 64, float32) through the
    native kernel (``causal_native_ms``; nan where this CPU cannot run it) and through torch's
    fused kernel with is_causal (``causal_sdpa_ms``), forward and backward, and forward alone
    (``causal_*_fwd_ms``), and forward and backward with the backward in its second blocking
    (``causal_native_second_ms``). And the paged decode kernel's step over int8 pages with
    bfloat16 queries (:data:`~qkv.kernels.tiled.measurement.PAGED`), the keys scored by bfloat16
    dot products (``paged_dots_ms``) and widened for float32 FMAs (``paged_widen_ms``; both nan
    where the CPU has no AVX512-BF16). And a bfloat16 decode step over a cache's rows
    (:data:`~qkv.kernels.tiled.measurement.DECODE`) through the paged kernel
    (``decode_paged_ms``) and torch's fused kernel (``decode_sdpa_ms``), and the same with 4
    query heads a key/value head (``*_gqa_ms``; nan where the paged kernel is not built)."""

    native_ms: float
    float32_ms: float
    native32_ms: float = float("nan")
    sdpa_bfloat16_ms: float = float("nan")
    sdpa_float16_ms: float = float("nan")
    sdpa_widened_ms: float = float("nan")
    sdpa_bfloat16_fwd_ms: float = float("nan")
    sdpa_float16_fwd_ms: float = float("nan")
    sdpa_widened_fwd_ms: float = float("nan")
    native_widen_ms: float = float("nan")
    native32_second_ms: float = float("nan")
    causal_native_ms: float = float("nan")
    causal_sdpa_ms: float = float("nan")
    causal_native_fwd_ms: float = float("nan")
    causal_sdpa_fwd_ms: float = float("nan")
    causal_native_second_ms: float = float("nan")
    paged_dots_ms: float = float("nan")
    paged_widen_ms: float = float("nan")
    decode_paged_ms: float = float("nan")
    decode_sdpa_ms: float = float("nan")
    decode_paged_gqa_ms: float = float("nan")
    decode_sdpa_gqa_ms: float = float("nan")
    #: the choices as a stored profile made them (:func:`profile.load`); None: from the times
    use_float32: bool | None = None
    use_bfloat16: bool | None = None
    widen_bfloat16: bool | None = None
    widen_float16: bool | None = None
    widen_bfloat16_fwd: bool | None = None
    widen_float16_fwd: bool | None = None
    use_blocking: int | None = None
    use_backward_blocking: int | None = None
    use_causal: bool | None = None
    use_causal_fwd: bool | None = None
    use_causal_bfloat16: bool | None = None
    use_causal_bfloat16_fwd: bool | None = None
    use_causal_float16: bool | None = None
    use_causal_float16_fwd: bool | None = None
    use_paged_dots: bool | None = None
    use_paged_decode: bool | None = None
    use_paged_decode_gqa: bool | None = None

    def sdpa_ratio(self, dtype: torch.dtype, backward: bool = True) -> float:
        """torch's fused kernel's time in half-precision ``dtype`` ÷ its time on float32
        copies, forward and backward or forward alone (nan: not measured)."""
        name, fwd = str(dtype).removeprefix("torch."), "" if backward else "_fwd"
        half = getattr(self, f"sdpa_{name}{fwd}_ms", math.nan)
        return float(half / getattr(self, f"sdpa_widened{fwd}_ms"))

    def widens(self, dtype: torch.dtype, backward: bool = True) -> bool:
        """Whether torch's fused kernel should take half-precision calls on float32 copies
        here — those that need a gradient (``backward``), or the others: it took over
        :data:`WIDEN_AT` × its time on copies in ``dtype`` (not measured: no)."""
        name, fwd = str(dtype).removeprefix("torch."), "" if backward else "_fwd"
        stored = getattr(self, f"widen_{name}{fwd}", None)
        if stored is not None:
            return bool(stored)
        return self.sdpa_ratio(dtype, backward) > WIDEN_AT

    def causal_ratio(self, backward: bool = True) -> float:
        """The native kernel's causal pass ÷ torch's fused kernel's with is_causal, forward
        and backward (the backward in its :attr:`backward_blocking`) or forward alone (nan:
        not measured)."""
        if not backward:
            return self.causal_native_fwd_ms / self.causal_sdpa_fwd_ms
        native = self.causal_native_second_ms if self.backward_blocking else self.causal_native_ms
        return native / self.causal_sdpa_ms

    def causal_at(self, dtype: torch.dtype = torch.float32, backward: bool = True) -> float:
        """The line under which :meth:`causal_ratio` sends a causal call with T_q == T_k in
        ``dtype`` to the native kernel: :data:`CAUSAL_AT` in float32. In half precision the
        native kernel runs at about its float32 speed (widened as it loads, or with bfloat16
        dot products where those won), and what it is held against is the path half precision
        takes otherwise: torch's kernel on float32 copies, float32's time and the copies'
        (:meth:`widens`), or torch's kernel in the dtype where that was the faster — its time
        on copies × :meth:`sdpa_ratio` (nan, not measured: as on copies). So the line is
        :data:`CAUSAL_HALF_AT` × the smaller of 1 and that ratio."""
        if dtype == torch.float32:
            return CAUSAL_AT
        ratio = self.sdpa_ratio(dtype, backward)
        other = 1.0 if self.widens(dtype, backward) or math.isnan(ratio) else min(1.0, ratio)
        return CAUSAL_HALF_AT * other

    def causal(self, dtype: torch.dtype = torch.float32, backward: bool = True) -> bool:
        """Whether a causal call with T_q == T_k in ``dtype`` — one that needs a gradient
        (``backward``), or another — runs natively here: the native kernel's causal pass
        took under :meth:`causal_at` × torch's time (not measured: no)."""
        stored = getattr(self, causal_field(dtype, backward))
        if stored is not None:
            return bool(stored)
        return self.causal_ratio(backward) < self.causal_at(dtype, backward)

    def paged_dots_ratio(self) -> float:
        """The paged decode step over int8 pages with bfloat16 dot products ÷ with widened
        keys (nan: not measured)."""
        return self.paged_dots_ms / self.paged_widen_ms

    @property
    def paged_dots(self) -> bool:
        """Whether the paged kernel scores bfloat16 queries against int8 and float8 keys with
        bfloat16 dot products here: under :data:`PAGED_DOTS_AT` × the time with widened keys
        (not measured: yes, as the kernel does by itself)."""
        if self.use_paged_dots is not None:
            return self.use_paged_dots
        return not self.paged_dots_ratio() >= PAGED_DOTS_AT

    def paged_decode_ratio(self, gqa: bool) -> float:
        """A bfloat16 decode step through the paged kernel ÷ through torch's, with 4 query
        heads a key/value head (``gqa``) or one (nan: not measured)."""
        suffix = "_gqa" if gqa else ""
        return float(
            getattr(self, f"decode_paged{suffix}_ms") / getattr(self, f"decode_sdpa{suffix}_ms")
        )

    def paged_decode(self, gqa: bool) -> bool:
        """Whether a bfloat16 decode step — with several query heads a key/value head
        (``gqa``) or one — runs the paged kernel here: under :data:`PAGED_DECODE_AT` × torch's
        time (not measured: yes, the kernel)."""
        stored = self.use_paged_decode_gqa if gqa else self.use_paged_decode
        if stored is not None:
            return stored
        return not self.paged_decode_ratio(gqa) >= PAGED_DECODE_AT

    @property
    def float32(self) -> bool:
        """Float32 runs natively: the native kernel takes at most :data:`FLOAT32_AT` ×
        torch's time here (docs/benchmarks.md#on-a-busy-machine)."""
        if self.use_float32 is not None:
            return self.use_float32
        return self.float32_ratio() <= FLOAT32_AT

    def float32_ratio(self) -> float:
        """The native float32 step's time (in the chosen :attr:`blocking`) ÷ torch's flash
        kernel's."""
        native32 = self.native32_second_ms if self.blocking else self.native32_ms
        return native32 / self.float32_ms

    def blocking_ratio(self) -> float:
        """The float32 step's time in its second blocking ÷ in its first (nan: not
        measured)."""
        return self.native32_second_ms / self.native32_ms

    @property
    def blocking(self) -> int:
        """The forward's blocking here (:data:`steps.BLOCKINGS`): the second (1) where it ran
        under :data:`BLOCKING_AT` × the first's time, else the first (0)."""
        if self.use_blocking is not None:
            return self.use_blocking
        return 1 if self.blocking_ratio() < BLOCKING_AT else 0

    def backward_blocking_ratio(self) -> float:
        """The causal pass forward and backward with the backward in its second blocking ÷
        in its first (nan: not measured)."""
        return self.causal_native_second_ms / self.causal_native_ms

    @property
    def backward_blocking(self) -> int:
        """The backward's blocking here, as :attr:`blocking` is the forward's."""
        if self.use_backward_blocking is not None:
            return self.use_backward_blocking
        return 1 if self.backward_blocking_ratio() < BLOCKING_AT else 0

    def bfloat16_ratio(self, float32: bool | None = None) -> float:
        """The native bfloat16 step's time ÷ that of the path bfloat16 takes otherwise:
        the native float32 step widening the inputs as it loads them where float32 runs
        natively (``float32``: that choice; by default this probe's), else torch's flash
        kernel in float32. (A probe stored without the widened step: float32's own time.)"""
        native32 = self.float32 if float32 is None else float32
        widened = self.native32_ms if math.isnan(self.native_widen_ms) else self.native_widen_ms
        return self.native_ms / (widened if native32 else self.float32_ms)

    @property
    def faster(self) -> bool:
        """bfloat16 runs natively: under :data:`BFLOAT16_AT` × the time of the path it
        would take otherwise (:meth:`bfloat16_ratio`)."""
        if self.use_bfloat16 is not None:
            return self.use_bfloat16
        return self.bfloat16_ratio() < BFLOAT16_AT


#: The Probe's times (its fields in ms), as :func:`profile.measure` fills them.
TIMES = tuple(f for f in Probe._fields if f.endswith("_ms"))
