"""Context-parallel attention: a sequence split across processes, attended exactly.

    torchrun --standalone --nproc_per_node 2 examples/context_parallel.py
    torchrun --standalone --nproc_per_node 4 examples/context_parallel.py --T 8192

Every rank builds the same full inputs (a demo: in a real model each rank would only ever
hold its shard), keeps the positions its balanced layout gives it, attends with packed
causal documents, and runs the backward pass. Rank 0 then checks the gathered output against
one process attending over the whole sequence. gloo over loopback: CPU only.
"""

import argparse
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import qkv
from qkv import distributed as qd
from qkv import masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=4096, help="sequence length (4096)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (8; 2 kv heads)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()

    rng = np.random.default_rng(0)  # 8 documents of random lengths, packed, causal
    cuts = np.sort(rng.choice(np.arange(1, args.T), 7, replace=False))
    mask = masks.document(np.searchsorted(cuts, np.arange(args.T), side="right")) & masks.causal()
    layout = qd.Layout.balanced(args.T, world, mask)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, args.heads, args.T, 64, generator=g)
    k, v = (torch.randn(1, 2, args.T, 64, generator=g) for _ in range(2))

    local = [layout.shard(x, 2).requires_grad_() for x in (q, k, v)]
    t0 = time.perf_counter()
    out = qd.attention(*local, layout=layout, mask=mask)  # (1, H, T_r, 64)
    out.sum().backward()
    seconds = time.perf_counter() - t0
    full = layout.gather(out.detach(), dim=2)
    print(
        f"rank {rank}: {layout.size(rank)} positions in {len(layout.runs[rank])} runs, "
        f"forward + backward {seconds:.2f} s",
        flush=True,
    )
    if rank == 0:
        want = qkv.attention(q, k, v, mask=mask)
        err = (full - want).abs().max().item()
        print(f"{world} ranks, T={args.T}: max |distributed - one process| = {err:.1e}")
        if err > 1e-5:
            raise SystemExit("mismatch")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
