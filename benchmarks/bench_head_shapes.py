"""Time per FLOP of the tiled kernel at the head shapes of 2026's models, against D = 64's.

    python benchmarks/bench_head_shapes.py [--T 4096] [--window 256] [--rounds 5]
    python benchmarks/bench_head_shapes.py --dispatch [--rounds 7]

One layer's attention, 8 query heads over 2 key/value heads, a causal sliding window of
``--window`` keys over T tokens, float32 and bfloat16, forward and forward + backward,
through ``qkv.attention(backend="tiled")`` at (D, D_v) = (64, 64), (80, 80), (96, 96),
(128, 128), (192, 128) (DeepSeek's multi-head latent attention, expanded), (256, 128),
(320, 320), (512, 512) (Gemma 4's global layers) and (576, 512) (latent attention absorbed
over its cache). Each row gives the path ``qkv.dispatch`` names, the median of ``--rounds``
interleaved runs, the time per GFLOP (2 · allowed pairs · (D + D_v) for the forward; 2.5×
that for forward + backward), its ratio to D = 64's in the same run, and the same call with
the native kernel turned off (``Tuning(native=False)``: what ran there before the kernel
took every head shape — torch's flash kernel call by call where D = D_v, the PyTorch tile
loop where not). Name the CPU beside the figures (``lscpu``).

``--dispatch`` measures rule "head dims differ" instead: where D_v != D, what ``auto``
runs under a causal mask (the native kernel, from ``Tuning.unequal_scores``) against SDPA,
whose CPU fused kernel takes D_v == D only (its math path builds the weights), at the
``mla`` preset's shape (16 sequences × 4 heads × 256 tokens, D = 48, D_v = 32) and at
DeepSeek's (192, 128) with 8 heads over T = 256, 1024 and 4096: median ms of interleaved
runs and the ratio, forward and forward + backward, float32 and bfloat16.
"""

import argparse
import statistics
import time

import torch
from timing import interleaved

import qkv

SHAPES = [(64, 64), (80, 80), (96, 96), (128, 128), (192, 128), (256, 128), (320, 320),
          (512, 512), (576, 512)]  # fmt: skip


def pairs(T: int, window: int) -> int:
    """Query-key pairs a causal window of ``window`` keys allows over T tokens."""
    return sum(min(i + 1, window + 1) for i in range(T))


def run(T: int, window: int, rounds: int) -> None:
    mask = qkv.masks.sliding_window(window)
    print(f"T = {T}, window {window}, H = 8 over H_kv = 2; ms, ms per GFLOP, ratio to D = 64")
    for dtype in (torch.float32, torch.bfloat16):
        for backward in (False, True):
            base = None
            for D, D_v in SHAPES:
                g = torch.Generator().manual_seed(0)
                q, k, v = (
                    (torch.randn(1, h, T, d, generator=g) / 2).to(dtype).requires_grad_(backward)
                    for h, d in ((8, D), (2, D), (2, D_v))
                )
                path = qkv.dispatch(q, k, v, mask=mask, backend="tiled").path

                def call(q=q, k=k, v=v):
                    out = qkv.attention(q, k, v, mask=mask, backend="tiled")
                    if backward:
                        out.float().sum().backward()
                        for x in (q, k, v):
                            x.grad = None

                times: dict[str, list[float]] = {"qkv": [], "before": []}
                for r in range(rounds + 1):
                    for name in ("qkv", "before")[:: 1 if r % 2 else -1]:
                        with qkv.tuned(native=name == "qkv"):
                            t0 = time.perf_counter()
                            call()
                            took = time.perf_counter() - t0
                        if r:
                            times[name].append(took * 1e3)
                ms = {n: statistics.median(t) for n, t in times.items()}
                gflop = 2 * pairs(T, window) * 8 * (D + D_v) * (2.5 if backward else 1.0) / 1e9
                per = ms["qkv"] / gflop
                base = per if base is None else base
                kind = "fwd+bwd" if backward else "fwd"
                name = str(dtype).removeprefix("torch.")
                print(
                    f"{name:8} {kind:7} ({D:3}, {D_v:3}) {path:20} {ms['qkv']:8.1f} ms "
                    f"{per:6.2f} ms/GFLOP  {per / base:4.2f}×   native off: "
                    f"{ms['before']:8.1f} ms ({ms['before'] / ms['qkv']:4.1f}×)"
                )


#: (B, H, T, D, D_v) of --dispatch: the mla preset's training call, DeepSeek's expanded heads.
UNEQUAL = [(16, 4, 256, 48, 32), (1, 8, 256, 192, 128), (1, 8, 1024, 192, 128),
           (1, 8, 4096, 192, 128)]  # fmt: skip


def dispatch(rounds: int) -> None:
    """``auto`` (rule "head dims differ") ÷ SDPA under a causal mask, where D_v != D."""
    mask = qkv.masks.causal()
    print("causal, D_v != D: auto ÷ sdpa (median ms of interleaved runs)")
    for dtype in (torch.float32, torch.bfloat16):
        for B, H, T, D, D_v in UNEQUAL:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, H, T, d, generator=g).to(dtype) for d in (D, D, D_v))
            rule = qkv.dispatch(q, k, v, mask=mask).rule
            for backward in (False, True):
                x = [t.clone().requires_grad_(backward) for t in (q, k, v)]

                def call(backend: str, x: list = x, backward: bool = backward) -> None:
                    out = qkv.attention(*x, mask=mask, backend=backend)
                    if backward:
                        torch.autograd.grad(out.float().sum(), x)

                ms = interleaved({b: lambda b=b: call(b) for b in ("auto", "sdpa")}, rounds)
                print(
                    f"{str(dtype).removeprefix('torch.'):8} {'fwd+bwd' if backward else 'fwd':7} "
                    f"{(B, H, T, D, D_v)!s:24} {rule:18} {ms['auto']:8.1f} ms  sdpa "
                    f"{ms['sdpa']:8.1f} ms  {ms['auto'] / ms['sdpa']:4.2f}×"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dispatch", action="store_true", help="rule 'head dims differ'")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.dispatch:
        dispatch(args.rounds)
    else:
        run(args.T, args.window, args.rounds)


if __name__ == "__main__":
    main()
