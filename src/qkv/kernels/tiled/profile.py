"""The machine's profile: what is measured of the kernels on this machine (:class:`Probe`,
:func:`measure`: the native kernel against torch's, torch's half precision against float32
copies), measured once per
machine and stored, so that every process on the machine runs the same kernel for the same
call, where a measurement per process picked one kernel in one process and another in the
next when the two were close.

The profile is one JSON file in the cache directory — ``QKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``, read when first needed — holding one entry
per machine key: the CPU's model and instruction flags, torch's thread count, the versions of
qkv and torch, the instruction set the kernel is pinned to and those torch's kernels are held
to (:func:`torch_limits`). A re-measurement
(``qkv doctor --remeasure``) keeps the stored choice unless the new one clears the
threshold by :data:`MARGIN`, so noise near the boundary does not flip it. A first
measurement with a ratio that near a threshold is taken three times, each time the median. A
directory that
cannot be written: the process measures for itself and says so once. A damaged or foreign
file: measured again, one warning. (The one file below the apps that qkv reads and writes.)

Legend: none (no tensors).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import statistics
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from . import measurement, steps

T = TypeVar("T")

#: relative margin a re-measurement must clear to change a stored choice
MARGIN = 0.1
FILE = "native-profile.json"
#: the file's format: 2 holds the half-precision SDPA measurements too, 3 the native
#: kernel's widened float32 step on bfloat16 inputs, 4 times of the banded pass, 5 the AVX2
#: and NEON steps' second register blocking, 6 half precision on copies wherever torch's
#: half-precision kernel is the slower, 7 the native kernel's causal pass beside torch's,
#: 8 the paged decode step over int8 pages with and without bfloat16 dot products, 9 a
#: bfloat16 decode step through the paged kernel and through torch's, 10 the AVX-512 step's
#: second blocking too (``native32_second_ms``, ``use_blocking``), 11 the causal pass over
#: 2,048 queries, not 1,024, 12 the backward's blocking apart from the forward's
#: (``causal_native_second_ms``, ``use_backward_blocking``) (a file of an older format is
#: measured again, silently)
FORMAT = 12


#: torch's half-precision kernel ÷ its time on float32 copies past which half precision runs
#: on copies: the faster of the two, so that half precision is never the slower (near the
#: line, :data:`MARGIN` keeps a stored choice and a first one is a median of three). It was
#: 1.1, a margin for the copies' memory: torch's bfloat16 causal forward held to AVX2 then
#: ran at 1.078× its time on copies and 1.07× float32's in the headline rows
WIDEN_AT = 1.0

#: the native float32 step ÷ torch's flash kernel at most which float32 runs natively: a
#: margin toward it (quiet, the two are close; beside other work, the native one call per
#: pass slows far less)
FLOAT32_AT = 1.1

#: the native bfloat16 step ÷ the path bfloat16 takes otherwise under which bfloat16 runs
#: the bfloat16 step: the faster of the two, a tie going to the bfloat16 step (near the line,
#: :data:`MARGIN` keeps a stored choice and a first one is a median of three). The probe's
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


def _causal_field(dtype: torch.dtype, backward: bool) -> str:
    """The field of :class:`Probe` that stores the causal choice for ``dtype``, with a
    gradient or forward alone: ``use_causal`` (float32), ``use_causal_bfloat16_fwd``, ..."""
    half = "" if dtype == torch.float32 else "_" + str(dtype).removeprefix("torch.")
    return f"use_causal{half}{'' if backward else '_fwd'}"


class Probe(NamedTuple):
    """One measurement, made once per machine (:func:`load`), medians of 7 interleaved runs each
    (:mod:`qkv.kernels.tiled.measurement`). One forward pass of the tiled kernel over
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
    (``causal_native_second_ms``). And the paged decode kernel's step over int8 pages with bfloat16
    queries (:data:`~qkv.kernels.tiled.measurement.PAGED`), the keys scored by bfloat16 dot
    products (``paged_dots_ms``) and widened for float32 FMAs (``paged_widen_ms``; both nan
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
    #: the choices as a stored profile made them (:func:`load`); None: from the times
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
        stored = getattr(self, _causal_field(dtype, backward))
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


#: The Probe's times (its fields in ms), as :func:`measure` and :func:`_median` fill them.
TIMES = tuple(f for f in Probe._fields if f.endswith("_ms"))


def measure() -> Probe:
    """Measure whether this CPU runs the native kernel faster than torch's flash kernel,
    and torch's half-precision backward slower than float32's (see :class:`Probe`; the
    passes timed: :mod:`qkv.kernels.tiled.measurement`). The dispatch reads it from the
    machine's profile (:func:`probe`), measured once per machine: on one Intel Xeon with
    AVX512-BF16 but no AMX the native bfloat16 path ran slower than float32, on the AMD EPYC
    of this project's sessions faster — the instruction-set flag alone does not say which
    wins."""
    ms: dict[str, Any] = measurement.times()  # nan: a pass this CPU cannot run
    return Probe(**{f: ms.get(f, math.nan) for f in TIMES})


def cache_dir() -> Path:
    """Where the profile lives: ``QKV_CACHE_DIR``, ``$XDG_CACHE_HOME/qkv`` or ``~/.cache/qkv``."""
    if os.environ.get("QKV_CACHE_DIR"):
        return Path(os.environ["QKV_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qkv"


def cpu() -> tuple[str, list[str]]:
    """The CPU's model name and instruction flags (Linux's /proc/cpuinfo; elsewhere what
    :mod:`platform` says, and no flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    first = text.split("\n\n")[0]  # the first processor's block
    pairs = (line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in pairs}
    model = fields.get("model name", "")
    flags = fields.get("flags", "").split()
    return model or platform.machine(), sorted(flags)


def machine_key() -> str:
    """What a stored measurement holds for: this CPU, threads, qkv, torch and the pin."""
    model, flags = cpu()
    try:
        qkv_version = metadata.version("qkv")
    except metadata.PackageNotFoundError:
        qkv_version = "0+unknown"
    digest = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16]
    return (
        f"{model} | flags {digest} | threads {torch.get_num_threads()} | qkv {qkv_version} "
        f"| torch {torch.__version__} | isa {steps.isa(torch.float32) or 'none'}"
        f"{torch_limits()}"
    )


def torch_limits() -> str:
    """The instruction sets torch's own kernels are held to, as the key names them: torch's
    vector kernels (``ATEN_CPU_CAPABILITY``) always, MKL's and oneDNN's matrix products
    where an environment variable limits them. The profile times torch's kernels, and MKL
    runs its AVX-512 code on an Intel CPU unless ``MKL_ENABLE_INSTRUCTIONS`` says otherwise:
    a profile measured with torch unlimited is no guide for a process whose torch is held
    to AVX2, nor the other way round. Read when the key is made, not at import."""
    held = [f" | torch isa {torch.backends.cpu.get_cpu_capability()}"]
    for name, var in (("mkl", "MKL_ENABLE_INSTRUCTIONS"), ("onednn", "ONEDNN_MAX_CPU_ISA")):
        if os.environ.get(var):
            held.append(f" {name} {os.environ[var]}")
    return "".join(held)


def _read(path: Path) -> dict[str, Any]:
    """The profile file's entries; {} where there is none, one warning where it is damaged
    or written by another format."""
    if not path.exists():
        return {}
    try:
        found = json.loads(path.read_text())
        older = isinstance(found, dict) and isinstance(found.get("format"), int)
        if older and 0 < found["format"] < FORMAT:  # written by an earlier qkv: not damaged
            return {}
        if not (isinstance(found, dict) and found.get("format") == FORMAT):
            raise ValueError("not a qkv profile of this format")
        entries = found.get("machines", {})
        if not isinstance(entries, dict):
            raise ValueError("no machines")
        return entries
    except (OSError, ValueError) as err:
        warnings.warn(f"{path}: damaged ({err}); measuring again", stacklevel=3)
        return {}


def _near(ratio: float, threshold: float) -> bool:
    """Whether a measured ratio lies within :data:`MARGIN` of its threshold."""
    return abs(ratio - threshold) < threshold * MARGIN


def _lines(p: Probe) -> list[tuple[float, float]]:
    """Each choice's ratio beside its threshold: the float32 step's second blocking ÷ its
    first (forward, backward), native ÷ torch in float32, native bfloat16 ÷ the path
    bfloat16 takes otherwise, torch's half precision ÷ float32 copies, the native causal
    pass ÷ torch's (against each dtype's line), the paged step over int8 pages with
    bfloat16 dot products ÷ without, and a bfloat16 decode step through the paged kernel ÷
    through torch's (without GQA, with it)."""
    halves = (torch.bfloat16, torch.float16)
    both = (True, False)
    lines = [(p.blocking_ratio(), BLOCKING_AT), (p.backward_blocking_ratio(), BLOCKING_AT)]
    lines += [(p.float32_ratio(), FLOAT32_AT)]
    lines += [(p.bfloat16_ratio(), BFLOAT16_AT)]
    lines += [(p.sdpa_ratio(d, b), WIDEN_AT) for d in halves for b in both]
    dtypes = (torch.float32, *halves)
    lines += [(p.causal_ratio(b), p.causal_at(d, b)) for d in dtypes for b in both]
    lines += [(p.paged_dots_ratio(), PAGED_DOTS_AT)]
    return lines + [(p.paged_decode_ratio(g), PAGED_DECODE_AT) for g in both]


def _median(probes: list[Probe]) -> Probe:
    """Each time the median of the measurements' (``nan`` where not measured)."""
    return Probe(**{f: statistics.median(getattr(p, f) for p in probes) for f in TIMES})


def _kept(new: T, old: T | None, ratio: float, threshold: float) -> T:
    """A choice the new measurement made, or the stored one where they differ and the new
    ratio lies within :data:`MARGIN` of its threshold."""
    return old if old is not None and old != new and _near(ratio, threshold) else new


def _decide(new: Probe, old: Probe | None) -> Probe:
    """The new measurement's choices, each kept as stored unless the new ratio clears the
    threshold by :data:`MARGIN` the other way."""
    stored_blocking = None if old is None else old.blocking
    blocking = _kept(new.blocking, stored_blocking, new.blocking_ratio(), BLOCKING_AT)
    new = new._replace(use_blocking=blocking)  # float32's time below is in this blocking
    stored_backward = None if old is None else old.backward_blocking
    ratio = new.backward_blocking_ratio()
    backward = _kept(new.backward_blocking, stored_backward, ratio, BLOCKING_AT)
    new = new._replace(use_backward_blocking=backward)  # the causal pass's backward: in it
    stored = None if old is None else old.float32
    float32 = _kept(new.float32, stored, new.float32_ratio(), FLOAT32_AT)
    r16 = new.bfloat16_ratio(float32)
    bf16 = _kept(r16 < BFLOAT16_AT, None if old is None else old.faster, r16, BFLOAT16_AT)
    widen = {}
    for dtype in (torch.bfloat16, torch.float16):
        for backward in (True, False):
            name = f"widen_{str(dtype).removeprefix('torch.')}{'' if backward else '_fwd'}"
            stored = None if old is None else old.widens(dtype, backward)
            ratio = new.sdpa_ratio(dtype, backward)
            widen[name] = _kept(new.widens(dtype, backward), stored, ratio, WIDEN_AT)
    new = new._replace(**widen)  # the half-precision causal lines below rest on these
    native_causal = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for backward in (True, False):
            stored = None if old is None else old.causal(dtype, backward)
            line = new.causal_at(dtype, backward)
            native_causal[_causal_field(dtype, backward)] = _kept(
                new.causal(dtype, backward), stored, new.causal_ratio(backward), line
            )
    stored = None if old is None else old.paged_dots
    dots = _kept(new.paged_dots, stored, new.paged_dots_ratio(), PAGED_DOTS_AT)
    decode = {}
    for gqa in (False, True):
        stored = None if old is None else old.paged_decode(gqa)
        decode[f"use_paged_decode{'_gqa' if gqa else ''}"] = _kept(
            new.paged_decode(gqa), stored, new.paged_decode_ratio(gqa), PAGED_DECODE_AT
        )
    return new._replace(
        use_float32=float32,
        use_bfloat16=bf16,
        **native_causal,
        use_paged_dots=dots,
        **decode,
    )


def _first(stored: Probe | None) -> Probe:
    """A measurement to decide from: where nothing is stored yet and a ratio lies within
    :data:`MARGIN` of its threshold, the median of three (a first choice near a line is the
    one the machine keeps, so it is measured more before it is made)."""
    new = measure()
    if stored is None and any(_near(r, t) for r, t in _lines(new)):
        new = _median([new, measure(), measure()])
    return new


def _probe(entry: Any) -> Probe | None:
    try:
        return Probe(**entry)
    except TypeError:
        return None


def load(remeasure: bool = False) -> tuple[Probe, str]:
    """The profile of this machine and where it came from: stored, measured and stored, or
    measured for this process alone (the directory cannot be written: one warning)."""
    path = cache_dir() / FILE
    entries = _read(path)
    key = machine_key()
    stored = _probe(entries.get(key))
    if stored is not None and not remeasure:
        return stored, f"stored in {path}"
    found = _decide(_first(stored), stored)
    entries[key] = found._asdict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"format": FORMAT, "machines": entries}, indent=1))
        os.replace(tmp, path)  # whole or not at all, whichever process writes last
    except OSError as err:
        warnings.warn(
            f"the machine profile cannot be stored in {path.parent} ({err.strerror}): "
            "measured for this process only; set QKV_CACHE_DIR to a writable directory",
            stacklevel=2,
        )
        return found, f"measured in this process ({path.parent} not writable)"
    return found, f"measured and stored in {path}"


@functools.cache
def probe() -> Probe:
    """This machine's profile (:func:`load`), read once per process; the steps run in the
    blockings it chose from then on, the forward's and the backward's."""
    found = load()[0]
    steps.set_blocking(found.blocking)
    steps.set_blocking(found.backward_blocking, backward=True)
    return found
