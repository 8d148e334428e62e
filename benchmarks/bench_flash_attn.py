"""FlashAttention's API on a CPU through qkv against the fallback GPU projects ship for the CPU.

    python benchmarks/bench_flash_attn.py [--T 2048 8192] [--window 256] [--rounds 5]

One layer of examples/flash_attn_gpt.py's attention (H = 4 query heads over H_kv = 2, D = 32,
float32), causal with a sliding window: ``qkv.flash_attn.flash_attn_func`` against torch's
SDPA with the window as a dense (T, T) bool mask, forward and forward + backward. Medians of
``--rounds`` interleaved runs after a warm-up, their ratio, and each call's peak resident
memory above its start (Linux's high-water mark, qkv.cli.bench.PeakRSS). Then a decode
step over a KV cache of T tokens, 8 sequences, H = 8 over H_kv = 2, D = 64:
``flash_attn_with_kvcache`` (one new token appended in place) against SDPA over the cache.
Name the CPU beside the figures (``lscpu``).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from qkv.cli.bench import PeakRSS
from qkv.flash_attn import flash_attn_func, flash_attn_with_kvcache


def dense(q, k, v, left):
    T = q.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = (j <= i) & (j >= i - left)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)


def timed(fn, leaves, backward):
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        out = fn()
        if backward:
            out.sum().backward()
            for x in leaves:
                x.grad = None
        took = time.perf_counter() - t0
        del out
    return took, mem.above / 2**20


def layer(T: int, window: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, T, h, 32, generator=g, requires_grad=True) for h in (4, 2, 2)]
    cases = {
        "qkv": lambda: flash_attn_func(*leaves, causal=True, window_size=(window, 0)),
        "sdpa-dense": lambda: dense(*leaves, window),
    }
    for backward in (False, True):
        times: dict[str, list[float]] = {n: [] for n in cases}
        peaks: dict[str, float] = dict.fromkeys(cases, 0.0)
        for r in range(rounds + 1):
            for name in list(cases)[:: 1 if r % 2 else -1]:
                took, peak = timed(cases[name], leaves, backward)
                peaks[name] = max(peaks[name], peak)
                if r:
                    times[name].append(took)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        print(
            f"| T={T} {'fwd+bwd' if backward else 'forward'} | {med['qkv']:.0f} ms | "
            f"{med['sdpa-dense']:.0f} ms | {med['sdpa-dense'] / med['qkv']:.1f}x | "
            f"{peaks['qkv']:.0f} MB | {peaks['sdpa-dense']:.0f} MB |",
            flush=True,
        )


def decode(T: int, rounds: int) -> None:
    B, H, H_kv, D = 8, 8, 2, 64
    g = torch.Generator().manual_seed(0)
    k_cache = torch.randn(B, T + rounds + 2, H_kv, D, generator=g)
    v_cache = torch.randn(B, T + rounds + 2, H_kv, D, generator=g)
    q = torch.randn(B, 1, H, D, generator=g)
    k, v = torch.randn(B, 1, H_kv, D, generator=g), torch.randn(B, 1, H_kv, D, generator=g)
    seqlens = torch.full((B,), T, dtype=torch.int32)
    times: dict[str, list[float]] = {"qkv": [], "sdpa": []}
    with torch.no_grad():
        for r in range(rounds + 1):
            for name in ("qkv", "sdpa")[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                if name == "qkv":
                    flash_attn_with_kvcache(
                        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True
                    )
                else:
                    k_cache[:, T] = k[:, 0]
                    v_cache[:, T] = v[:, 0]
                    F.scaled_dot_product_attention(
                        q.transpose(1, 2),
                        k_cache[:, : T + 1].transpose(1, 2),
                        v_cache[:, : T + 1].transpose(1, 2),
                        enable_gqa=True,
                    )
                if r:
                    times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(
        f"| decode, cache {T} | {med['qkv']:.2f} ms | {med['sdpa']:.2f} ms | "
        f"{med['sdpa'] / med['qkv']:.2f}x | | |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, window {args.window}")
    print("| call | qkv | SDPA, dense mask | SDPA ÷ qkv | qkv peak | SDPA peak |")
    print("|---|---|---|---|---|---|")
    for T in args.T:
        layer(T, args.window, args.rounds)
    for T in args.T:
        decode(T, 4 * args.rounds)


if __name__ == "__main__":
    main()
