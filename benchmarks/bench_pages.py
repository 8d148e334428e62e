"""Where a paged cache's pages lie, and what the decode step's time makes of it.

    python benchmarks/bench_pages.py [--batch 32] [--tokens 4096] [--rounds 9] [--huge]

A decode step (``qkv.paged_attention``, H = 32 query heads over H_kv = 8, D = 128,
bfloat16 queries) over ``--batch`` sequences of ``--tokens`` tokens in pages of 16, read
from a ``qkv.PagedKVCache`` pool (bfloat16, then int8), with four block tables:

- in order: each sequence's pages one run, side by side;
- one free list in turn: the sequences decode together from short prompts, each taking the
  lowest free page when it needs one (qkv's allocator before 2026-11-28, and any that
  ignores where a page lies): their pages interleave;
- qkv's allocator: the same decoding through ``qkv.serving.pages.PageAllocator``, which
  keeps a sequence's pages in runs;
- scattered: a random permutation of the pool.

Each table's time ÷ in order's, medians of ``--rounds`` interleaved runs, and the runs of
consecutive pages per sequence. ``--huge`` instead times one table (qkv's allocator's) over
two pools, one on transparent huge pages (as ``PagedKVCache`` keeps them, ``qkv._memory``)
and one on 4 KiB pages. Name the CPU beside the figures (``lscpu``).
"""

import argparse
import itertools
import random

import torch
from timing import interleaved

import qkv
from qkv import _memory
from qkv.kernels.quant import is_quantized, quantize
from qkv.serving.pages import PageAllocator

H, H_KV, D, P = 32, 8, 128, 16


def decoded_tables(batch: int, tokens: int, num_pages: int) -> dict[str, list[list[int]]]:
    """Block tables of `batch` sequences grown from prompts of 1–200 tokens a token at a
    time: through one free list handed out in turn, and through qkv's allocator."""
    prompts = [random.Random(b).randint(1, 200) for b in range(batch)]
    free, turn = list(range(num_pages - 1, -1, -1)), [[] for _ in range(batch)]
    alloc = PageAllocator(num_pages, P)
    seqs = [alloc.new_sequence() for _ in range(batch)]
    alloc.reserve(seqs, prompts)
    lengths = list(prompts)
    for b, n in enumerate(prompts):
        turn[b] += [free.pop() for _ in range(-(-n // P))]
    while min(lengths) < tokens:
        grow = [int(n < tokens) for n in lengths]
        alloc.reserve(seqs, grow)
        for b, g in enumerate(grow):
            if g and lengths[b] % P == 0:
                turn[b].append(free.pop())
            lengths[b] += g
    return {"one free list in turn": turn, "qkv's allocator": [alloc.table(s) for s in seqs]}


def runs(table: list[int]) -> int:
    return 1 + sum(1 for x, y in itertools.pairwise(table) if y != x + 1)


def pool(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor):
    """A PagedKVCache of ``dtype`` holding k and v (H_kv, pages, P, D), quantized where
    ``dtype`` is, and its pages and scales as ``paged_attention`` takes them."""
    H_kv, num_pages, page_size, head_dim = k.shape
    p = qkv.PagedKVCache(num_pages, page_size, H_kv, head_dim, dtype=dtype)
    scales = {}
    if not is_quantized(dtype):
        p.keys.copy_(k), p.values.copy_(v)
    else:
        (kq, ks), (vq, vs) = (quantize(x, dtype) for x in (k, v))
        p.keys.copy_(kq), p.values.copy_(vq)
        assert p.key_scale is not None and p.value_scale is not None
        p.key_scale.copy_(ks), p.value_scale.copy_(vs)
        scales = dict(
            key_scale=p.key_scale.permute(1, 2, 0), value_scale=p.value_scale.permute(1, 2, 0)
        )
    return p.keys.permute(1, 2, 0, 3), p.values.permute(1, 2, 0, 3), scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--huge", action="store_true", help="huge pages against 4 KiB ones")
    args = parser.parse_args()
    B, L = args.batch, args.tokens
    per = -(-L // P)  # pages a sequence holds
    n = B * per + B * 13  # the pages, and room for the prompts' last pages
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(H_KV, n, P, D, generator=g) for _ in range(2))
    q = torch.randn(B, H, D, generator=g).to(torch.bfloat16)
    lengths = torch.full((B,), L)
    tables = {"in order": torch.arange(B * per).view(B, per).tolist()}
    tables |= decoded_tables(B, L, n)
    tables["scattered"] = torch.randperm(n, generator=g)[: B * per].view(B, per).tolist()
    as_tensors = {name: torch.tensor([t[:per] for t in ts]) for name, ts in tables.items()}
    calls = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        if args.huge:
            table = as_tensors["qkv's allocator"]
            for memory, start in (("4 KiB pages", 1 << 62), ("huge pages", _memory.HUGE_FROM)):
                saved, _memory.HUGE_FROM = _memory.HUGE_FROM, start
                kp, vp, s = pool(dtype, k, v)
                _memory.HUGE_FROM = saved
                calls[name, memory] = lambda kp=kp, vp=vp, s=s: qkv.paged_attention(
                    q, kp, vp, table, lengths, **s
                )
            continue
        kp, vp, s = pool(dtype, k, v)
        for label, table in as_tensors.items():
            calls[name, label] = lambda kp=kp, vp=vp, s=s, t=table: qkv.paged_attention(
                q, kp, vp, t, lengths, **s
            )
    with torch.no_grad():
        ms = interleaved(calls, args.rounds)
    base = "4 KiB pages" if args.huge else "in order"
    print(f"## A decode step: {B} sequences × {L} tokens, H = {H} over {H_KV}, D = {D}")
    for (name, label), t in ms.items():
        extra = ""
        if not args.huge:
            run = sum(len(x) for x in tables[label]) / sum(runs(x) for x in tables[label])
            extra = f"  ({run:.1f} pages a run)"
        print(f"{name:9} {label:22} {t:7.2f} ms  {t / ms[name, base]:.2f}× {base}{extra}")


if __name__ == "__main__":
    main()
