"""The NumPy oracle's helpers and seed 003's function."""

import numpy as np
import pytest

from qkv import numpy as qnp


def naive_softmax(x):
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def test_stable_softmax_where_the_naive_one_overflows():
    x = np.array([1000.0, 1001.0, 1002.0])
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isnan(naive_softmax(x)).all()
    np.testing.assert_allclose(qnp.softmax(x), naive_softmax(x - 1002.0))
    np.testing.assert_allclose(qnp.softmax(x).sum(), 1.0)


def test_softmax_rows_sum_to_one_and_masked_rows_are_zero():
    x = np.array([[0.0, -np.inf, 1.0], [-np.inf] * 3])
    s = qnp.softmax(x)
    np.testing.assert_allclose(s[0].sum(), 1.0)
    assert s[0, 1] == 0
    np.testing.assert_array_equal(s[1], 0.0)


def test_logsumexp():
    x = np.array([[1e8, 1e8], [-np.inf, -np.inf], [0.0, np.log(3.0)]])
    np.testing.assert_allclose(qnp.logsumexp(x), [1e8 + np.log(2), -np.inf, np.log(4)])
    assert qnp.logsumexp(np.zeros((2, 0))).tolist() == [-np.inf, -np.inf]


def test_seed_function_additive_and_bool_masks_agree():
    rng = np.random.default_rng(3)
    Q, K, V = rng.standard_normal((3, 4, 8))
    additive = np.where(np.tri(4, dtype=bool), 0.0, -np.inf)  # the seed's 0 / -inf mask
    out_a, w_a = qnp.scaled_dot_product_attention(Q, K, V, mask=additive)
    out_b, w_b = qnp.scaled_dot_product_attention(Q, K, V, mask=np.tri(4, dtype=bool))
    np.testing.assert_allclose(out_a, out_b)
    np.testing.assert_allclose(w_a, w_b)
    np.testing.assert_allclose(out_a, qnp.attention(Q, K, V, mask=np.tri(4, dtype=bool)))


def test_seed_function_works_batched():
    rng = np.random.default_rng(4)
    Q, K, V = rng.standard_normal((3, 2, 5, 4))  # the seed's K.T would transpose B too
    out, w = qnp.scaled_dot_product_attention(Q, K, V)
    np.testing.assert_allclose(out, qnp.attention(Q, K, V))
    np.testing.assert_allclose(w.sum(-1), 1.0)


def test_seed_function_rejects_bad_masks():
    Q = np.ones((2, 4))
    with pytest.raises(
        ValueError, match=r"mask must have shape \(T_q, T_k\) .* = \(2, 2\); got \(3, 3\)"
    ):
        qnp.scaled_dot_product_attention(Q, Q, Q, mask=np.zeros((3, 3)))
    with pytest.raises(TypeError, match="mask must be bool"):
        qnp.scaled_dot_product_attention(Q, Q, Q, mask=np.zeros((2, 2), dtype=int))
