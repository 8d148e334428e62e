"""Variable-length attention: the figures of docs/ragged.md.

    python benchmarks/bench_varlen.py [--rounds 5]

16 causal sequences of 64 to 4,096 tokens (lengths drawn log-uniformly, seed 0), H = 8,
D = 64, float32 and bfloat16, forward and forward + backward:
``qkv.varlen_attention`` on the packed batch, against the sum of running each sequence
alone through ``qkv.attention`` and against SDPA over the right-padded (16, 8, 4096, 64)
batch with a dense (causal and padding) bool mask. Medians of interleaved rounds; ratios in
the same run.
"""

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import qkv

H, D, N, LO, HI = 8, 64, 16, 64, 4096


def lengths() -> list[int]:
    rng = np.random.default_rng(0)
    out = np.exp(rng.uniform(np.log(LO), np.log(HI), N)).astype(int)
    out[0], out[-1] = LO, HI  # the range's ends, always
    return [int(n) for n in out]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ns = lengths()
    total, T = sum(ns), max(ns)
    cu = torch.tensor([0, *np.cumsum(ns)])
    print(f"lengths: {ns} (total {total})")
    print(
        "| dtype, pass | varlen | each alone, summed | SDPA padded + dense mask | "
        "varlen ÷ alone | SDPA ÷ varlen |"
    )
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(total, H, D, generator=g).to(dtype) for _ in range(3))
        pad = torch.zeros(N, H, T, D, dtype=dtype)
        padded = [pad.clone() for _ in range(3)]
        for s, n in enumerate(ns):
            for x, p in zip((q, k, v), padded):
                p[s, :, :n] = x[cu[s] : cu[s] + n].transpose(0, 1)
        valid = torch.arange(T)[None, :] < torch.tensor(ns)[:, None]  # (N, T)
        dense = torch.ones(T, T, dtype=torch.bool).tril()[None] & valid[:, None, :]
        dense = dense[:, None]  # (N, 1, T, T): causal and the sequence's own keys
        # (padded query rows attend to key 0 so that no row is empty: SDPA would give NaN)
        dense[:, :, :, 0] = True

        cases = {
            "varlen": lambda xs: qkv.varlen_attention(*xs, cu, cu, T, T, window_size=(-1, 0)),
            "alone": lambda xs: torch.cat([_alone(xs, cu, s) for s in range(N)]),
            "sdpa": lambda xs: F.scaled_dot_product_attention(*xs, attn_mask=dense),
        }
        inputs = {"varlen": (q, k, v), "alone": (q, k, v), "sdpa": tuple(padded)}
        for grad in (False, True):
            times: dict[str, list[float]] = {name: [] for name in cases}
            for r in range(args.rounds + 1):
                for name in list(cases) if r % 2 == 0 else list(reversed(cases)):
                    took = _timed(cases[name], inputs[name], grad)
                    if r:  # round 0 warms up
                        times[name].append(took)
            med = {n: statistics.median(t) for n, t in times.items()}
            what = f"{str(dtype).removeprefix('torch.')}, {'fwd+bwd' if grad else 'forward'}"
            print(
                f"| {what} | {med['varlen'] * 1e3:.0f} ms | {med['alone'] * 1e3:.0f} ms | "
                f"{med['sdpa'] * 1e3:.0f} ms | {med['varlen'] / med['alone']:.2f} | "
                f"{med['sdpa'] / med['varlen']:.1f} |",
                flush=True,
            )


def _alone(xs, cu, s):
    a, b = int(cu[s]), int(cu[s + 1])
    q, k, v = (x[a:b].transpose(0, 1)[None] for x in xs)
    return qkv.attention(q, k, v, mask=qkv.masks.causal())[0].transpose(0, 1)


def _timed(fn, xs, grad: bool) -> float:
    xs = [x.detach().requires_grad_(grad) for x in xs]
    t0 = time.perf_counter()
    out = fn(xs)
    if grad:
        out.float().square().mean().backward()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
