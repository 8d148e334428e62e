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
What the times decide, and the lines they are held against: :mod:`qkv.kernels.tiled.choices`.

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
from typing import Any, TypeVar

import torch

from . import measurement, steps
from .choices import (
    BFLOAT16_AT,
    BLOCKING_AT,
    FLOAT32_AT,
    PAGED_DECODE_AT,
    PAGED_DOTS_AT,
    TIMES,
    WIDEN_AT,
    Probe,
    causal_field,
)

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
            native_causal[causal_field(dtype, backward)] = _kept(
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
