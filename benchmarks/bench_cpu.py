"""The headline rows on the CPU at hand: qkv against its baselines, and half precision
against float32 through ``backend="auto"``.

    python benchmarks/bench_cpu.py [--rounds 5] [--avx2]

First, qkv against the baseline each headline row names, float32, B = 1, H = 8, D = 64:
``sliding_window(256)`` at T = 16,384 forward through ``auto`` against FlexAttention compiled
(``backend="flex"``; its compile time apart; torch's FlexAttention has no CPU backward), and
causal T = 4,096 through the tiled kernel (``backend="tiled"``) against SDPA ``is_causal``,
forward and forward + backward; qkv's time ÷ the baseline's (targets ≤ 0.8 and ≤ 1.0). Then
the half-precision workloads — a causal sliding window of 256 keys over T = 8,192 and 16,384
tokens, and causal attention over T = 4,096 — with B = 1, H = 8, D = 64, forward and forward
+ backward, each in float32, bfloat16 and float16 through ``qkv.attention`` as ``auto``
chooses; and two decode steps, float32 against bfloat16 (the memory-bound ones, target ≤
0.8): one query per sequence over a contiguous cache (``qkv.attention``, 8 sequences ×
4,096 tokens, H = 8 over H_kv = 2, D = 128) and over a paged one (``qkv.paged_attention``,
32 sequences × 4,096 tokens in pages of 16, H = H_kv = 8, D = 128; the native paged kernel's
vector item, AVX2 where pinned). Each row gives the path ``qkv.dispatch`` names (forward /
with a gradient), the median of ``--rounds`` interleaved runs and the half-precision time ÷
float32's in the same run: the target is ≤ 1.0 (half precision never slower than float32).

``--avx2`` runs the CPU as an AVX2-only one would be: qkv's kernel pinned to its AVX2 step
with no bfloat16 dot products (``QKV_NATIVE_ISA=avx2``), torch's kernels and oneDNN's
limited to AVX2 (``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``,
``ONEDNN_MAX_CPU_ISA=AVX2``) — set before torch is imported, so the script runs itself again
with them. MKL does torch's float32 matrix products (SDPA's among them) and, on an Intel CPU,
runs its AVX-512 code unless told otherwise: without it the baselines keep AVX-512 speed.
Name the CPU beside the figures (``lscpu``), and say "pinned AVX2" for these rows.
"""

import argparse
import os
import sys

from timing import interleaved

AVX2 = {
    "QKV_NATIVE_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--avx2", action="store_true", help="run as an AVX2-only CPU would")
    args = parser.parse_args()
    if args.avx2 and any(os.environ.get(k) != v for k, v in AVX2.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2})
    baselines(args.rounds)
    run(args.rounds)
    decode(args.rounds * 3)


def run(rounds: int) -> None:
    import torch

    import qkv

    workloads = {
        "window(256) T=8192": (8192, qkv.masks.sliding_window(256)),
        "window(256) T=16384": (16384, qkv.masks.sliding_window(256)),
        "causal T=4096": (4096, qkv.masks.causal()),
    }
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    pinned = " (pinned AVX2)" if os.environ.get("QKV_NATIVE_ISA") == "avx2" else ""
    print(f"B = 1, H = 8, D = 64, threads {torch.get_num_threads()}{pinned}; ms, ÷ float32")
    for label, (T, mask) in workloads.items():
        for backward in (False, True):
            calls, paths = {}, {}
            for dtype in dtypes:
                g = torch.Generator().manual_seed(0)
                q, k, v = (
                    torch.randn(1, 8, T, 64, generator=g).to(dtype).requires_grad_(backward)
                    for _ in range(3)
                )
                paths[dtype] = qkv.dispatch(q, k, v, mask=mask).path
                calls[dtype] = step(q, k, v, mask, backward)
            ms = interleaved(calls, rounds)
            kind = "fwd+bwd" if backward else "fwd"
            for dtype in dtypes:
                name = str(dtype).removeprefix("torch.")
                ratio = ms[dtype] / ms[torch.float32]
                print(
                    f"{label:20} {kind:7} {name:8} {paths[dtype]:19} {ms[dtype]:9.1f} ms "
                    f"{ratio:5.2f}×"
                )


def baselines(rounds: int) -> None:
    """qkv against the baseline of each headline row (the docstring's first part)."""
    import torch
    import torch.nn.functional as F

    import qkv

    g = torch.Generator().manual_seed(0)
    window = qkv.masks.sliding_window(256)
    x = [torch.randn(1, 8, 16384, 64, generator=g) for _ in range(3)]
    c = [torch.randn(1, 8, 4096, 64, generator=g).requires_grad_() for _ in range(3)]

    def both(fn, grad: bool):
        def call():
            if not grad:
                with torch.no_grad():
                    return fn()
            out = fn()
            return torch.autograd.grad(out, c, torch.ones_like(out))

        return call

    rows = {
        "window(256) T=16384 fwd": (
            lambda: qkv.attention(*x, mask=window),
            lambda: qkv.attention(*x, mask=window, backend="flex"),
            "flex compiled",
        ),
        **{
            f"causal T=4096 {kind} (tiled)": (
                both(lambda: qkv.attention(*c, mask=qkv.masks.causal(), backend="tiled"), grad),
                both(lambda: F.scaled_dot_product_attention(*c, is_causal=True), grad),
                "sdpa is_causal",
            )
            for kind, grad in (("fwd", False), ("fwd+bwd", True))
        },
    }
    for name, (ours, theirs, base) in rows.items():
        theirs()  # (flex: compiled here, before the timing)
        ms = interleaved({"qkv": ours, base: theirs}, rounds)
        ratio = ms["qkv"] / ms[base]
        print(f"{name:28} qkv {ms['qkv']:8.1f} ms  {base} {ms[base]:8.1f} ms  {ratio:5.2f}×")


def decode(rounds: int) -> None:
    """The two decode steps of the docstring, float32 against bfloat16."""
    import torch

    import qkv

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, h, t, 128, generator=g) for h, t in ((8, 1), (2, 4096), (2, 4096)))
    B, H_kv, L, P = 32, 8, 4096, 16
    pages = [torch.randn(B * L // P, P, H_kv, 128, generator=g) for _ in range(2)]
    pq = torch.randn(B, 8, 128, generator=g)
    table, lengths = torch.arange(B * L // P).view(B, L // P), torch.full((B,), L)
    dtypes = (torch.float32, torch.bfloat16)
    cast = {dt: [x.to(dt) for x in (q, k, v, pq, *pages)] for dt in dtypes}
    steps = {
        "decode 8 × 4096": lambda c: qkv.attention(c[0], c[1], c[2]),
        "paged decode 32 × 4096": lambda c: qkv.paged_attention(c[3], c[4], c[5], table, lengths),
    }
    for name, fn in steps.items():
        calls = {dt: (lambda fn=fn, c=cast[dt]: fn(c)) for dt in dtypes}
        with torch.no_grad():
            ms = interleaved(calls, rounds)
        for dt in calls:
            ratio = ms[dt] / ms[torch.float32]
            print(f"{name:28} {str(dt).removeprefix('torch.'):8} {ms[dt]:9.2f} ms {ratio:5.2f}×")


def step(q, k, v, mask, backward):
    """One forward (no gradient recorded), or forward and backward, through ``auto``."""
    import torch

    import qkv

    def call():
        if not backward:
            with torch.no_grad():
                return qkv.attention(q, k, v, mask=mask)
        out = qkv.attention(q, k, v, mask=mask)
        return torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    return call


if __name__ == "__main__":
    main()
