"""Every backend against the float64 NumPy oracle, and against torch SDPA where it defines
the case: odd sizes, T_q != T_k, odd D, D_v != D, GQA/MQA, every mask kind."""

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import qkv
from qkv import masks
from tests.helpers import make_qkv, mask_zoo, oracle, small_tiles
from tests.tolerances import FLOAT64

BACKENDS = ["reference", "sdpa", "tiled", "auto"]


@pytest.fixture(autouse=True)
def tiny_tiles(tune):
    tune(**small_tiles())


# (B, H, H_kv, T_q, T_k, D, D_v): odd sizes, T_q < T_k, T_q > T_k, odd D, D_v != D, GQA, MQA.
FAST_SHAPES = [
    (1, 1, 1, 1, 1, 1, 1),
    (2, 4, 2, 5, 17, 7, 3),
    (1, 3, 1, 17, 5, 5, 5),
    (2, 2, 2, 17, 17, 16, 9),
]
SLOW_SHAPES = [
    (B, H, H_kv, T_q, T_k, 7, 5)
    for B, (H, H_kv), T_q, T_k in itertools.product(
        (1, 2), ((1, 1), (4, 2), (4, 1)), (1, 2, 17, 113), (1, 2, 17, 113)
    )
]


def check_against_oracle(shape, mask_name, backend):
    B, _H, _H_kv, T_q, T_k, _D, _D_v = shape
    q, k, v = make_qkv(*shape)
    mask = mask_zoo(B, T_k, T_q)[mask_name]
    out = qkv.attention(q, k, v, mask=mask, backend=backend)
    np.testing.assert_allclose(out.numpy(), oracle(q, k, v, mask=mask), atol=FLOAT64, rtol=0)
    _, w_ref, lse_ref = oracle(q, k, v, mask=mask, return_weights=True, return_lse=True)
    if backend in ("reference", "tiled", "auto"):
        _, lse = qkv.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
        np.testing.assert_allclose(lse.numpy(), lse_ref, atol=FLOAT64, rtol=0)
        w = qkv.attention_weights(q, k, lse, mask=mask)  # weights recomputed from the lse
        np.testing.assert_allclose(w.numpy(), w_ref, atol=FLOAT64, rtol=0)
    if backend == "reference":
        _, w = qkv.attention(q, k, v, mask=mask, backend=backend, return_weights=True)
        np.testing.assert_allclose(w.numpy(), w_ref, atol=FLOAT64, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_name", list(mask_zoo(1, 1)))
@pytest.mark.parametrize("shape", FAST_SHAPES, ids=str)
def test_matches_oracle(shape, mask_name, backend):
    check_against_oracle(shape, mask_name, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_name", list(mask_zoo(1, 1)))
@pytest.mark.parametrize("shape", SLOW_SHAPES, ids=str)
def test_matches_oracle_exhaustive(shape, mask_name, backend):
    check_against_oracle(shape, mask_name, backend)


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unbatched_layouts(rank, backend):
    q, k, v = make_qkv(2, 1, 1, 5, 7, 4, 3)
    squeeze = (lambda x: x[0, 0]) if rank == 2 else (lambda x: x[:, 0])
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(1)) < 0.6
    out = qkv.attention(
        *map(squeeze, (q, k, v)), mask=mask if rank == 2 else mask[None], backend=backend
    )
    want = squeeze(qkv.attention(q, k, v, mask=mask, backend="reference"))
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, atol=FLOAT64, rtol=0)


@pytest.mark.parametrize("T_q,T_k", [(5, 5), (3, 9), (9, 3)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_is_sdpa_lower_right(T_q, T_k, backend):
    q, k, v = make_qkv(2, 4, 2, T_q, T_k, 8, 8)
    ours = qkv.attention(q, k, v, mask=masks.causal(), backend=backend)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    with warnings.catch_warnings():  # torch warns of NaN rows for T_q > T_k; it gives 0 here
        warnings.simplefilter("ignore")
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T_q, T_k))
    if T_q > T_k:  # the first T_q - T_k queries have no key: our semantics say 0
        assert (ours[:, :, : T_q - T_k] == 0).all()
    torch.testing.assert_close(ours, theirs, atol=FLOAT64, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_mask_and_scale_match_sdpa(backend):
    q, k, v = make_qkv(2, 3, 3, 6, 11, 5, 4)
    ours = qkv.attention(q, k, v, scale=0.3, backend=backend)
    theirs = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(ours, theirs, atol=FLOAT64, rtol=0)


def test_explicit_q_offset():
    q, k, v = make_qkv(1, 2, 2, 3, 8, 4, 4)
    for q_offset in (0, 2, 5):
        for backend in BACKENDS:
            out = qkv.attention(q, k, v, mask=masks.causal(), q_offset=q_offset, backend=backend)
            want = oracle(q, k, v, mask=masks.causal(), q_offset=q_offset)
            np.testing.assert_allclose(out.numpy(), want, atol=FLOAT64, rtol=0)


def test_gqa_equals_repeated_heads():
    q, k, v = make_qkv(2, 6, 2, 5, 7, 4, 3)
    gqa = qkv.attention(q, k, v, mask=masks.causal())
    mha = qkv.attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), mask=masks.causal()
    )
    torch.testing.assert_close(gqa, mha, atol=FLOAT64, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
def test_gradcheck(backend):
    q, k, v = (x.requires_grad_() for x in make_qkv(2, 4, 2, 5, 7, 3, 4))
    mask = masks.sliding_window(3) | masks.prefix_lm(1)
    torch.autograd.gradcheck(
        lambda q, k, v: qkv.attention(q, k, v, mask=mask, backend=backend), (q, k, v)
    )


def test_gradcheck_weights_and_lse():
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 1, 4, 5, 3, 2))
    torch.autograd.gradcheck(
        lambda q, k, v: qkv.attention(
            q, k, v, mask=masks.causal(), return_weights=True, return_lse=True
        ),
        (q, k, v),
    )


@pytest.mark.parametrize("mask_name", list(mask_zoo(1, 1)))
@pytest.mark.parametrize("shape", [(2, 4, 2, 19, 37, 5, 3), (1, 3, 1, 37, 19, 4, 6)], ids=str)
def test_tiled_gradients_equal_reference(shape, mask_name):
    q, k, v = make_qkv(*shape)
    mask = mask_zoo(shape[0], shape[4], shape[3])[mask_name]
    dout = torch.randn(*shape[:2], shape[3], shape[6], dtype=torch.float64)
    grads = {}
    for backend in ("reference", "tiled"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        qkv.attention(*leaves, mask=mask, backend=backend).backward(dout)
        grads[backend] = [x.grad for x in leaves]
    for ref, til in zip(grads["reference"], grads["tiled"]):
        torch.testing.assert_close(til, ref, atol=FLOAT64, rtol=0)


def test_dispatch_prefers_tiled_for_sparse_and_long_masks():
    q, k, v = make_qkv(1, 1, 1, 64, 64, 4, 4)  # 8 x 8 tiles of 8 (small_tiles fixture)
    d = qkv.dispatch(q, k, v, mask=masks.sliding_window(8))
    assert d.backend == "tiled" and "of the scores to compute" in d.reason
    assert qkv.dispatch(q, k, v, mask=masks.padding([60])).backend == "sdpa"


@pytest.mark.parametrize(
    "options,words",
    [
        (
            dict(backend="tiled", return_weights=True),
            "backend='tiled' cannot give the attention weights",
        ),
        (dict(backend="tiled", dropout_p=0.1), "backend='tiled' cannot give dropout"),
        (dict(backend="sdpa", return_lse=True), "backend='sdpa' cannot give the log-sum-exp"),
    ],
)
def test_backends_refuse_what_they_cannot_give(options, words):
    q, k, v = make_qkv(1, 1, 1, 4, 4, 4, 4)
    with pytest.raises(ValueError, match=words):
        qkv.attention(q, k, v, **options)
