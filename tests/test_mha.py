"""The production MultiHeadAttention: GQA, RoPE, KV cache, cross-attention, torch interop."""

import pytest
import torch
from tolerances import FLOAT64
from torch import nn

import qkv
from qkv import masks

torch.manual_seed(0)


def mha(**kw):
    kw = {"num_heads": 4, **kw}
    return qkv.MultiHeadAttention(kw.pop("d_in", 16), kw.pop("d_out", 16), **kw).double()


def x_(B=2, T=9, E=16, seed=1):
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ------------------------------------------------------------------ GQA and RoPE


def test_gqa_with_repeated_kv_weights_equals_mha():
    gqa = mha(num_kv_heads=2, causal=True, qkv_bias=True)
    full = mha(causal=True, qkv_bias=True)
    state = gqa.state_dict()
    for name in ("W_key.weight", "W_key.bias", "W_value.weight", "W_value.bias"):
        t = state[name]  # (H_kv · d_head, …): give each of the 2 query heads per group a copy
        state[name] = t.view(2, 4, -1).repeat_interleave(2, 0).reshape(16, *t.shape[1:])
    full.load_state_dict(state)
    torch.testing.assert_close(gqa(x_()), full(x_()), atol=FLOAT64, rtol=0)


def test_mqa_and_shapes():
    m = mha(num_kv_heads=1)
    assert m.W_key.weight.shape == (4, 16) and m(x_()).shape == (2, 9, 16)


def test_rope_is_a_rotation_that_sees_relative_positions():
    rope = qkv.RoPE(8).double()
    q, k = (
        torch.randn(2, 3, 5, 8, dtype=torch.float64),
        torch.randn(2, 3, 5, 8, dtype=torch.float64),
    )
    torch.testing.assert_close(rope(q, 7).norm(dim=-1), q.norm(dim=-1))
    shifted = rope(q, 11) @ rope(k, 11).transpose(-1, -2)
    torch.testing.assert_close(rope(q, 0) @ rope(k, 0).transpose(-1, -2), shifted)
    # Against the complex-number definition: x_j + i·x_{j+D/2} times e^{i·p·θ_j}.
    p = torch.arange(3, 8, dtype=torch.float64)
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    z = torch.complex(q[..., :4], q[..., 4:]) * torch.polar(
        torch.ones(5, 4, dtype=torch.float64), p[:, None] * theta
    )
    torch.testing.assert_close(rope(q, 3), torch.cat([z.real, z.imag], -1))
    torch.testing.assert_close(rope(q, torch.arange(3, 8)), rope(q, 3))


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda: qkv.RoPE(7), "head_dim must be even"),
        (lambda: qkv.RoPE(8, base=1.0), "base must be > 1"),
        (
            lambda: qkv.RoPE(8)(torch.zeros(2, 6)),
            "x must have shape (..., T, D) with D=8; got (2, 6)",
        ),
        (
            lambda: qkv.RoPE(8)(torch.zeros(3, 8), torch.arange(4)),
            "positions must have shape (T,) = (3,)",
        ),
        (lambda: mha(num_kv_heads=3), "num_heads must be a multiple of num_kv_heads"),
        (lambda: mha(rope=qkv.RoPE(8)), "rope must have head_dim = d_out / num_heads = 4; got 8"),
        (lambda: mha(rope=qkv.RoPE(4))(x_(), x_()), "rope and cache apply to self-attention"),
        (lambda: mha()(x_(), x_(B=3)), "context must have the layout and batch of x"),
    ],
)
def test_mha_errors(make, words):
    with pytest.raises(ValueError) as info:
        make()
    assert words in str(info.value)


# ------------------------------------------------------------------ KV cache


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


# ------------------------------------------------------------------ cross-attention and masks


def test_cross_attention_with_its_own_width():
    m = mha(d_kv=6)
    x, ctx = x_(T=5), x_(T=7, E=6)
    q, k, v = m.project(x, ctx)
    assert (q.shape, k.shape) == ((2, 4, 5, 4), (2, 4, 7, 4))
    want = m.merge(qkv.attention(q, k, v, mask=masks.padding([7, 3])), like=x)
    torch.testing.assert_close(m(x, ctx, mask=masks.padding([7, 3])), want)


def test_cross_attention_with_same_input_is_self_attention():
    m = mha()
    torch.testing.assert_close(m(x_(), x_()), m(x_()))


# ------------------------------------------------------------------ torch.nn.MultiheadAttention


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_equals_torch(batch_first, bias):
    t = nn.MultiheadAttention(16, 4, bias=bias, batch_first=batch_first).double().eval()
    ours = qkv.MultiHeadAttention.from_torch(t).eval()
    x = x_(T=7)
    kpm = torch.tensor([[False] * 7, [False] * 5 + [True] * 2])  # True = padding, torch's way
    am = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)  # True = blocked
    xt = x if batch_first else x.transpose(0, 1)
    want, _ = t(xt, xt, xt, key_padding_mask=kpm, attn_mask=am)
    want = want if batch_first else want.transpose(0, 1)
    got = ours(x, mask=masks.from_torch(key_padding_mask=kpm, attn_mask=am))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        ours(x, mask=masks.causal() & masks.padding([7, 5])), want, atol=1e-12, rtol=0
    )


def test_from_torch_float_and_per_head_masks_and_kdim():
    t = nn.MultiheadAttention(16, 4, kdim=6, vdim=6, batch_first=True).double().eval()
    ours = qkv.MultiHeadAttention.from_torch(t).eval()
    x, ctx = x_(T=5), x_(T=7, E=6)
    am = torch.where(torch.rand(2 * 4, 5, 7) < 0.3, float("-inf"), 0.0).double()
    am[..., 0] = 0.0  # no fully masked row
    want, _ = t(x, ctx, ctx, attn_mask=am)
    got = ours(x, ctx, mask=masks.from_torch(attn_mask=am, num_heads=4))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_to_torch_round_trip(num_kv_heads):
    ours = mha(num_kv_heads=num_kv_heads, qkv_bias=True).eval()
    t = ours.to_torch(batch_first=True).eval()
    x = x_()
    torch.testing.assert_close(t(x, x, x, need_weights=False)[0], ours(x), atol=1e-12, rtol=0)
    back = qkv.MultiHeadAttention.from_torch(t).eval()
    torch.testing.assert_close(back(x), ours(x), atol=1e-12, rtol=0)


def test_interop_errors():
    with pytest.raises(ValueError, match="add_bias_kv and add_zero_attn"):
        qkv.MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="no rotary embedding"):
        mha(rope=qkv.RoPE(4)).to_torch()
    with pytest.raises(ValueError, match="holds additive biases other than 0 and -inf"):
        masks.from_torch(attn_mask=torch.full((3, 3), -1e9))
    with pytest.raises(ValueError, match="needs num_heads dividing 6"):
        masks.from_torch(attn_mask=torch.zeros(6, 3, 3, dtype=torch.bool))
    assert masks.from_torch() is None


def test_rope_frequencies_are_not_saved_with_the_weights():
    # A buffer recomputed from head_dim and base: checkpoints hold weights only.
    mha = qkv.MultiHeadAttention(16, 16, num_heads=2, rope=qkv.RoPE(8))
    assert not any("inv_freq" in name for name in mha.state_dict())
    assert list(qkv.RoPE(8).state_dict()) == []
