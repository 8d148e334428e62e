"""Half-precision gradients rounded by the native backward itself (``backward_many``'s
``grads``): each head's float32 sums rounded as the head ends, instead of float32 gradients
of the whole pass that torch then rounds. The bits must be exactly those of the float32
sums rounded by ``.to()``, whichever worker ran the pass (key blocks or whole heads as
work items), over calls that split the rows and overlap in keys."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.kernels.tiled import native_backward, steps
from tests.helpers import grads, make_qkv, mask_zoo

pytestmark = pytest.mark.skipif(
    not steps.available(torch.float32), reason="native kernel not built, or no AVX-512/AVX2 here"
)

# (what the inputs hold, what the kernel computes in): half precision widened to float32,
# or bfloat16 dot products where the CPU has them
KINDS = {
    "bf16-widened": (torch.bfloat16, torch.float32),
    "f16-widened": (torch.float16, torch.float32),
    "bf16-dots": (torch.bfloat16, torch.bfloat16),
}


def pass_inputs(B, H_kv, G, T_q, T_k, D, D_v, source, seed=3):
    """A backward pass's inputs in the kernel's layout, lse and Delta made up (finite, one
    row with no key: lse -inf), and a bias over T_k keys with some keys masked."""
    g = torch.Generator().manual_seed(seed)
    q5 = torch.randn(B, H_kv, G, T_q, D, generator=g).to(source)
    do5 = torch.randn(B, H_kv, G, T_q, D_v, generator=g).to(source)
    k = torch.randn(B, H_kv, T_k, D, generator=g).to(source)
    v = torch.randn(B, H_kv, T_k, D_v, generator=g).to(source)
    lse = 4 + torch.rand(B, H_kv, G, T_q, generator=g)
    lse[:, :, 0, 3] = float("-inf")
    delta = torch.randn(B, H_kv, G, T_q, generator=g)
    bias = torch.zeros(1, 1, G * T_q, T_k).masked_fill(
        torch.rand(1, 1, G * T_q, T_k, generator=g) < 0.3, float("-inf")
    )
    return q5, do5, k, v, lse, delta, bias


# rows and keys of each call: rows 70..89 and keys 280.. in none, keys 100..149 in two
CALLS = [(0, 70, 0, 150), (0, 70, 100, 280), (90, 200, 0, 150), (90, 200, 100, 280)]


def run_pass(inputs, step, rounded, scale=0.3):
    """The pass over CALLS computed in ``step``: into float32 sums then rounded by torch, or
    rounded by the kernel."""
    q5, do5, k, v, lse, delta, bias = inputs
    G, T_q = q5.shape[2:4]
    shapes = [q5.shape, k.shape, v.shape]
    if rounded:
        out = [torch.full(s, float("nan"), dtype=k.dtype) for s in shapes]  # all written
    else:
        out = [torch.zeros(s) for s in shapes]
    jobs = []
    for q0, q1, k0, k1 in CALLS:
        rows = bias[..., :, k0:k1].view(1, 1, G, T_q, k1 - k0)[:, :, :, q0:q1]
        own = (out[0][:, :, :, q0:q1], out[1][:, :, k0:k1], out[2][:, :, k0:k1])
        jobs.append(
            native_backward.BackwardJob(
                q5[:, :, :, q0:q1],
                do5[:, :, :, q0:q1],
                k0,
                k1,
                rows.reshape(1, 1, G * (q1 - q0), k1 - k0),
                lse[..., q0:q1],
                delta[..., q0:q1],
                *((None,) * 3 if rounded else own),
                qpos=q0,
                q0=q0,
            )
        )
    native_backward.backward_many(
        jobs, k, v, scale, dtype=step, grads=tuple(out) if rounded else None
    )
    return out if rounded else [x.to(k.dtype) for x in out]


@pytest.mark.parametrize("isa", ["", "avx2"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("B,H_kv,threads", [(1, 2, 2), (2, 4, 1), (2, 4, 2)])
@pytest.mark.parametrize("D,D_v", [(64, 64), (40, 24), (96, 136)])
def test_rounded_gradients_are_the_float32_sums_rounded(isa, kind, B, H_kv, threads, D, D_v):
    """Same bits as the float32 sums rounded by ``.to()``, every row and key written (rows
    and keys no call covers: 0), with work items as key blocks (2 heads on 2 threads) or
    whole heads (8 heads on 1 or 2: HEADS_PER_THREAD), GQA, head dims off the vectors."""
    source, step = KINDS[kind]
    if isa and isa not in steps.isas():
        pytest.skip(f"this CPU cannot run the {isa} step")
    before = torch.get_num_threads()
    with steps.use_isa(isa):
        if not steps.available(step):
            pytest.skip(f"this CPU cannot run the kernel in {step}")
        inputs = pass_inputs(B, H_kv, 2, 200, 300, D, D_v, source)
        try:
            torch.set_num_threads(threads)
            want, got = run_pass(inputs, step, False), run_pass(inputs, step, True)
        finally:
            torch.set_num_threads(before)
    for name, a, b in zip(("dQ", "dK", "dV"), got, want):
        assert torch.equal(a, b), name
    assert not got[0][:, :, :, 70:90].any() and not got[1][:, :, 280:].any()


def test_rounded_gradients_are_checked():
    """grads and the jobs must agree: a job with its own dq beside grads, rows past grads'
    dQ, grads in float32 or of the wrong shape are errors, not memory written astray."""
    inputs = pass_inputs(1, 2, 2, 200, 300, 32, 32, torch.bfloat16)
    q5, do5, k, v, lse, delta, _ = inputs
    grads_ = tuple(torch.empty(s, dtype=k.dtype) for s in (q5.shape, k.shape, v.shape))

    def job(**kw):
        fields = dict(
            q5=q5, do5=do5, k0=0, k1=300, bias=None, lse=lse, delta=delta, dq=None, dk=None
        )
        return native_backward.BackwardJob(**{**fields, "dv": None, **kw})

    with pytest.raises(ValueError, match="None"):
        native_backward.backward_many([job(dq=torch.zeros(q5.shape))], k, v, 0.3, grads=grads_)
    with pytest.raises(ValueError, match="past grads"):
        native_backward.backward_many([job(q0=1)], k, v, 0.3, grads=grads_)
    with pytest.raises(ValueError, match="do not fit"):
        native_backward.backward_many([job()], k, v, 0.3, grads=tuple(x.float() for x in grads_))
    with pytest.raises(ValueError, match="do not fit"):
        native_backward.backward_many(
            [job()], k, v, 0.3, grads=(grads_[0], grads_[1][:, :, 1:], grads_[2])
        )
    with pytest.raises(ValueError, match="needs dq"):
        native_backward.backward_many([job()], k, v, 0.3)


def test_a_pass_with_no_call_writes_zero_gradients():
    """No call (a plan whose mask leaves nothing): grads all zero, not the memory
    torch.empty handed over."""
    q5, _, k, v, *_ = pass_inputs(2, 2, 2, 50, 40, 32, 32, torch.bfloat16)
    out = tuple(torch.full(s, float("nan"), dtype=k.dtype) for s in (q5.shape, k.shape, v.shape))
    native_backward.backward_many([], k, v, 0.3, dtype=torch.float32, grads=out)
    assert all(not x.any() for x in out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "padding"])
def test_half_precision_training_gets_the_kernels_rounded_gradients(dtype, name, monkeypatch):
    """Through ``qkv.attention``: the native backward of half-precision inputs is given
    grads (no float32 gradients of the pass), and they come back in the inputs' dtype, near
    those of the same inputs in float32 (the bits: the test above)."""
    q, k, v = make_qkv(2, 4, 2, 61, 75, 32, 32, dtype=dtype, seed=4)
    g = torch.randn(2, 4, 61, 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    mask = mask_zoo(2, 75, 61)[name]
    real, seen = native_backward.backward_many, []

    def spy(*a, grads=None, **kw):
        seen.append(grads is not None)
        return real(*a, grads=grads, **kw)

    monkeypatch.setattr(native_backward, "backward_many", spy)
    got = grads(q, k, v, g, mask, backend="tiled")
    assert seen == [True], "the native backward did not round its gradients"
    assert qkv.dispatch(q, k, v, mask=mask, backend="tiled").path.startswith("tiled-native")
    want = grads(q.float(), k.float(), v.float(), g.float(), mask, backend="tiled")
    for a, b in zip(got, want):  # (within half precision's rounding of inputs kept apart)
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, atol=3e-2, rtol=3e-2)
