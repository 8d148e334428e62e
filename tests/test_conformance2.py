"""Conformance, round 2: tests for bugs the first round let through (each was planted in a
copy of qkv and this file made to fail on it), the two guarantees of docs/semantics.md that
were false, gradients through the log-sum-exp, and low precision held to the output's own
rounding."""

import numpy as np
import pytest
import torch
from helpers import make_qkv, small_tiles
from tolerances import FLOAT64, rounding_tolerance

import qkv
from qkv import masks

BACKENDS = ["reference", "sdpa", "tiled", "auto"]
LSE_BACKENDS = ["reference", "tiled", "auto"]


def oracle(q, k, v, **kw):
    arrays = [x.detach().double().numpy() for x in (q, k, v)]
    if isinstance(kw.get("mask"), torch.Tensor):
        kw["mask"] = kw["mask"].numpy()
    return qkv.numpy.attention(*arrays, **kw)


# -- 1. dropout keeps the mask ---------------------------------------------------------------

DROPOUT_MASKS = {
    "causal": masks.causal(),
    "padding": masks.padding([3, 6]),
    "window": masks.sliding_window(2),
    "dense": torch.rand(6, 6, generator=torch.Generator().manual_seed(0)) < 0.5,
}


@pytest.mark.parametrize("name", list(DROPOUT_MASKS))
def test_dropout_keeps_the_mask(name):
    # With dropout on and no generator (every module in training mode), a key must still
    # reach only the rows that may see it: perturbing key j (and its value) under the same
    # dropout pattern changes no row that masks j out.
    mask = DROPOUT_MASKS[name]
    q, k, v = make_qkv(2, 2, 2, 6, 6, 4, 3)
    allowed = (
        torch.from_numpy(mask.to_numpy(2, 2, 6, 6).copy())
        if isinstance(mask, masks.Mask)
        else mask.expand(2, 2, 6, 6)
    )
    assert qkv.dispatch(q, k, v, mask=mask, dropout_p=0.5).sdpa_mask != "none"
    torch.manual_seed(0)
    base = qkv.attention(q, k, v, mask=mask, dropout_p=0.5)
    for j in range(6):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, j] += 3.0
        v2[:, :, j] += 100.0
        torch.manual_seed(0)
        out = qkv.attention(q, k2, v2, mask=mask, dropout_p=0.5)
        blind = ~allowed[..., j]  # (B, H, T_q): rows that mask key j out
        torch.testing.assert_close(out[blind], base[blind], atol=FLOAT64, rtol=0)


def test_dropout_with_the_lse_is_applied():
    # tiled returns the lse but has no dropout: auto must not send this call there.
    q, k, v = make_qkv(1, 2, 1, 6, 6, 4, 3)
    choice = qkv.dispatch(q, k, v, dropout_p=0.5, return_lse=True)
    assert choice.backend == "reference" and "dropout with the log-sum-exp" in choice.reason
    torch.manual_seed(0)
    out, _lse = qkv.attention(q, k, v, dropout_p=0.5, return_lse=True)
    torch.manual_seed(0)
    want, _, _lse_want = qkv.attention(
        q, k, v, dropout_p=0.5, return_weights=True, return_lse=True, backend="reference"
    )
    torch.testing.assert_close(out, want, atol=FLOAT64, rtol=0)
    assert not torch.allclose(out, qkv.attention(q, k, v))


@pytest.mark.parametrize(
    "make",
    [
        lambda: qkv.CausalAttention(4, 3, dropout=0.5),
        lambda: qkv.SelfAttention(4, 3, causal=True, dropout=0.5),
        lambda: qkv.MultiHeadAttention(4, 4, 2, causal=True, dropout=0.5),
        lambda: qkv.MultiHeadAttentionWrapper(4, 2, 2, causal=True, dropout=0.5),
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


# -- 2. a causal module given a user mask stays causal -----------------------------------


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
        lambda: qkv.SelfAttention(4, 3, causal=True),
        lambda: qkv.MultiHeadAttention(4, 4, 2, causal=True, num_kv_heads=1),
        lambda: qkv.MultiHeadAttentionWrapper(4, 2, 2, causal=True),
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
    module = qkv.SelfAttention(4, 3, causal=True).double()
    x = torch.randn(2, 7, 4, dtype=torch.float64)
    q, k, v = module.project(x)  # (B, 1, T, 3)
    want = np.tril(np.ones((7, 7), bool)) & (np.arange(7) < np.array([[5], [7]]))[:, None, None]
    out = module(x, mask=masks.padding([5, 7]))
    np.testing.assert_allclose(out.detach().numpy(), oracle(q, k, v, mask=want)[:, 0], atol=FLOAT64)


# -- 3. uneven tiles (the tile cache keys on the diagonal offset) ---------------------------

SHIFT_INVARIANT = {
    "causal": masks.causal(),
    "window": masks.sliding_window(3),
    "causal&window": masks.causal() & masks.sliding_window(5),
    "~causal": ~masks.causal(),
    "window|causal": masks.sliding_window(2) | ~masks.causal(),
}


@pytest.mark.parametrize(
    "tiles", [(8, 5, 10), (6, 4, 8), (5, 8, 16), (7, 3, 9), (1, 2, 2)], ids=str
)
@pytest.mark.parametrize("name", list(SHIFT_INVARIANT))
@pytest.mark.parametrize("T_q, T_k", [(37, 37), (23, 41)])
def test_tiled_with_uneven_tiles_matches_the_oracle(tune, tiles, name, T_q, T_k):
    tune(**small_tiles(*tiles))
    q, k, v = make_qkv(2, 2, 1, T_q, T_k, 4, 3)
    mask = SHIFT_INVARIANT[name]
    out, lse = qkv.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    want, _, lse_want = oracle(q, k, v, mask=mask, return_weights=True, return_lse=True)
    np.testing.assert_allclose(out.numpy(), want, atol=FLOAT64, rtol=0)
    np.testing.assert_allclose(lse.numpy(), lse_want, atol=FLOAT64, rtol=0)


# -- 4. dense masks with rows, offset per query block -------------------------------------


@pytest.mark.parametrize(
    "shape",
    [(300, 300), (2, 1, 300, 300), (2, 3, 300, 300), (1, 3, 300, 1), (2, 1, 300, 1)],
    ids=str,
)
@pytest.mark.parametrize("backend", LSE_BACKENDS)
def test_dense_masks_with_rows_at_default_tiles(shape, backend):
    q, k, v = make_qkv(2, 3, 1, 300, 300, 8, 4)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(shape, generator=g) < 0.5
    out, lse = qkv.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    want, _, lse_want = oracle(q, k, v, mask=mask, return_weights=True, return_lse=True)
    np.testing.assert_allclose(out.numpy(), want, atol=FLOAT64, rtol=0)
    np.testing.assert_allclose(lse.numpy(), lse_want, atol=FLOAT64, rtol=0)


# -- 5. the long-sequence rule ------------------------------------------------------------


def test_dispatch_sends_long_dense_ish_masks_to_tiled(tune):

    tune(**small_tiles(), long_scores=64 * 64)
    q, k, v = make_qkv(1, 1, 1, 64, 64, 4, 4)
    mask = masks.padding([60])  # computes 15/16 of the scores: not sparse
    choice = qkv.dispatch(q, k, v, mask=mask)
    assert choice.backend == "tiled" and "T_q × T_k = 64 × 64" in choice.reason
    short = make_qkv(1, 1, 1, 63, 64, 4, 4)[0]
    assert qkv.dispatch(short, k, v, mask=mask).backend == "sdpa"
    np.testing.assert_allclose(
        qkv.attention(q, k, v, mask=mask).numpy(), oracle(q, k, v, mask=mask), atol=FLOAT64
    )


# -- guarantees: a masked-out non-finite key reaches no other row ---------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_masked_non_finite_key_with_dropout_reaches_no_other_row(bad):
    q, k, v = make_qkv(1, 2, 1, 6, 6, 3, 2)
    k[0, 0, 4, 1] = bad
    choice = qkv.dispatch(q, k, v, mask=masks.causal(), dropout_p=0.3)
    assert choice.backend == "reference" and "no dropout" in choice.reason
    out = qkv.attention(q, k, v, mask=masks.causal(), dropout_p=0.3)
    assert torch.isfinite(out[..., :4, :]).all()


def leaves_with_bad_key_4(bad):
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 1, 6, 6, 3, 2))
    with torch.no_grad():
        k[0, 0, 4, 1] = bad
    return q, k, v


@pytest.mark.parametrize("backend", LSE_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_masked_non_finite_key_reaches_no_other_row_backward(backend, bad):
    q, k, v = leaves_with_bad_key_4(bad)
    out = qkv.attention(q, k, v, mask=masks.causal(), backend=backend)
    out[..., :4, :].sum().backward()  # a loss on the rows that never see key 4
    # Rows 4 and 5 attend to key 4: they are NaN, and so are their gradients (plain
    # arithmetic); rows 0-3 mask it out and must not be touched.
    assert torch.isfinite(q.grad[..., :4, :]).all()


@pytest.mark.parametrize("backend", LSE_BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_key_no_row_may_see_poisons_no_gradient(backend, bad):
    q, k, v = leaves_with_bad_key_4(bad)
    out = qkv.attention(q, k, v, mask=masks.padding([4]), backend=backend)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert torch.isfinite(v.grad).all() and torch.isfinite(k.grad[0, 0, :4]).all()


# -- gradients through the log-sum-exp: split-K with merge_attention --------------------------

SPLIT_MASKS = {
    "none": None,
    "causal": masks.causal(),
    "padding": masks.padding([13, 20]),
    "document": masks.document([0] * 7 + [1] * 9 + [2] * 4),
    "window": masks.sliding_window(4),
}


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


# -- low precision, held to the output's own rounding ----------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", [None, masks.causal(), masks.sliding_window(64)], ids=str)
def test_low_precision_within_its_own_rounding_at_long_length(backend, dtype, mask):
    # T = 1024: long enough that accumulating the 1024-term sums in low precision costs
    # several units in the last place, far beyond 1.5× the output's own rounding.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 32, generator=g).to(dtype) for _ in range(3))
    exact = oracle(q, k, v, mask=mask)
    got = qkv.attention(q, k, v, mask=mask, backend=backend)
    assert got.dtype == dtype
    err = np.abs(got.double().numpy() - exact).max()
    assert err <= rounding_tolerance(exact, dtype), (err, rounding_tolerance(exact, dtype))
