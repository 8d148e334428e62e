"""The streaming cache (src/qkv/nn/streaming.py): attention over the first tokens and the
last window only, at the positions the attention-sink paper assigns (slots in the cache),
equal to attention computed directly over those tokens."""

import pytest
import torch

import qkv
from qkv.nn import StreamingCache


def kept(t, sinks, window):
    """The stream positions a cache holds after reading tokens 0 .. t."""
    first = list(range(min(sinks, t + 1)))
    recent = list(range(max(len(first), t + 1 - window), t + 1))
    return first + recent


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("sinks,window", [(0, 3), (1, 3), (4, 2)])
def test_each_step_equals_attention_over_the_kept_tokens(rope, sinks, window):
    """A stream of 12 tokens (a prompt of 2, then one at a time): each output equals the
    module's output computed directly over the kept tokens — the first ``sinks`` and the
    last ``window`` — each rotated at its slot in the cache (the query at the last)."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(16, 16, 4, num_kv_heads=2, causal=True,
                                 rope=qkv.RoPE(4) if rope else None).double()  # fmt: skip
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    cache = StreamingCache(1, 2, 4, window=window, sinks=sinks, rope=mha.rope,
                           dtype=torch.float64)  # fmt: skip
    with torch.no_grad():
        got = [mha(x[:, :2], cache=cache)]
        got += [mha(x[:, t : t + 1], cache=cache) for t in range(2, 12)]
        got = torch.cat(got, 1)
        saved, mha.rope = mha.rope, None
        q, k, v = mha.project(x)  # unrotated
        mha.rope = saved
        for t in range(12):
            idx = kept(t, sinks, window)
            n = len(idx)
            qt, kt = q[:, :, t : t + 1], k[:, :, idx]
            if rope:
                qt, kt = mha.rope(qt, n - 1), mha.rope(kt, 0)
            want = mha.merge(qkv.attention(qt, kt, v[:, :, idx]), like=x)
            torch.testing.assert_close(got[:, t], want[:, 0], rtol=0, atol=1e-12)
    assert (cache.length, cache.seen) == (min(12, sinks + window), 12)


def test_a_gpt_streams_past_its_context_and_equals_the_forward_within_it():
    """GPT.new_streaming_caches: within the capacity the logits equal the plain forward's;
    past the context (block_size 16) the stream goes on, 40 tokens in fixed memory."""
    from qkv.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16, positions="rope"))
    model.eval()
    ids = torch.randint(0, 256, (1, 40))
    caches = model.new_streaming_caches(1, window=12, sinks=4)
    with torch.no_grad():
        want = model(ids[:, :16])
        got = torch.cat([model(ids[:, t : t + 1], caches=caches) for t in range(16)], 1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        for t in range(16, 40):
            assert torch.isfinite(model(ids[:, t : t + 1], caches=caches)).all()
    assert caches[0].length == 16 and caches[0].seen == 40
    with pytest.raises(ValueError, match="must fit the context window"):
        model.new_streaming_caches(1, window=16, sinks=4)


def test_a_streaming_cache_says_what_it_cannot_take():
    mha = qkv.MultiHeadAttention(8, 8, 2, causal=True)
    cache = StreamingCache(1, 2, 4, window=2, sinks=1)
    with pytest.raises(ValueError, match="takes no mask"):
        mha(torch.randn(1, 2, 8), cache=cache, mask=qkv.masks.causal())
    mha(torch.randn(1, 2, 8), cache=cache)
    with pytest.raises(ValueError, match="one token at a time"):
        mha(torch.randn(1, 2, 8), cache=cache)
    with pytest.raises(ValueError, match="sinks must be an int >= 0"):
        StreamingCache(1, 2, 4, window=2, sinks=-1)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        StreamingCache(1, 2, 4, window=0)
    from qkv.models import GPTConfig

    with pytest.raises(ValueError, match="attention_sinks"):
        GPTConfig(attention="mla", attention_sinks=True)
