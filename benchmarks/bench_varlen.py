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
of 16 tokens, memory against a contiguous cache of batch × max; a decode step's attention
over their pages (read in place by ``qkv.paged_attention``, or gathered first, or SDPA over a
contiguous padded copy); and one decode step of a MultiHeadAttention (E = 384, 6 heads: the
default GPT preset's shape) over 8 sequences of 1,024 cached tokens, on a paged batch against
a KVCache.
"""

import argparse
import copy
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
    D = E // Hh
    pool = qkv.PagedKVCache(4096, P, Hh, D)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in ns:
        seqs.append(pool.new_sequence())
        pool.append([seqs[-1]], torch.randn(1, Hh, n, D, generator=g), torch.randn(1, Hh, n, D))
    held, contiguous = pool.pages_in_use * P, len(ns) * max(ns)
    print(
        f"32 sequences, {sum(ns)} tokens: paged holds {held} token slots "
        f"({held / sum(ns):.3f}× the tokens), a contiguous cache {contiguous} "
        f"({contiguous / sum(ns):.2f}×)"
    )
    _paged_attention(pool, seqs, rounds)
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(E, E, num_heads=Hh, causal=True).eval()
    B, L = 8, 1024
    prompt = torch.randn(B, L, E)
    kv = mha.new_cache(B, L + rounds + 8)
    pages = qkv.PagedKVCache(B * (L + rounds + 8) // P + B, P, Hh, D)
    seqs = [pages.new_sequence() for _ in range(B)]
    with torch.no_grad():
        mha(prompt, cache=kv), mha(prompt, cache=pages.batch(seqs))
        times: dict[str, list[float]] = {"contiguous": [], "paged": []}
        x = torch.randn(B, 1, E)
        for r in range(rounds):
            cases = (("contiguous", lambda: kv), ("paged", lambda: pages.batch(seqs)))
            for name, cache in cases[:: 1 if r % 2 else -1]:
                t0 = time.perf_counter()
                mha(x, cache=cache())
                times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(
        f"MultiHeadAttention decode step, B={B}, {L} cached: contiguous KVCache "
        f"{med['contiguous'] * 1e3:.2f} ms, paged {med['paged'] * 1e3:.2f} ms "
        f"({med['paged'] / med['contiguous']:.2f}×)"
    )


def _paged_attention(pool, seqs, rounds: int) -> None:
    """One decode step's attention over the 32 ragged sequences' pages (H = 6, D = 64):
    read in place by ``qkv.paged_attention``, against gathering the pages first
    (``PagedKVCache.gather`` + ``qkv.attention`` with a padding mask) and against SDPA over
    a contiguous padded copy with a dense mask (the copy made outside the timing)."""
    print("| dtype | in place (paged_attention) | gather + attention | SDPA, contiguous |")
    print("|---|---|---|---|")
    B, H = len(seqs), pool.keys.shape[0]
    tables, lengths = pool.block_tables(seqs)
    k_contig, v_contig, _ = pool.gather(seqs)
    k_contig, v_contig = k_contig.clone(), v_contig.clone()
    valid = torch.arange(k_contig.shape[2])[None, :] < lengths[:, None]  # (B, L)
    for dtype in (torch.float32, torch.bfloat16):
        src = pool if dtype == torch.float32 else _cast(pool, dtype)
        kp, vp = src.pages()
        q = torch.randn(B, H, pool.keys.shape[3]).to(dtype)
        kc, vc = k_contig.to(dtype), v_contig.to(dtype)
        mask = qkv.masks.padding(lengths)
        cases = {
            "in place": lambda: qkv.paged_attention(q, kp, vp, tables, lengths),
            "gather": lambda: qkv.attention(q[:, :, None], *src.gather(seqs)[:2], mask=mask),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q[:, :, None], kc, vc, attn_mask=valid[:, None, None]
            ),
        }
        with torch.no_grad():
            med = {n: t * 1e3 for n, t in _rounds(cases, rounds)[0].items()}
        print(
            f"| {str(dtype).removeprefix('torch.')} | {med['in place']:.2f} ms | "
            f"{med['gather']:.2f} ms ({med['gather'] / med['in place']:.2f}×) | "
            f"{med['sdpa']:.2f} ms ({med['sdpa'] / med['in place']:.2f}×) |"
        )


def _cast(pool, dtype):
    """A copy of the pool (same sequences and pages) in another dtype."""
    other = copy.copy(pool)
    other.keys, other.values = pool.keys.to(dtype), pool.values.to(dtype)
    other._scratch = {}
    return other


def generate(rounds: int = 3) -> None:
    """32 prompts of 16–128 tokens (the default preset's window is 256), 128 new tokens each,
    greedy, on the default preset's untrained GPT: decoded together (a list of prompts:
    packed prefill, the paged cache) against one at a time (each on its own contiguous
    cache). Medians of interleaved rounds."""
    from qkv.models import GPT
    from qkv.training import PRESETS

    torch.manual_seed(0)
    model = GPT(PRESETS["cpu-10min"][0]).eval()
    prompts = _prompts(low=0)
    new = 128
    cases = {
        "together": lambda: model.generate(prompts, new, temperature=0.0),
        "alone": lambda: [model.generate(p[None], new, temperature=0.0)[0] for p in prompts],
    }
    med, outs = _rounds(cases, rounds)
    same = all(torch.equal(a, b) for a, b in zip(outs["together"], outs["alone"]))
    tokens = len(prompts) * new
    print(
        f"32 prompts, {new} new tokens each: together {tokens / med['together']:.0f} tokens/s, "
        f"one at a time {tokens / med['alone']:.0f} tokens/s "
        f"({med['alone'] / med['together']:.2f}×); same tokens: {same}"
    )


def hf(rounds: int = 9) -> None:
    """The default preset's shape as a GPT-2 (learned positions: what from_huggingface
    converts), random weights: 32 prompts of 16–128 tokens, 128 new tokens, greedy; qkv's
    ragged generation against transformers' generate over the left-padded batch (sdpa).
    Medians of interleaved rounds."""
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
    prompts = _prompts(low=1)
    new, T = 128, max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :], mask[i, T - len(p) :] = p, 1

    def theirs():
        with torch.no_grad():
            return hf_model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=False,
                min_new_tokens=new,
                pad_token_id=0,
            )

    cases = {"qkv": lambda: ours.generate(prompts, new, temperature=0.0), "hf": theirs}
    med, outs = _rounds(cases, rounds)
    same = sum(torch.equal(a[len(p) :], b[T:]) for a, b, p in zip(outs["qkv"], outs["hf"], prompts))
    tokens = len(prompts) * new
    print(
        f"32 prompts, {new} new tokens: qkv {tokens / med['qkv']:.0f} tokens/s, transformers "
        f"{tokens / med['hf']:.0f} tokens/s ({med['hf'] / med['qkv']:.2f}×); {same} of 32 "
        "continuations identical"
    )


def _prompts(low: int) -> list[torch.Tensor]:
    """32 prompts of 16–128 random tokens (low..255), seed 0."""
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    return [torch.randint(low, 256, (int(n),), generator=g) for n in rng.integers(16, 129, 32)]


def _rounds(cases, rounds: int):
    """Median seconds of each case over interleaved rounds (after one warm-up), and each
    case's last output."""
    times: dict[str, list[float]] = {n: [] for n in cases}
    outs = {}
    for r in range(rounds + 1):
        for name in list(cases) if r % 2 == 0 else list(reversed(cases)):
            t0 = time.perf_counter()
            outs[name] = cases[name]()
            if r:
                times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}, outs


def cascade(rounds: int = 30) -> None:
    """A decode step of a MultiHeadAttention (E = 384, 6 heads) for 32 requests that share
    a 1,024-token prompt (forked pages, the prefix read once: cascade) against the same
    requests each holding its own copy of the prompt (each reads its own pages, in place),
    and against a contiguous KVCache."""
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
            "cascade": lambda: shared.batch(forked),
            "own copies": lambda: copies.batch(separate),
            "contiguous": lambda: contiguous,
        }
        x = torch.randn(B, 1, E)
        steps = {n: (lambda c=c: mha(x, cache=c())) for n, c in cases.items()}
        med = {n: t * 1e3 for n, t in _rounds(steps, rounds)[0].items()}
    print(
        f"decode step, {B} requests sharing {L} tokens: cascade {med['cascade']:.2f} ms, "
        f"each its own copy {med['own copies']:.2f} ms "
        f"({med['cascade'] / med['own copies']:.2f}×), contiguous KVCache "
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
