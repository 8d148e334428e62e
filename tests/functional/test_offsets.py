"""Any q_offset: queries placed before the first key or after the last one, every backend
against the float64 oracle (out and lse), the gradients of the tiled kernel against the
reference, and the compiled path."""

import numpy as np
import pytest
import torch

import qkv
from tests.helpers import make_qkv, mask_zoo, oracle, small_tiles


@pytest.mark.parametrize("T_q,T_k,offsets", [(13, 7, [-6, -2, 0, 3]), (7, 13, [-4, 9, 20])])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled", "auto"])
def test_any_offset(T_q, T_k, offsets, backend, tune):
    tune(**small_tiles(4, 4, 8))
    q, k, v = make_qkv(2, 4, 2, T_q, T_k, 8, 8)
    for name, m in mask_zoo(2, T_k, T_q).items():
        if not isinstance(m, qkv.masks.Mask) and m is not None:
            continue
        for off in offsets:
            want, want_lse = oracle(q, k, v, mask=m, q_offset=off, return_lse=True)
            if backend == "sdpa":
                got = qkv.attention(q, k, v, mask=m, q_offset=off, backend=backend)
            else:
                got, lse = qkv.attention(
                    q, k, v, mask=m, q_offset=off, backend=backend, return_lse=True
                )
                np.testing.assert_allclose(
                    lse.numpy(), want_lse, atol=1e-12, err_msg=f"{name} {off}"
                )
            np.testing.assert_allclose(got.numpy(), want, atol=1e-12, err_msg=f"{name} {off}")


@pytest.mark.parametrize("off", [-3, 0, 9])
def test_any_offset_gradients(off, tune):
    tune(**small_tiles(4, 4, 8))
    q, k, v = make_qkv(2, 4, 2, 9, 6, 8, 8)
    m = qkv.masks.causal() & qkv.masks.padding([6, 4])

    def grads(backend):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = qkv.attention(*xs, mask=m, q_offset=off, backend=backend)
        return torch.autograd.grad(out.square().sum(), xs)

    for a, b in zip(grads("tiled"), grads("reference")):
        assert (a - b).abs().max() < 1e-10


def test_any_offset_compiled():
    q, k, v = make_qkv(1, 2, 2, 9, 6, 8, 8)
    f = torch.compile(
        lambda q, k, v: qkv.attention(q, k, v, mask=qkv.masks.causal(), q_offset=-2),
        backend="eager",
    )
    want = oracle(q, k, v, mask=qkv.masks.causal(), q_offset=-2)
    np.testing.assert_allclose(f(q, k, v).numpy(), want, atol=1e-12)
