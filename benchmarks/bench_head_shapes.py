"""Time per FLOP of the tiled kernel at the head shapes of 2026's models, against D = 64's.

    python benchmarks/bench_head_shapes.py [--T 4096] [--window 256] [--rounds 5]

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
"""

import argparse
import statistics
import time

import torch

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    run(args.T, args.window, args.rounds)


if __name__ == "__main__":
    main()
