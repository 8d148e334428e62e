"""The rule "a row with nothing to attend gives 0, never NaN" in its corners: sinks of
±inf, rows with no key beside a -inf sink, merges with an empty part (+inf lse, vLLM's
marker), FlashAttention's per-sequence ALiBi slopes in varlen and FlashMLA's unused index
slots. Every backend and the native kernels against the float64 oracle, forward and
backward, and a property test over the public entry points."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import qkv
from qkv.kernels import paged as paged_kernel
from qkv.kernels.tiled import steps
from tests.helpers import make_qkv, oracle, small_tiles
from tests.tolerances import FLOAT64, LOW_PRECISION

INF = math.inf
BACKENDS = ["reference", "sdpa", "tiled", "auto"]
#: one head per case: the sink takes the row, no sink at all, finite, a very large one
SINKS = [INF, -INF, 0.5, 40.0]


def _masks(T_q, T_k):
    """No mask; a mask whose row 1 has no key (and row 0 only key 0)."""
    some = torch.ones(T_q, T_k, dtype=torch.bool)
    some[1] = False
    some[0, 1:] = False
    return {"none": None, "row without keys": some}


def test_the_oracle_gives_an_infinite_sink_the_whole_row():
    q, k, v = (x.numpy() for x in make_qkv(1, 4, 4, 3, 5, 8, 8))
    mask = _masks(3, 5)["row without keys"].numpy()
    out, w, lse = qkv.numpy.attention(
        q, k, v, mask=mask, sinks=np.array(SINKS), return_weights=True, return_lse=True
    )
    assert not np.isnan(out).any() and not np.isnan(w).any() and not np.isnan(lse).any()
    assert (out[0, 0] == 0).all() and (w[0, 0] == 0).all() and (lse[0, 0] == INF).all()
    assert (out[0, :, 1] == 0).all()  # no key: 0 whatever the sink
    assert lse[0, 1, 1] == -INF  # no key, sink -inf: nothing at all
    assert lse[0, 2, 1] == 0.5 and lse[0, 3, 1] == 40.0  # no key: the sink's logit


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_name", ["none", "row without keys"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_infinite_sinks_equal_the_oracle_forward_and_backward(backend, mask_name, dtype, tune):
    tune(**small_tiles())
    q, k, v = make_qkv(2, 4, 2, 3, 17, 8, 8, dtype=dtype)
    mask = _masks(3, 17)[mask_name]
    sinks = torch.tensor(SINKS, dtype=dtype)
    want, want_lse = oracle(q, k, v, mask=mask, sinks=sinks.numpy(), return_lse=True)
    q, k, v, sinks = (x.clone().requires_grad_() for x in (q, k, v, sinks))
    if backend == "sdpa":  # torch's kernel gives no log-sum-exp
        out, lse = qkv.attention(q, k, v, mask=mask, sinks=sinks, backend=backend), None
    else:
        out, lse = qkv.attention(q, k, v, mask=mask, sinks=sinks, backend=backend, return_lse=True)
    tol = FLOAT64 if dtype == torch.float64 else LOW_PRECISION[dtype]
    assert np.abs(out.detach().double().numpy() - want).max() < tol
    if lse is not None:
        got = lse.detach().double().numpy()
        assert (np.isinf(got) == np.isinf(want_lse)).all()
        assert (got[np.isinf(got)] == want_lse[np.isinf(got)]).all()
        finite = np.isfinite(want_lse)
        assert np.abs(got[finite] - want_lse[finite]).max() < tol
    # A loss through out and through every finite lse; the infinite ones carry none.
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    loss = (out * g).sum()
    if lse is not None:
        loss = loss + lse.masked_fill(~lse.isfinite(), 0.0).sum()
    loss.backward()
    for t in (q, k, v, sinks):
        assert t.grad is not None and t.grad.isfinite().all(), backend
    # Head 0's sink takes every row: nothing flows to its query, nor to the sink from out.
    assert (q.grad[:, 0] == 0).all()
    assert sinks.grad[0] == 0 and sinks.grad[1] == 0  # -inf: no weight, no gradient


@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_gradients_with_infinite_sinks_equal_the_reference_backends(backend, tune):
    tune(**small_tiles())
    q, k, v = make_qkv(2, 4, 4, 5, 11, 8, 8)
    mask = _masks(5, 11)["row without keys"]
    sinks = torch.tensor(SINKS, dtype=torch.float64)
    g = torch.randn(2, 4, 5, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def grads(backend):
        x = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = qkv.attention(*x[:3], mask=mask, sinks=x[3], backend=backend)
        return torch.autograd.grad((out * g).sum(), x)

    for got, want in zip(grads(backend), grads("reference")):
        assert (got - want).abs().max() < FLOAT64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_infinite_sinks_on_the_native_kernel(dtype, tune):
    if not steps.available(dtype):
        pytest.skip(f"no native {dtype} kernel on this CPU or build")
    tune(small_scores=0)
    q, k, v = make_qkv(1, 4, 4, 70, 70, 64, 64, dtype=dtype)
    mask = qkv.masks.causal() & qkv.masks.key_indices(
        np.where(np.arange(70)[None, :, None] == 5, -1, np.arange(8)[None, None, :]),
        unused_from=70,
    )
    sinks = torch.tensor(SINKS)
    assert qkv.dispatch(q, k, v, mask=mask, sinks=sinks).path.startswith("tiled-native")
    want, want_lse = oracle(q, k, v, mask=mask, sinks=sinks.numpy(), return_lse=True)
    q, k, v, sinks = (x.clone().requires_grad_() for x in (q, k, v, sinks))
    out, lse = qkv.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert np.abs(out.detach().double().numpy() - want).max() < tol
    assert (lse.detach().numpy()[:, :, 5] == want_lse[:, :, 5]).all()  # the row with no key
    (out.float() * 1.5).sum().backward()
    for t in (q, k, v, sinks):
        assert t.grad is not None and t.grad.float().isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_paged_decode_with_infinite_sinks_and_empty_sequences(dtype):
    """float32 runs the native paged kernel (where built), float64 the gathered path."""
    g = torch.Generator().manual_seed(4)
    pages_k = torch.randn(6, 4, 2, 8, generator=g).to(dtype)
    pages_v = torch.randn(6, 4, 2, 8, generator=g).to(dtype)
    table = torch.tensor([[3, 1], [0, 2], [5, 4]])
    lengths = torch.tensor([6, 0, 3])
    q = torch.randn(3, 4, 8, generator=g).to(dtype)
    sinks = torch.tensor(SINKS, dtype=dtype)
    if dtype == torch.float32 and paged_kernel.available():
        assert paged_kernel.supports(q, pages_k, pages_v, sinks)
    out, lse = qkv.paged_attention(
        q, pages_k, pages_v, table, lengths, sinks=sinks, return_lse=True
    )
    for b in range(3):
        n = int(lengths[b])
        k = pages_k[table[b]].reshape(8, 2, 8)[:n].transpose(0, 1)
        v = pages_v[table[b]].reshape(8, 2, 8)[:n].transpose(0, 1)
        want, want_lse = oracle(
            q[b][None, :, None], k[None], v[None], sinks=sinks.numpy(), return_lse=True
        )
        assert np.abs(out[b].double().numpy() - want[0, :, 0]).max() < 1e-5
        assert np.allclose(lse[b].double().numpy(), want_lse[0, :, 0], rtol=0, atol=1e-5)


def test_cascade_applies_an_infinite_sink_once_after_the_merge():
    q, k, v = make_qkv(2, 4, 4, 3, 5, 8, 8)
    pk, pv = torch.randn(4, 6, 8, dtype=torch.float64), torch.randn(4, 6, 8, dtype=torch.float64)
    sinks = torch.tensor(SINKS, dtype=torch.float64)
    out, lse = qkv.cascade_attention(q, pk, pv, k, v, sinks=sinks, return_lse=True)
    whole_k = torch.cat([pk.expand(2, -1, -1, -1), k], 2)
    whole_v = torch.cat([pv.expand(2, -1, -1, -1), v], 2)
    want, want_lse = oracle(q, whole_k, whole_v, sinks=sinks.numpy(), return_lse=True)
    assert np.abs(out.numpy() - want).max() < FLOAT64
    assert (lse[:, 0] == INF).all()
    assert np.abs(lse[:, 1:].numpy() - want_lse[:, 1:]).max() < FLOAT64


def test_merge_treats_an_infinite_lse_as_an_empty_part():
    """vLLM's rule: FlashAttention 2 reports a part with no key as lse +inf."""
    out = torch.randn(2, 3, 4, dtype=torch.float64)
    lse = torch.randn(2, 3, dtype=torch.float64)
    junk = torch.full_like(out, 7.0)
    merged, merged_lse = qkv.merge_attention([out, junk], [lse, torch.full_like(lse, INF)])
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    nothing, nothing_lse = qkv.merge_attention([junk], [torch.full_like(lse, INF)])
    assert torch.equal(nothing, torch.zeros_like(out)) and (nothing_lse == -INF).all()


def test_merge_joins_sinks_once_after_the_parts():
    q, k, v = make_qkv(1, 4, 4, 3, 10, 8, 8)
    sinks = torch.tensor(SINKS, dtype=torch.float64)
    a = qkv.attention(q, k[:, :, :4], v[:, :, :4], return_lse=True)
    b = qkv.attention(q, k[:, :, 4:], v[:, :, 4:], return_lse=True)
    out, lse = qkv.merge_attention([a[0], b[0]], [a[1], b[1]], sinks=sinks)
    want, want_lse = oracle(q, k, v, sinks=sinks.numpy(), return_lse=True)
    assert np.abs(out.numpy() - want).max() < FLOAT64
    assert (lse[:, 0] == INF).all()
    assert np.abs(lse[:, 1:].numpy() - want_lse[:, 1:]).max() < FLOAT64
    with pytest.raises(ValueError, match=r"\(B, H, T_q, D_v\)"):
        qkv.merge_attention([a[0][0]], [a[1][0]], sinks=sinks)


def test_varlen_takes_per_sequence_alibi_slopes_forward_and_backward():
    """FlashAttention 2's alibi_slopes (N, H): sequence s reads row s, gradients included."""
    cu = torch.tensor([0, 3, 8, 8, 12])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(12, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(12, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(12, 2, 8, generator=g, dtype=torch.float64)
    slopes = torch.rand(4, 4, generator=g, dtype=torch.float64).requires_grad_()
    for window in [(-1, 0), (-1, -1), (2, 1)]:
        mod = qkv.scores.alibi(slopes, symmetric=True)
        out = qkv.varlen_attention(
            q, k, v, cu, cu, 5, 5, window_size=window, enable_gqa=True, score_mod=mod
        )
        (d_slopes,) = torch.autograd.grad(out.sum(), slopes)
        for s in range(4):
            q0, q1 = int(cu[s]), int(cu[s + 1])
            if q1 == q0:
                assert (d_slopes[s] == 0).all()
                continue
            one = slopes[s].detach().clone().requires_grad_()
            left, right = window
            mask = qkv.masks.predicate(
                lambda b, h, qi, ki, lo=left, hi=right: (
                    ((lo < 0) | (ki >= qi - lo)) & ((hi < 0) | (ki <= qi + hi))
                )
            )
            x = [t[q0:q1].transpose(0, 1)[None] for t in (q, k, v)]
            alone = qkv.attention(*x, mask=mask, score_mod=qkv.scores.alibi(one, symmetric=True))
            assert (alone[0].transpose(0, 1) - out[q0:q1]).abs().max() < FLOAT64
            (want,) = torch.autograd.grad(alone.sum(), one)
            assert (want - d_slopes[s]).abs().max() < FLOAT64
    with pytest.raises(ValueError, match="bound to a batch of 3; here there are N = 4"):
        qkv.varlen_attention(
            q, k, v, cu, cu, 5, 5, enable_gqa=True,
            score_mod=qkv.scores.alibi(torch.rand(3, 4, dtype=torch.float64), symmetric=True),
        )  # fmt: skip


def test_key_indices_take_flashmla_unused_slots():
    """Any index >= T_k (up to 2³¹ − 1) marks an unused slot with ``unused_from=T_k``;
    without it such an index is refused and the error says how."""
    q, k, v = make_qkv(1, 2, 2, 4, 6, 8, 8)
    minus = np.array([[[0, 2, -1], [1, -1, -1], [-1, -1, -1], [5, 3, 0]]])
    flashmla = np.where(minus < 0, np.array([6, 2**31 - 1, 9])[None, None, :], minus)
    want = qkv.attention(q, k, v, mask=qkv.masks.key_indices(minus, first=2))
    got = qkv.attention(q, k, v, mask=qkv.masks.key_indices(flashmla, first=2, unused_from=6))
    assert torch.equal(got, want)
    assert (got[0, :, 2] == 0).all()  # a row whose every slot is unused
    with pytest.raises(ValueError, match="pass unused_from=6"):
        qkv.attention(q, k, v, mask=qkv.masks.key_indices(flashmla, first=2))
    with pytest.raises(ValueError, match="unused_from must be >= 0"):
        qkv.masks.key_indices(minus, unused_from=-1)


SINK_VALUES = st.sampled_from([INF, -INF, 0.0, 3.0, -30.0])


@given(
    sinks=st.lists(SINK_VALUES, min_size=2, max_size=2),
    lengths=st.lists(st.integers(0, 6), min_size=2, max_size=2),
    T_q=st.integers(1, 4),
    entry=st.sampled_from(["attention", "varlen", "paged", "cascade", "merge"]),
    backend=st.sampled_from(BACKENDS),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_no_public_entry_point_returns_nan_for_finite_inputs(
    sinks, lengths, T_q, entry, backend, dtype
):
    """Finite inputs, any sinks (±inf included), any number of valid keys (0 too)."""
    B, H, T_k, D = 2, 2, 6, 4
    q, k, v = make_qkv(B, H, H, T_q, T_k, D, D, dtype=dtype, seed=sum(lengths))
    s = torch.tensor(sinks, dtype=dtype, requires_grad=True)
    pad = qkv.masks.padding(lengths)
    lse_too = backend != "sdpa"  # torch's kernel gives no log-sum-exp
    lse = None
    if entry == "attention":
        result = qkv.attention(q, k, v, mask=pad, sinks=s, backend=backend, return_lse=lse_too)
        out, lse = result if lse_too else (result, None)
    elif entry == "varlen":
        qs = torch.cat([q[b].transpose(0, 1) for b in range(B)])  # (B·T_q, H, D)
        ks = torch.cat([k[b, :, : lengths[b]].transpose(0, 1) for b in range(B)])
        vs = torch.cat([v[b, :, : lengths[b]].transpose(0, 1) for b in range(B)])
        cu_q = torch.arange(B + 1) * T_q
        cu_k = torch.tensor([0, lengths[0], sum(lengths)])
        result = qkv.varlen_attention(
            qs, ks, vs, cu_q, cu_k, T_q, T_k, sinks=s, backend=backend,
            return_aux=type("Aux", (), {"lse": lse_too})(),
        )  # fmt: skip
        out, lse = result if lse_too else (result, None)
    elif entry == "paged":
        pages_k = k.transpose(1, 2).reshape(B * 3, 2, H, D)  # 3 pages of 2 per sequence
        pages_v = v.transpose(1, 2).reshape(B * 3, 2, H, D)
        table = torch.arange(B * 3).reshape(B, 3)
        out, lse = qkv.paged_attention(
            q[:, :, 0], pages_k, pages_v, table, torch.tensor(lengths), sinks=s, return_lse=True
        )
    elif entry == "cascade":
        out, lse = qkv.cascade_attention(
            q, k[0, :, : lengths[0]], v[0, :, : lengths[0]], k, v, mask=pad, sinks=s,
            return_lse=True,
        )  # fmt: skip
    else:
        a = qkv.attention(q, k, v, mask=pad, return_lse=True)
        b = qkv.attention(q, k, v, mask=~pad, return_lse=True)
        out, lse = qkv.merge_attention([a[0], b[0]], [a[1], b[1]], sinks=s)
    assert not out.isnan().any(), entry
    if lse is not None:
        assert not lse.isnan().any(), entry
    out.sum().backward()
    assert s.grad is not None and s.grad.isfinite().all(), entry
