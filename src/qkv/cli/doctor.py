"""``qkv doctor``: what this machine runs. It prints the CPU and its instruction sets, the
threads, the native kernels, the stored profile behind the kernel choice, and which code
each dtype and mask kind takes."""

from __future__ import annotations

import argparse
import math
import platform
from importlib import metadata
from pathlib import Path

import torch

from .. import masks
from ..functional import dispatch
from ..kernels import built, paged
from ..kernels.tiled import measurement, profile, steps

#: the kernel's transparent huge page setting (Linux)
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: the instruction flags that decide which step runs
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "bf16", "sve")


def pool_pages() -> str:
    """Where a large paged pool's memory comes from (a PagedKVCache of 8 MiB or more asks for
    huge pages): huge pages or 4 KiB ones, as the kernel's transparent huge page setting
    says (its bracketed word)."""
    try:
        mode = THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "4 KiB pages (no transparent huge pages here)"
    if mode == "never":
        return "4 KiB pages (transparent huge pages: never)"
    return f"large ones on 2 MiB huge pages (transparent huge pages: {mode})"


def run_doctor(args: argparse.Namespace) -> int:
    model, flags = profile.cpu()
    print(f"qkv {metadata.version('qkv')}, torch {torch.__version__}, Python "
          f"{platform.python_version()}")  # fmt: skip
    have = [f for f in FLAGS if f in flags]
    print(f"CPU: {model} ({platform.machine()}; {', '.join(have) or 'no flags read'})")
    print(f"threads: {torch.get_num_threads()} (torch's)")
    for name, why in built.failed().items():
        print(f"{name}: failed to build at install: {why} (pip install -v shows the compiler)")
    if not steps.available(torch.float32):
        print("native tiled kernel: not built or not runnable here (PyTorch paths run)")
    else:
        bf16 = (
            "bfloat16 dot products"
            if steps.available(torch.bfloat16)
            else "widened to float32 as loaded (no bfloat16 dot product here)"
        )
        threads = "OpenMP threads" if steps.openmp() else "one thread (built without OpenMP)"
        print(
            f"native tiled kernel: float32 on {steps.isa(torch.float32)} "
            f"(steps built: {', '.join(steps.isas())}); bfloat16: {bf16}; float16: widened; "
            f"{threads}"
        )
    if paged.available():
        scored = "; bfloat16 queries scored with bfloat16 dot products" if paged.dots() else ""
        print(f"native paged decode kernel: {paged.isa() or 'plain C'}{scored}")
    else:
        print("native paged decode kernel: not built")
    print(f"paged KV pools: {pool_pages()}")
    if steps.available(torch.float32):
        found, where = profile.load(remeasure=args.remeasure)
        print(f"profile: {where}")
        print(f"  machine: {profile.machine_key()}")
        T, W = measurement.BANDED
        print(
            f"  probe (4 heads, D = 64, {T:,} queries over the {W} keys before each, as tiles): "
            f"native bfloat16 "
            f"{found.native_ms:.2f} ms, float32 through torch's kernel {found.float32_ms:.2f} ms, "
            f"native float32 {found.native32_ms:.2f} ms, native float32 on bfloat16 inputs "
            f"{found.native_widen_ms:.2f} ms"
        )
        print(
            f"  float32 runs {'natively' if found.float32 else 'through torch'}; bfloat16 "
            f"{'natively' if found.faster else 'as float32 does'}"
        )
        if not math.isnan(found.blocking_ratio()):
            step = steps.isa(torch.float32)
            first, second = (steps.blocking_name(step, n) for n in steps.BLOCKINGS)
            print(
                f"  the {step} step in {first} {found.native32_ms:.2f} ms, in {second} "
                f"{found.native32_second_ms:.2f} ms ({found.blocking_ratio():.2f}×): it takes "
                f"{steps.blocking_name(step, found.blocking)}"
            )
        if not math.isnan(found.backward_blocking_ratio()):
            step = steps.isa(torch.float32)
            print(
                f"  its backward (causal over {measurement.CAUSAL:,} queries, forward + backward): "
                f"in {steps.blocking_name(step, 1)} {found.backward_blocking_ratio():.2f}× the "
                f"time in {steps.blocking_name(step, 0)}: it takes "
                f"{steps.blocking_name(step, found.backward_blocking)}"
            )
        print("  torch's fused kernel, causal over 512 queries, ms (bfloat16 / float16 / copies):")
        widened = []
        for backward, what in ((False, "forward"), (True, "forward + backward")):
            fwd = "" if backward else "_fwd"
            ms = [getattr(found, f"sdpa_{n}{fwd}_ms") for n in ("bfloat16", "float16", "widened")]
            print(f"    {what}: {' / '.join(f'{t:.2f}' for t in ms)}")
            widened += [
                f"{n} {'with a gradient' if backward else 'forward'}"
                for n in ("bfloat16", "float16")
                if found.widens(getattr(torch, n), backward)
            ]
        print(f"  on float32 copies through torch's kernel: {', '.join(widened) or 'none'}")
        print(
            f"  causal over {measurement.CAUSAL:,} queries, float32, native / torch's kernel ms: "
            f"forward {found.causal_native_fwd_ms:.2f} / {found.causal_sdpa_fwd_ms:.2f}, "
            f"forward + backward {found.causal_native_ms:.2f} / {found.causal_sdpa_ms:.2f}"
        )
        print("  causal with T_q == T_k natively (the native pass ÷ torch's under the line):")
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            runs = [
                f"{w} ({found.causal_ratio(b):.2f} against {found.causal_at(dtype, b):.2f})"
                for b, w in ((False, "forward"), (True, "with a gradient"))
                if found.causal(dtype, b)
            ]
            print(f"    {str(dtype).removeprefix('torch.')}: {', '.join(runs) or 'never'}")
        if not math.isnan(found.paged_decode_ratio(False)):
            B, H, T, D = measurement.DECODE
            runs = [
                w for g, w in ((False, "without GQA"), (True, "with GQA")) if found.paged_decode(g)
            ]
            print(
                f"  bfloat16 decode step ({B} × {T:,} keys, H = {H}, D = {D}), paged kernel / "
                f"torch's ms: {found.decode_paged_ms:.2f} / {found.decode_sdpa_ms:.2f}, with 4 "
                f"query heads a key/value head {found.decode_paged_gqa_ms:.2f} / "
                f"{found.decode_sdpa_gqa_ms:.2f}; on the paged kernel: {', '.join(runs) or 'never'}"
            )
        if not math.isnan(found.paged_dots_ratio()):
            how = "bfloat16 dot products" if found.paged_dots else "widened keys, float32 FMAs"
            print(
                f"  paged decode, int8 pages, bfloat16 queries, ms (bfloat16 dot products / "
                f"widened keys): {found.paged_dots_ms:.2f} / {found.paged_widen_ms:.2f}; "
                f"int8 and float8 keys scored by {how}"
            )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 4096, 64, generator=g)
    kinds = {
        "no mask": None,
        "causal": masks.causal(),
        "sliding_window(256)": masks.sliding_window(256),
        "document (8 docs)": masks.document(torch.arange(4096) // 512),
    }
    print("which code runs (B=1, H=8, T=4096, D=64), forward / with a gradient:")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        xg = xd.clone().requires_grad_()
        for name, mask in kinds.items():
            d, t = dispatch(xd, xd, xd, mask=mask), dispatch(xg, xg, xg, mask=mask)
            both = d.path if t.path == d.path else f"{d.path} / {t.path}"
            print(f"  {str(dtype).removeprefix('torch.'):8} {name:20} {both:31} ({d.rule})")
    return 0
