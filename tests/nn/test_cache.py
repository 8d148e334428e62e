"""The KV cache (qkv.KVCache): cached decoding equals the full forward pass, and its errors."""

import pytest
import torch

import qkv
from qkv import masks
from tests.helpers import mha, x_
from tests.tolerances import FLOAT64


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("chunk", [1, 3])
def test_cached_decoding_equals_full_forward(rope, num_kv_heads, chunk):
    m = mha(num_kv_heads=num_kv_heads, causal=True, rope=qkv.RoPE(4) if rope else None)
    x = x_(T=10)
    full = m(x)
    cache = m.new_cache(batch=2, max_len=10)
    parts = [m(x[:, i : i + chunk], cache=cache) for i in range(0, 10, chunk)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=FLOAT64, rtol=0)
    assert cache.length == 10


def test_cached_decoding_with_a_sliding_window():
    m = mha(causal=True, rope=qkv.RoPE(4))
    x = x_(T=12)
    window = masks.sliding_window(4)
    full = m(x, mask=window)
    cache = m.new_cache(2, 12)
    steps = torch.cat([m(x[:, i : i + 1], mask=window, cache=cache) for i in range(12)], 1)
    torch.testing.assert_close(steps, full, atol=FLOAT64, rtol=0)


def test_cache_errors():
    cache = qkv.KVCache(2, 2, max_len=4, head_dim=3)
    with pytest.raises(
        ValueError,
        match=r"key must have shape \(B, H_kv, T, D\) with B=2, H_kv=2, D=3; got \(2, 1, 1, 3\)",
    ):
        cache.append(torch.zeros(2, 1, 1, 3), torch.zeros(2, 1, 1, 3))
    with pytest.raises(
        TypeError, match="key is torch.float64 on cpu but the cache holds torch.float32"
    ):
        cache.append(torch.zeros(2, 2, 1, 3, dtype=torch.float64), torch.zeros(2, 2, 1, 3))
    with pytest.raises(ValueError, match="value must have T=2 tokens like key; got 1"):
        cache.append(torch.zeros(2, 2, 2, 3), torch.zeros(2, 2, 1, 3))
    cache.append(torch.zeros(2, 2, 4, 3), torch.zeros(2, 2, 4, 3))
    with pytest.raises(
        ValueError,
        match="KVCache overflow: appending T=1 tokens to 4 cached would exceed max_len=4",
    ):
        cache.append(torch.zeros(2, 2, 1, 3), torch.zeros(2, 2, 1, 3))
    cache.reset()
    assert cache.length == 0 and "length=0" in repr(cache)
    with pytest.raises(ValueError, match="max_len must be an int >= 1; got 0"):
        qkv.KVCache(1, 1, 0, 4)
