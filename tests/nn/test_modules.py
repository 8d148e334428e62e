"""The tutorial stages and the modules: identities that would catch a real bug."""

import numpy as np
import pytest
import torch
from torch import nn

import qkv
from qkv import masks
from tests.helpers import oracle
from tests.tolerances import FLOAT64


def functional_with_same_weights(module, x, mask=None):
    q, k, v = module.W_query(x), module.W_key(x), module.W_value(x)
    return qkv.attention(q, k, v, mask=mask)


@pytest.mark.parametrize("shape", [(7, 4), (3, 7, 4)])
def test_self_attention_equals_functional(shape):
    x = torch.randn(*shape, dtype=torch.float64)
    sa = qkv.learn.SelfAttention(4, 3, qkv_bias=True).double()
    torch.testing.assert_close(sa(x), functional_with_same_weights(sa, x))
    ca = qkv.learn.CausalAttention(4, 3).double()
    torch.testing.assert_close(ca(x), functional_with_same_weights(ca, x, masks.causal()))


def test_cross_attention_with_same_input_equals_self_attention():
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    torch.manual_seed(0)
    sa = qkv.learn.SelfAttention(4, 3).double()
    torch.manual_seed(0)
    ca = qkv.learn.CrossAttention(4, 3).double()
    torch.testing.assert_close(ca(x, x), sa(x))


def test_cross_attention_other_width_and_length():
    ca = qkv.learn.CrossAttention(4, 3, d_kv=5).double()
    x_q, x_kv = torch.randn(2, 6, 4, dtype=torch.float64), torch.randn(2, 9, 5, dtype=torch.float64)
    out = ca(x_q, x_kv, mask=masks.padding([9, 4]))
    want = qkv.numpy.attention(
        ca.W_query(x_q).detach().numpy(),
        ca.W_key(x_kv).detach().numpy(),
        ca.W_value(x_kv).detach().numpy(),
        mask=masks.padding([9, 4]),
    )
    np.testing.assert_allclose(out.detach().numpy(), want, atol=FLOAT64)


def test_multi_head_attention_equals_heads_done_by_hand():
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mha = qkv.MultiHeadAttention(8, 12, num_heads=3, causal=True, qkv_bias=True).double()
    q, k, v = (W(x).view(2, 5, 3, 4).transpose(1, 2) for W in (mha.W_query, mha.W_key, mha.W_value))
    heads = [
        qkv.numpy.attention(
            q[:, h].detach().numpy(),
            k[:, h].detach().numpy(),
            v[:, h].detach().numpy(),
            mask=masks.causal(),
        )
        for h in range(3)
    ]
    want = mha.out_proj(torch.from_numpy(np.concatenate(heads, axis=-1)))
    torch.testing.assert_close(mha(x), want, atol=FLOAT64, rtol=0)
    torch.testing.assert_close(mha(x[0]), mha(x)[0])  # (T, E) input
    assert mha.out_proj.bias is not None


def test_wrapper_heads_are_independent_self_attentions():
    x = torch.randn(5, 4)
    w = qkv.learn.MultiHeadAttentionWrapper(4, 3, num_heads=2, causal=True)
    torch.testing.assert_close(w(x), torch.cat([w.heads[0](x), w.heads[1](x)], -1))
    assert w(x).shape == (5, 6)


def test_module_masks_combine_with_causal():
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    mha = qkv.MultiHeadAttention(4, 4, num_heads=2, causal=True).double()
    pad = masks.padding([6, 3])
    dense = pad.dense(2, 1, 6, 6)[:, 0]  # (B, T, T) bool
    torch.testing.assert_close(mha(x, mask=pad), mha(x, mask=dense))
    sa = qkv.learn.SelfAttention(4, 4, causal=True).double()
    torch.testing.assert_close(sa(x, mask=pad), sa(x, mask=dense))


def test_dropout_only_in_training():
    x = torch.randn(2, 16, 8)
    mha = qkv.MultiHeadAttention(8, 8, num_heads=2, dropout=0.5)
    mha.eval()
    torch.testing.assert_close(mha(x), mha(x), atol=0, rtol=0)
    mha.train()
    assert not torch.equal(mha(x), mha(x))


def test_gradients_reach_every_weight():
    mha = qkv.MultiHeadAttention(4, 6, num_heads=2, causal=True)
    mha(torch.randn(2, 5, 4)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mha.parameters())


def test_weights_created_in_the_seeds_order():
    torch.manual_seed(3)
    mha = qkv.MultiHeadAttention(4, 6, num_heads=2)
    torch.manual_seed(3)
    expected = [nn.Linear(4, 6, bias=False) for _ in range(3)] + [nn.Linear(6, 6)]
    for ours, theirs in zip((mha.W_query, mha.W_key, mha.W_value, mha.out_proj), expected):
        assert torch.equal(ours.weight, theirs.weight)


@pytest.mark.parametrize(
    "make,x,exc,words",
    [
        (
            lambda: qkv.MultiHeadAttention(4, 6, num_heads=4),
            None,
            ValueError,
            "d_out must be a multiple of num_heads; got d_out=6, num_heads=4",
        ),
        (
            lambda: qkv.learn.SelfAttention(4, 2),
            torch.randn(5, 3),
            ValueError,
            "x must have shape (T, E) or (B, T, E) with E=4; got (5, 3)",
        ),
        (
            lambda: qkv.MultiHeadAttention(4, 4, 2),
            torch.randn(1, 2, 5, 4),
            ValueError,
            "x must have shape (T, E) or (B, T, E) with E=4; got (1, 2, 5, 4)",
        ),
        (
            lambda: qkv.learn.CrossAttention(4, 2, d_kv=3),
            (torch.randn(5, 4), torch.randn(5, 4)),
            ValueError,
            "x_k must have shape (T, E) or (B, T, E) with E=3; got (5, 4)",
        ),
    ],
)
def test_module_errors(make, x, exc, words):
    with pytest.raises(exc) as info:
        module = make()
        module(*x) if isinstance(x, tuple) else module(x)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: qkv.learn.CausalAttention(4, 3, dropout=0.5),
        lambda: qkv.learn.SelfAttention(4, 3, causal=True, dropout=0.5),
        lambda: qkv.MultiHeadAttention(4, 4, 2, causal=True, dropout=0.5),
        lambda: qkv.learn.MultiHeadAttentionWrapper(4, 2, 2, causal=True, dropout=0.5),
    ],
)
def test_causal_modules_in_training_do_not_see_the_future(make):
    torch.manual_seed(0)
    module = make().double().train()
    x = torch.randn(2, 7, 4, dtype=torch.float64)
    x2 = x.clone()
    x2[:, -1] += 10.0  # change only the last token
    torch.manual_seed(1)
    a = module(x)
    torch.manual_seed(1)
    b = module(x2)
    torch.testing.assert_close(a[:, :-1], b[:, :-1], atol=FLOAT64, rtol=0)


@pytest.mark.parametrize(
    "user_mask",
    [
        masks.padding([5, 7]),
        torch.tensor([[True] * 5 + [False] * 2, [True] * 7])[:, None, :].expand(2, 7, 7),  # (B,T,T)
        torch.ones(7, 7, dtype=torch.bool),
    ],
)
@pytest.mark.parametrize(
    "make",
    [
        lambda: qkv.learn.SelfAttention(4, 3, causal=True),
        lambda: qkv.MultiHeadAttention(4, 4, 2, causal=True, num_kv_heads=1),
        lambda: qkv.learn.MultiHeadAttentionWrapper(4, 2, 2, causal=True),
    ],
)
def test_causal_module_with_a_user_mask_stays_causal(make, user_mask):
    torch.manual_seed(0)
    module = make().double().eval()
    x = torch.randn(2, 7, 4, dtype=torch.float64)
    x2 = x.clone()
    x2[:, -1] += 10.0
    a, b = module(x, mask=user_mask), module(x2, mask=user_mask)
    # Row t may see tokens 0..t only: changing the last token changes only the last row.
    torch.testing.assert_close(a[:, :-1], b[:, :-1], atol=FLOAT64, rtol=0)
    assert not torch.allclose(a[1, -1], b[1, -1])


def test_causal_module_with_a_user_mask_equals_the_oracle():
    torch.manual_seed(0)
    module = qkv.learn.SelfAttention(4, 3, causal=True).double()
    x = torch.randn(2, 7, 4, dtype=torch.float64)
    q, k, v = module.project(x)  # (B, 1, T, 3)
    want = np.tril(np.ones((7, 7), bool)) & (np.arange(7) < np.array([[5], [7]]))[:, None, None]
    out = module(x, mask=masks.padding([5, 7]))
    np.testing.assert_allclose(out.detach().numpy(), oracle(q, k, v, mask=want)[:, 0], atol=FLOAT64)
