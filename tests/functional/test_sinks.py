"""Attention sinks (``qkv.attention(..., sinks=logits)``): one logit per query head, a key
with no value in every row's softmax, on every backend against the NumPy float64 oracle,
which adds the sink as one more column (a different formula from the kernels', which scale
the output from the log-sum-exp)."""

import numpy as np
import pytest
import torch

import qkv
from qkv.kernels.tiled import steps
from tests.helpers import make_qkv, mask_zoo, oracle, small_tiles

BACKENDS = ["reference", "sdpa", "tiled", "auto"]
SHAPES = [  # B, H, H_kv, T_q, T_k, D, D_v: odd sizes, T_q != T_k both ways, GQA
    (2, 4, 2, 13, 29, 8, 8),
    (1, 3, 3, 31, 17, 16, 16),
    (2, 2, 1, 1, 40, 8, 8),  # a decode step
]


def sinks_for(H, dtype=torch.float64, seed=3):
    return torch.randn(H, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_sinks_equal_the_oracle_for_every_mask(backend, shape, tune):
    tune(**small_tiles())  # many tiles: partial, full and empty blocks
    B, H, _, T_q, T_k, _, _ = shape
    q, k, v = make_qkv(*shape)
    sinks = sinks_for(H)
    for name, mask in mask_zoo(B, T_k, T_q).items():
        want, want_lse = oracle(q, k, v, mask=mask, sinks=sinks.numpy(), return_lse=True)
        if backend == "sdpa":  # no log-sum-exp from torch's kernel
            got = qkv.attention(q, k, v, mask=mask, sinks=sinks, backend=backend)
            lse = None
        else:
            got, lse = qkv.attention(
                q, k, v, mask=mask, sinks=sinks, backend=backend, return_lse=True
            )
        assert np.abs(got.numpy() - want).max() < 1e-12, name
        if lse is not None:
            assert np.abs(lse.numpy() - want_lse).max() < 1e-12, name


def test_a_fully_masked_row_attends_only_to_its_sink():
    """Its output stays 0 (the sink has no value) and its log-sum-exp is the sink's logit."""
    q, k, v = make_qkv(1, 2, 2, 4, 6, 8, 8)
    sinks = torch.tensor([0.5, -2.0], dtype=torch.float64)
    nothing = qkv.masks.padding([0])
    for backend in ["reference", "tiled", "auto"]:
        out, lse = qkv.attention(
            q, k, v, mask=nothing, sinks=sinks, backend=backend, return_lse=True
        )
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, sinks.view(1, 2, 1).expand(1, 2, 4)), backend
    out = qkv.attention(q, k, v, mask=nothing, sinks=sinks, backend="sdpa")
    assert torch.equal(out, torch.zeros_like(out))


def test_sinks_shrink_the_weights_by_exactly_their_share():
    q, k, v = make_qkv(2, 4, 2, 9, 9, 8, 8)
    sinks = sinks_for(4)
    mask = qkv.masks.causal()
    _, weights, lse = qkv.attention(
        q, k, v, mask=mask, sinks=sinks, return_weights=True, return_lse=True
    )
    share = torch.exp(sinks.view(1, 4, 1) - lse)  # the sink's weight in each row
    assert torch.allclose(weights.sum(-1) + share, torch.ones_like(lse), atol=1e-14)
    # The log-sum-exp tools see the sinks through the log-sum-exp they are given.
    again = qkv.attention_weights(q, k, lse, mask=mask)
    assert torch.allclose(again, weights, atol=1e-14)


def formula(q, k, v, mask, sinks, scale):
    """The sinks by float64 autograd of the formula itself: scores with one more column."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    rows = sinks.view(1, -1, 1) if sinks.ndim == 1 else sinks
    column = rows[..., None].expand(*s.shape[:3], 1)
    p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    return p @ v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_name", ["none", "causal", "sliding_window", "causal&padding"])
def test_gradients_reach_the_sinks_and_equal_autograd_of_the_formula(backend, mask_name, tune):
    tune(**small_tiles())
    B, H, H_kv, T_q, T_k, D = 2, 4, 2, 11, 19, 8
    q, k, v = make_qkv(B, H, H_kv, T_q, T_k, D, D)
    mask = mask_zoo(B, T_k, T_q)[mask_name]
    g = torch.randn(B, H, T_q, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    dense = None if mask is None else mask.dense(B, H, T_q, T_k, q_offset=T_k - T_q)

    def grads(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v, sinks_for(H))]
        return torch.autograd.grad((fn(*xs) * g).sum(), xs)

    want = grads(lambda q, k, v, s: formula(q, k, v, dense, s, D**-0.5))
    got = grads(lambda q, k, v, s: qkv.attention(q, k, v, mask=mask, sinks=s, backend=backend))
    for name, a, b in zip("qkvs", got, want):
        assert (a - b).abs().max() < 1e-10, (name, float((a - b).abs().max()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [(2, 4, 11), (1, 4, 1), (2, 1, 11)])
def test_sinks_per_row_equal_the_oracle_with_gradients(backend, rows, tune):
    """Sinks computed from the input (one per batch, head and query, as Inkling's)."""
    tune(**small_tiles())
    B, H, H_kv, T_q, T_k, D = 2, 4, 2, 11, 19, 8
    q, k, v = make_qkv(B, H, H_kv, T_q, T_k, D, D)
    sinks = torch.randn(rows, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    mask = qkv.masks.causal() & qkv.masks.padding([19, 9])
    want = oracle(q, k, v, mask=mask, sinks=sinks.numpy())
    got = qkv.attention(q, k, v, mask=mask, sinks=sinks, backend=backend)
    assert np.abs(got.numpy() - want).max() < 1e-12
    dense = mask.dense(B, H, T_q, T_k, q_offset=T_k - T_q)
    g = torch.randn(B, H, T_q, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def grads(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        return torch.autograd.grad((fn(*xs) * g).sum(), xs)

    want_g = grads(lambda q, k, v, s: formula(q, k, v, dense, s, D**-0.5))
    got_g = grads(lambda q, k, v, s: qkv.attention(q, k, v, mask=mask, sinks=s, backend=backend))
    for name, a, b in zip("qkvs", got_g, want_g):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-10, name


def test_gradients_reach_the_sinks_through_the_log_sum_exp_too():
    """A loss on the returned log-sum-exp (which includes the sinks) as well as on out."""
    q, k, v = make_qkv(1, 2, 2, 7, 7, 8, 8)

    def loss(backend):
        xs = [x.clone().requires_grad_() for x in (q, k, v, sinks_for(2))]
        out, lse = qkv.attention(
            *xs[:3], mask=qkv.masks.causal(), sinks=xs[3], backend=backend, return_lse=True
        )
        return torch.autograd.grad(out.sum() + (lse * lse).sum(), xs)

    for a, b in zip(loss("tiled"), loss("reference")):
        assert (a - b).abs().max() < 1e-12


def test_sinks_with_a_score_modification_on_the_tiled_loop(tune):
    tune(**small_tiles())
    q, k, v = make_qkv(2, 4, 2, 13, 21, 8, 8)
    sinks = sinks_for(4)
    mod = qkv.scores.alibi(qkv.scores.alibi_slopes(4))
    want = oracle(q, k, v, mask=qkv.masks.causal(), score_mod=mod, sinks=sinks.numpy())
    for backend in ["tiled", "reference", "auto"]:
        got = qkv.attention(
            q, k, v, mask=qkv.masks.causal(), score_mod=mod, sinks=sinks, backend=backend
        )
        assert np.abs(got.numpy() - want).max() < 1e-12, backend


def test_dispatch_says_how_sinks_are_applied():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 4, 4)
    sinks = sinks_for(2)
    assert qkv.dispatch(q, k, v, sinks=sinks).rule == "sinks"
    assert qkv.dispatch(q, k, v, sinks=sinks).backend == "tiled"
    dropped = qkv.dispatch(q, k, v, sinks=sinks, dropout_p=0.1)
    assert dropped.backend == "reference" and "dropout" in dropped.reason


def test_sinks_with_dropout_keep_the_sink_out_of_the_dropped_weights():
    """Dropout drops weights after the softmax, the sink's column excluded: out is the
    dropped weights (which sum to less than 1) times value."""
    q, k, v = make_qkv(1, 2, 2, 6, 6, 4, 4)
    sinks = sinks_for(2)
    g = torch.Generator().manual_seed(0)
    out, w = qkv.attention(q, k, v, sinks=sinks, dropout_p=0.5, generator=g, return_weights=True)
    assert torch.allclose(out, w @ v, atol=1e-14)


def test_sinks_inside_torch_compile():
    q, k, v = make_qkv(1, 2, 2, 9, 9, 8, 8)
    sinks = sinks_for(2)
    fn = torch.compile(
        lambda q, k, v, s: qkv.attention(q, k, v, mask=qkv.masks.causal(), sinks=s),
        backend="eager",
        fullgraph=False,
    )
    want = oracle(q, k, v, mask=qkv.masks.causal(), sinks=sinks.numpy())
    assert np.abs(fn(q, k, v, sinks).numpy() - want).max() < 1e-12


@pytest.mark.skipif(not steps.available(), reason="no native bfloat16 kernel here")
def test_sinks_on_the_native_bfloat16_path():
    q, k, v = make_qkv(1, 4, 2, 300, 300, 64, 64, dtype=torch.bfloat16)
    sinks = sinks_for(4, torch.float32)
    mask = qkv.masks.sliding_window(64)
    with qkv.tuned(native_scores=0):
        assert qkv.dispatch(q, k, v, mask=mask, sinks=sinks).path == "tiled-native"
        got = qkv.attention(q, k, v, mask=mask, sinks=sinks)
    want = oracle(q, k, v, mask=mask, sinks=sinks.double().numpy())
    assert np.abs(got.float().numpy() - want).max() < 2e-2  # bfloat16's rounding of out


@pytest.mark.parametrize(
    "sinks, error, match",
    [
        (torch.zeros(3), ValueError, r"sinks must have shape \(H,\) = \(2,\)"),
        (torch.zeros(1, 2), ValueError, r"shape \(H,\)"),
        (torch.zeros(1, 2, 4), ValueError, r"\(B\|1, H\|1, T_q\|1\) = \(1\|1, 2\|1, 3\|1\)"),
        (torch.zeros(2, dtype=torch.long), TypeError, "floating"),
        ([0.0, 0.0], TypeError, "floating torch.Tensor"),
    ],
)
def test_bad_sinks_are_refused(sinks, error, match):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(error, match=match):
        qkv.attention(q, q, q, sinks=sinks)


def test_flex_on_cpu_refuses_sinks_and_says_why():
    q = torch.randn(1, 2, 3, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="sinks"):
        qkv.attention(q, q, q, sinks=torch.zeros(2), backend="flex")


def test_multi_head_attention_learns_sinks_and_explain_shows_them():
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(16, 16, num_heads=4, causal=True, sinks=True)
    assert mha.sinks.shape == (4,)
    x = torch.randn(2, 7, 16)
    mha(x).square().mean().backward()
    assert mha.sinks.grad.abs().max() > 0  # learnable: gradients reach them
    with torch.no_grad():
        mha.sinks.fill_(1.0)
    trace = qkv.explain(x[0], module=mha)
    share = 1 - trace.weights.sum(-1)  # each row's share taken by its head's sink
    assert (share > 0.05).all() and (share < 1).all()
    assert "sink" in trace.to_text()
    plain = qkv.MultiHeadAttention(16, 16, num_heads=4, sinks=False)
    assert plain.sinks is None


def test_the_recorder_sees_the_sinks_through_the_log_sum_exp():
    q, k, v = make_qkv(1, 4, 2, 9, 9, 8, 8)
    sinks = sinks_for(4)
    with qkv.heads.record() as calls:
        qkv.attention(q, k, v, mask=qkv.masks.causal(), sinks=sinks)
    _, want = qkv.attention(q, k, v, mask=qkv.masks.causal(), sinks=sinks, return_weights=True)
    assert torch.allclose(calls[0].weights(), want, atol=1e-14)
