"""How near this CPU's matmul peak the native kernel runs (issue 25's figure).

    python benchmarks/bench_peak.py [--T 4096] [--rounds 7]

In one run, interleaved, medians of ``--rounds``: a plain T × T × T matmul (``torch.mm``) in
float32 and in bfloat16 — the peak torch reaches on this CPU — and one unmasked attention
call of 8 heads, T queries over T keys, D = 64: qkv's native kernel in float32 and in
bfloat16 (``qkv.kernels.tiled.native.attend``) and torch's CPU flash kernel in float32.
Attention counts 4·H·T²·D floating-point operations (Q Kᵀ and P V); the native bfloat16
kernel does a third more (P enters ·V as two bfloat16 parts), not counted. Name the CPU
beside the figures (``lscpu``).
"""

import argparse
import statistics
import time

import torch

from qkv.kernels.tiled import native, steps
from qkv.kernels.tiled.torch_ops import FLASH

H, D = 8, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    T = args.T
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(T, T, generator=g) for _ in range(2))
    a16, b16 = a.bfloat16(), b.bfloat16()
    q, k, v = (torch.randn(1, H, T, D, generator=g) for _ in range(3))
    calls = {
        "torch.mm float32": (lambda: a @ b, 2 * T**3),
        "torch.mm bfloat16": (lambda: a16 @ b16, 2 * T**3),
        "flash kernel float32": (
            lambda: FLASH(q, k, v, 0.0, False, scale=D**-0.5),
            4 * H * T * T * D,
        ),
    }
    for dtype in (torch.float32, torch.bfloat16):
        if steps.available(dtype):
            q5 = q.to(dtype).view(1, H, 1, T, D)
            packed = native.pack(k.to(dtype), v.to(dtype))
            calls[f"native {str(dtype).removeprefix('torch.')}"] = (
                lambda q5=q5, p=packed: native.attend(q5, p, 0, T, None, D**-0.5),
                4 * H * T * T * D,
            )
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds + 1):
        for name in list(calls)[:: 1 if r % 2 else -1]:
            t0 = time.perf_counter()
            calls[name][0]()
            if r:
                times[name].append(time.perf_counter() - t0)
    rate = {n: calls[n][1] / statistics.median(t) / 1e9 for n, t in times.items()}
    print(f"T = {T}, torch threads {torch.get_num_threads()}, medians of {args.rounds}")
    print("| call | ms | GFLOP/s | of torch.mm in its dtype |")
    print("|---|---|---|---|")
    for name, t in times.items():
        peak = rate["torch.mm bfloat16" if "bfloat16" in name else "torch.mm float32"]
        ms = statistics.median(t) * 1e3
        print(f"| {name} | {ms:.1f} | {rate[name]:.0f} | {rate[name] / peak:.0%} |")


if __name__ == "__main__":
    main()
