"""backend="flex" on this machine (docs/kernels.md#flex):

    python benchmarks/bench_flex.py            # BlockMask build at T = 16K, forward at T = 4K

1. Building the BlockMask from qkv's block map against ``create_block_mask`` evaluating the
   predicate over T × T, at T = 16,384 (median of 3), and whether they agree block for block.
2. Forward at T = 4,096, H = 8, D = 64, float32: the flex backend's steady-state time (its
   compile time apart) against the tiled kernel and SDPA with the dense mask, medians of 5,
   interleaved. On CUDA when one is present (forward only, as on the CPU, where torch's
   FlexAttention has no backward).
"""

import statistics
import time

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask

import qkv
from qkv import masks
from qkv.core import lowering as L
from qkv.kernels import flex as F

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cases(T: int) -> dict[str, masks.Mask]:
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, T), 7, replace=False))
    ids = np.searchsorted(cuts, np.arange(T), side="right")
    return {
        "causal": masks.causal(),
        "sliding_window(256)": masks.sliding_window(256),
        "8 documents & causal": masks.document(ids) & masks.causal(),
        "prefix_lm(T/4)": masks.prefix_lm(T // 4),
    }


def same(a, b) -> bool:
    for count, index in (
        ("kv_num_blocks", "kv_indices"),
        ("full_kv_num_blocks", "full_kv_indices"),
    ):
        if not torch.equal(getattr(a, count), getattr(b, count)):
            return False
        n = getattr(a, count)[0, 0]
        ia, ib = getattr(a, index)[0, 0], getattr(b, index)[0, 0]
        if any(
            sorted(ia[r, :k].tolist()) != sorted(ib[r, :k].tolist())
            for r, k in enumerate(n.tolist())
        ):
            return False
    return True


def median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(T: int = 16384) -> None:
    cpu = DEVICE
    print(
        f"| mask (T = {T}) | qkv block map → BlockMask | create_block_mask | ratio | "
        "equal block for block |"
    )
    print("|---|---|---|---|---|")
    for name, mask in cases(T).items():
        ours = median(lambda: L.flex_block_mask(mask, 1, 1, T, T, 0, cpu), 3)
        theirs = median(
            lambda: create_block_mask(
                L.flex_mask_mod(mask, 0, cpu), 1, 1, T, T, device=cpu, BLOCK_SIZE=F.BLOCK
            ),
            3,
        )
        equal = same(
            L.flex_block_mask(mask, 1, 1, T, T, 0, cpu),
            create_block_mask(
                L.flex_mask_mod(mask, 0, cpu), 1, 1, T, T, device=cpu, BLOCK_SIZE=F.BLOCK
            ),
        )
        print(
            f"| {name} | {ours * 1e3:.0f} ms | {theirs * 1e3:.0f} ms | {theirs / ours:.0f}× | "
            f"{'yes' if equal else 'NO'} |",
            flush=True,
        )


def forward(T: int = 4096, H: int = 8, D: int = 64, repeats: int = 5) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, D, generator=g).to(DEVICE) for _ in range(3))
    print(
        f"\n| mask (T = {T}, fwd, float32) | flex compile | flex | tiled | sdpa (dense mask) "
        "| flex / tiled |"
    )
    print("|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, mask in cases(T).items():
            t0 = time.perf_counter()
            qkv.attention(q, k, v, mask=mask, backend="flex")
            first = time.perf_counter() - t0
            runs = {"flex": [], "tiled": [], "sdpa": []}
            for _ in range(repeats):
                for backend in runs:
                    t0 = time.perf_counter()
                    qkv.attention(q, k, v, mask=mask, backend=backend)
                    runs[backend].append(time.perf_counter() - t0)
            m = {b: statistics.median(t) for b, t in runs.items()}
            print(
                f"| {name} | {first:.1f} s | {m['flex'] * 1e3:.0f} ms | "
                f"{m['tiled'] * 1e3:.0f} ms | {m['sdpa'] * 1e3:.0f} ms | "
                f"{m['flex'] / m['tiled']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    build()
    forward()
