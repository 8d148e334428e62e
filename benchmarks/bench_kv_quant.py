"""Quantized KV caches (int8, float8 e4m3) against float32 and bfloat16: bytes, decode speed
and what the rounding does to a trained model.

    python benchmarks/bench_kv_quant.py [--rounds 20] [--train-steps 300] [--out runs/kvq]

1. Bytes per token and key/value head of a page pool (D = 128), its scales included, read
   from ``qkv.PagedKVCache``'s buffers.
2. One decode step over 32 sequences × 4,096 cached tokens (H = 32 query heads over
   H_kv = 8, then H = 8 over 8, D = 128): ``qkv.paged_attention`` reading the pages in
   place, bfloat16 queries over bfloat16, int8 and e4m3 pages (float32 queries over float32
   pages beside them).
3. Generation at 8K context: a GPT (2 layers, E = 512, 8 heads, bfloat16) prefilled with
   8,192 tokens a sequence, then 32 greedy decode steps through bfloat16, int8 and e4m3 KV
   caches (``GPT.new_caches(kv_dtype=...)``), taken in turn: tokens per second, for one
   sequence and for 16 and 32 decoded together (``--batch``). One sequence's step is mostly
   the model's own work; 16 sequences' caches (540 MB in bfloat16) are most of theirs.
4. A trained model (``cpu-10min``'s, ``--train-steps`` steps on the standard library's
   sources, kept in ``--out``): 256 new greedy tokens through float32, int8 and e4m3
   caches — the largest logit error along the float32 run's tokens (teacher-forced, against
   the logits' own spread) and how many greedy tokens match the float32 run's.

Medians of ``--rounds`` interleaved runs. Name the CPU beside the figures (``lscpu``).
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_pages import pool as filled_pool
from timing import interleaved

import qkv
from qkv.models import GPT, GPTConfig
from qkv.training import load_checkpoint, train

KINDS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8,
         "fp8": torch.float8_e4m3fn}  # fmt: skip


def page_bytes() -> None:
    print("## Bytes per token and key/value head (D = 128, scales included)")
    f32 = None
    for name, dtype in KINDS.items():
        pool = qkv.PagedKVCache(4, 16, 1, 128, dtype=dtype)
        held = [pool.keys, pool.values, *(s for s in pool.scales() if s is not None)]
        per = sum(x.numel() * x.element_size() for x in held) / (4 * 16)
        f32 = per if f32 is None else f32
        print(f"{name:9} {per:6.0f} bytes  {per / f32:.3f}× float32's")


def decode_step(rounds: int, H: int) -> None:
    B, H_kv, D, L, P = 32, 8, 128, 4096, 16
    g = torch.Generator().manual_seed(0)
    # qkv's pools (PagedKVCache: (H_kv, pages, P, D), on huge pages where Linux gives them),
    # read as (pages, P, H_kv, D): each head's page one block (as PagedKVCache.pages() gives it)
    k = torch.randn(H_kv, B * L // P, P, D, generator=g)
    v = torch.randn(H_kv, B * L // P, P, D, generator=g)
    table = torch.arange(B * L // P).view(B, L // P)
    lengths = torch.full((B,), L)
    q = torch.randn(B, H, D, generator=g)
    calls = {}
    for name, dtype in KINDS.items():
        kp, vp, scales = filled_pool(dtype, k, v)
        qq = q if dtype == torch.float32 else q.to(torch.bfloat16)
        calls[name] = lambda qq=qq, kp=kp, vp=vp, s=scales: qkv.paged_attention(
            qq, kp, vp, table, lengths, **s
        )
    with torch.no_grad():
        ms = interleaved(calls, rounds)
    print(f"## A decode step: {B} sequences × {L} tokens, H = {H} over {H_kv}, D = {D}")
    for name, t in ms.items():
        print(f"{name:9} {t:7.2f} ms  {t / ms['bfloat16']:.2f}× bfloat16's")


def generation(batch: int) -> None:
    """Decode steps of a GPT at 8K context over caches of each kind, the kinds' steps taken
    in turn (alternating order) so that the machine's moment weighs on all alike."""
    torch.manual_seed(0)
    config = GPTConfig(block_size=8192 + 64, n_layer=2, n_head=8, n_embd=512, positions="rope")
    model = GPT(config).to(torch.bfloat16).eval()
    prompt = torch.randint(0, 256, (batch, 8192))
    kinds = {"bfloat16": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
    caches, logits, times = {}, {}, {name: [] for name in kinds}
    with torch.no_grad():
        for name, kv in kinds.items():
            caches[name] = model.new_caches(batch, kv_dtype=kv)
            logits[name] = model(prompt, caches=caches[name])
        for i in range(32):
            for name in kinds if i % 2 else reversed(list(kinds)):
                t0 = time.perf_counter()
                nxt = logits[name][:, -1:].argmax(-1)
                logits[name] = model(nxt, caches=caches[name])
                times[name].append(time.perf_counter() - t0)
    rates = {name: batch / statistics.median(t) for name, t in times.items()}
    print(f"## Generation at 8,192 tokens of context, {batch} sequence(s) "
          "(2 layers, E = 512, bfloat16 model)")  # fmt: skip
    for name, r in rates.items():
        print(f"{name:9} {r:7.1f} tokens/s  {r / rates['bfloat16']:.2f}× bfloat16's")


def accuracy(out: Path, steps: int) -> None:
    if not (out / "latest").exists():
        train(out, preset="cpu-10min", steps=steps, progress=False)
    model = load_checkpoint(out).eval()
    prompt = torch.tensor([list(b"def attention(query, key, value):\n    ")])
    runs = {}
    with torch.no_grad():
        for name, kv in (("float32", None), ("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            runs[name] = model.generate(prompt, 256, temperature=0.0, kv_dtype=kv)
        base = runs["float32"]  # the float32 run's tokens, fed to every cache (teacher-forced)
        window = model.config.block_size
        spread = None
        print(f"## A trained model ({steps} steps of cpu-10min), 256 new greedy tokens")
        for name, kv in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            ref_caches, caches = model.new_caches(1), model.new_caches(1, kv_dtype=kv)
            T = prompt.shape[1]
            want = [model(base[:, :T], caches=ref_caches)[:, -1]]
            got = [model(base[:, :T], caches=caches)[:, -1]]
            for t in range(T, min(base.shape[1] - 1, window)):
                want.append(model(base[:, t : t + 1], caches=ref_caches)[:, -1])
                got.append(model(base[:, t : t + 1], caches=caches)[:, -1])
            w, g = torch.stack(want), torch.stack(got)
            spread = (w.amax(-1) - w.amin(-1)).median()
            err = (g - w).abs().amax()
            same = int((runs[name] == base).all(0).sum()) - T
            first = (runs[name] != base).any(0).nonzero()
            diverge = "never" if not len(first) else f"at new token {int(first[0]) - T}"
            print(
                f"{name:9} largest logit error {float(err):.4f} ({float(err / spread):.4%} of "
                f"the logits' spread) over {len(want)} steps; greedy tokens equal to "
                f"float32's: {same}/256, diverging {diverge}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("runs/kvq"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32],
                        help="sequences decoded together in the generation part")  # fmt: skip
    parser.add_argument("--only", choices=["bytes", "decode", "generation", "accuracy"], nargs="+")
    args = parser.parse_args()
    parts = args.only or ["bytes", "decode", "generation", "accuracy"]
    if "bytes" in parts:
        page_bytes()
    if "decode" in parts:
        for heads in (32, 8):  # GQA (4 query heads a key/value head), and MHA
            decode_step(args.rounds, heads)
    if "generation" in parts:
        for batch in args.batch:
            generation(batch)
    if "accuracy" in parts:
        accuracy(args.out, args.train_steps)


if __name__ == "__main__":
    main()
