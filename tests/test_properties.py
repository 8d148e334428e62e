"""Property-based conformance: random shapes (1 and primes), GQA layouts, q_offsets, masks
composed from every kind with &, | and ~, and value ranges (tiny, huge, exact ties); every
backend against the float64 NumPy oracle. `--hypothesis-profile=slow` for thousands."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qkv
from qkv import masks

from helpers import use_small_tiles
from tolerances import LOW_PRECISION, float64_tolerance

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
            lambda ids: masks.document(sorted(ids))),
        st.integers(0, T_k).map(masks.prefix_lm),
        st.just(masks.predicate(lambda b, h, q, kv: (q * 7 + kv * 3 + h) % 5 != 0, "hash")),
    ]
    m = draw(st.one_of(leaves))
    if depth == 0 or m is None or not draw(st.booleans()):
        return m
    other = draw(mask_trees(B, T_k, depth - 1)) or masks.full()
    return draw(st.sampled_from([m & other, m | other, ~m]))


@st.composite
def problems(draw):
    B, H_kv, groups = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    T_q, T_k, D, D_v = draw(SIZES), draw(SIZES), draw(st.sampled_from([1, 3, 8])), draw(
        st.sampled_from([1, 4]))
    q_offset = draw(st.one_of(st.none(), st.integers(0, T_k - T_q))) if T_q <= T_k else None
    scale = draw(st.sampled_from([1e-3, 1.0, 1e4]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shapes = [(B, H_kv * groups, T_q, D), (B, H_kv, T_k, D), (B, H_kv, T_k, D_v)]
    if draw(st.booleans()):  # exact ties: small integers, many equal scores
        q, k, v = (rng.integers(-2, 3, s).astype(np.float64) for s in shapes)
    else:
        q, k, v = (rng.standard_normal(s) for s in shapes)
    q, k = q * scale, k * scale
    mask = draw(mask_trees(B, T_k))
    return q, k, v * scale, mask, q_offset, scale


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    use_small_tiles(monkeypatch, block_q=4, block_k=4, chunk_k=8)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled", "auto"])
@given(problem=problems())
def test_every_backend_matches_the_oracle(backend, problem):
    q, k, v, mask, q_offset, scale = problem
    want = qkv.numpy.attention(q, k, v, mask=mask, q_offset=q_offset)
    got = qkv.attention(*map(torch.from_numpy, (q, k, v)), mask=mask, q_offset=q_offset,
                        backend=backend)
    score_scale = float(np.abs(q).max() * np.abs(k).max() * q.shape[-1]) if q.size else 1.0
    tol = float64_tolerance(score_scale, max(1.0, float(np.abs(v).max(initial=0.0))))
    np.testing.assert_allclose(got.numpy(), want, atol=tol, rtol=0)
    assert not np.isnan(got.numpy()).any()


@given(problem=problems())
def test_lse_and_weights_on_demand_match_the_oracle(problem):
    q, k, v, mask, q_offset, scale = problem
    _, w_ref, lse_ref = qkv.numpy.attention(q, k, v, mask=mask, q_offset=q_offset,
                                            return_weights=True, return_lse=True)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    _, lse = qkv.attention(tq, tk, tv, mask=mask, q_offset=q_offset, return_lse=True)
    score_scale = float(np.abs(q).max() * np.abs(k).max() * q.shape[-1]) if q.size else 1.0
    np.testing.assert_allclose(lse.numpy(), lse_ref, atol=float64_tolerance(score_scale, 1.0),
                               rtol=0)
    w = qkv.attention_weights(tq, tk, lse, mask=mask, q_offset=q_offset)
    np.testing.assert_allclose(w.numpy(), w_ref, atol=float64_tolerance(score_scale, 1.0),
                               rtol=0)


@given(T=st.integers(1, 12), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=12),
       num_kv_heads=st.sampled_from([1, 2, 4]), rope=st.booleans(), seed=st.integers(0, 99))
def test_cached_decode_in_random_chunks_equals_full_forward(T, chunks, num_kv_heads, rope, seed):
    torch.manual_seed(seed)
    m = qkv.MultiHeadAttention(8, 8, num_heads=4, num_kv_heads=num_kv_heads, causal=True,
                               rope=qkv.RoPE(2) if rope else None).double()
    x = torch.randn(2, T, 8, dtype=torch.float64)
    cache, parts, i = m.new_cache(2, T), [], 0
    for n in chunks * T:
        if i >= T:
            break
        parts.append(m(x[:, i:i + n], cache=cache))
        i += n
    torch.testing.assert_close(torch.cat(parts, 1), m(x), atol=1e-10, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiled"])
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       T_q=SIZES, T_k=SIZES, H_kv=st.integers(1, 2), seed=st.integers(0, 2**16),
       mask=st.sampled_from([None, masks.causal(), masks.sliding_window(3),
                             masks.prefix_lm(2) | ~masks.causal()]))
def test_low_precision_matches_the_oracle_on_the_same_inputs(backend, dtype, T_q, T_k, H_kv,
                                                            seed, mask):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in
               [(1, 2 * H_kv, T_q, 16), (1, H_kv, T_k, 16), (1, H_kv, T_k, 16)])
    want = qkv.numpy.attention(*(x.double().numpy() for x in (q, k, v)), mask=mask)
    got = qkv.attention(q, k, v, mask=mask, backend=backend)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.double().numpy(), want, atol=LOW_PRECISION[dtype], rtol=0)
