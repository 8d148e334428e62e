"""The production MultiHeadAttention: GQA, RoPE, KV cache, cross-attention, torch interop."""

import pytest
import torch
from torch import nn

import qkv
from qkv import masks
from tests.helpers import mha, x_
from tests.tolerances import FLOAT64

torch.manual_seed(0)


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


def test_an_input_of_another_dtype_gets_a_clear_error_not_torch_s():
    m = qkv.MultiHeadAttention(16, 16, 4)  # float32 weights
    with pytest.raises(TypeError, match="x has dtype float64 but the module's weights are float32"):
        m(torch.randn(2, 5, 16, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts for the module: allowed
        assert m(torch.randn(2, 5, 16).bfloat16()).shape == (2, 5, 16)
