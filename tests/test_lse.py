"""attention_weights (weights on demand from the lse) and merge_attention (split-K)."""

import itertools

import numpy as np
import pytest
import torch

import qkv
from qkv import masks
from tests.helpers import LSE_BACKENDS, make_qkv, small_tiles
from tests.tolerances import FLOAT64

SPLIT_MASKS = {
    "none": None,
    "causal": masks.causal(),
    "padding": masks.padding([13, 20]),
    "document": masks.document([0] * 7 + [1] * 9 + [2] * 4),
    "window": masks.sliding_window(4),
}


@pytest.mark.parametrize("splits", [[0, 7, 19], [0, 1, 2, 19], [0, 19]])
@pytest.mark.parametrize("mask_name", ["none", "causal", "window", "doc&causal"])
def test_merge_equals_one_pass_over_all_keys(splits, mask_name):
    B, H, H_kv, T_q, T_k = 2, 4, 2, 5, 19
    q, k, v = make_qkv(B, H, H_kv, T_q, T_k, 6, 3)
    ids = np.repeat([0, 1, 2], [4, 9, 6])
    mask = {
        "none": None,
        "causal": masks.causal(),
        "window": masks.sliding_window(3),
        "doc&causal": masks.document(ids) & masks.causal(),
    }[mask_name]
    dense = None if mask is None else mask.dense(B, H, T_q, T_k)
    whole, lse = qkv.attention(q, k, v, mask=dense, return_lse=True)
    parts = []
    for a, b in itertools.pairwise(splits):
        sub = None if dense is None else dense[..., a:b]
        parts.append(qkv.attention(q, k[:, :, a:b], v[:, :, a:b], mask=sub, return_lse=True))
    out, merged_lse = qkv.merge_attention(*zip(*parts))
    torch.testing.assert_close(out, whole, atol=FLOAT64, rtol=0)
    torch.testing.assert_close(merged_lse, lse, atol=FLOAT64, rtol=0)


def test_merge_with_parts_that_saw_no_key():
    q, k, v = make_qkv(1, 1, 1, 3, 4, 2, 2)
    blind = torch.zeros(3, 4, dtype=torch.bool)
    seen = torch.tensor([[True] * 4, [True] * 4, [False] * 4])  # row 2 sees nothing at all
    a = qkv.attention(q, k, v, mask=blind, return_lse=True)
    b = qkv.attention(q, k, v, mask=seen, return_lse=True)
    out, lse = qkv.merge_attention([a[0], b[0]], [a[1], b[1]])
    torch.testing.assert_close(out, b[0])
    assert lse[0, 0, 2] == float("-inf") and (out[0, 0, 2] == 0).all()
    assert not out.isnan().any()


def test_merge_half_precision_in_float32():
    q, k, v = (x.to(torch.bfloat16) for x in make_qkv(1, 2, 2, 4, 8, 8, 8))
    a = qkv.attention(q, k[:, :, :5], v[:, :, :5], return_lse=True)
    b = qkv.attention(q, k[:, :, 5:], v[:, :, 5:], return_lse=True)
    out, lse = qkv.merge_attention([a[0], b[0]], [a[1], b[1]])
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = qkv.attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=0)


def test_merge_errors():
    with pytest.raises(ValueError, match="non-empty and of equal length; got 0 and 0"):
        qkv.merge_attention([], [])
    with pytest.raises(ValueError, match=r"lses\[1\] shape \(2, 3\); got \(2, 3, 4\) and \(2, 2\)"):
        qkv.merge_attention([torch.zeros(2, 3, 4)] * 2, [torch.zeros(2, 3), torch.zeros(2, 2)])


def test_attention_weights_for_chosen_heads_and_rows(tune):
    tune(**small_tiles())
    q, k, v = make_qkv(2, 4, 2, 37, 37, 5, 5)
    mask = masks.sliding_window(6) | masks.prefix_lm(3)
    _, lse = qkv.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    _, w_all = qkv.attention(q, k, v, mask=mask, return_weights=True)
    w = qkv.attention_weights(q, k, lse, mask=mask, heads=[3, 0], rows=[0, 17, 36])
    assert w.shape == (2, 2, 3, 37)
    torch.testing.assert_close(w, w_all[:, [3, 0]][:, :, [0, 17, 36]], atol=FLOAT64, rtol=0)
    w = qkv.attention_weights(q, k, lse, mask=mask, rows=slice(30, None))
    torch.testing.assert_close(w, w_all[:, :, 30:], atol=FLOAT64, rtol=0)


def test_attention_weights_3d_and_errors():
    q, k, v = make_qkv(2, 1, 1, 6, 6, 4, 4)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]
    _, w_all, lse = qkv.attention(
        q, k, v, mask=masks.causal(), return_weights=True, return_lse=True
    )
    torch.testing.assert_close(
        qkv.attention_weights(q, k, lse, mask=masks.causal(), rows=[2]), w_all[:, [2]]
    )
    with pytest.raises(
        ValueError, match=r"lse must have shape \(B, T_q\) = \(2, 6\); got \(2, 5\)"
    ):
        qkv.attention_weights(q, k, lse[:, :5])
    with pytest.raises(ValueError, match="heads can be chosen only for"):
        qkv.attention_weights(q, k, lse, heads=[0])


def test_attention_weights_checks_inputs_like_attention():
    q, k, v = make_qkv(1, 1, 1, 4, 4, 3, 3)
    tri = np.tri(4, dtype=bool)
    _, lse = qkv.attention(q, k, v, mask=tri, return_lse=True)
    _, w_all = qkv.attention(q, k, v, mask=tri, return_weights=True)
    torch.testing.assert_close(qkv.attention_weights(q, k, lse, mask=tri), w_all)  # NumPy mask
    with pytest.raises(TypeError, match="query must be a torch.Tensor .* got ndarray"):
        qkv.attention_weights(q.numpy(), k, lse)
    with pytest.raises(TypeError, match="lse must be a torch.Tensor .* got list"):
        qkv.attention_weights(q, k, [0.0])


@pytest.mark.parametrize("name", list(SPLIT_MASKS))
@pytest.mark.parametrize("backend", LSE_BACKENDS)
def test_split_k_through_merge_attention_has_the_gradients_of_one_pass(backend, name):
    # Two parts of 10 keys each, merged, against one pass over all 20 (GQA: 4 heads on 2).
    q, k, v = make_qkv(2, 4, 2, 7, 20, 5, 3)
    mask = SPLIT_MASKS[name]
    dense = None if mask is None else mask.dense(2, 4, 7, 20)
    dout = torch.randn(2, 4, 7, 3, dtype=torch.float64)
    grads = {}
    for how in ("one pass", "split"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        ql, kl, vl = leaves
        if how == "one pass":
            out = qkv.attention(ql, kl, vl, mask=mask, backend="reference")
        else:
            parts = [
                qkv.attention(
                    ql,
                    kl[:, :, s],
                    vl[:, :, s],
                    return_lse=True,
                    mask=None if dense is None else dense[..., s],
                    backend=backend,
                )
                for s in (slice(0, 10), slice(10, 20))
            ]
            out, _ = qkv.merge_attention([o for o, _ in parts], [l_ for _, l_ in parts])
        out.backward(dout)
        grads[how] = [out.detach()] + [x.grad for x in leaves]
    for one, split in zip(grads["one pass"], grads["split"]):
        torch.testing.assert_close(split, one, atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", LSE_BACKENDS)
def test_gradcheck_through_the_lse(backend):
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 1, 5, 6, 3, 2))

    def f(q, k, v):
        out, lse = qkv.attention(
            q, k, v, mask=masks.causal() & masks.padding([4]), return_lse=True, backend=backend
        )
        return out, lse.masked_fill(lse == float("-inf"), 0.0)

    torch.autograd.gradcheck(f, (q, k, v))


def test_merge_attention_rows_no_part_saw_have_zero_gradients():
    outs = [torch.zeros(1, 3, 2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    lses = [
        torch.tensor([[0.5, float("-inf"), 1.0]], dtype=torch.float64, requires_grad=True),
        torch.tensor(
            [[float("-inf"), float("-inf"), 2.0]], dtype=torch.float64, requires_grad=True
        ),
    ]
    out, lse = qkv.merge_attention(outs, lses)
    (out.sum() + lse.masked_fill(lse == float("-inf"), 0.0).sum()).backward()
    assert lse[0, 1] == float("-inf")
    for t in outs + lses:
        assert torch.isfinite(t.grad).all()
