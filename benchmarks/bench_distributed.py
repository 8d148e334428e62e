"""Context parallelism's figures (docs/distributed.md).

    python benchmarks/bench_distributed.py            # balance: scored blocks per rank
    python benchmarks/bench_distributed.py memory     # peak memory, T=65536, ~15 min here
    python benchmarks/bench_distributed.py memory ring  # one process and the ring only
    python benchmarks/bench_distributed.py memory ring --piece 512   # the ring's piece length

Balance: scored (128 x 128) blocks per rank, max / mean, for the balanced layout and
contiguous sharding, at T = 16K and W = 4 (layouts are plans: one process). Memory: causal
attention at T = 65536, H = 8, D = 64, float32, forward + backward; each process's peak
resident memory (VmHWM) above its baseline (VmRSS once torch is imported and its inputs or
shards are built), for one process and for each rank of 4 gloo processes per schedule, on
the head-tail layout (two chunks per rank).
"""

import json
import socket
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qkv
from qkv import masks
from qkv.distributed import Layout, attention

T, W, BLOCK = 16384, 4, 128


def scored_blocks(layout: Layout, mask: masks.Mask) -> np.ndarray:
    work = []
    for runs in layout.runs:
        total = 0
        for a, b in runs:
            for s in range(a, b, BLOCK):
                e = min(s + BLOCK, b)
                codes = mask.blocks(
                    mask.batch or 1, 1, e - s, T, block_q=e - s, block_k=BLOCK, q_offset=s
                )
                total += int((codes != masks.EMPTY).sum())
        work.append(total)
    return np.array(work)


def main() -> None:
    rng = np.random.default_rng(0)
    ids = np.searchsorted(
        np.sort(rng.choice(np.arange(1, T), 7, replace=False)), np.arange(T), side="right"
    )  # 8 documents of random lengths
    cases = {
        "causal": masks.causal(),
        "8 documents & causal": masks.document(ids) & masks.causal(),
        "8 documents": masks.document(ids),
        "sliding_window(256)": masks.sliding_window(256),
        "prefix_lm(4096)": masks.prefix_lm(4096),
    }
    print(f"| mask (T={T}, W={W}) | balanced: max/mean | contiguous: max/mean | planning |")
    print("|---|---|---|---|")
    for name, mask in cases.items():
        t0 = time.perf_counter()
        balanced = Layout.balanced(T, W, mask)
        seconds = time.perf_counter() - t0
        b, c = scored_blocks(balanced, mask), scored_blocks(Layout.contiguous(T, W), mask)
        print(
            f"| {name} | {b.max() / b.mean():.3f} | {c.max() / c.mean():.3f} | "
            f"{seconds * 1e3:.0f} ms |"
        )


def _kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


MEM = dict(T=65536, H=8, D=64)


def _single(queue) -> None:
    T, H, D = MEM["T"], MEM["H"], MEM["D"]
    q, k, v = (torch.randn(1, H, T, D).requires_grad_() for _ in range(3))
    base, t0 = _kb("VmRSS"), time.perf_counter()
    qkv.attention(q, k, v, mask=masks.causal(), backend="tiled").sum().backward()
    queue.put(
        {
            "who": "one process",
            "peak_mb": (_kb("VmHWM") - base) / 1024,
            "seconds": time.perf_counter() - t0,
        }
    )


def _rank(rank, world, port, schedule, queue, piece=1024) -> None:
    torch.set_num_threads(1)  # 4 processes on this 2-core machine: no oversubscription
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=1800),
    )
    T, H, D = MEM["T"], MEM["H"], MEM["D"]
    layout = Layout.balanced(T, world, masks.causal(), chunks_per_rank=2)  # head-tail
    n = layout.size(rank)
    q, k, v = (torch.randn(1, H, n, D).requires_grad_() for _ in range(3))
    base, t0 = _kb("VmRSS"), time.perf_counter()
    attention(
        q, k, v, layout=layout, mask=masks.causal(), schedule=schedule, ring_piece=piece
    ).sum().backward()
    queue.put(
        {
            "who": f"{schedule}{f' (ring_piece={piece})' if schedule == 'ring' else ''}, "
            f"rank {rank}/{world}",
            "peak_mb": (_kb("VmHWM") - base) / 1024,
            "seconds": time.perf_counter() - t0,
        }
    )
    dist.destroy_process_group()


def memory(schedules=("allgather", "ring"), piece=1024) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_single, args=(queue,))
    p.start()
    p.join()
    results = [queue.get()]
    print(json.dumps(results[-1]), flush=True)
    for schedule in schedules:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(
            _rank, args=(4, port, schedule, queue, piece), nprocs=4, join=True, start_method="spawn"
        )
        for _ in range(4):
            results.append(queue.get())
            print(json.dumps(results[-1]), flush=True)
    single = results[0]["peak_mb"]
    print(
        f"| who (T={MEM['T']}, H={MEM['H']}, D={MEM['D']}, causal, fwd+bwd) | peak above "
        "baseline | ÷ one process | seconds |"
    )
    print("|---|---|---|---|")
    for r in results:
        print(
            f"| {r['who']} | {r['peak_mb']:.0f} MB | {r['peak_mb'] / single:.2f} | "
            f"{r['seconds']:.0f} |"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["memory"]:
        args = sys.argv[2:]
        piece = int(args[args.index("--piece") + 1]) if "--piece" in args else 1024
        names = [a for a in args if a in ("allgather", "ring")] or ["allgather", "ring"]
        memory(names, piece)
    else:
        main()
