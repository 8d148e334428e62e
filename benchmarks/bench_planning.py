"""Planning the tiled kernel: the block map and its chunks (docs/kernels.md#planning).

    python benchmarks/bench_planning.py

For each structured mask and length, the planner the kernel uses (``Mask.sparse_blocks`` then
``make_plan``: array work over the tiles the mask's structure may leave non-empty) against
the dense block map it replaced (every (T/128) × (T/64) tile classified, then the same
chunking): median seconds of 3 and peak Python-heap memory (tracemalloc). The dense map is
skipped where it would need more than ~1.5 GB. "rows" is the time to make the per-row
tuples a kernel iterates, which the kernel pays when it first runs.
"""

import statistics
import time
import tracemalloc

import numpy as np

from qkv import masks
from qkv.kernels.tiled.plan import BLOCK_K, BLOCK_Q, dense_to_sparse, make_plan

DENSE_LIMIT = 1 << 30  # map cells; the dense classification holds several arrays this big


def planners(m: masks.Mask, T: int) -> dict:
    kw = dict(block_q=BLOCK_Q, block_k=BLOCK_K)
    return {
        "sparse": lambda: make_plan(*m.sparse_blocks(1, 1, T, T, **kw), T, T),
        "dense": lambda: make_plan(*dense_to_sparse(m.blocks(1, 1, T, T, **kw)), T, T),
    }


def measure(fn) -> tuple[float, float, object]:
    fn()  # warm (imports, allocator)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        plan = fn()
        times.append(time.perf_counter() - t)
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return statistics.median(times), peak / 1e6, plan


def main() -> None:
    print("| mask | T | planner | plan (s) | peak (MB) | chunks | rows (s) |")
    print("|---|---|---|---|---|---|---|")
    for T in (1 << 16, 1 << 18, 1 << 20, 1 << 22):
        ids = np.repeat(np.arange(8), T // 8)
        cases = {
            "sliding_window(256)": masks.sliding_window(256),
            "8 documents & sliding_window(256)": masks.document(ids) & masks.sliding_window(256),
        }
        if T <= 1 << 18:  # causal and whole documents attend O(T²): their plans are that big
            cases |= {
                "causal": masks.causal(),
                "8 documents & causal": masks.document(ids) & masks.causal(),
            }
        for name, m in cases.items():
            for planner, fn in planners(m, T).items():
                if planner == "dense" and (T // BLOCK_Q) * (T // BLOCK_K) > DENSE_LIMIT:
                    print(
                        f"| {name} | {T:,} | dense | — (a {T // BLOCK_Q:,} × "
                        f"{T // BLOCK_K:,} map) | | | |"
                    )
                    continue
                seconds, peak, plan = measure(fn)
                t = time.perf_counter()
                _ = plan.rows  # made on first use: timed here
                rows = time.perf_counter() - t
                print(
                    f"| {name} | {T:,} | {planner} | {seconds:.4f} | {peak:.1f} | "
                    f"{len(plan.k0):,} | {rows:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
