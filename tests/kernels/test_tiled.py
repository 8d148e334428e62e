"""The tiled kernel: its flash calls (torch's CPU flash kernel per call over query blocks and
their keys) against the NumPy float64 oracle and against the PyTorch loop they replace —
every mask kind, odd sizes, T_q != T_k, GQA, fully masked rows, gaps inside a span; float64,
float32 and half precision (which the flash calls run in float32) — and uneven tiles, dense
masks with rows, at default and tiny tile sizes. The native bfloat16 kernel has
test_native.py."""

import numpy as np
import pytest
import torch

import qkv
from qkv import masks
from qkv import numpy as qnp
from qkv.kernels.tiled import flash as K
from qkv.kernels.tiled.calls import calls as calls_of
from tests.helpers import (
    LSE_BACKENDS,
    grads,
    make_qkv,
    mask_zoo,
    oracle,
    oracle_with_lse,
    small_tiles,
)
from tests.tolerances import FLOAT64, LOW_PRECISION

SHIFT_INVARIANT = {
    "causal": masks.causal(),
    "window": masks.sliding_window(3),
    "causal&window": masks.causal() & masks.sliding_window(5),
    "~causal": ~masks.causal(),
    "window|causal": masks.sliding_window(2) | ~masks.causal(),
}

pytestmark = pytest.mark.skipif(K.FLASH is None, reason="this torch has no fused CPU kernel")

TOL = {torch.float64: FLOAT64, **LOW_PRECISION}


def run(q, k, v, mask, fused, monkeypatch, tune):
    tune(fused=fused)
    calls = []
    real = K.fused_forward
    monkeypatch.setattr(K, "fused_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out, lse = qkv.attention(q, k, v, mask=mask, backend="tiled", return_lse=True)
    return out, lse, bool(calls)


@pytest.mark.parametrize("small", [False, True], ids=["blocks", "small_tiles"])
@pytest.mark.parametrize("name", list(mask_zoo(2, 53, 37)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_fused_equals_the_oracle_and_the_loop(name, dtype, small, monkeypatch, tune):
    if small:  # 8 x 8 tiles, 16-key chunks: many blocks, spans with EMPTY gaps
        tune(**small_tiles())
    T_q, T_k = 37, 53
    mask = mask_zoo(2, T_k, T_q)[name]
    q, k, v = make_qkv(2, 4, 2, T_q, T_k, 8, 8, dtype=dtype, seed=3)
    if small:
        tune(**SMALL_CALLS)
    out, lse, fused = run(q, k, v, mask, True, monkeypatch, tune)
    assert fused
    want, want_lse = oracle_with_lse(q, k, v, mask)
    tol = TOL[dtype]
    np.testing.assert_allclose(out.double().numpy(), want, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse.double().numpy(), want_lse, atol=tol * 4, rtol=tol)
    loop_out, loop_lse, fused = run(q, k, v, mask, False, monkeypatch, tune)
    assert not fused
    np.testing.assert_allclose(
        out.double().numpy(), loop_out.double().numpy(), atol=2 * tol, rtol=2 * tol
    )
    assert torch.equal(lse == float("-inf"), loop_lse == float("-inf"))  # the same empty rows


#: With 8 × 8 tiles: spans over 24 keys cut into FULL and masked stretches, groups of 4 query
#: blocks sharing FULL stretches of 8 keys or more, backward calls of 16 keys (the backward
#: cuts longer unmasked calls).
SMALL_CALLS = dict(fused_span=24, group=4, shared_min=8, backward_span=16)


@pytest.mark.parametrize("T_q,T_k", [(37, 53), (64, 64), (120, 41), (1, 30)])
def test_calls_cover_each_block_s_keys_exactly_once(T_q, T_k):
    from qkv._checks import Problem
    from qkv.core.dispatch import make_tiled_plan

    tuning = qkv.Tuning(**small_tiles(), **SMALL_CALLS)
    for name, mask in mask_zoo(2, T_k, T_q).items():
        plan = make_tiled_plan(mask, Problem(0, 2, 2, 2, T_q, T_k, 8, 8, T_k - T_q, 1.0), tuning)
        count = np.zeros((T_q, T_k), int)
        for _, _, group in calls_of(plan, tuning):
            for c in group:
                assert c.k0 < c.k1 and c.q0 < c.q1, (name, c)
                if c.chunks is None:  # every key FULL for every query of the call
                    count[c.q0 : c.q1, c.k0 : c.k1] += 1
                    continue
                for x in c.chunks:
                    assert c.k0 <= x.k0 < x.k1 <= c.k1, (name, c)
                    count[c.q0 : c.q1, x.k0 : x.k1] += 1
        want = np.zeros((T_q, T_k), int)
        for q0, q1, chunks in plan.rows:
            for x in chunks:
                want[q0:q1, x.k0 : x.k1] += 1
        np.testing.assert_array_equal(count, want, err_msg=name)
        assert want.max() <= 1


def test_rows_with_no_key_give_zero_and_minus_infinity(monkeypatch, tune):
    tune(**small_tiles())
    q, k, v = make_qkv(2, 2, 2, 20, 30, 8, 8, dtype=torch.float32)
    mask = masks.padding([0, 30]) | masks.predicate(lambda b, h, qi, kv: qi == kv + 100)
    out, lse, fused = run(q, k, v, mask, True, monkeypatch, tune)
    assert fused and (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    assert torch.isfinite(lse[1]).all()


def test_what_the_fused_step_cannot_take_runs_the_loop(monkeypatch, tune):
    q, k, v = make_qkv(1, 2, 2, 40, 40, 8, 8, dtype=torch.float32)
    with qkv.tuned(native=False):  # D_v != D: torch's flash kernel cannot take it
        _, _, fused = run(q, k, v[..., :4], masks.causal(), True, monkeypatch, tune)
    assert not fused
    k_nan = k.clone()
    k_nan[0, 0, 30] = float("nan")  # masked out for rows < 30: must not reach them
    out, _, fused = run(q, k_nan, v, masks.causal(), True, monkeypatch, tune)
    assert not fused and torch.isfinite(out[0, 0, :30]).all()
    with torch.no_grad():
        _, _, fused = run(q, k, v, masks.causal(), True, monkeypatch, tune)
        assert fused
    out = qkv.attention(
        q, k, v, mask=masks.causal(), backend="tiled", score_mod=qkv.scores.softcap(2.0)
    )  # modifications: the loop
    want = qnp.attention(
        *(x.double().numpy() for x in (q, k, v)),
        mask=masks.causal(),
        score_mod=qkv.scores.softcap(2.0),
    )
    np.testing.assert_allclose(out.double().numpy(), want, atol=1e-5)


@pytest.mark.parametrize("small", [False, True], ids=["blocks", "small_tiles"])
@pytest.mark.parametrize("name", [n for n, m in mask_zoo(2, 53, 37).items()])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_fused_backward_equals_the_reference_gradients(name, dtype, small, monkeypatch, tune):
    if small:
        tune(**small_tiles())
    mask = mask_zoo(2, 53, 37)[name]
    q, k, v = make_qkv(2, 4, 2, 37, 53, 8, 8, dtype=dtype, seed=5)
    g = torch.randn(2, 4, 37, 8, generator=torch.Generator().manual_seed(6)).to(dtype)
    calls = []
    real = K.fused_backward
    monkeypatch.setattr(K, "fused_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    if small:
        tune(**SMALL_CALLS)
    fused = grads(q, k, v, g, mask, backend="tiled")
    assert calls
    want = grads(q.double(), k.double(), v.double(), g.double(), mask, backend="reference")
    tol = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 6e-2, torch.float16: 8e-3}[
        dtype
    ]
    for got, exp in zip(fused, want):
        np.testing.assert_allclose(got.double().numpy(), exp.numpy(), atol=tol, rtol=tol)


def test_a_loss_on_the_log_sum_exp_takes_the_loop_backward(monkeypatch):
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 2, 2, 30, 30, 8, 8, seed=7))
    monkeypatch.setattr(K, "fused_backward", None)  # would fail if called
    out, lse = qkv.attention(q, k, v, mask=masks.causal(), backend="tiled", return_lse=True)
    (out.sum() + lse.sum()).backward()
    monkeypatch.undo()  # gradcheck also sends zero lse gradients, which the fused pass takes
    torch.autograd.gradcheck(
        lambda a, b, c: qkv.attention(
            a, b, c, mask=masks.causal(), backend="tiled", return_lse=True
        )[1],
        (q, k, v),
    )


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
