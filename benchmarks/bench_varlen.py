"""Variable-length attention: the figures of docs/ragged.md.

    python benchmarks/bench_varlen.py [--rounds 5]
    python benchmarks/bench_varlen.py paged      # the paged KV cache: memory, decode step
    python benchmarks/bench_varlen.py generate   # ragged prompts decoded together vs alone
    python benchmarks/bench_varlen.py cascade    # 32 requests sharing a 1,024-token prefix
    python benchmarks/bench_varlen.py hf         # ragged generation against HF generate

16 causal sequences of 64 to 4,096 tokens (lengths drawn log-uniformly, seed 0), H = 8,
D = 64, float32 and bfloat16, forward and forward + backward:
``qkv.varlen_attention`` on the packed batch, against the sum of running each sequence
alone through ``qkv.attention`` and against SDPA over the right-padded (16, 8, 4096, 64)
batch with a dense (causal and padding) bool mask. Medians of interleaved rounds; ratios in
the same run. Paged: 32 sequences of 16–1,024 tokens (log-uniform, seed 0) held in pages
of 16 tokens, memory against a contiguous cache of batch × max; and one decode step of a
MultiHeadAttention (E = 384, 6 heads: the default GPT preset's shape) over 8 sequences of
1,024 cached tokens, on a paged batch (its pages gathered per step) against a KVCache.
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


def paged(rounds: int = 30) -> None:
    rng = np.random.default_rng(0)
    ns = [int(n) for n in np.exp(rng.uniform(np.log(16), np.log(1024), 32))]
    E, Hh, P = 384, 6, 16
    pool = qkv.PagedKVCache(4096, P, Hh, E // Hh)
    for n in ns:
        s = pool.new_sequence()
        pool.append([s], torch.zeros(1, Hh, n, E // Hh), torch.zeros(1, Hh, n, E // Hh))
    held, contiguous = pool.pages_in_use * P, len(ns) * max(ns)
    print(
        f"32 sequences, {sum(ns)} tokens: paged holds {held} token slots "
        f"({held / sum(ns):.3f}× the tokens), a contiguous cache {contiguous} "
        f"({contiguous / sum(ns):.2f}×)"
    )
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(E, E, num_heads=Hh, causal=True).eval()
    B, L = 8, 1024
    prompt = torch.randn(B, L, E)
    kv = mha.new_cache(B, L + rounds + 8)
    pages = qkv.PagedKVCache(B * (L + rounds + 8) // P + B, P, Hh, E // Hh)
    paged_batch = pages.batch([pages.new_sequence() for _ in range(B)])
    with torch.no_grad():
        mha(prompt, cache=kv), mha(prompt, cache=paged_batch)
        times: dict[str, list[float]] = {"contiguous": [], "paged": []}
        x = torch.randn(B, 1, E)
        for r in range(rounds):
            for name, cache in (("contiguous", kv), ("paged", paged_batch))[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                mha(x, cache=cache)
                times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(
        f"decode step, B={B}, {L} cached: contiguous {med['contiguous'] * 1e3:.2f} ms, "
        f"paged {med['paged'] * 1e3:.2f} ms ({med['paged'] / med['contiguous']:.2f}×)"
    )


def generate() -> None:
    """32 prompts of 16–128 tokens (the default preset's window is 256), 128 new tokens each,
    greedy, on the default preset's untrained GPT: decoded together (a list of prompts, the
    paged cache) against one at a time (each on its own contiguous cache)."""
    from qkv.models import GPT
    from qkv.training import PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS["cpu-10min"][0]).eval()
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=g) for n in rng.integers(16, 129, 32)]
    new = 128
    t0 = time.perf_counter()
    together = model.generate(prompts, new, temperature=0.0)
    t_together = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = [model.generate(p[None], new, temperature=0.0)[0] for p in prompts]
    t_alone = time.perf_counter() - t0
    same = all(torch.equal(a, b) for a, b in zip(together, alone))
    tokens = len(prompts) * new
    print(
        f"32 prompts, {new} new tokens each: together {tokens / t_together:.0f} tokens/s, "
        f"one at a time {tokens / t_alone:.0f} tokens/s "
        f"({t_alone / t_together:.2f}×); same tokens: {same}"
    )


def hf() -> None:
    """The default preset's shape as a GPT-2 (learned positions: what from_huggingface
    converts), random weights: 32 prompts of 16–128 tokens, 128 new tokens, greedy; qkv's
    ragged generation against transformers' generate over the left-padded batch (sdpa)."""
    import transformers

    from qkv.models import GPT

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=256,
        n_embd=128,
        n_layer=4,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    ours = GPT.from_huggingface(hf_model).eval()
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (int(n),), generator=g) for n in rng.integers(16, 129, 32)]
    new, T = 128, max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :], mask[i, T - len(p) :] = p, 1
    t0 = time.perf_counter()
    together = ours.generate(prompts, new, temperature=0.0)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        theirs = hf_model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            min_new_tokens=new,
            pad_token_id=0,
        )
    t_hf = time.perf_counter() - t0
    same = sum(torch.equal(a[len(p) :], b[T:]) for a, b, p in zip(together, theirs, prompts))
    tokens = len(prompts) * new
    print(
        f"32 prompts, {new} new tokens: qkv {tokens / t_ours:.0f} tokens/s, transformers "
        f"{tokens / t_hf:.0f} tokens/s ({t_hf / t_ours:.2f}×); {same} of 32 continuations "
        "identical"
    )


def cascade(rounds: int = 30) -> None:
    """A decode step of a MultiHeadAttention (E = 384, 6 heads) for 32 requests that share
    a 1,024-token prompt (forked pages, the prefix read once: cascade) against the same
    requests each holding its own copy of the prompt (every page gathered), and against a
    contiguous KVCache."""
    torch.manual_seed(0)
    E, Hh, P, B, L = 384, 6, 16, 32, 1024
    mha = qkv.MultiHeadAttention(E, E, num_heads=Hh, causal=True, rope=qkv.RoPE(E // Hh)).eval()
    prompt, own = torch.randn(1, L, E), torch.randn(B, 8, E)
    pages = B * (L + rounds + 64) // P
    with torch.no_grad():
        shared = qkv.PagedKVCache(pages, P, Hh, E // Hh)
        first = shared.new_sequence()
        mha(prompt, cache=shared.batch([first]))
        forked = [first] + [shared.fork(first) for _ in range(B - 1)]
        copies = qkv.PagedKVCache(pages, P, Hh, E // Hh)
        separate = [copies.new_sequence() for _ in range(B)]
        mha(prompt.expand(B, -1, -1), cache=copies.batch(separate))
        contiguous = mha.new_cache(B, L + rounds + 64)
        mha(prompt.expand(B, -1, -1), cache=contiguous)
        for cache in (shared.batch(forked), copies.batch(separate), contiguous):
            mha(own, cache=cache)
        cases = {
            "cascade": shared.batch(forked),
            "gathered": copies.batch(separate),
            "contiguous": contiguous,
        }
        times: dict[str, list[float]] = {n: [] for n in cases}
        x = torch.randn(B, 1, E)
        for r in range(rounds):
            for name in list(cases) if r % 2 == 0 else list(reversed(cases)):
                t0 = time.perf_counter()
                mha(x, cache=cases[name])
                times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    print(
        f"decode step, {B} requests sharing {L} tokens: cascade {med['cascade']:.2f} ms, "
        f"every page gathered {med['gathered']:.2f} ms "
        f"({med['cascade'] / med['gathered']:.2f}×), contiguous KVCache "
        f"{med['contiguous']:.2f} ms ({med['cascade'] / med['contiguous']:.2f}×); pages held "
        f"{shared.pages_in_use} shared against {copies.pages_in_use}"
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["paged"]:
        paged()
    elif sys.argv[1:2] == ["generate"]:
        generate()
    elif sys.argv[1:2] == ["cascade"]:
        cascade()
    elif sys.argv[1:2] == ["hf"]:
        hf()
    else:
        main()
