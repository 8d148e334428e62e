"""qkv.PagedKVCache: pages taken as sequences grow and given back when they end; equal to
the contiguous KVCache through MultiHeadAttention and the GPT; ragged sequences attended
from their pages equal each sequence attended alone."""

import pytest
import torch

import qkv
from qkv.models import GPT, GPTConfig


def pool(num_pages=16, page_size=4, H_kv=2, D=8, dtype=torch.float64):
    return qkv.PagedKVCache(num_pages, page_size, H_kv, D, dtype=dtype)


def test_pages_are_taken_as_needed_and_reused_after_free():
    p = pool(num_pages=6, page_size=4)
    a, b = p.new_sequence(), p.new_sequence()
    assert p.pages_in_use == 0  # an empty sequence holds no page
    p.append([a, b], torch.randn(2, 2, 5, 8, dtype=torch.float64), torch.randn(2, 2, 5, 8).double())
    assert p.pages_in_use == 4 and p.tokens == 10
    p.append([a], torch.randn(1, 2, 3, 8).double(), torch.randn(1, 2, 3, 8).double())
    assert p.block_table(a)[:2] != p.block_table(b)[:2] and len(p.block_table(a)) == 2
    freed = set(p.block_table(a))
    p.free(a)
    assert p.pages_in_use == 2
    c = p.new_sequence()
    p.append([c], torch.randn(1, 2, 8, 8).double(), torch.randn(1, 2, 8, 8).double())
    assert set(p.block_table(c)) == freed  # a's pages, reused
    with pytest.raises(KeyError, match="no live sequence"):
        p.block_table(a)


def test_a_full_pool_is_an_error_never_a_truncation():
    p = pool(num_pages=2, page_size=4)
    a = p.new_sequence()
    p.append([a], torch.randn(1, 2, 6, 8).double(), torch.randn(1, 2, 6, 8).double())
    with pytest.raises(ValueError, match="PagedKVCache full: .* needs 1 more pages of 4 tokens; 0"):
        p.append([a], torch.randn(1, 2, 3, 8).double(), torch.randn(1, 2, 3, 8).double())
    assert p.lengths([a]).tolist() == [6]  # nothing stored


def test_gather_returns_each_sequence_up_to_its_length():
    p = pool(page_size=3)
    seqs = [p.new_sequence() for _ in range(3)]
    want_k = {s: [] for s in seqs}
    g = torch.Generator().manual_seed(0)
    for step, T in enumerate([4, 1, 5]):
        batch = seqs[: 3 - step % 2]  # sequences grow unevenly
        k = torch.randn(len(batch), 2, T, 8, generator=g, dtype=torch.float64)
        p.append(batch, k, k + 1)
        for b, s in enumerate(batch):
            want_k[s].append(k[b])
    k, v, lengths = p.gather(seqs)
    for b, s in enumerate(seqs):
        n = int(lengths[b])
        assert torch.equal(k[b, :, :n], torch.cat(want_k[s], dim=1))
        assert torch.equal(v[b, :, :n], torch.cat(want_k[s], dim=1) + 1)


def test_ragged_decoding_from_pages_equals_each_sequence_alone():
    """A batch of sequences of different lengths, one new query each: attention over the
    gathered pages with a padding mask equals attending each sequence's keys alone."""
    p = pool(page_size=4)
    g = torch.Generator().manual_seed(1)
    lengths = [3, 9, 6]
    seqs = [p.new_sequence() for _ in lengths]
    keys = [torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in lengths]
    for s, k in zip(seqs, keys):
        p.append([s], k, 2 * k)
    k, v, held = p.gather(seqs)
    q = torch.randn(3, 4, 1, 8, generator=g, dtype=torch.float64)
    out = qkv.attention(q, k, v, mask=qkv.masks.padding(held))
    for b, kb in enumerate(keys):
        alone = qkv.attention(q[b : b + 1], kb, 2 * kb)
        assert (out[b : b + 1] - alone).abs().max() < 1e-12


def test_multi_head_attention_decodes_the_same_on_either_cache():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(
        16, 16, num_heads=4, num_kv_heads=2, causal=True, rope=qkv.RoPE(4)
    ).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    contiguous = mha.new_cache(2, 32)
    p = qkv.PagedKVCache(8, 4, 2, 4, dtype=torch.float64)
    paged = p.batch([p.new_sequence(), p.new_sequence()])
    for chunk in (x[:, :5], x[:, 5:6], x[:, 6:11]):  # a prefill, a step, a chunk
        a = mha(chunk, cache=contiguous)
        b = mha(chunk, cache=paged)
        assert (a - b).abs().max() < 1e-12
    assert paged.length == contiguous.length == 11


def test_gpt_generates_the_same_tokens_on_paged_caches():
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=40,
            block_size=32,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=16,
            positions="rope",
        )
    ).eval()
    idx = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(2))
    want = model.generate(idx, 8, temperature=0.0)
    caches = model.new_paged_caches(num_pages=8, page_size=4)
    seqs = [caches.new_sequence() for _ in range(2)]
    batch = caches.batch(seqs)
    with torch.no_grad():
        logits = model(idx, caches=batch)
        out = idx
        for _ in range(8):
            token = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, token], dim=1)
            logits = model(token, caches=batch)
    assert torch.equal(out, want)
    assert caches.pages_in_use == 2 * 2 * 4  # 2 layers × 2 sequences × ceil(14 / 4) pages
    for s in seqs:
        caches.free(s)
    assert caches.pages_in_use == 0


def test_bad_appends_are_refused():
    p = pool()
    a = p.new_sequence()
    with pytest.raises(ValueError, match=r"\(B, H_kv, T, D\) with B=1 sequences, H_kv=2"):
        p.append([a], torch.randn(1, 3, 2, 8).double(), torch.randn(1, 3, 2, 8).double())
    with pytest.raises(TypeError, match="float32 on cpu but the pool holds torch.float64"):
        p.append([a], torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    with pytest.raises(ValueError, match="appears twice"):
        p.append([a, a], torch.randn(2, 2, 2, 8).double(), torch.randn(2, 2, 2, 8).double())
    with pytest.raises(ValueError, match="num_pages must be an int >= 1"):
        qkv.PagedKVCache(0, 4, 2, 8)
    b = p.new_sequence()
    p.append([a], torch.randn(1, 2, 2, 8).double(), torch.randn(1, 2, 2, 8).double())
    with pytest.raises(ValueError, match="different numbers of tokens"):
        _ = p.batch([a, b]).length


def small_gpt(positions="rope"):
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab_size=40,
            block_size=48,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=16,
            positions=positions,
        )
    ).eval()


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_ragged_prompts_generate_the_same_greedy_tokens_as_each_alone(positions):
    model = small_gpt(positions)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 40, (n,), generator=g) for n in (3, 11, 1, 7)]
    got = model.generate(prompts, 9, temperature=0.0)
    for prompt, out in zip(prompts, got):
        alone = model.generate(prompt[None], 9, temperature=0.0)[0]
        assert torch.equal(out, alone)


def test_each_prompt_stops_at_its_own_end_token_while_the_others_go_on():
    model = small_gpt()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 40, (n,), generator=g) for n in (4, 6, 2)]
    full = model.generate(prompts, 10, temperature=0.0)
    stop = int(full[1][len(prompts[1]) + 2])  # prompt 1's third new token
    got = model.generate(prompts, 10, temperature=0.0, stop_token=stop)
    for prompt, whole, out in zip(prompts, full, got):
        new = whole[len(prompt) :].tolist()
        end = new.index(stop) + 1 if stop in new else len(new)
        assert torch.equal(out, whole[: len(prompt) + end])  # cut at its own stop token
    assert len(got[1]) < len(full[1])  # prompt 1 stopped early


def test_sampling_is_reproducible_from_a_generator():
    model = small_gpt()
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    runs = [
        model.generate(prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(9))
        for _ in range(2)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_requests_join_between_steps_and_pages_are_reused():
    from qkv.serving import Batcher

    model = small_gpt()
    batcher = Batcher(model, num_pages=6, page_size=4)
    a = batcher.add(torch.tensor([1, 2, 3, 4, 5]), max_new_tokens=3)
    batcher.step()
    b = batcher.add(torch.tensor([7, 8]), max_new_tokens=5)  # joins mid-way
    batcher.run()
    for rid, prompt, new in ((a, [1, 2, 3, 4, 5], 3), (b, [7, 8], 5)):
        alone = model.generate(torch.tensor([prompt]), new, temperature=0.0)[0]
        assert torch.equal(batcher.result(rid), alone)
    assert batcher.caches.pages_in_use == 0  # every page back in the pool
    with pytest.raises(ValueError, match="exceed the context window of 48"):
        batcher.add(torch.zeros(40, dtype=torch.long), max_new_tokens=9)
    with pytest.raises(ValueError, match="PagedKVCache full"):
        for _ in range(4):
            batcher.add(torch.zeros(20, dtype=torch.long), max_new_tokens=1)


def test_forked_sequences_share_full_pages_counted_and_copy_the_last():
    p = pool(num_pages=12, page_size=4)
    a = p.new_sequence()
    p.append([a], torch.randn(1, 2, 10, 8).double(), torch.randn(1, 2, 10, 8).double())
    b = p.fork(a)
    assert p.block_table(b)[:2] == p.block_table(a)[:2]  # the full pages, shared
    assert p.block_table(b)[2] != p.block_table(a)[2]  # the partly filled one, copied
    k, v, _ = p.gather([a, b])
    assert torch.equal(k[0], k[1]) and torch.equal(v[0], v[1])
    assert p.shared_prefix([a, b]) == 2 and p.pages_in_use == 4
    p.free(a)
    assert p.pages_in_use == 3  # the shared pages stay: b holds them
    p.free(b)
    assert p.pages_in_use == 0


@pytest.mark.parametrize("suffix", [0, 5])
def test_cascade_attention_equals_attention_over_prefix_and_suffix(suffix):
    g = torch.Generator().manual_seed(6)
    B, H, H_kv, L_p, D = 3, 4, 2, 17, 8
    q = torch.randn(B, H, 2, D, generator=g, dtype=torch.float64)
    pk, pv = (torch.randn(H_kv, L_p, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, H_kv, suffix, D, generator=g, dtype=torch.float64) for _ in range(2))
    xs = [x.clone().requires_grad_() for x in (q, pk, pv, k, v)]
    out, lse = qkv.cascade_attention(*xs, return_lse=True)
    ys = [x.clone().requires_grad_() for x in (q, pk, pv, k, v)]
    whole_k = torch.cat([ys[1].expand(B, -1, -1, -1), ys[3]], dim=2)
    whole_v = torch.cat([ys[2].expand(B, -1, -1, -1), ys[4]], dim=2)
    want, want_lse = qkv.attention(ys[0], whole_k, whole_v, return_lse=True, backend="reference")
    assert (out - want).abs().max() < 1e-12 and (lse - want_lse).abs().max() < 1e-12
    gout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got_g = torch.autograd.grad((out * gout).sum(), xs, allow_unused=True)
    want_g = torch.autograd.grad((want * gout).sum(), ys, allow_unused=True)
    for a, b in zip(got_g, want_g):
        assert (a is None and (b is None or not b.any())) or (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("T", [1, 3])  # a decode step, a chunk
def test_shared_prefixes_nested_are_read_once_and_equal_each_alone(monkeypatch, dtype, sinks, T):
    torch.manual_seed(0)
    mha = (
        qkv.MultiHeadAttention(
            16, 16, num_heads=4, num_kv_heads=2, causal=True, rope=qkv.RoPE(4), sinks=sinks
        )
        .to(dtype)
        .eval()
    )
    if sinks:
        torch.nn.init.normal_(mha.sinks)
    p = qkv.PagedKVCache(40, 4, 2, 4, dtype=dtype)
    g = torch.Generator().manual_seed(7)

    def x_(n):
        return torch.randn(1, n, 16, generator=g, dtype=torch.float64).to(dtype)

    prompt, more = x_(13), x_(7)  # a system prompt for all; more of it for two
    history = {}
    with torch.no_grad():
        first = p.new_sequence()
        mha(prompt, cache=p.batch([first]))
        late = [p.fork(first), p.fork(first)]  # at 13 tokens: 3 full pages shared
        mha(more, cache=p.batch([first]))
        seqs = [first, p.fork(first), *late]  # the second shares 5 full pages with the first
        own = [x_(n) for n in (1, 3, 2, 4)]
        for i, (s, x) in enumerate(zip(seqs, own)):
            mha(x, cache=p.batch([s]))
            history[i] = [prompt, more, x] if i < 2 else [prompt, x]
        step = torch.randn(4, T, 16, generator=g, dtype=torch.float64).to(dtype)
        read = []
        real = qkv.serving.batch._shared
        monkeypatch.setattr(
            qkv.serving.batch,
            "_shared",
            lambda q, pool, pages: read.append(len(pages)) or real(q, pool, pages),
        )
        got = mha(step, cache=p.batch(seqs))
        assert sorted(read) == [2, 3]  # the 3 pages all share, the 2 more the first two share
        for b in range(4):
            alone = mha.new_cache(1, 40)
            for x in history[b]:
                mha(x, cache=alone)
            want = mha(step[b : b + 1], cache=alone)
            assert (got[b : b + 1] - want).abs().max() < (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_packed_prefill_equals_each_prompt_alone_and_fills_its_pages(causal, sinks):
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(
        16, 16, num_heads=4, num_kv_heads=2, causal=causal, rope=qkv.RoPE(4), sinks=sinks
    ).double()
    if sinks:
        torch.nn.init.normal_(mha.sinks)
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 9, 4]
    prompts = [torch.randn(1, n, 16, generator=g, dtype=torch.float64) for n in lengths]
    p = pool(num_pages=16, page_size=4, D=4)
    seqs = [p.new_sequence() for _ in lengths]
    with torch.no_grad():
        got = mha(torch.cat(prompts, dim=1), cache=p.packed(seqs, lengths))
        step = torch.randn(4, 1, 16, generator=g, dtype=torch.float64)
        after = mha(step, cache=p.batch(seqs))  # a decode step on the pages it filled
    assert p.lengths(seqs).tolist() == [n + 1 for n in lengths]
    starts = [0, 5, 6, 15]
    for b, (x, n, s0) in enumerate(zip(prompts, lengths, starts)):
        alone = mha.new_cache(1, 16)
        want = mha(x, cache=alone)
        assert (got[:, s0 : s0 + n] - want).abs().max() < 1e-12
        assert (after[b : b + 1] - mha(step[b : b + 1], cache=alone)).abs().max() < 1e-12


def test_packed_prefill_refusals():
    mha = qkv.MultiHeadAttention(16, 16, num_heads=4, num_kv_heads=2, causal=True).double()
    p = pool(num_pages=16, page_size=4, D=4)
    a, b = p.new_sequence(), p.new_sequence()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="takes 5 tokens; got 6"):
        mha(x, cache=p.packed([a, b], [2, 3]))
    with pytest.raises(ValueError, match="takes no layout, context, mask or dropout"):
        mha(x, cache=p.packed([a, b], [2, 4]), mask=qkv.masks.causal())
    with pytest.raises(ValueError, match="one length >= 1 per sequence"):
        p.packed([a, b], [6, 0])
    p.append([a], torch.randn(1, 2, 3, 4).double(), torch.randn(1, 2, 3, 4).double())
    with pytest.raises(ValueError, match="these already hold"):
        p.packed([a, b], [2, 4])
    with pytest.raises(ValueError, match="attended per sequence"):
        p.packed([b], [2]).append(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    model = small_gpt()
    caches = model.new_paged_caches(8, 4)
    seqs = [caches.new_sequence() for _ in range(2)]
    with pytest.raises(ValueError, match=r"a packed prefill takes idx \(1, total\)"):
        model(torch.zeros(2, 3, dtype=torch.long), caches=caches.packed(seqs, [3, 3]))


def test_the_layers_of_a_model_share_one_book_of_pages():
    model = small_gpt()
    caches = model.new_paged_caches(num_pages=8, page_size=4)
    a = caches.new_sequence()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5, 6]]), caches=caches.batch([a]))
    child = caches.fork(a)  # a full page shared, the partly filled second copied per layer
    tables = [pool.block_table(child) for pool in caches.pools]
    assert tables[0] == tables[1] and tables[0][0] == caches.pools[0].block_table(a)[0]
    for layer in caches.pools:
        copied, source = tables[0][1], layer.block_table(a)[1]
        assert torch.equal(layer.keys[:, copied, :2], layer.keys[:, source, :2])
    batch = caches.batch([a])
    batch[0].store(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(ValueError, match="went out of step"):
        batch[1].store(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="empty pools of one number and size of pages"):
        qkv.serving.PagedCaches([pool(num_pages=4), pool(num_pages=5)])
