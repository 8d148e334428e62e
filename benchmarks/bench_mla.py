"""One decode step of multi-head latent attention over its latent cache, against multi-head
attention of the same model shape over its KV cache.

    python benchmarks/bench_mla.py [--context 4096] [--heads 16] [--rounds 30]

A layer of width E = 2048 with ``--heads`` heads of 128 (DeepSeek V3's head, its 128 heads
cut to fit a CPU): ``qkv.MultiHeadAttention`` (H_kv = H) with a ``qkv.KVCache``, and
``qkv.nn.MultiHeadLatentAttention`` (r = 512, rope 64, nope 128, v 128) with its
``LatentCache``, absorbed (the form the module picks for one token) and expanded. Each
cache holds ``--context`` tokens; a step appends one token and attends over all, float32,
no gradient. Medians of ``--rounds`` interleaved steps; the cache bytes per token are read
from the caches themselves. Name the CPU beside the figures (``lscpu``).
"""

import argparse
import statistics
import time

import torch

import qkv
from qkv.nn import MultiHeadLatentAttention


def run(context: int, H: int, rounds: int) -> None:
    torch.manual_seed(0)
    E = 2048
    mha = qkv.MultiHeadAttention(E, H * 128, H, causal=True)
    mla = MultiHeadLatentAttention(
        E, H, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    prompt = torch.randn(1, context, E)
    kv, latent = mha.new_cache(1, context + 1), mla.new_cache(1, context + 1)
    with torch.no_grad():  # both caches filled by a prefill of the prompt
        mha(prompt, cache=kv)
        mla(prompt, cache=latent)
    x = torch.randn(1, 1, E)

    def step(module, cache, **kw):
        def call():
            cache.length = context  # the same step each time: context cached, one appended
            with torch.no_grad():
                return module(x, cache=cache, **kw)

        return call

    cases = {
        "MHA + KVCache": step(mha, kv),
        "MLA absorbed + LatentCache": step(mla, latent),
        "MLA expanded + LatentCache": step(mla, latent, form="expanded"),
    }
    times: dict[str, list[float]] = {n: [] for n in cases}
    for r in range(rounds + 1):
        names = list(cases)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            cases[name]()
            if r:
                times[name].append((time.perf_counter() - t0) * 1e3)
    mha_bytes = (kv.keys[0, :, 0].numel() + kv.values[0, :, 0].numel()) * 4
    print(f"E = {E}, H = {H} heads of 128, {context} cached tokens, float32, one layer")
    print(f"cache bytes per token: MHA {mha_bytes:,}, MLA {latent.bytes_per_token():,} "
          f"({latent.bytes_per_token() / mha_bytes:.3f}×)")  # fmt: skip
    base = statistics.median(times["MHA + KVCache"])
    for name, t in times.items():
        ms = statistics.median(t)
        print(f"{name:28} {ms:7.2f} ms  {ms / base:4.2f}× MHA's")
    print(mla.dispatch(x, cache=latent).reason[:160])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    run(args.context, args.heads, args.rounds)


if __name__ == "__main__":
    main()
