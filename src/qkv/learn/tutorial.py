"""The seeds' stages of attention as small, readable pieces, in the order a learner meets them.

1. :func:`simplified_attention`: no weights. Scores are dot products of the inputs.
2. :func:`naive_softmax` beside :func:`stable_softmax`: why we subtract the max.
3. :class:`SelfAttention_v1`: trainable ``nn.Parameter`` weights, scaled scores.
4. :func:`dot_product_variance`: why the scores are divided by ``sqrt(d_k)``.
5. :func:`average_past_loops`, :func:`average_past_matmul`, :func:`average_past_softmax`:
   three equal ways to let each position average over its past (seed 001), the germ of
   causal masking.

The production modules (:class:`qkv.learn.SelfAttention` and friends) follow from here.

Legend: B batch · T sequence length · E input width.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from ..functional import attention
from ..masks import causal

# The seeds' six-token sentence with their 3-d embeddings.
SENTENCE = ("Your", "journey", "starts", "with", "one", "step")
EMBEDDINGS = (
    (0.43, 0.15, 0.89),
    (0.55, 0.87, 0.66),
    (0.57, 0.85, 0.64),
    (0.22, 0.58, 0.33),
    (0.77, 0.25, 0.10),
    (0.05, 0.80, 0.55),
)


def sentence_embeddings() -> torch.Tensor:
    """The seeds' embeddings of "Your journey starts with one step", shape (6, 3)."""
    return torch.tensor(EMBEDDINGS)


class Simplified(NamedTuple):
    scores: torch.Tensor  # (…, T, T)
    weights: torch.Tensor  # (…, T, T), rows sum to 1
    context: torch.Tensor  # (…, T, E)


def simplified_attention(x: torch.Tensor) -> Simplified:
    """Self-attention with no trainable weights (seed 004, first section).

    Every token's embedding serves as its query, key and value: the score of token ``i``
    for token ``j`` is the dot product ``x_i · x_j``, a softmax turns each row of scores into
    weights that sum to 1, and the context vector of ``i`` is the weighted sum of all
    embeddings. No scaling: that arrives with trainable weights.

    Args:
        x: (T, E) or (B, T, E).

    Example:
        >>> r = simplified_attention(sentence_embeddings())
        >>> r.context[1]
        tensor([0.4419, 0.6515, 0.5683])
    """
    scores = x @ x.transpose(-2, -1)  # (…, T, T)
    context, weights = attention(x, x, x, scale=1.0, return_weights=True)
    return Simplified(scores, weights, context)


def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x) / sum(exp(x))`` as written in the textbook. ``exp`` overflows to inf for
    x above ~88 in float32 (~709 in float64), and then the result is NaN."""
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def stable_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The same function with the row maximum subtracted first: softmax does not change
    when a constant is added to a row, and now ``exp`` sees only numbers <= 0."""
    return naive_softmax(x - x.amax(dim=dim, keepdim=True), dim=dim)


class SelfAttention_v1(nn.Module):
    """Self-attention with ``nn.Parameter(torch.rand(d_in, d_out))`` weights (seeds 000 and
    004), created in the order query, key, value.

    The queries are ``x W_q``, the keys ``x W_k`` and the values ``x W_v``. The weights are
    ``softmax(Q Kᵀ / sqrt(d_out))`` and the context is ``weights · V``. (The
    trainable-weights notebook's version computed the context from a global variable
    instead of its own weights. This one does not.)

    Example:
        >>> _ = torch.manual_seed(123)
        >>> SelfAttention_v1(3, 2)(sentence_embeddings())[1]
        tensor([0.3061, 0.8210], grad_fn=<SelectBackward0>)
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, E) -> queries, keys, values, each (1, 1, T, d_out) (one batch, one head)."""
        q, k, v = ((x @ W)[None, None] for W in (self.W_query, self.W_key, self.W_value))
        return q, k, v

    def merge(self, context: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return context[0, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, E) -> (T, d_out)."""
        return self.merge(attention(*self.project(x)), like=x)


class Variance(NamedTuple):
    unscaled: float  # variance of q · k
    scaled: float  # variance of q · k / sqrt(dim)


def dot_product_variance(
    dim: int,
    trials: int = 1000,
    rng: np.random.Generator | None = None,
    *,
    distribution: str = "normal",
) -> Variance:
    """Why scores are divided by ``sqrt(d_k)``: the variance of ``q · k`` grows with ``dim``.

    For q, k with independent standard normal entries, ``Var(q · k) = dim``, so
    ``Var(q · k / sqrt(dim)) = 1`` whatever the dim, and the softmax stays soft instead of
    collapsing onto the largest score. The trainable-weights notebook drew from
    ``np.random.rand`` (uniform [0, 1)): then ``Var(q · k) = dim · 7/144`` and the scaled
    variance stays flat at 7/144 ≈ 0.049, flat but not 1 — which is what its printed 0.046
    and 0.050 show.

    Args:
        dim: vector length. trials: number of (q, k) pairs.
        rng: a NumPy generator (default: a fresh unseeded one).
        distribution: "normal" or "uniform".
    """
    rng = np.random.default_rng() if rng is None else rng
    if distribution == "normal":
        q, k = rng.standard_normal((2, trials, dim))
    elif distribution == "uniform":
        q, k = rng.random((2, trials, dim))
    else:
        raise ValueError(f"distribution must be 'normal' or 'uniform'; got {distribution!r}")
    dots = (q * k).sum(-1)
    return Variance(float(np.var(dots)), float(np.var(dots / np.sqrt(dim))))


def average_past_loops(x: torch.Tensor) -> torch.Tensor:
    """Seed 001, way 1: for each position t, the mean of x[…, :t+1, :], with loops.
    x: (B, T, C) -> (B, T, C)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[-2]):
        out[..., t, :] = x[..., : t + 1, :].mean(dim=-2)
    return out


def average_past_matmul(x: torch.Tensor) -> torch.Tensor:
    """Way 2: multiply by a lower-triangular matrix whose rows are normalised to sum to 1."""
    T = x.shape[-2]
    wei = torch.tril(torch.ones(T, T, dtype=x.dtype))
    wei = wei / wei.sum(dim=1, keepdim=True)  # (T, T)
    return wei @ x  # (T, T) @ (B, T, C) -> (B, T, C)


def average_past_softmax(x: torch.Tensor) -> torch.Tensor:
    """Way 3, the one attention uses: all scores equal (0), future masked out, softmax.
    Uniform weights over the past (the same averages) and now the scores can be learned."""
    zeros = x.new_zeros(*x.shape[:-1], 1)  # queries and keys whose scores are all 0
    return attention(zeros, zeros, x, mask=causal())
