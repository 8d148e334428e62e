"""The machine's profile: the native kernel's probe (:class:`native.Probe`), measured once per
machine and stored, so that every process on the machine runs the same kernel for the same
call, where a measurement per process picked one kernel in one process and another in the
next when the two were close.

The profile is one JSON file in the cache directory — ``QKV_CACHE_DIR``, else
``$XDG_CACHE_HOME/qkv``, else ``~/.cache/qkv``, read when first needed — holding one entry
per machine key: the CPU's model and instruction flags, torch's thread count, the versions of
qkv and torch and the instruction set the kernel is pinned to. A re-measurement
(``qkv doctor --remeasure``) keeps the stored choice unless the new one clears the
threshold by :data:`MARGIN`, so noise near the boundary does not flip it. A directory that
cannot be written: the process measures for itself and says so once. A damaged or foreign
file: measured again, one warning. (The one file below the apps that qkv reads and writes.)

Legend: none (no tensors).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from . import native

#: relative margin a re-measurement must clear to change a stored choice
MARGIN = 0.1
FILE = "native-profile.json"
#: the file's format: 2 holds the half-precision SDPA measurements too (a file of an
#: older format is measured again, silently)
FORMAT = 2


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
        f"| torch {torch.__version__} | isa {native.isa(torch.float32) or 'none'}"
    )


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


def _decide(new: native.Probe, old: native.Probe | None) -> native.Probe:
    """The new measurement's choices, each kept as stored unless the new ratio clears the
    threshold by :data:`MARGIN` the other way."""
    float32, bf16 = new.float32, new.faster
    if old is not None:
        r32 = new.native32_ms / new.float32_ms
        if old.float32 != float32 and abs(r32 - 1.1) < 1.1 * MARGIN:
            float32 = old.float32
        base = min(new.float32_ms, new.native32_ms if float32 else float("inf"))
        r16 = new.native_ms / base
        if old.faster != bf16 and abs(r16 - 0.9) < 0.9 * MARGIN:
            bf16 = old.faster
    widen = {}
    for dtype in (torch.bfloat16, torch.float16):
        for backward in (True, False):
            name = f"widen_{str(dtype).removeprefix('torch.')}{'' if backward else '_fwd'}"
            widen[name] = new.widens(dtype, backward)
            ratio = new.sdpa_ratio(dtype, backward)
            near = abs(ratio - native.WIDEN_AT) < native.WIDEN_AT * MARGIN
            if old is not None and old.widens(dtype, backward) != widen[name] and near:
                widen[name] = old.widens(dtype, backward)
    return new._replace(use_float32=float32, use_bfloat16=bf16, **widen)


def _probe(entry: Any) -> native.Probe | None:
    try:
        return native.Probe(**entry)
    except TypeError:
        return None


def load(remeasure: bool = False) -> tuple[native.Probe, str]:
    """The profile of this machine and where it came from: stored, measured and stored, or
    measured for this process alone (the directory cannot be written: one warning)."""
    path = cache_dir() / FILE
    entries = _read(path)
    key = machine_key()
    stored = _probe(entries.get(key))
    if stored is not None and not remeasure:
        return stored, f"stored in {path}"
    found = _decide(native.measure(), stored)
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
def probe() -> native.Probe:
    """This machine's profile (:func:`load`), read once per process."""
    return load()[0]
