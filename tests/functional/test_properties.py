"""Property-based conformance: random shapes (1 and primes), GQA layouts, q_offsets, masks
composed from every kind with &, | and ~, dense masks of every broadcastable shape, explicit
scales, uneven tile shapes, and value ranges (tiny, huge, exact ties); every backend against
the float64 NumPy oracle. Targeted examples (fully masked rows, query blocks with no key) run
in every default run. `--hypothesis-profile=slow` for thousands."""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import qkv
from qkv import masks
from tests.helpers import small_tiles
from tests.tolerances import (
    LOW_PRECISION,
    SDPA_SMALL_ROUNDING_UNITS,
    float64_tolerance,
    rounding_tolerance,
)

SIZES = st.sampled_from([1, 2, 3, 5, 7, 13, 17, 31])


@st.composite
def mask_trees(draw, B, T_k, depth=2):
    """A mask built from every kind, combined with &, | and ~."""
    leaves = [
        st.just(None),
        st.just(masks.full()),
        st.just(masks.causal()),
        st.integers(1, 8).map(masks.sliding_window),
        st.lists(st.integers(0, T_k), min_size=B, max_size=B).map(masks.padding),
        st.lists(st.integers(0, 3), min_size=T_k, max_size=T_k).map(
            lambda ids: masks.document(sorted(ids))
        ),
        st.integers(0, T_k).map(masks.prefix_lm),
        st.just(masks.predicate(lambda b, h, q, kv: (q * 7 + kv * 3 + h) % 5 != 0, "hash")),
    ]
    m = draw(st.one_of(leaves))
    if depth == 0 or m is None or not draw(st.booleans()):
        return m
    other = draw(mask_trees(B, T_k, depth - 1)) or masks.full()
    return draw(st.sampled_from([m & other, m | other, ~m]))


@dataclass
class Problem:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: Any
    q_offset: int | None
    scale: float | None  # passed as scale=; None: the default 1/sqrt(D)
    tiles: tuple[int, int, int]  # the tiled kernel's (block_q, block_k, chunk_k)

    @property
    def score_scale(self) -> float:
        s = 1.0 / np.sqrt(self.q.shape[-1]) if self.scale is None else self.scale
        return (
            float(
                np.abs(self.q).max(initial=0)
                * np.abs(self.k).max(initial=0)
                * self.q.shape[-1]
                * max(1.0, s)
            )
            or 1.0
        )


@st.composite
def dense_masks(draw, B, H, T_q, T_k):
    """A dense bool mask of any broadcastable shape, rows included."""
    shape = (
        draw(st.sampled_from([1, B])),
        draw(st.sampled_from([1, H])),
        draw(st.sampled_from([1, T_q])),
        T_k,
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.random(shape) < draw(st.sampled_from([0.2, 0.6, 0.95]))


@st.composite
def problems(draw):
    B, H_kv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    T_q, T_k, D, D_v = (
        draw(SIZES),
        draw(SIZES),
        draw(st.sampled_from([1, 3, 8])),
        draw(st.sampled_from([1, 4])),
    )
    q_offset = draw(st.one_of(st.none(), st.integers(0, T_k - T_q))) if T_q <= T_k else None
    magnitude = draw(st.sampled_from([1e-3, 1.0, 1e4]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shapes = [(B, H_kv * groups, T_q, D), (B, H_kv, T_k, D), (B, H_kv, T_k, D_v)]
    if draw(st.booleans()):  # exact ties: small integers, many equal scores
        q, k, v = (rng.integers(-2, 3, s).astype(np.float64) for s in shapes)
    else:
        q, k, v = (rng.standard_normal(s) for s in shapes)
    q, k = q * magnitude, k * magnitude
    if draw(st.integers(0, 3)) == 0:
        mask = draw(dense_masks(B, H_kv * groups, T_q, T_k))
    else:
        mask = draw(mask_trees(B, T_k))
    scale = draw(st.one_of(st.none(), st.sampled_from([1e-2, 0.37, 3.0])))
    # Uneven tiles too: query blocks that are no multiple of the key blocks.
    block_q, block_k = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    tiles = (block_q, block_k, block_k * draw(st.integers(1, 3)))
    return Problem(q, k, v * magnitude, mask, q_offset, scale, tiles)


def _targeted() -> list[Problem]:
    """Cases chance may miss, run in every default run: fully masked rows (padding to 0,
    queries before every key) and whole query blocks with no key at all."""
    rng = np.random.default_rng(7)
    q, k, v = (
        rng.standard_normal((1, 2, 9, 3)),
        rng.standard_normal((1, 1, 5, 3)),
        rng.standard_normal((1, 1, 5, 2)),
    )
    q2, k2, v2 = (rng.standard_normal(s) for s in [(2, 2, 6, 4), (2, 2, 6, 4), (2, 2, 6, 3)])
    none = np.zeros((2, 1, 6, 6), bool)
    none[:, :, 3:, :4] = True  # rows 0-2 see nothing
    return [
        # T_q > T_k, causal: queries 0-3 come before every key; blocks of 2 queries are empty.
        Problem(q, k, v, masks.causal(), None, None, (2, 2, 4)),
        Problem(q, k, v, masks.causal() & masks.padding([3]), None, 0.5, (3, 2, 2)),
        # padding to length 0: every row of batch 0 is fully masked.
        Problem(q2, k2, v2, masks.padding([0, 4]), None, None, (4, 3, 6)),
        # a dense mask whose first query block sees no key.
        Problem(q2, k2, v2, none, None, 2.0, (3, 2, 4)),
    ]


def with_targeted(test):
    for case in _targeted():
        test = example(problem=case)(test)
    return test


@pytest.fixture(autouse=True)
def tiny_tiles(tune):
    tune(**small_tiles(block_q=4, block_k=4, chunk_k=8))


@contextmanager
def tiles_of(problem: Problem):
    with qkv.tuned(**small_tiles(*problem.tiles)):
        yield


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled", "auto"])
@with_targeted
@given(problem=problems())
def test_every_backend_matches_the_oracle(backend, problem):
    p = problem
    want = qkv.numpy.attention(p.q, p.k, p.v, mask=p.mask, q_offset=p.q_offset, scale=p.scale)
    with tiles_of(p):
        got = qkv.attention(
            *map(torch.from_numpy, (p.q, p.k, p.v)),
            mask=p.mask,
            q_offset=p.q_offset,
            scale=p.scale,
            backend=backend,
        )
    tol = float64_tolerance(p.score_scale, max(1.0, float(np.abs(p.v).max(initial=0.0))))
    np.testing.assert_allclose(got.numpy(), want, atol=tol, rtol=0)
    assert not np.isnan(got.numpy()).any()


@with_targeted
@given(problem=problems())
def test_lse_and_weights_on_demand_match_the_oracle(problem):
    p = problem
    _, w_ref, lse_ref = qkv.numpy.attention(
        p.q,
        p.k,
        p.v,
        mask=p.mask,
        q_offset=p.q_offset,
        scale=p.scale,
        return_weights=True,
        return_lse=True,
    )
    tq, tk, tv = map(torch.from_numpy, (p.q, p.k, p.v))
    with tiles_of(p):
        _, lse = qkv.attention(
            tq, tk, tv, mask=p.mask, q_offset=p.q_offset, scale=p.scale, return_lse=True
        )
    tol = float64_tolerance(p.score_scale, 1.0)
    np.testing.assert_allclose(lse.numpy(), lse_ref, atol=tol, rtol=0)
    w = qkv.attention_weights(tq, tk, lse, mask=p.mask, q_offset=p.q_offset, scale=p.scale)
    np.testing.assert_allclose(w.numpy(), w_ref, atol=tol, rtol=0)


@given(
    T=st.integers(1, 12),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=12),
    num_kv_heads=st.sampled_from([1, 2, 4]),
    rope=st.booleans(),
    seed=st.integers(0, 99),
)
def test_cached_decode_in_random_chunks_equals_full_forward(T, chunks, num_kv_heads, rope, seed):
    torch.manual_seed(seed)
    m = qkv.MultiHeadAttention(
        8,
        8,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        causal=True,
        rope=qkv.RoPE(2) if rope else None,
    ).double()
    x = torch.randn(2, T, 8, dtype=torch.float64)
    cache, parts, i = m.new_cache(2, T), [], 0
    for n in chunks * T:
        if i >= T:
            break
        parts.append(m(x[:, i : i + n], cache=cache))
        i += n
    torch.testing.assert_close(torch.cat(parts, 1), m(x), atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    T_q=SIZES,
    T_k=SIZES,
    H_kv=st.integers(1, 2),
    seed=st.integers(0, 2**16),
    mask=st.sampled_from(
        [None, masks.causal(), masks.sliding_window(3), masks.prefix_lm(2) | ~masks.causal()]
    ),
)
def test_low_precision_matches_the_oracle_on_the_same_inputs(
    backend, dtype, T_q, T_k, H_kv, seed, mask
):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(*s, generator=g).to(dtype)
        for s in [(1, 2 * H_kv, T_q, 16), (1, H_kv, T_k, 16), (1, H_kv, T_k, 16)]
    )
    want = qkv.numpy.attention(*(x.double().numpy() for x in (q, k, v)), mask=mask)
    got = qkv.attention(q, k, v, mask=mask, backend=backend)
    assert got.dtype == dtype
    # Half precision accumulates in float32, so its error is the output's own rounding;
    # float32 has no wider accumulator and keeps its own bound.
    units = SDPA_SMALL_ROUNDING_UNITS if backend == "sdpa" else 1.5
    tol = LOW_PRECISION[dtype] if dtype == torch.float32 else rounding_tolerance(want, dtype, units)
    np.testing.assert_allclose(got.double().numpy(), want, atol=tol, rtol=0)
