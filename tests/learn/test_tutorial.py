"""The tutorial's stages (qkv.tutorial): the seeds' math, step by step, and what each stage
shows."""

import numpy as np
import pytest
import torch

from qkv import tutorial
from tests.tolerances import FLOAT64


def test_naive_softmax_overflows_where_the_stable_one_does_not():
    x = torch.tensor([10.0, 100.0, 1000.0])
    assert tutorial.naive_softmax(x).isnan().any()  # exp(1000) = inf in float32; inf/inf
    torch.testing.assert_close(tutorial.stable_softmax(x), torch.softmax(x, -1))
    small = torch.randn(4, 7)
    torch.testing.assert_close(tutorial.naive_softmax(small), tutorial.stable_softmax(small))


@pytest.mark.parametrize("dim", [4, 64, 512])
def test_dot_product_variance_grows_with_dim_and_scaling_flattens_it(dim):
    # 20,000 trials: the relative standard error of a variance estimate is ~sqrt(2/n) = 1%
    # for normal dot products (heavier tails at small dim); 10% is a wide, safe bound.
    v = tutorial.dot_product_variance(dim, 20_000, np.random.default_rng(0))
    assert v.unscaled == pytest.approx(dim, rel=0.1)
    assert v.scaled == pytest.approx(1.0, rel=0.1)
    u = tutorial.dot_product_variance(dim, 20_000, np.random.default_rng(1), distribution="uniform")
    assert u.unscaled == pytest.approx(dim * 7 / 144, rel=0.1)  # seed 000's draw
    assert u.scaled == pytest.approx(7 / 144, rel=0.1)  # flat, but not 1
    with pytest.raises(ValueError, match="distribution must be 'normal' or 'uniform'"):
        tutorial.dot_product_variance(dim, distribution="gamma")


def test_three_ways_to_average_the_past_are_equal():
    x = torch.randn(3, 11, 5, dtype=torch.float64)
    a = tutorial.average_past_loops(x)
    torch.testing.assert_close(tutorial.average_past_matmul(x), a, atol=FLOAT64, rtol=0)
    torch.testing.assert_close(tutorial.average_past_softmax(x), a, atol=FLOAT64, rtol=0)


def test_simplified_attention_is_unscaled_self_attention():
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    r = tutorial.simplified_attention(x)
    torch.testing.assert_close(r.weights, torch.softmax(x @ x.transpose(-1, -2), -1))
    torch.testing.assert_close(r.context, r.weights @ x)
