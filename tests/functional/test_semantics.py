"""The semantics table of docs/semantics.md, one test per row, on every backend."""

import math

import numpy as np
import pytest
import torch

import qkv
from qkv import masks
from tests.helpers import LSE_BACKENDS, make_qkv, oracle
from tests.tolerances import FLOAT64, LOW_PRECISION, rounding_tolerance

DROPOUT_MASKS = {
    "causal": masks.causal(),
    "padding": masks.padding([3, 6]),
    "window": masks.sliding_window(2),
    "dense": torch.rand(6, 6, generator=torch.Generator().manual_seed(0)) < 0.5,
}

BACKENDS = ["reference", "sdpa", "tiled"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_scale_is_inverse_sqrt_d(backend):
    q, k, v = make_qkv(1, 2, 2, 4, 6, 9, 3)
    torch.testing.assert_close(
        qkv.attention(q, k, v, backend=backend),
        qkv.attention(q, k, v, scale=1 / 3, backend=backend),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero_never_nan(backend):
    q, k, v = make_qkv(2, 2, 1, 4, 5, 3, 3)
    mask = masks.padding([0, 5]) & masks.causal()  # batch row 0 sees no key at all
    out = qkv.attention(q, k, v, mask=mask, backend=backend)
    assert not out.isnan().any()
    assert (out[0] == 0).all() and (out[1] != 0).any()


def test_fully_masked_rows_weights_and_lse():
    q, k, v = make_qkv(1, 1, 1, 3, 4, 2, 2)
    dense = torch.tensor([[True, False, True, True], [False] * 4, [True] * 4])
    _out, w, lse = qkv.attention(q, k, v, mask=dense, return_weights=True, return_lse=True)
    assert (w[0, 0, 1] == 0).all() and lse[0, 0, 1] == -math.inf
    assert torch.isfinite(lse[0, 0, [0, 2]]).all()
    _, w_np, lse_np = qkv.numpy.attention(
        *(x.numpy() for x in (q, k, v)), mask=dense.numpy(), return_weights=True, return_lse=True
    )
    assert (w_np[0, 0, 1] == 0).all() and lse_np[0, 0, 1] == -np.inf


@pytest.mark.parametrize("backend", ["reference", "tiled", "auto", "numpy"])
def test_nan_in_a_key_stays_in_the_rows_that_attend_to_it(backend):
    q, k, v = make_qkv(1, 1, 1, 4, 4, 3, 2)
    k[0, 0, 2, 1] = float("nan")
    if backend == "numpy":
        out = torch.from_numpy(
            qkv.numpy.attention(q.numpy(), k.numpy(), v.numpy(), mask=masks.causal())
        )
    else:
        out = qkv.attention(q, k, v, mask=masks.causal(), backend=backend)
    # Causal: queries 0 and 1 never see key 2; queries 2 and 3 do.
    assert not out[..., :2, :].isnan().any()
    assert out[..., 2:, :].isnan().all()


def test_sdpa_itself_spreads_a_masked_nan_key():
    # Why auto avoids sdpa for non-finite keys under a mask: torch's fused kernel leaks the
    # NaN into rows that mask the key out. If torch fixes this, this test says so.
    q, k, v = make_qkv(1, 1, 1, 4, 4, 3, 2)
    k[0, 0, 2, 1] = float("nan")
    assert qkv.dispatch(q, k, v, mask=masks.causal()).backend == "tiled"
    assert qkv.attention(q, k, v, mask=masks.causal(), backend="sdpa")[..., :2, :].isnan().any()


@pytest.mark.parametrize("backend", [*BACKENDS, "numpy"])
def test_huge_logits_do_not_overflow(backend):
    q, k, v = make_qkv(1, 1, 1, 3, 5, 4, 2)
    q = q * 1e4
    k = k * 1e4  # scores of order 1e8
    if backend == "numpy":
        out = qkv.numpy.attention(q.numpy(), k.numpy(), v.numpy())
    else:
        out = qkv.attention(q, k, v, backend=backend).numpy()
    assert np.isfinite(out).all()
    # At this scale the softmax is one-hot: each row copies the value of its best key.
    best = (q @ k.transpose(-1, -2)).argmax(-1)
    np.testing.assert_allclose(out[0, 0], v[0, 0, best[0, 0]].numpy(), atol=FLOAT64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", [None, masks.causal(), masks.sliding_window(4)], ids=repr)
def test_low_precision_within_tolerance(dtype, backend, mask):
    q, k, v = make_qkv(2, 4, 2, 33, 47, 16, 16)
    want = qkv.numpy.attention(q.numpy(), k.numpy(), v.numpy(), mask=mask)
    out = qkv.attention(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask, backend=backend)
    assert out.dtype == dtype
    np.testing.assert_allclose(out.double().numpy(), want, atol=LOW_PRECISION[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_lse_is_float32(dtype):
    q, k, v = (x.to(dtype) for x in make_qkv(1, 1, 1, 3, 3, 4, 4))
    _, lse = qkv.attention(q, k, v, return_lse=True)
    assert lse.dtype == torch.float32


def test_dropout_is_reproducible_from_a_generator():
    q, k, v = make_qkv(2, 2, 2, 16, 16, 8, 8)
    run = lambda seed: qkv.attention(  # noqa: E731
        q,
        k,
        v,
        dropout_p=0.3,
        return_weights=True,
        generator=torch.Generator().manual_seed(seed),
    )
    (a, wa), (b, wb), (c, _) = run(7), run(7), run(8)
    assert torch.equal(a, b) and torch.equal(wa, wb)
    assert not torch.equal(a, c)
    torch.testing.assert_close(a, wa @ v)  # the weights returned are the ones applied


def test_dropout_keep_rate_and_scaling():
    p, n = 0.25, 64
    q, k, v = make_qkv(4, 4, 4, n, n, 4, 4)
    _, w = qkv.attention(
        q, k, v, dropout_p=p, return_weights=True, generator=torch.Generator().manual_seed(0)
    )
    _, w0 = qkv.attention(q, k, v, return_weights=True)
    kept = w != 0
    # 65,536 Bernoulli(0.75) draws: std of the rate is 0.0017; 0.01 is ~6 sigma.
    assert abs(kept.double().mean().item() - (1 - p)) < 0.01
    torch.testing.assert_close(w[kept], w0[kept] / (1 - p))


def test_no_dropout_when_p_is_zero():
    q, k, v = make_qkv(1, 1, 1, 5, 5, 4, 4)
    torch.testing.assert_close(
        qkv.attention(q, k, v, dropout_p=0.0), qkv.attention(q, k, v), atol=0, rtol=0
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequences(backend):
    q, k, v = make_qkv(2, 2, 1, 0, 5, 4, 3)
    assert qkv.attention(q, k, v, backend=backend).shape == (2, 2, 0, 3)
    q, k, v = make_qkv(2, 2, 1, 4, 0, 4, 3)  # no keys: every row fully masked
    out, w, lse = qkv.attention(q, k, v, return_weights=True, return_lse=True)
    assert (out == 0).all() and out.shape == (2, 2, 4, 3) and w.shape == (2, 2, 4, 0)
    assert (lse == -math.inf).all()
    np.testing.assert_array_equal(qkv.numpy.attention(q.numpy(), k.numpy(), v.numpy()), 0)
    # ... with a mask too (a packed sequence with queries and no key)
    out = qkv.attention(q, k, v, mask=masks.causal(), backend=backend)
    assert (out == 0).all() and out.shape == (2, 2, 4, 3)


def test_same_inputs_give_bit_identical_outputs():
    q, k, v = make_qkv(2, 4, 2, 31, 31, 8, 8, dtype=torch.float32)
    for backend in BACKENDS:
        a = qkv.attention(q, k, v, mask=masks.causal(), backend=backend)
        assert torch.equal(a, qkv.attention(q, k, v, mask=masks.causal(), backend=backend))


def test_numpy_mask_accepted_by_the_torch_core():
    q, k, v = make_qkv(1, 1, 1, 3, 3, 2, 2)
    tri = np.tri(3, dtype=bool)
    torch.testing.assert_close(
        qkv.attention(q, k, v, mask=tri), qkv.attention(q, k, v, mask=masks.causal())
    )


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


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_masked_non_finite_key_with_dropout_reaches_no_other_row(bad):
    q, k, v = make_qkv(1, 2, 1, 6, 6, 3, 2)
    k[0, 0, 4, 1] = bad
    choice = qkv.dispatch(q, k, v, mask=masks.causal(), dropout_p=0.3)
    assert choice.backend == "reference" and "no dropout" in choice.reason
    out = qkv.attention(q, k, v, mask=masks.causal(), dropout_p=0.3)
    assert torch.isfinite(out[..., :4, :]).all()


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


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
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


def leaves_with_bad_key_4(bad):
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 1, 6, 6, 3, 2))
    with torch.no_grad():
        k[0, 0, 4, 1] = bad
    return q, k, v
