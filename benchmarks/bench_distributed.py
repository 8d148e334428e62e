"""Balance of context-parallel layouts (docs/distributed.md): scored (128 x 128) blocks per
rank, max / mean, for the balanced layout and contiguous sharding, at T = 16K and W = 4.
Runs in one process: layouts are plans, not communication.

    python benchmarks/bench_distributed.py
"""

import time

import numpy as np

from qkv import masks
from qkv.distributed import Layout

T, W, BLOCK = 16384, 4, 128


def scored_blocks(layout: Layout, mask: masks.Mask) -> np.ndarray:
    work = []
    for runs in layout.runs:
        total = 0
        for a, b in runs:
            for s in range(a, b, BLOCK):
                e = min(s + BLOCK, b)
                codes = mask.blocks(mask.batch or 1, 1, e - s, T, block_q=e - s, block_k=BLOCK,
                                    q_offset=s)
                total += int((codes != masks.EMPTY).sum())
        work.append(total)
    return np.array(work)


def main() -> None:
    rng = np.random.default_rng(0)
    ids = np.searchsorted(np.sort(rng.choice(np.arange(1, T), 7, replace=False)), np.arange(T),
                          side="right")  # 8 documents of random lengths
    cases = {"causal": masks.causal(), "8 documents & causal": masks.document(ids) & masks.causal(),
             "8 documents": masks.document(ids), "sliding_window(256)": masks.sliding_window(256),
             "prefix_lm(4096)": masks.prefix_lm(4096)}
    print(f"| mask (T={T}, W={W}) | balanced: max/mean | contiguous: max/mean | planning |")
    print("|---|---|---|---|")
    for name, mask in cases.items():
        t0 = time.perf_counter()
        balanced = Layout.balanced(T, W, mask)
        seconds = time.perf_counter() - t0
        b, c = scored_blocks(balanced, mask), scored_blocks(Layout.contiguous(T, W), mask)
        print(f"| {name} | {b.max() / b.mean():.3f} | {c.max() / c.mean():.3f} | "
              f"{seconds * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
